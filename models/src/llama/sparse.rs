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

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;
use ds_engine::kernels::grad::{linear, linear_backward};
use ds_engine::kernels::primitive::softmax_last_dim;
use ds_engine::model::{tensor_bytes, ParamSpec, Split};
use ds_engine::parallel::{Ep, Tp};

use super::config::{Family, LlamaConfig, SparseMlp};
use super::layers::weight_init;
use super::ops::{swiglu, swiglu_backward};

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

/// `backward`'s results: the input's gradient through the experts (a partial sum under
/// tensor parallelism) and through the router (whole), and the named parameter gradients.
pub(super) struct SparseGrads {
    pub dx_experts: Tensor,
    pub dx_router: Tensor,
    pub params: Vec<(String, Tensor)>,
}

/// What `forward` keeps for `backward`.
///
/// Note [routes to experts]: the routes (token i / k's (i % k)-th choice) are put in expert
/// order, which is rank order under expert parallelism (each rank holds a block of
/// consecutive experts); their tokens' rows travel to the ranks holding their experts in one
/// exchange, each expert runs on the rows it received from every rank, and the outputs travel
/// back in the same order. At ep 1 the exchanges are no-ops and the same code runs.
pub(super) struct SparseTape {
    /// The block's input, whole tokens [N, d].
    x: Tensor,
    /// The router's probabilities [N, experts], f32.
    probs: Tensor,
    /// Per route: its expert.
    chosen: Vec<usize>,
    /// The kept probabilities [N, k] (f32), and each route's weight [N k] (the compute dtype).
    kept: Tensor,
    weights: Tensor,
    /// The routes in expert order and their tokens, [R] u32.
    order: Tensor,
    tokens: Tensor,
    /// Rows sent to and received from each expert-parallel rank.
    sent: Vec<usize>,
    received: Vec<usize>,
    /// The rows this rank's experts ran on [received, d].
    rows: Tensor,
    /// The experts' outputs per route in expert order, before the route weights [R, d] (a
    /// partial sum under tensor parallelism).
    outputs: Tensor,
    ran: Vec<ExpertRun>,
}

/// One of this rank's experts' forward on the rows routed to it.
struct ExpertRun {
    expert: usize,
    /// Its rows among the received ones, [n] u32.
    rows: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

impl SparseTape {
    pub fn activation_bytes(&self) -> usize {
        let runs: usize = self
            .ran
            .iter()
            .map(|r| {
                [&r.gate, &r.up, &r.act]
                    .into_iter()
                    .map(tensor_bytes)
                    .sum::<usize>()
            })
            .sum();
        [
            &self.x,
            &self.probs,
            &self.kept,
            &self.weights,
            &self.rows,
            &self.outputs,
        ]
        .into_iter()
        .map(tensor_bytes)
        .sum::<usize>()
            + runs
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
        let dev = x.device();
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
        // Note [routes to experts]
        let mut order: Vec<usize> = (0..chosen.len()).collect();
        order.sort_by_key(|&r| chosen[r]);
        let per_expert = counts(&chosen, e);
        if let Some((loss, layer)) = self.router_loss {
            loss.record(layer, &per_expert, &probs)?;
        }
        let sent = per_rank(&per_expert, self.ep.size());
        let from = self.ep.exchange_counts(&per_expert, e / self.ep.size())?;
        let received = per_rank(&from, self.ep.size());
        let tokens: Vec<u32> = order.iter().map(|&r| (r / k) as u32).collect();
        let (order, tokens) = (
            index(order.iter().map(|&r| r as u32), dev)?,
            index(tokens, dev)?,
        );
        let rows = self
            .ep
            .exchange(&xs.index_select(&tokens, 0)?, &sent, &received)?;
        let mut out_rows = rows.zeros_like()?;
        let mut ran = Vec::new();
        for (expert, at) in self.local_rows(&from, dev)? {
            let [wg, wu, wd] = self.weights(vb, expert)?;
            let xe = rows.index_select(&at, 0)?;
            let (gate, up) = (linear(&xe, &wg, None)?, linear(&xe, &wu, None)?);
            let act = swiglu(&gate, &up)?;
            out_rows = out_rows.index_add(&at, &linear(&act, &wd, None)?, 0)?;
            ran.push(ExpertRun {
                expert,
                rows: at,
                gate,
                up,
                act,
            });
        }
        let outputs = self.ep.exchange(&out_rows, &received, &sent)?;
        let w = weights.index_select(&order, 0)?.unsqueeze(1)?;
        let out = xs
            .zeros_like()?
            .index_add(&tokens, &outputs.broadcast_mul(&w)?, 0)?;
        let tape = SparseTape {
            x: xs,
            probs,
            chosen,
            kept,
            weights,
            order,
            tokens,
            sent,
            received,
            rows,
            outputs,
            ran,
        };
        Ok((out.reshape(dims)?, tape))
    }

