//! The mixture-of-experts MLP of Mixtral and Qwen3-MoE (transformers'
//! `MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`): a linear router, softmax over the
//! experts in f32, the `top_k` most probable kept per token (renormalised to sum to one with
//! `norm_topk_prob`), and each kept expert's SwiGLU MLP output weighted by its probability.
//! No capacity: no token is dropped. Parameters under the hub's names (the per-expert form
//! save_pretrained writes): `{block}.gate.weight` [experts, d] and
//! `{block}.experts.{e}.{gate, up, down}.weight`.
//!
//! Which experts a token goes to is a discrete choice, made on the host from the router's
//! probabilities; the kept probabilities are taken from the tensor, so that candle's autograd
//! of `forward` (the function the written-out `backward` is tested against) reaches the
//! router as transformers' does.
//!
//! Under tensor parallelism each expert is split as the dense MLP is (gate and up by output,
//! down by input: Megatron's scheme, HF's `packed_colwise`/`rowwise` expert plan): every rank
//! routes the same whole tokens with the replicated router, and the experts' partial outputs
//! are summed over the group once, after they are combined.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;
use ds_engine::kernels::grad::{linear, linear_backward};
use ds_engine::kernels::primitive::softmax_last_dim;
use ds_engine::model::{tensor_bytes, ParamSpec, Split};
use ds_engine::parallel::Tp;

use super::config::{Family, LlamaConfig, SparseMlp};
use super::layers::weight_init;
use super::ops::{swiglu, swiglu_backward};

/// One layer's mixture of experts, this rank's slices of it.
pub(super) struct Experts<'a> {
    pub m: &'a SparseMlp,
    pub family: Family,
    pub tp: &'a Tp,
    pub hidden: usize,
}

/// `backward`'s results: the input's gradient through the experts (a partial sum under
/// tensor parallelism) and through the router (whole), and the named parameter gradients.
pub(super) struct SparseGrads {
    pub dx_experts: Tensor,
    pub dx_router: Tensor,
    pub params: Vec<(String, Tensor)>,
}

/// What `forward` keeps for `backward`.
pub(super) struct SparseTape {
    /// The block's input, whole tokens [N, d].
    x: Tensor,
    /// The router's probabilities [N, experts], f32.
    probs: Tensor,
    /// Per route (token i / k's (i % k)-th choice): its expert.
    chosen: Vec<usize>,
    /// The kept probabilities [N, k] (f32), and each route's weight [N k] (the compute dtype).
    kept: Tensor,
    weights: Tensor,
    ran: Vec<ExpertRun>,
}

/// One expert's forward on the tokens routed to it.
struct ExpertRun {
    expert: usize,
    /// The tokens and the routes (indices into `chosen`), [n] u32.
    tokens: Tensor,
    routes: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
    /// Its output before the route weights, a partial sum under tensor parallelism [n, d].
    y: Tensor,
}

impl SparseTape {
    pub fn activation_bytes(&self) -> usize {
        let runs: usize = self
            .ran
            .iter()
            .map(|r| {
                [&r.gate, &r.up, &r.act, &r.y]
                    .into_iter()
                    .map(tensor_bytes)
                    .sum::<usize>()
            })
            .sum();
        [&self.x, &self.probs, &self.kept, &self.weights]
            .into_iter()
            .map(tensor_bytes)
            .sum::<usize>()
            + runs
    }
}

/// The router's and every expert's parameter specs, under `c.family`'s names.
pub(super) fn params(m: &SparseMlp, c: &LlamaConfig) -> Vec<ParamSpec> {
    let (block, [gate, up, down]) = c.family.expert_names();
    let (d, f) = (c.hidden_size, m.expert_size);
    let init = weight_init(c);
    let router = ParamSpec::new(&format!("{block}.gate.weight"), &[m.num_experts, d], init);
    let experts = (0..m.num_experts).flat_map(|e| {
        let name = |proj: &str| format!("{block}.experts.{e}.{proj}.weight");
        [
            ParamSpec::new(&name(gate), &[f, d], init).split(Split::dim(0)),
            ParamSpec::new(&name(up), &[f, d], init).split(Split::dim(0)),
            ParamSpec::new(&name(down), &[d, f], init).split(Split::dim(1)),
        ]
    });
    std::iter::once(router).chain(experts).collect()
}

