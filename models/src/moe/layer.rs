//! DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE`): a linear router, the gating of
//! gating.rs, and experts that are two-layer GELU MLPs (Linear, GELU, Linear, as DeepSpeed's
//! examples build them). Each expert runs on the tokens routed to it; each token's output is
//! its experts' outputs weighted by its kept gates (renormalised over its kept routes for
//! k >= 2). The router's load-balancing loss, times `aux_coef`, joins the model's loss
//! through `Context::add_loss` (DeepSpeed's users add `coef * l_aux` to theirs by hand).
//!
//! The routing is decided on each rank's tokens of the micro-batch, before they travel: the
//! capacity is a share of those tokens, as DeepSpeed's gate decides it on each rank's before
//! its all-to-all. So a layout that keeps the micro-batches (data parallelism with
//! accumulation, tensor, pipeline and expert parallelism) drops the same tokens.
//!
//! The layer has its own backward (the routing is a discrete choice, made on the host; the
//! route weights and `l_aux` are taken from the router's probabilities so that candle's
//! autograd of `forward`, the reference the backward is tested against, reaches the router).
//! Under expert parallelism the tokens travel to their experts' ranks (moe::dispatch); under
//! tensor parallelism each expert is split as the dense MLP is (the first linear by output,
//! the second by input, its bias added once) and every rank routes the same whole tokens.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use ds_nn::kernels::grad::{linear, linear_backward};
use ds_nn::kernels::primitive::softmax_last_dim;
use ds_nn::model::{tensor_bytes, Context, Grads, Init, Layer, ParamSpec, Split, Tape, Taped};
use ds_nn::parallel::{Ep, Tp};

use super::dispatch::{
    route_probs, scatter_route_probs, softmax_backward, Dispatch, DispatchTape, ExpertMlp,
    MixtureGrads, Routes,
};
use super::gating::{route, GateConfig, Routing};
use crate::blocks::Activation;
pub use crate::blocks::Gelu;

/// How a model spells and starts its MoE layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeStyle {
    /// The router's weight [experts, hidden].
    pub router: &'static str,
    /// Expert e's parameters are under `{experts}.{e}`.
    pub experts: &'static str,
    /// The two linears of an expert.
    pub linears: [&'static str; 2],
    pub gelu: Gelu,
    /// The linears' and router's start: torch.nn.Linear's (uniform within 1 / sqrt(in), bias
    /// too) or a GPT's (normal weights, zero biases).
    pub init: Option<f64>,
}

impl MoeStyle {
    /// DeepSpeed's examples: `MoE(expert=Sequential(Linear, GELU, Linear))`, as
    /// `gate.wg.weight` and `experts.{e}.fc1/fc2`, torch's start.
    pub const DEEPSPEED_EXAMPLE: MoeStyle = MoeStyle {
        router: "gate.wg.weight",
        experts: "experts",
        linears: ["fc1", "fc2"],
        gelu: Gelu::Erf,
        init: None,
    };

    /// The MoE GPT's: DeepSpeed's module names around the GPT's MLP (`c_fc`, `c_proj`).
    pub const GPT: MoeStyle = MoeStyle {
        router: "deepspeed_moe.gate.wg.weight",
        experts: "deepspeed_moe.experts.deepspeed_experts",
        linears: ["c_fc", "c_proj"],
        gelu: Gelu::Tanh,
        init: Some(0.02),
    };
}

/// One mixture-of-experts layer over hidden states [.., hidden].
#[derive(Clone)]
pub struct MoeLayer {
    pub hidden: usize,
    /// The experts' inner width.
    pub ffn: usize,
    pub experts: usize,
    pub gate: GateConfig,
    /// The capacity factor in evaluation (`Context::evaluating`; DeepSpeed's
    /// `eval_capacity_factor`, in its modules' `eval()` mode); training's by default.
    pub eval_capacity_factor: f64,
    /// The weight of the router's load-balancing loss in the model's loss.
    pub aux_coef: f64,
    pub style: MoeStyle,
    tp: Tp,
    ep: Ep,
}

impl std::fmt::Debug for MoeLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoeLayer")
            .field("hidden", &self.hidden)
            .field("ffn", &self.ffn)
            .field("experts", &self.experts)
            .field("gate", &self.gate)
            .field("eval_capacity_factor", &self.eval_capacity_factor)
            .field("aux_coef", &self.aux_coef)
            .field("tp", &self.tp.size())
            .field("ep", &self.ep.size())
            .finish()
    }
}

