//! Tokens to their experts and back: the part every mixture of experts shares, whatever its
//! router (Mixtral's top-k, DeepSpeed-MoE's gating with capacity) and its experts' MLP.
//! Given each route (a token sent to an expert) and its weight, the output of a token is the
//! weighted sum of its experts' outputs on it; under expert parallelism the rows travel to
//! the ranks holding their experts and back (Note [routes to experts]); under tensor
//! parallelism each expert is split as a dense MLP is and the outputs are partial sums, for
//! the caller to reduce.
//!
//! Note [routes to experts]: the routes are put in expert order, which is rank order under
//! expert parallelism (each rank holds a block of consecutive experts); their tokens' rows
//! travel to the ranks holding their experts in one exchange, each expert runs on the rows it
//! received from every rank, and the outputs travel back in the same order. At ep 1 the
//! exchanges are no-ops and the same code runs.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::blocks::{Activation, Linear, MlpKept, MlpWeights};
use ds_nn::kernels::grad::bias_backward;
use ds_nn::kernels::scatter_rows::sum_into_rows;
use ds_nn::model::tensor_bytes;
use ds_nn::parallel::{Ep, Tp};

/// One expert's MLP: the shared block on this rank's slices (under tensor parallelism up and
/// gate split by output, down by input), under the mixture's names: expert e's linear `l` is
/// `{prefix}.{e}.{linears[l]}`.
pub(crate) struct ExpertMlp {
    pub act: Activation,
    pub hidden: usize,
    /// The width on this rank.
    pub width: usize,
    pub prefix: String,
    /// The linears' names in declaration order: gate (SwiGLU's), up, down.
    pub linears: Vec<&'static str>,
    /// Whether the linears have biases (DeepSpeed-MoE's experts do, Mixtral's not).
    pub biases: bool,
    /// Whether this rank adds down's bias (one rank of a tensor-parallel group: the partial
    /// outputs are summed).
    pub adds_bias: bool,
}

impl ExpertMlp {
    /// Expert `e`'s parameter names, relative to the layer, in declaration order.
    fn names(&self, e: usize) -> Vec<String> {
        let mut names = Vec::new();
        for l in &self.linears {
            names.push(format!("{}.{e}.{l}.weight", self.prefix));
            if self.biases {
                names.push(format!("{}.{e}.{l}.bias", self.prefix));
            }
        }
        names
    }

    /// Expert `e`'s linears, this rank's slices.
    fn weights(&self, vb: &VarBuilder, e: usize) -> Result<MlpWeights> {
        let (d, f) = (self.hidden, self.width);
        let linear = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            let at = format!("{}.{e}.{name}", self.prefix);
            Ok(Linear {
                w: vb.get((out, inp), &format!("{at}.weight"))?,
                b: match self.biases {
                    true => Some(vb.get(out, &format!("{at}.bias"))?),
                    false => None,
                },
            })
        };
        let (gate, [up, down]) = match self.linears.as_slice() {
            [g, u, dn] => (Some(linear(g, f, d)?), [*u, *dn]),
            [u, dn] => (None, [*u, *dn]),
            _ => unreachable!("invariant: an expert has two or three linears"),
        };
        Ok(MlpWeights {
            gate,
            up: linear(up, f, d)?,
            down: linear(down, d, f)?,
        })
    }

    /// Expert `e`'s output on rows `x` [n, d] (a partial sum under tensor parallelism).
    fn forward(&self, vb: &VarBuilder, e: usize, x: &Tensor) -> Result<(Tensor, MlpKept)> {
        self.act.forward(&self.weights(vb, e)?, x, self.adds_bias)
    }

    /// From the gradient `dy` of its output: the gradient of `x` (partial under tensor
    /// parallelism) and of expert `e`'s parameters, in the order of `names`.
    fn backward(
        &self,
        vb: &VarBuilder,
        e: usize,
        x: &Tensor,
        kept: MlpKept,
        dy: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let w = self.weights(vb, e)?;
        let g = self.act.backward(&w, x, Some(kept), dy)?;
        let dx = g.dx.clone();
        let mut grads = g.declared();
        // down's bias is whole on every rank, and so is `dy`: its full gradient here
        if let Some(b) = &w.down.b {
            grads.push(bias_backward(dy, b)?);
        }
        Ok((dx, grads))
    }

    /// Expert `e`'s parameters, this rank's slices, in the order of `names` (for zero
    /// gradients where no token came).
    fn params(&self, vb: &VarBuilder, e: usize) -> Result<Vec<Tensor>> {
        let w = self.weights(vb, e)?;
        let linear = |l: Linear| std::iter::once(l.w).chain(l.b);
        let mut out: Vec<Tensor> = w.gate.into_iter().flat_map(linear).collect();
        out.extend(linear(w.up));
        out.extend(linear(w.down));
        Ok(out)
    }
}