impl Experts<'_> {
    fn router_name(&self) -> String {
        format!("{}.gate.weight", self.family.expert_names().0)
    }

    fn expert_name(&self, e: usize, which: usize) -> String {
        let (block, names) = self.family.expert_names();
        format!("{block}.experts.{e}.{}.weight", names[which])
    }

    /// Expert `e`'s (gate, up, down) weights, this rank's slices.
    fn weights(&self, vb: &VarBuilder, e: usize) -> Result<[Tensor; 3]> {
        let (d, f) = (self.hidden, self.m.expert_size / self.tp.size());
        Ok([
            vb.get((f, d), &self.expert_name(e, 0))?,
            vb.get((f, d), &self.expert_name(e, 1))?,
            vb.get((d, f), &self.expert_name(e, 2))?,
        ])
    }

    /// The block on whole tokens `x` [.., d]: its output (a partial sum under tensor
    /// parallelism, for the caller to reduce) and its tape.
    pub fn forward(&self, vb: &VarBuilder, x: &Tensor) -> Result<(Tensor, SparseTape)> {
        let (d, e, k) = (self.hidden, self.m.num_experts, self.m.top_k);
        let dims = x.dims().to_vec();
        let xs = x.reshape(((), d))?;
        let router = vb.get((e, d), &self.router_name())?;
        let probs = softmax_last_dim(&linear(&xs, &router, None)?.to_dtype(DType::F32)?)?;
        let chosen = top_k(&probs.flatten_all()?.to_vec1::<f32>()?, e, k);
        let kept = kept_probs(&probs, &chosen, e, k)?;
        let weights = match self.m.norm_topk_prob {
            true => kept.broadcast_div(&kept.sum_keepdim(1)?)?,
            false => kept.clone(),
        };
        let weights = weights.flatten_all()?.to_dtype(x.dtype())?;
        let mut out = xs.zeros_like()?;
        let mut ran = Vec::new();
        for (expert, tokens, routes) in routed(&chosen, e, k, x.device())? {
            let [wg, wu, wd] = self.weights(vb, expert)?;
            let xe = xs.index_select(&tokens, 0)?;
            let (gate, up) = (linear(&xe, &wg, None)?, linear(&xe, &wu, None)?);
            let act = swiglu(&gate, &up)?;
            let y = linear(&act, &wd, None)?;
            let w = weights.index_select(&routes, 0)?.unsqueeze(1)?;
            out = out.index_add(&tokens, &y.broadcast_mul(&w)?, 0)?;
            ran.push(ExpertRun {
                expert,
                tokens,
                routes,
                gate,
                up,
                act,
                y,
            });
        }
        let tape = SparseTape {
            x: xs,
            probs,
            chosen,
            kept,
            weights,
            ran,
        };
        Ok((out.reshape(dims)?, tape))
    }

    /// From the gradient `dy` [.., d] of the block's (reduced) output: the gradients of its
    /// input, the router and every expert (zeros for those no token reached).
    pub fn backward(&self, vb: &VarBuilder, t: SparseTape, dy: &Tensor) -> Result<SparseGrads> {
        let (d, e, k) = (self.hidden, self.m.num_experts, self.m.top_k);
        let dys = dy.reshape(((), d))?;
        let mut dx = t.x.zeros_like()?;
        // d loss / d weight of each route: the route's output against its gradient
        let mut dweights = Tensor::zeros(t.chosen.len(), DType::F32, dy.device())?;
        let mut grads: Vec<Option<[Tensor; 3]>> = (0..e).map(|_| None).collect();
        for run in t.ran {
            let [wg, wu, wd] = self.weights(vb, run.expert)?;
            let dout = dys.index_select(&run.tokens, 0)?;
            let dw = (&dout * &run.y)?.sum(D::Minus1)?.to_dtype(DType::F32)?;
            dweights = dweights.index_add(&run.routes, &dw, 0)?;
            let w = t.weights.index_select(&run.routes, 0)?.unsqueeze(1)?;
            let down = linear_backward(&run.act, &wd, &dout.broadcast_mul(&w)?)?;
            let (dgate, dup) = swiglu_backward(&run.gate, &run.up, &down.dx)?;
            let xe = t.x.index_select(&run.tokens, 0)?;
            let gate = linear_backward(&xe, &wg, &dgate)?;
            let up = linear_backward(&xe, &wu, &dup)?;
            dx = dx.index_add(&run.tokens, &(gate.dx + up.dx)?, 0)?;
            grads[run.expert] = Some([gate.dw, up.dw, down.dw]);
        }
        // each rank's routes' outputs are partial sums: so are their dot products
        let dweights = self.tp.sum(&dweights)?.reshape(((), k))?;
        let dkept = match self.m.norm_topk_prob {
            // w = kept / sum(kept): dkept_j = (dw_j - sum_i dw_i w_i) / sum(kept)
            true => {
                let sum = t.kept.sum_keepdim(1)?;
                let w = t.kept.broadcast_div(&sum)?;
                let dot = (&dweights * &w)?.sum_keepdim(1)?;
                dweights.broadcast_sub(&dot)?.broadcast_div(&sum)?
            }
            false => dweights,
        };
        let dprobs = scatter_kept(&dkept, &t.chosen, e, k)?;
        let dot = (&dprobs * &t.probs)?.sum_keepdim(1)?;
        let dlogits = (t.probs * dprobs.broadcast_sub(&dot)?)?.to_dtype(t.x.dtype())?;
        let router = linear_backward(&t.x, &vb.get((e, d), &self.router_name())?, &dlogits)?;
        let mut named = vec![(self.router_name(), router.dw)];
        for (expert, g) in grads.into_iter().enumerate() {
            let g = match g {
                Some(g) => g,
                None => {
                    let [g, u, d] = self.weights(vb, expert)?;
                    [g.zeros_like()?, u.zeros_like()?, d.zeros_like()?]
                }
            };
            for (which, grad) in g.into_iter().enumerate() {
                named.push((self.expert_name(expert, which), grad));
            }
        }
        let shape = dy.shape();
        Ok(SparseGrads {
            dx_experts: dx.reshape(shape)?,
            dx_router: router.dx.reshape(shape)?,
            params: named,
        })
    }
}

