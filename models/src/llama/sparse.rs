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

use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use ds_nn::kernels::grad::{linear, linear_backward};
use ds_nn::kernels::primitive::softmax_last_dim;
use ds_nn::model::{tensor_bytes, ParamSpec, Split};
use ds_nn::parallel::{Ep, Tp};

use super::config::{Family, LlamaConfig, SparseMlp};
use super::layers::weight_init;
use crate::blocks::Activation;
use crate::moe::dispatch::{
    counts, route_probs, scatter_route_probs, softmax_backward, Dispatch, DispatchTape, ExpertMlp,
    MixtureGrads, Routes,
};

/// One layer's mixture of experts, this rank's slices of it.
pub(super) struct Experts<'a> {
    pub m: &'a SparseMlp,
    pub family: Family,
    pub tp: &'a Tp,
    pub ep: &'a Ep,
    pub hidden: usize,
    /// The router's load-balancing loss and this layer's place among the sparse ones.
    pub router_loss: Option<(&'a RouterLoss, usize)>,
}

/// Note [router load-balancing loss]: transformers' `load_balancing_loss_func`
/// (`output_router_logits`) is one loss over all sparse layers at once, not a sum of per-layer
/// ones: with F_e the share of all layers' routes that chose expert e and P_e the mean of all
/// layers' router probabilities for e (both over L layers x N tokens), `coef * E * sum_e F_e
/// P_e` joins the loss. Its gradient reaches layer l's probabilities as `coef * E * F_e / (L
/// N)` for every token, which needs every layer's counts: known once the whole forward ran.
/// So the sparse layers record their counts and probability sums here in forward, the loss
/// layer adds the value to the loss and records the seed its backward receives, and each
/// sparse layer's backward, which runs after, adds the gradient. It needs every sparse layer
/// in this process: pipeline parallelism is refused with it.
#[derive(Clone)]
pub struct RouterLoss(Arc<Mutex<RouterStats>>);

struct RouterStats {
    coef: f64,
    experts: usize,
    /// Per sparse layer, from its last forward.
    layers: Vec<Option<LayerRouting>>,
    /// The gradient of the model's loss the loss layer's backward received.
    seed: f32,
}

/// One sparse layer's routing in its last forward.
#[derive(Clone)]
struct LayerRouting {
    /// How many routes chose each expert.
    counts: Vec<f32>,
    /// The sum over tokens of each expert's probability.
    probs: Vec<f32>,
    tokens: usize,
}

impl RouterLoss {
    pub(super) fn new(coef: f64, experts: usize, layers: usize) -> RouterLoss {
        RouterLoss(Arc::new(Mutex::new(RouterStats {
            coef,
            experts,
            layers: vec![None; layers],
            seed: 0.0,
        })))
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, RouterStats> {
        // a poisoned lock only means another thread panicked holding it: the numbers stand
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, layer: usize, counts: &[usize], probs: &Tensor) -> Result<()> {
        self.stats().layers[layer] = Some(LayerRouting {
            counts: counts.iter().map(|&c| c as f32).collect(),
            probs: probs.sum(0)?.to_vec1::<f32>()?,
            tokens: probs.dim(0)?,
        });
        Ok(())
    }

    /// Per expert F_e and P_e, and L N (Note [router load-balancing loss]).
    fn fractions(&self) -> Result<(Vec<f64>, Vec<f64>, f64)> {
        let st = self.stats();
        let (mut f, mut p, mut rows) = (vec![0f64; st.experts], vec![0f64; st.experts], 0);
        for layer in &st.layers {
            let Some(r) = layer else {
                candle_core::bail!(
                    "the router's load-balancing loss needs every sparse layer's forward in this process (pipeline parallelism splits them)"
                )
            };
            for e in 0..st.experts {
                f[e] += r.counts[e] as f64;
                p[e] += r.probs[e] as f64;
            }
            rows += r.tokens;
        }
        let rows = rows as f64;
        let share = |v: Vec<f64>| v.into_iter().map(|x| x / rows).collect();
        Ok((share(f), share(p), rows))
    }

    /// `coef * E * sum_e F_e P_e`, to add to the loss.
    pub(super) fn value(&self) -> Result<f64> {
        let (f, p, _) = self.fractions()?;
        let st = self.stats();
        let dot: f64 = f.iter().zip(&p).map(|(f, p)| f * p).sum();
        Ok(st.coef * st.experts as f64 * dot)
    }

    pub(super) fn set_seed(&self, seed: f32) {
        self.stats().seed = seed;
    }

    /// The gradient of the seeded loss with respect to each of a sparse layer's router
    /// probabilities, the same for every token: `seed * coef * E * F_e / (L N)`.
    fn probs_grad(&self) -> Result<Vec<f32>> {
        let (f, _, rows) = self.fractions()?;
        let st = self.stats();
        let k = st.seed as f64 * st.coef * st.experts as f64 / rows;
        Ok(f.iter().map(|f| (k * f) as f32).collect())
    }
}

/// What `forward` keeps for `backward`.
pub(super) struct SparseTape {
    /// The block's input, whole tokens [N, d].
    x: Tensor,
    /// The router's probabilities [N, experts], f32.
    probs: Tensor,
    /// Route r is token r / k's (r % k)-th choice.
    routes: Routes,
    /// The kept probabilities [N, k] (f32).
    kept: Tensor,
    dispatch: DispatchTape,
}

impl SparseTape {
    pub fn activation_bytes(&self) -> usize {
        let own: usize = [&self.x, &self.probs, &self.kept]
            .into_iter()
            .map(tensor_bytes)
            .sum();
        own + self.dispatch.activation_bytes()
    }
}

/// The router's and this rank's experts' parameter specs, under `c.family`'s names, the
/// experts marked (`ParamSpec::expert`: the engine keeps them apart under expert
/// parallelism, the estimate counts them).
pub(super) fn params(m: &SparseMlp, c: &LlamaConfig, ep: &Ep) -> Vec<ParamSpec> {
    let (block, _) = c.family.expert_names();
    let router = ParamSpec::new(
        &format!("{block}.gate.weight"),
        &[m.num_experts, c.hidden_size],
        weight_init(c),
    );
    let experts = expert_specs(m, c, ep.local(m.num_experts));
    std::iter::once(router).chain(experts).collect()
}

/// The other expert-parallel ranks' experts of the layer under `prefix`, full names.
pub(super) fn held_elsewhere(
    m: &SparseMlp,
    c: &LlamaConfig,
    ep: &Ep,
    prefix: &str,
) -> Vec<ParamSpec> {
    let local = ep.local(m.num_experts);
    let others = (0..m.num_experts).filter(|e| !local.contains(e));
    others
        .flat_map(|e| expert_specs(m, c, e..e + 1))
        .map(|mut p| {
            p.name = format!("{prefix}.{}", p.name);
            p
        })
        .collect()
}

/// Experts `experts`' (gate, up, down) specs, each split by tensor parallelism as the dense
/// MLP's.
fn expert_specs(
    m: &SparseMlp,
    c: &LlamaConfig,
    experts: std::ops::Range<usize>,
) -> impl Iterator<Item = ParamSpec> {
    let (block, [gate, up, down]) = c.family.expert_names();
    let (d, f) = (c.hidden_size, m.expert_size);
    let init = weight_init(c);
    experts.flat_map(move |e| {
        let name = |proj: &str| format!("{block}.experts.{e}.{proj}.weight");
        [
            ParamSpec::new(&name(gate), &[f, d], init).split(Split::dim(0)),
            ParamSpec::new(&name(up), &[f, d], init).split(Split::dim(0)),
            ParamSpec::new(&name(down), &[d, f], init).split(Split::dim(1)),
        ]
        .map(ParamSpec::expert)
    })
}

impl Experts<'_> {
    fn router_name(&self) -> String {
        format!("{}.gate.weight", self.family.expert_names().0)
    }