/// The routes of `tokens` tokens: per route, its token and its expert.
pub(crate) struct Routes {
    pub tokens: Vec<u32>,
    pub experts: Vec<usize>,
}

/// A mixture's experts on this rank, and where the others are.
pub(crate) struct Dispatch<'a> {
    pub mlp: &'a ExpertMlp,
    /// How many experts the mixture has, on every rank together.
    pub experts: usize,
    pub tp: &'a Tp,
    pub ep: &'a Ep,
}

/// What `Dispatch::forward` keeps for its backward.
pub(crate) struct DispatchTape {
    /// The routes in expert order: their places in the routes' list and their tokens, [R] u32.
    order: Tensor,
    tokens: Tensor,
    /// Each route's weight, in the routes' order [R] (the compute dtype).
    weights: Tensor,
    /// Rows sent to and received from each expert-parallel rank.
    sent: Vec<usize>,
    received: Vec<usize>,
    /// The rows this rank's experts ran on [received, d].
    rows: Tensor,
    /// The experts' outputs per route in expert order, before the weights [R, d].
    outputs: Tensor,
    ran: Vec<ExpertRun>,
}

/// One of this rank's experts' forward on the rows routed to it.
struct ExpertRun {
    expert: usize,
    /// Its rows among the received ones, [n] u32.
    rows: Tensor,
    saved: MlpKept,
}

impl DispatchTape {
    pub fn activation_bytes(&self) -> usize {
        let runs: usize = self.ran.iter().map(|r| r.saved.bytes()).sum();
        [&self.weights, &self.rows, &self.outputs]
            .into_iter()
            .map(tensor_bytes)
            .sum::<usize>()
            + runs
    }
}

/// `Dispatch::backward`'s results.
pub(crate) struct DispatchGrads {
    /// The gradient of the tokens [N, d] through the experts (a partial sum under tensor
    /// parallelism).
    pub dx: Tensor,
    /// The gradient of each route's weight [R], f32, whole.
    pub dweights: Tensor,
    /// This rank's experts' parameter gradients, named (zeros where no token came).
    pub params: Vec<(String, Tensor)>,
}