impl MoeLayer {
    /// The layer, its settings checked: at least one expert, `k` between 1 and the expert
    /// count, a positive capacity factor. In DeepSpeed's example style, on one rank.
    pub fn new(
        hidden: usize,
        ffn: usize,
        experts: usize,
        gate: GateConfig,
        aux_coef: f64,
    ) -> std::result::Result<MoeLayer, String> {
        check(hidden, ffn, experts, &gate)?;
        Ok(MoeLayer {
            hidden,
            ffn,
            experts,
            gate,
            eval_capacity_factor: gate.capacity_factor,
            aux_coef,
            style: MoeStyle::DEEPSPEED_EXAMPLE,
            tp: Tp::none(),
            ep: Ep::none(),
        })
    }

    pub fn with_style(mut self, style: MoeStyle) -> MoeLayer {
        self.style = style;
        self
    }

    /// The layer with `factor` as its evaluation capacity factor, checked as training's.
    pub fn with_eval_capacity_factor(
        mut self,
        factor: f64,
    ) -> std::result::Result<MoeLayer, String> {
        let eval = GateConfig {
            capacity_factor: factor,
            ..self.gate
        };
        check(self.hidden, self.ffn, self.experts, &eval)
            .map_err(|e| e.replace("capacity_factor", "eval_capacity_factor"))?;
        self.eval_capacity_factor = factor;
        Ok(self)
    }

    /// Forward FLOPs over `tokens` tokens: the router and, per route (k a token, as if none
    /// were dropped), the expert's two products.
    pub fn flops(&self, tokens: usize) -> u64 {
        let (d, f, e) = (self.hidden as u64, self.ffn as u64, self.experts as u64);
        let routes = (tokens * self.gate.k) as u64;
        2 * tokens as u64 * d * e + 4 * routes * d * f / self.tp.size() as u64
    }

    /// The gate of a training forward, or of an evaluation's.
    fn gate(&self, evaluating: bool) -> GateConfig {
        match evaluating {
            true => GateConfig {
                capacity_factor: self.eval_capacity_factor,
                ..self.gate
            },
            false => self.gate,
        }
    }

    /// The layer with its experts split over `ep` (each rank holds experts / ep) and each
    /// expert over `tp`; the error says what does not divide.
    pub fn parallel(mut self, tp: &Tp, ep: &Ep) -> std::result::Result<MoeLayer, String> {
        check_ep_divides(self.experts, ep.size())?;
        crate::check_tp_divides(tp.size(), &[("expert width", self.ffn)])?;
        self.tp = tp.clone();
        self.ep = ep.clone();
        Ok(self)
    }

    /// The router's and this rank's experts' parameter specs (the experts marked: the engine
    /// keeps them apart under expert parallelism).
    pub fn specs(&self) -> Vec<ParamSpec> {
        let router = ParamSpec::new(
            self.style.router,
            &[self.experts, self.hidden],
            self.weight_init(self.hidden),
        );
        let experts = self
            .ep
            .local(self.experts)
            .flat_map(|e| self.expert_specs(e));
        std::iter::once(router).chain(experts).collect()
    }

    /// The other expert-parallel ranks' experts, their names under `prefix`.
    pub fn held_elsewhere(&self, prefix: &str) -> Vec<ParamSpec> {
        let local = self.ep.local(self.experts);
        (0..self.experts)
            .filter(|e| !local.contains(e))
            .flat_map(|e| self.expert_specs(e))
            .map(|mut p| {
                p.name = format!("{prefix}.{}", p.name);
                p
            })
            .collect()
    }

    fn weight_init(&self, inp: usize) -> Init {
        match self.style.init {
            Some(std) => Init::normal(std),
            None => torch_linear_init(inp),
        }
    }

    fn bias_init(&self, inp: usize) -> Init {
        match self.style.init {
            Some(_) => Init::Zeros,
            None => torch_linear_init(inp),
        }
    }

    /// Expert `e`'s linears: the first split by output rows (bias too), the second by input
    /// columns (bias whole).
    fn expert_specs(&self, e: usize) -> [ParamSpec; 4] {
        let (d, f) = (self.hidden, self.ffn);
        let name = |linear: usize, what: &str| {
            format!(
                "{}.{e}.{}.{what}",
                self.style.experts, self.style.linears[linear]
            )
        };
        [
            ParamSpec::new(&name(0, "weight"), &[f, d], self.weight_init(d)).split(Split::dim(0)),
            ParamSpec::new(&name(0, "bias"), &[f], self.bias_init(d)).split(Split::dim(0)),
            ParamSpec::new(&name(1, "weight"), &[d, f], self.weight_init(f)).split(Split::dim(1)),
            ParamSpec::new(&name(1, "bias"), &[d], self.bias_init(f)),
        ]
        .map(ParamSpec::expert)
    }