/// Per expert reached: its id, the tokens routed to it and the routes (indices into
/// `chosen`), as u32 index tensors.
fn routed(
    chosen: &[usize],
    experts: usize,
    k: usize,
    dev: &candle_core::Device,
) -> Result<Vec<(usize, Tensor, Tensor)>> {
    let mut per: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); experts];
    for (i, e) in chosen.iter().enumerate() {
        per[*e].0.push((i / k) as u32);
        per[*e].1.push(i as u32);
    }
    per.into_iter()
        .enumerate()
        .filter(|(_, (tokens, _))| !tokens.is_empty())
        .map(|(e, (tokens, routes))| {
            let n = tokens.len();
            Ok((
                e,
                Tensor::from_vec(tokens, n, dev)?,
                Tensor::from_vec(routes, n, dev)?,
            ))
        })
        .collect()
}

/// The cells of [tokens, experts] that `chosen` names, flattened.
fn cells(chosen: &[usize], experts: usize, k: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let cells: Vec<u32> = chosen
        .iter()
        .enumerate()
        .map(|(i, e)| ((i / k) * experts + e) as u32)
        .collect();
    let n = cells.len();
    Tensor::from_vec(cells, n, dev)
}

/// The chosen experts' probabilities [tokens, k], taken from `probs` so that autograd
/// reaches the router through them.
fn kept_probs(probs: &Tensor, chosen: &[usize], experts: usize, k: usize) -> Result<Tensor> {
    let at = cells(chosen, experts, k, probs.device())?;
    probs.flatten_all()?.index_select(&at, 0)?.reshape(((), k))
}

/// `kept_probs`' backward: `dkept` [tokens, k] put back in the chosen cells of
/// [tokens, experts], zeros elsewhere.
fn scatter_kept(dkept: &Tensor, chosen: &[usize], experts: usize, k: usize) -> Result<Tensor> {
    let tokens = chosen.len() / k;
    let at = cells(chosen, experts, k, dkept.device())?;
    Tensor::zeros(tokens * experts, DType::F32, dkept.device())?
        .index_add(&at, &dkept.flatten_all()?, 0)?
        .reshape((tokens, experts))
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