impl Dispatch<'_> {
    /// Each token of `xs` [N, d] sent to its experts by `routes`, weighted by `weights` [R]
    /// (the compute dtype): the output [N, d] and the tape.
    pub fn forward(
        &self,
        vb: &VarBuilder,
        xs: &Tensor,
        routes: &Routes,
        weights: Tensor,
    ) -> Result<(Tensor, DispatchTape)> {
        let dev = xs.device();
        let e = self.experts;
        // Note [routes to experts]
        let mut order: Vec<usize> = (0..routes.experts.len()).collect();
        order.sort_by_key(|&r| routes.experts[r]);
        let per_expert = counts(&routes.experts, e);
        let sent = per_rank(&per_expert, self.ep.size());
        let from = self.ep.exchange_counts(&per_expert, e / self.ep.size())?;
        let received = per_rank(&from, self.ep.size());
        let tokens = order.iter().map(|&r| routes.tokens[r]);
        let (tokens, order) = (
            index(tokens, dev)?,
            index(order.iter().map(|&r| r as u32), dev)?,
        );
        let rows = self
            .ep
            .exchange(&xs.index_select(&tokens, 0)?, &sent, &received)?;
        let mut out_rows = rows.zeros_like()?;
        let mut ran = Vec::new();
        for (expert, at) in self.local_rows(&from, dev)? {
            let (y, saved) = self.mlp.forward(vb, expert, &rows.index_select(&at, 0)?)?;
            out_rows = out_rows.index_add(&at, &y, 0)?;
            ran.push(ExpertRun {
                expert,
                rows: at,
                saved,
            });
        }
        let outputs = self.ep.exchange(&out_rows, &received, &sent)?;
        let w = weights.index_select(&order, 0)?.unsqueeze(1)?;
        let out = sum_into_rows(&tokens, &outputs.broadcast_mul(&w)?, xs.dim(0)?)?;
        let tape = DispatchTape {
            order,
            tokens,
            weights,
            sent,
            received,
            rows,
            outputs,
            ran,
        };
        Ok((out, tape))
    }

    /// Per local expert that received rows: its id and their positions among the received
    /// rows, which come by sending rank, each rank's in expert order (`from` says how many
    /// each rank sent each local expert).
    fn local_rows(&self, from: &[usize], dev: &Device) -> Result<Vec<(usize, Tensor)>> {
        let local = self.ep.local(self.experts);
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

    /// From the gradient `dys` [N, d] of the (reduced) output: the gradients of the tokens,
    /// of the route weights and of this rank's experts.
    pub fn backward(
        &self,
        vb: &VarBuilder,
        t: DispatchTape,
        dys: &Tensor,
    ) -> Result<DispatchGrads> {
        let dout = dys.index_select(&t.tokens, 0)?;
        // d loss / d weight of each route: the route's output against its gradient; the
        // outputs are partial sums under tensor parallelism, and so are these
        let dw = (&dout * &t.outputs)?.sum(D::Minus1)?.to_dtype(DType::F32)?;
        let routes = t.weights.dim(0)?;
        let dweights =
            Tensor::zeros(routes, DType::F32, dys.device())?.index_add(&t.order, &dw, 0)?;
        let w = t.weights.index_select(&t.order, 0)?.unsqueeze(1)?;
        let drows = self
            .ep
            .exchange(&dout.broadcast_mul(&w)?, &t.sent, &t.received)?;
        let mut dx_rows = t.rows.zeros_like()?;
        let local = self.ep.local(self.experts);
        let mut grads: Vec<Option<Vec<Tensor>>> = local.clone().map(|_| None).collect();
        for run in t.ran {
            let (dx, g) = self.mlp.backward(
                vb,
                run.expert,
                &t.rows.index_select(&run.rows, 0)?,
                run.saved,
                &drows.index_select(&run.rows, 0)?,
            )?;
            dx_rows = dx_rows.index_add(&run.rows, &dx, 0)?;
            grads[run.expert - local.start] = Some(g);
        }
        let dx_routes = self.ep.exchange(&dx_rows, &t.received, &t.sent)?;
        let dx = sum_into_rows(&t.tokens, &dx_routes, dys.dim(0)?)?;
        let mut params = Vec::new();
        for (expert, g) in local.zip(grads) {
            let g = match g {
                Some(g) => g,
                None => self
                    .mlp
                    .params(vb, expert)?
                    .iter()
                    .map(Tensor::zeros_like)
                    .collect::<Result<_>>()?,
            };
            params.extend(self.mlp.names(expert).into_iter().zip(g));
        }
        Ok(DispatchGrads {
            dx,
            dweights: self.tp.sum(&dweights)?,
            params,
        })
    }
}

/// A mixture's gradients: of its input through the experts (a partial sum under tensor
/// parallelism) and through the router (whole), and of its parameters, named.
pub(crate) struct MixtureGrads {
    pub dx_experts: Tensor,
    pub dx_router: Tensor,
    pub params: Vec<(String, Tensor)>,
}

/// How many routes chose each of `experts`.
pub(crate) fn counts(chosen: &[usize], experts: usize) -> Vec<usize> {
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
pub(crate) fn index(ids: impl IntoIterator<Item = u32>, dev: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = ids.into_iter().collect();
    let n = ids.len();
    Tensor::from_vec(ids, n, dev)
}

/// The cells of a [tokens, experts] matrix that the routes name, flattened.
pub(crate) fn cells(routes: &Routes, experts: usize, dev: &Device) -> Result<Tensor> {
    let cells = routes
        .tokens
        .iter()
        .zip(&routes.experts)
        .map(|(&t, &e)| t * experts as u32 + e as u32);
    index(cells, dev)
}

/// The routes' entries of `probs` [tokens, experts], [R], taken from the tensor so that
/// autograd reaches the router through them.
pub(crate) fn route_probs(probs: &Tensor, routes: &Routes) -> Result<Tensor> {
    let at = cells(routes, probs.dim(1)?, probs.device())?;
    probs.flatten_all()?.index_select(&at, 0)
}

/// `route_probs`' backward: `dkept` [R] put back in the routes' cells of a [tokens, experts]
/// matrix, zeros elsewhere.
pub(crate) fn scatter_route_probs(
    dkept: &Tensor,
    routes: &Routes,
    tokens: usize,
    experts: usize,
) -> Result<Tensor> {
    let at = cells(routes, experts, dkept.device())?;
    Tensor::zeros(tokens * experts, DType::F32, dkept.device())?
        .index_add(&at, dkept, 0)?
        .reshape((tokens, experts))
}

/// Softmax's backward on its output `probs` [N, E]: the gradient of its input.
pub(crate) fn softmax_backward(probs: &Tensor, dprobs: &Tensor) -> Result<Tensor> {
    let dot = (dprobs * probs)?.sum_keepdim(1)?;
    probs * dprobs.broadcast_sub(&dot)?
}