    /// Each expert: Linear, GELU, Linear.
    fn mlp(&self) -> ExpertMlp {
        ExpertMlp {
            act: Activation::Gelu(self.style.gelu),
            hidden: self.hidden,
            width: self.ffn / self.tp.size(),
            prefix: self.style.experts.to_string(),
            linears: self.style.linears.to_vec(),
            biases: true,
            adds_bias: self.tp.rank() == 0,
        }
    }

    fn dispatch<'a>(&'a self, mlp: &'a ExpertMlp) -> Dispatch<'a> {
        Dispatch {
            mlp,
            experts: self.experts,
            tp: &self.tp,
            ep: &self.ep,
        }
    }

    /// The layer on whole tokens `xs` [N, d]: its output (a partial sum under tensor
    /// parallelism, for the caller to reduce), `aux_coef * l_aux` (a scalar made from the
    /// router's probabilities) and the tape. `evaluating`: with the evaluation capacity.
    pub(crate) fn run(
        &self,
        vb: &VarBuilder,
        xs: &Tensor,
        evaluating: bool,
    ) -> Result<(Tensor, Tensor, MoeTape)> {
        let (d, e) = (self.hidden, self.experts);
        // the router in f32, as DeepSpeed's TopKGate
        let wg = vb.get((e, d), self.style.router)?.to_dtype(DType::F32)?;
        let logits = linear(&xs.to_dtype(DType::F32)?, &wg, None)?;
        let gate = self.gate(evaluating);
        let routing = route(&logits.flatten_all()?.to_vec1::<f32>()?, e, &gate);
        let probs = softmax_last_dim(&logits)?;
        let routes = routes_of(&routing);
        let (kept, denom) = self.kept_weights(&probs, &routes)?;
        let weights = match &denom {
            Some(denom) => (&kept / denom)?,
            None => kept.clone(),
        };
        let mlp = self.mlp();
        let dispatch = self.dispatch(&mlp);
        let (out, tape) = dispatch.forward(vb, xs, &routes, weights.to_dtype(xs.dtype())?)?;
        // l_aux: the mean gates (through which its gradient reaches the router) against the
        // routing's constant choice fractions
        let ce = Tensor::new(routing.choice_fraction.as_slice(), xs.device())?;
        let l_aux = (probs.mean(0)? * &ce)?.sum_all()?;
        let aux = l_aux.affine(routing.aux_scale as f64 * self.aux_coef, 0.0)?;
        let tape = MoeTape {
            x: xs.clone(),
            probs,
            routes,
            kept,
            denom,
            ce: ce
                .affine(routing.aux_scale as f64 * self.aux_coef, 0.0)?
                .unsqueeze(0)?,
            seed: None,
            dispatch: tape,
        };
        Ok((out, aux, tape))
    }

    /// Each route's kept gate [R] (f32) and, for k >= 2, its token's sum of kept gates (the
    /// divisor that renormalises them, DeepSpeed's `denom_s`, at least f32's epsilon).
    fn kept_weights(&self, probs: &Tensor, routes: &Routes) -> Result<(Tensor, Option<Tensor>)> {
        let kept = route_probs(probs, routes)?;
        if self.gate.k == 1 {
            return Ok((kept, None));
        }
        let dev = probs.device();
        let tokens = super::dispatch::index(routes.tokens.iter().copied(), dev)?;
        let sums = Tensor::zeros(probs.dim(0)?, DType::F32, dev)?.index_add(&tokens, &kept, 0)?;
        let denom = sums
            .index_select(&tokens, 0)?
            .clamp(f32::EPSILON, f32::INFINITY)?;
        Ok((kept, Some(denom)))
    }

