//! DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE` at ep_size 1): a linear router, the
//! gating of gating.rs, and experts that are two-layer GELU MLPs (Linear, GELU, Linear, as
//! DeepSpeed's examples build them). Each expert runs on the tokens routed to it; each token's
//! output is its experts' outputs weighted by its kept gates (renormalised over its kept routes
//! for k >= 2). The router's load-balancing loss, times `aux_coef`, joins the model's loss
//! through `Context::add_loss` (DeepSpeed's users add `coef * l_aux` to theirs by hand).

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Linear, VarBuilder};
use ds_engine::model::{Context, Init, Layer, ParamSpec};

use super::gating::{route, GateConfig, Routing};

/// One mixture-of-experts layer over hidden states [.., hidden].
#[derive(Debug, Clone)]
pub struct MoeLayer {
    pub hidden: usize,
    /// The experts' inner width.
    pub ffn: usize,
    pub experts: usize,
    pub gate: GateConfig,
    /// The weight of the router's load-balancing loss in the model's loss.
    pub aux_coef: f64,
}

impl MoeLayer {
    /// The layer, its settings checked: at least one expert, `k` between 1 and the expert
    /// count, a positive capacity factor.
    pub fn new(
        hidden: usize,
        ffn: usize,
        experts: usize,
        gate: GateConfig,
        aux_coef: f64,
    ) -> std::result::Result<MoeLayer, String> {
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
        Ok(MoeLayer {
            hidden,
            ffn,
            experts,
            gate,
            aux_coef,
        })
    }

    fn expert(&self, vb: &VarBuilder, e: usize) -> Result<[Linear; 2]> {
        let (d, f) = (self.hidden, self.ffn);
        let linear = |name: &str, out: usize, inp: usize| -> Result<Linear> {
            let vb = vb.pp(format!("experts.{e}.{name}"));
            Ok(Linear::new(
                vb.get((out, inp), "weight")?,
                Some(vb.get(out, "bias")?),
            ))
        };
        Ok([linear("fc1", f, d)?, linear("fc2", d, f)?])
    }

    /// Each route's weight, from the router's probabilities `probs` [tokens, experts] so that
    /// the gradient reaches the router: the kept gate, over the sum of the token's kept gates
    /// for k >= 2. In the order of `routes` flattened token by token.
    fn route_weights(&self, probs: &Tensor, routing: &Routing) -> Result<Tensor> {
        let dev = probs.device();
        let (tokens, cells): (Vec<u32>, Vec<u32>) = routing
            .routes
            .iter()
            .enumerate()
            .flat_map(|(s, r)| {
                r.iter()
                    .map(move |r| (s as u32, (s * self.experts + r.expert) as u32))
            })
            .unzip();
        let n = tokens.len();
        let kept = probs
            .flatten_all()?
            .index_select(&Tensor::from_vec(cells, n, dev)?, 0)?;
        if self.gate.k == 1 {
            return Ok(kept);
        }
        let tokens = Tensor::from_vec(tokens, n, dev)?;
        let sums =
            Tensor::zeros(routing.routes.len(), DType::F32, dev)?.index_add(&tokens, &kept, 0)?;
        let denom = sums
            .index_select(&tokens, 0)?
            .clamp(f32::EPSILON, f32::INFINITY)?;
        kept / denom
    }
}

fn linear_specs(name: &str, out: usize, inp: usize) -> [ParamSpec; 2] {
    // torch.nn.Linear's start: uniform within 1 / sqrt(in) for both
    let bound = 1.0 / (inp as f64).sqrt();
    let init = Init::Uniform {
        lo: -bound,
        hi: bound,
    };
    [
        ParamSpec::new(&format!("{name}.weight"), &[out, inp], init),
        ParamSpec::new(&format!("{name}.bias"), &[out], init),
    ]
}

impl Layer for MoeLayer {
    fn params(&self) -> Vec<ParamSpec> {
        let (d, f) = (self.hidden, self.ffn);
        let router = ParamSpec::new("gate.wg.weight", &[self.experts, d], Init::normal(0.02));
        let experts = (0..self.experts).flat_map(|e| {
            let [w1, b1] = linear_specs(&format!("experts.{e}.fc1"), f, d);
            let [w2, b2] = linear_specs(&format!("experts.{e}.fc2"), d, f);
            [w1, b1, w2, b2]
        });
        std::iter::once(router).chain(experts).collect()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let xs = x.reshape(((), self.hidden))?;
        let wg = vb.get((self.experts, self.hidden), "gate.wg.weight")?;
        // the router in f32, as DeepSpeed's TopKGate
        let logits = xs
            .to_dtype(DType::F32)?
            .matmul(&wg.to_dtype(DType::F32)?.t()?)?;
        let routing = route(
            &logits.flatten_all()?.to_vec1::<f32>()?,
            self.experts,
            &self.gate,
        );
        let probs = candle_nn::ops::softmax(&logits, D::Minus1)?;
        let weights = self.route_weights(&probs, &routing)?;
        // route r of the flattened list: its token and expert
        let flat: Vec<(u32, usize)> = routing
            .routes
            .iter()
            .enumerate()
            .flat_map(|(s, r)| r.iter().map(move |r| (s as u32, r.expert)))
            .collect();
        let dev = x.device();
        let mut out = xs.zeros_like()?;
        for e in 0..self.experts {
            let (at, tokens): (Vec<u32>, Vec<u32>) = flat
                .iter()
                .enumerate()
                .filter(|(_, (_, ex))| *ex == e)
                .map(|(i, (s, _))| (i as u32, *s))
                .unzip();
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let tokens = Tensor::from_vec(tokens, n, dev)?;
            let [fc1, fc2] = self.expert(vb, e)?;
            let y = fc2.forward(&fc1.forward(&xs.index_select(&tokens, 0)?)?.gelu_erf()?)?;
            let w = weights.index_select(&Tensor::from_vec(at, n, dev)?, 0)?;
            let y = y.broadcast_mul(&w.to_dtype(y.dtype())?.unsqueeze(1)?)?;
            out = out.index_add(&tokens, &y, 0)?;
        }
        // l_aux: the mean gates (through which its gradient reaches the router) against the
        // routing's constant choice fractions
        let ce = Tensor::new(routing.choice_fraction.as_slice(), dev)?;
        let l_aux = (probs.mean(0)? * ce)?
            .sum_all()?
            .affine(routing.aux_scale as f64, 0.0)?;
        cx.add_loss(l_aux.affine(self.aux_coef, 0.0)?)?;
        out.reshape(dims)
    }
}