    /// Per local expert that received rows: its id and their positions among the received
    /// rows, which come by sending rank, each rank's in expert order (`from` says how many
    /// each rank sent each local expert).
    fn local_rows(
        &self,
        from: &[usize],
        dev: &candle_core::Device,
    ) -> Result<Vec<(usize, Tensor)>> {
        let local = self.ep.local(self.m.num_experts);
        let mut at: Vec<Vec<u32>> = vec![Vec::new(); local.len()];
        let mut next = 0u32;
        for (i, n) in from.iter().enumerate() {
            at[i % local.len()].extend(next..next + *n as u32);
            next += *n as u32;
        }
        at.into_iter()
            .zip(local)
            .filter(|(rows, _)| !rows.is_empty())
            .map(|(rows, e)| Ok((e, index(rows, dev)?)))
            .collect()
    }

    /// From the gradient `dy` [.., d] of the block's (reduced) output: the gradients of its
    /// input, the router and this rank's experts (zeros for those no token reached).
    pub fn backward(&self, vb: &VarBuilder, t: SparseTape, dy: &Tensor) -> Result<SparseGrads> {
        let (d, e, k) = (self.hidden, self.m.num_experts, self.m.top_k);
        let dys = dy.reshape(((), d))?;
        let dout = dys.index_select(&t.tokens, 0)?;
        // d loss / d weight of each route: the route's output against its gradient; the
        // outputs are partial sums under tensor parallelism, and so are these
        let dw = (&dout * &t.outputs)?.sum(D::Minus1)?.to_dtype(DType::F32)?;
        let dweights =
            Tensor::zeros(t.chosen.len(), DType::F32, dy.device())?.index_add(&t.order, &dw, 0)?;
        let w = t.weights.index_select(&t.order, 0)?.unsqueeze(1)?;
        let drows = self
            .ep
            .exchange(&dout.broadcast_mul(&w)?, &t.sent, &t.received)?;
        let mut dx_rows = t.rows.zeros_like()?;
        let local = self.ep.local(e);
        let mut grads: Vec<Option<[Tensor; 3]>> = local.clone().map(|_| None).collect();
        for run in t.ran {
            let [wg, wu, wd] = self.weights(vb, run.expert)?;
            let down = linear_backward(&run.act, &wd, &drows.index_select(&run.rows, 0)?)?;
            let (dgate, dup) = swiglu_backward(&run.gate, &run.up, &down.dx)?;
            let xe = t.rows.index_select(&run.rows, 0)?;
            let gate = linear_backward(&xe, &wg, &dgate)?;
            let up = linear_backward(&xe, &wu, &dup)?;
            dx_rows = dx_rows.index_add(&run.rows, &(gate.dx + up.dx)?, 0)?;
            grads[run.expert - local.start] = Some([gate.dw, up.dw, down.dw]);
        }
        let dx_routes = self.ep.exchange(&dx_rows, &t.received, &t.sent)?;
        let dx = t.x.zeros_like()?.index_add(&t.tokens, &dx_routes, 0)?;
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
        let mut dprobs = scatter_kept(&dkept, &t.chosen, e, k)?;
        if let Some((loss, _)) = self.router_loss {
            let g = Tensor::new(loss.probs_grad()?, dy.device())?;
            dprobs = dprobs.broadcast_add(&g)?;
        }
        let dot = (&dprobs * &t.probs)?.sum_keepdim(1)?;
        let dlogits = (t.probs * dprobs.broadcast_sub(&dot)?)?.to_dtype(t.x.dtype())?;
        let router = linear_backward(&t.x, &vb.get((e, d), &self.router_name())?, &dlogits)?;
        let mut named = vec![(self.router_name(), router.dw)];
        for (expert, g) in local.zip(grads) {
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

/// How many routes chose each of `experts`.
fn counts(chosen: &[usize], experts: usize) -> Vec<usize> {
    let mut n = vec![0; experts];
    for e in chosen {
        n[*e] += 1;
    }
    n
}

/// Per-expert counts summed into each of `ranks` ranks' block of consecutive experts.
fn per_rank(per_expert: &[usize], ranks: usize) -> Vec<usize> {
    per_expert
        .chunks(per_expert.len() / ranks)
        .map(|c| c.iter().sum())
        .collect()
}

/// A u32 index tensor.
fn index(ids: impl IntoIterator<Item = u32>, dev: &candle_core::Device) -> Result<Tensor> {
    let ids: Vec<u32> = ids.into_iter().collect();
    let n = ids.len();
    Tensor::from_vec(ids, n, dev)
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