    /// From the gradient `dys` [N, d] of the (reduced) output: the gradient of the tokens
    /// through the experts (partial under tensor parallelism) and through the router (whole),
    /// and the named parameter gradients, the router's first.
    pub(crate) fn backward_parts(
        &self,
        vb: &VarBuilder,
        t: MoeTape,
        dys: &Tensor,
    ) -> Result<MixtureGrads> {
        let (d, e) = (self.hidden, self.experts);
        let mlp = self.mlp();
        let g = self.dispatch(&mlp).backward(vb, t.dispatch, dys)?;
        let dkept = match &t.denom {
            // w = kept / denom, denom the token's sum of kept gates:
            // dkept_j = (dw_j - sum over the token's routes of dw_i w_i) / denom
            Some(denom) => {
                let dev = dys.device();
                let tokens = super::dispatch::index(t.routes.tokens.iter().copied(), dev)?;
                let w = (&t.kept / denom)?;
                let dot = Tensor::zeros(t.probs.dim(0)?, DType::F32, dev)?.index_add(
                    &tokens,
                    &(&g.dweights * &w)?,
                    0,
                )?;
                (g.dweights - dot.index_select(&tokens, 0)?)?.div(denom)?
            }
            None => g.dweights,
        };
        let (tokens, _) = t.probs.dims2()?;
        let mut dprobs = scatter_route_probs(&dkept, &t.routes, tokens, e)?;
        if let Some(seed) = t.seed {
            // d (coef scale sum_e mean_t(p_te) ce_e) / d p_te = coef scale ce_e / N
            let aux = t.ce.affine(seed / tokens as f64, 0.0)?;
            dprobs = dprobs.broadcast_add(&aux)?;
        }
        let dlogits = softmax_backward(&t.probs, &dprobs)?;
        let wg = vb.get((e, d), self.style.router)?;
        let router = linear_backward(
            &t.x.to_dtype(DType::F32)?,
            &wg.to_dtype(DType::F32)?,
            &dlogits,
        )?;
        let params = std::iter::once((
            self.style.router.to_string(),
            router.dw.to_dtype(wg.dtype())?,
        ))
        .chain(g.params)
        .collect();
        Ok(MixtureGrads {
            dx_experts: g.dx,
            dx_router: router.dx.to_dtype(dys.dtype())?,
            params,
        })
    }
}

fn check(
    hidden: usize,
    ffn: usize,
    experts: usize,
    gate: &GateConfig,
) -> std::result::Result<(), String> {
    if experts == 0 || hidden == 0 || ffn == 0 {
        return Err(format!(
            "moe: experts ({experts}), hidden ({hidden}) and ffn ({ffn}) must be at least 1"
        ));
    }
    if gate.k == 0 || gate.k > experts {
        return Err(format!(
            "moe: top-k {} must lie between 1 and the number of experts, {experts}",
            gate.k
        ));
    }
    if !(gate.capacity_factor.is_finite() && gate.capacity_factor > 0.0) {
        return Err(format!(
            "moe: capacity_factor {} must be a positive number",
            gate.capacity_factor
        ));
    }
    Ok(())
}

/// Whether `ep` ranks hold equal shares of `experts`.
pub fn check_ep_divides(experts: usize, ep: usize) -> std::result::Result<(), String> {
    match ep > 0 && experts.is_multiple_of(ep) {
        true => Ok(()),
        false => Err(format!(
            "{experts} experts do not split evenly over expert-parallel size {ep}"
        )),
    }
}

/// torch.nn.Linear's start: uniform within 1 / sqrt(in), for weight and bias.
fn torch_linear_init(inp: usize) -> Init {
    let bound = 1.0 / (inp as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        hi: bound,
    }
}

/// The kept routes, token by token.
fn routes_of(routing: &Routing) -> Routes {
    let (tokens, experts) = routing
        .routes
        .iter()
        .enumerate()
        .flat_map(|(s, r)| r.iter().map(move |r| (s as u32, r.expert)))
        .unzip();
    Routes { tokens, experts }
}

/// What the layer's backward reads.
pub(crate) struct MoeTape {
    /// The tokens [N, d].
    x: Tensor,
    /// The router's probabilities [N, experts], f32.
    probs: Tensor,
    routes: Routes,
    /// Each route's kept gate [R] and the divisor that renormalises it (k >= 2), f32.
    kept: Tensor,
    denom: Option<Tensor>,
    /// The constant factor of `aux_coef * l_aux` per expert [1, experts].
    ce: Tensor,
    /// The model's loss seed, when the layer's `l_aux` joined the loss.
    seed: Option<f64>,
    dispatch: DispatchTape,
}

impl MoeTape {
    pub fn activation_bytes(&self) -> usize {
        let own: usize = [&self.x, &self.probs, &self.kept]
            .into_iter()
            .chain(&self.denom)
            .map(tensor_bytes)
            .sum();
        own + self.dispatch.activation_bytes()
    }

    /// The seed of the model's loss, which `aux_coef * l_aux` joined.
    pub fn seed(&mut self, seed: f64) {
        self.seed = Some(seed);
    }
}

/// The layer alone, over [.., hidden]: its output summed over the tensor-parallel group.
struct LayerTape {
    layer: MoeLayer,
    moe: MoeTape,
}

