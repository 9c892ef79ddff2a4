//! The mixture-of-experts MLP of Mixtral and Qwen3-MoE (transformers'
//! `MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`): a linear router, softmax over the
//! experts in f32, the `top_k` most probable kept per token (renormalised to sum to one with
//! `norm_topk_prob`), and each kept expert's SwiGLU MLP output weighted by its probability.
//! No capacity: no token is dropped. Parameters under the hub's names (the per-expert form
//! save_pretrained writes): `{block}.gate.weight` [experts, d] and
//! `{block}.experts.{e}.{gate, up, down}.weight`.
//!
//! Which experts a token goes to is a discrete choice, made on the host from the router's
//! probabilities; the kept probabilities are taken from the tensor, so the router's gradient
//! flows through them as in transformers. Differentiated by candle's autograd.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use ds_engine::kernels::grad::linear;
use ds_engine::kernels::primitive::softmax_last_dim;
use ds_engine::model::ParamSpec;

use super::config::{Family, LlamaConfig, SparseMlp};
use super::layers::weight_init;
use super::ops::swiglu;

/// The router's and every expert's parameter specs, under `family`'s names.
pub(super) fn params(m: &SparseMlp, c: &LlamaConfig) -> Vec<ParamSpec> {
    let (block, [gate, up, down]) = c.family.expert_names();
    let (d, f) = (c.hidden_size, m.expert_size);
    let init = weight_init(c);
    let router = ParamSpec::new(&format!("{block}.gate.weight"), &[m.num_experts, d], init);
    let experts = (0..m.num_experts).flat_map(|e| {
        let name = |proj: &str| format!("{block}.experts.{e}.{proj}.weight");
        [
            ParamSpec::new(&name(gate), &[f, d], init),
            ParamSpec::new(&name(up), &[f, d], init),
            ParamSpec::new(&name(down), &[d, f], init),
        ]
    });
    std::iter::once(router).chain(experts).collect()
}

/// The block's output for hidden states `x` [.., d].
pub(super) fn forward(
    m: &SparseMlp,
    family: Family,
    vb: &VarBuilder,
    x: &Tensor,
) -> Result<Tensor> {
    let (block, [gate, up, down]) = family.expert_names();
    let dims = x.dims().to_vec();
    let d = *dims
        .last()
        .expect("invariant: hidden states have a last dimension");
    let (e, f, k) = (m.num_experts, m.expert_size, m.top_k);
    let xs = x.reshape(((), d))?;
    let router = vb.get((e, d), &format!("{block}.gate.weight"))?;
    let probs = softmax_last_dim(&linear(&xs, &router, None)?.to_dtype(DType::F32)?)?;
    let chosen = top_k(&probs.flatten_all()?.to_vec1::<f32>()?, e, k);
    let weights = kept_weights(&probs, &chosen, e, k, m.norm_topk_prob)?.to_dtype(x.dtype())?;
    let dev = x.device();
    let mut out = xs.zeros_like()?;
    for expert in 0..e {
        // route i is token i / k's (i % k)-th choice
        let (routes, tokens): (Vec<u32>, Vec<u32>) = chosen
            .iter()
            .enumerate()
            .filter(|(_, c)| **c == expert)
            .map(|(i, _)| (i as u32, (i / k) as u32))
            .unzip();
        if tokens.is_empty() {
            continue;
        }
        let n = tokens.len();
        let tokens = Tensor::from_vec(tokens, n, dev)?;
        let w = |proj: &str, shape: (usize, usize)| {
            vb.get(shape, &format!("{block}.experts.{expert}.{proj}.weight"))
        };
        let xe = xs.index_select(&tokens, 0)?;
        let act = swiglu(
            &linear(&xe, &w(gate, (f, d))?, None)?,
            &linear(&xe, &w(up, (f, d))?, None)?,
        )?;
        let y = linear(&act, &w(down, (d, f))?, None)?;
        let scale = weights.index_select(&Tensor::from_vec(routes, n, dev)?, 0)?;
        out = out.index_add(&tokens, &y.broadcast_mul(&scale.unsqueeze(1)?)?, 0)?;
    }
    out.reshape(dims)
}

/// Each route's weight [tokens k], from the probabilities `probs` [tokens, experts] so that
/// the router's gradient flows through them: the kept probability, over the sum of the
/// token's kept ones when `normalise`.
fn kept_weights(
    probs: &Tensor,
    chosen: &[usize],
    experts: usize,
    k: usize,
    normalise: bool,
) -> Result<Tensor> {
    let cells: Vec<u32> = chosen
        .iter()
        .enumerate()
        .map(|(i, e)| ((i / k) * experts + e) as u32)
        .collect();
    let n = cells.len();
    let kept = probs
        .flatten_all()?
        .index_select(&Tensor::from_vec(cells, n, probs.device())?, 0)?
        .reshape((n / k, k))?;
    let kept = match normalise {
        true => kept.broadcast_div(&kept.sum_keepdim(1)?)?,
        false => kept,
    };
    kept.flatten_all()
}

/// Per token, its `k` most probable experts in decreasing probability (the lower index
/// first among equals), token after token: `probs` is [tokens, experts] row-major.
pub fn top_k(probs: &[f32], experts: usize, k: usize) -> Vec<usize> {
    probs
        .chunks(experts)
        .flat_map(|row| {
            let mut order: Vec<usize> = (0..experts).collect();
            // a stable sort keeps equal probabilities in index order
            order.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
            order.truncate(k);
            order
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_most_probable_in_order() {
        let probs = [0.1, 0.4, 0.2, 0.3, 0.25, 0.25, 0.4, 0.1];
        assert_eq!(top_k(&probs, 4, 2), vec![1, 3, 2, 0]);
        assert_eq!(top_k(&probs, 4, 1), vec![1, 2]);
    }
}