    /// Each expert: SwiGLU's gate, up and down, no biases.
    fn mlp(&self) -> ExpertMlp {
        let (block, names) = self.family.expert_names();
        ExpertMlp {
            act: Activation::SwiGlu,
            hidden: self.hidden,
            width: self.m.expert_size / self.tp.size(),
            prefix: format!("{block}.experts"),
            linears: names.to_vec(),
            biases: false,
            adds_bias: false,
        }
    }

    fn dispatch<'b>(&'b self, mlp: &'b ExpertMlp) -> Dispatch<'b> {
        Dispatch {
            mlp,
            experts: self.m.num_experts,
            tp: self.tp,
            ep: self.ep,
        }
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
        if let Some((loss, layer)) = self.router_loss {
            loss.record(layer, &counts(&chosen, e), &probs)?;
        }
        let routes = Routes {
            tokens: (0..chosen.len()).map(|r| (r / k) as u32).collect(),
            experts: chosen,
        };
        let kept = route_probs(&probs, &routes)?.reshape(((), k))?;
        let weights = match self.m.norm_topk_prob {
            true => kept.broadcast_div(&kept.sum_keepdim(1)?)?,
            false => kept.clone(),
        };
        let weights = weights.flatten_all()?.to_dtype(x.dtype())?;
        let mlp = self.mlp();
        let (out, dispatch) = self.dispatch(&mlp).forward(vb, &xs, &routes, weights)?;
        let tape = SparseTape {
            x: xs,
            probs,
            routes,
            kept,
            dispatch,
        };
        Ok((out.reshape(dims)?, tape))
    }

    /// From the gradient `dy` [.., d] of the block's (reduced) output: the gradients of its
    /// input, the router and this rank's experts (zeros for those no token reached).
    pub fn backward(&self, vb: &VarBuilder, t: SparseTape, dy: &Tensor) -> Result<MixtureGrads> {
        let (d, e, k) = (self.hidden, self.m.num_experts, self.m.top_k);
        let dys = dy.reshape(((), d))?;
        let mlp = self.mlp();
        let g = self.dispatch(&mlp).backward(vb, t.dispatch, &dys)?;
        let dweights = g.dweights.reshape(((), k))?;
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
        let tokens = t.probs.dim(0)?;
        let mut dprobs = scatter_route_probs(&dkept.flatten_all()?, &t.routes, tokens, e)?;
        if let Some((loss, _)) = self.router_loss {
            let g = Tensor::new(loss.probs_grad()?, dy.device())?;
            dprobs = dprobs.broadcast_add(&g)?;
        }
        let dlogits = softmax_backward(&t.probs, &dprobs)?.to_dtype(t.x.dtype())?;
        let router = linear_backward(&t.x, &vb.get((e, d), &self.router_name())?, &dlogits)?;
        let params = std::iter::once((self.router_name(), router.dw))
            .chain(g.params)
            .collect();
        let shape = dy.shape();
        Ok(MixtureGrads {
            dx_experts: g.dx.reshape(shape)?,
            dx_router: router.dx.reshape(shape)?,
            params,
        })
    }
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