impl Tape for LayerTape {
    fn activation_bytes(&self) -> usize {
        self.moe.activation_bytes()
    }

    fn seed_added_loss(&mut self, seed: f64) {
        self.moe.seed(seed);
    }

    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> Result<Grads> {
        let LayerTape { layer, moe } = *self;
        let dys = dy.reshape(((), layer.hidden))?;
        let g = layer.backward_parts(vb, moe, &dys)?;
        let dx = (layer.tp.sum(&g.dx_experts)? + g.dx_router)?;
        let order: Vec<String> = layer.specs().into_iter().map(|p| p.name).collect();
        Ok(Grads {
            input: Some(dx.reshape(dy.shape())?),
            params: in_order(g.params, &order)?,
        })
    }
}

/// Named gradients in the order of `names`.
pub(crate) fn in_order(mut named: Vec<(String, Tensor)>, names: &[String]) -> Result<Vec<Tensor>> {
    names
        .iter()
        .map(|n| {
            let at = named.iter().position(|(m, _)| m == n);
            match at {
                Some(i) => Ok(named.swap_remove(i).1),
                None => candle_core::bail!("moe: no gradient for {n}"),
            }
        })
        .collect()
}

impl MoeLayer {
    fn taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Taped> {
        let xs = x.reshape(((), self.hidden))?;
        let (out, aux, moe) = self.run(vb, &xs, cx.evaluating())?;
        cx.add_loss(aux)?;
        let tape = LayerTape {
            layer: self.clone(),
            moe,
        };
        Ok(Taped {
            output: self.tp.sum(&out)?.reshape(x.shape())?,
            tape: Box::new(tape),
        })
    }
}

impl Layer for MoeLayer {
    fn params(&self) -> Vec<ParamSpec> {
        self.specs()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Tensor> {
        Ok(self.taped(vb, x, cx)?.output)
    }

    fn forward_taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Option<Taped>> {
        self.taped(vb, x, cx).map(Some)
    }

    /// Of an input of `shape` [B, T] or [B, T, d] (the engine's profile passes the token
    /// ids' shape), as `flops` counts.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        Some(self.flops(shape.iter().take(2).product()))
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use candle_core::{DType, Device, Tensor};
    use candle_nn::VarBuilder;
    use ds_nn::model::{Context, Layer};
    use ds_nn::Inputs;

    use super::MoeLayer;
    use crate::moe::gating::{DropPolicy, GateConfig};
    use crate::taped_check::values;

    /// An evaluation's forward (`Context::evaluating`) routes with the evaluation capacity,
    /// a training one with training's: a layer at 0.25 evaluating at 4 is, in evaluation, the
    /// layer at 4.
    #[test]
    fn evaluation_routes_with_the_evaluation_capacity() {
        let gate = GateConfig {
            k: 1,
            capacity_factor: 0.25,
            min_capacity: 1,
            drop_tokens: true,
            drop_policy: DropPolicy::Probs,
        };
        let tight = MoeLayer::new(8, 12, 4, gate, 0.01).unwrap();
        let both = tight.clone().with_eval_capacity_factor(4.0).unwrap();
        let wide = GateConfig {
            capacity_factor: 4.0,
            ..gate
        };
        let wide = MoeLayer::new(8, 12, 4, wide, 0.01).unwrap();
        let dev = Device::Cpu;
        let map: HashMap<String, Tensor> = tight
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let v = values(p.numel(), i as u64);
                (
                    p.name.clone(),
                    Tensor::from_vec(v, p.shape.as_slice(), &dev).unwrap(),
                )
            })
            .collect();
        let vb = VarBuilder::from_tensors(map, DType::F32, &dev);
        let x = Tensor::from_vec(values(2 * 10 * 8, 99), (2, 10, 8), &dev).unwrap();
        let inputs = Inputs::new();
        let out = |layer: &MoeLayer, evaluating: bool| {
            let added = RefCell::new(Vec::new());
            let cx = Context::new(&inputs)
                .adding_into(&added)
                .in_evaluation(evaluating);
            let y = layer.forward(&vb, &x, &cx).unwrap();
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(out(&both, true), out(&wide, false));
        assert_eq!(out(&both, false), out(&tight, false));
        assert_ne!(
            out(&both, true),
            out(&both, false),
            "the tight capacity drops"
        );
        let e = tight.with_eval_capacity_factor(0.0).unwrap_err();
        assert!(e.contains("eval_capacity_factor 0"), "{e}");
    }
}
