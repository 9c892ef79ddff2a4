//! The MLP, defined once with its backward: `down(act(up(x)))` with GELU (tanh or erf), or
//! `down(silu(gate(x)) * up(x))` (SwiGLU). The dense MLP of every family and each expert of
//! a mixture are this block; a family names its linears and says where they are split.
//!
//! The block computes on this rank's slices and returns the down projection's product
//! without its bias when the caller sums partial products (tensor parallelism: `up`/`gate`
//! column-parallel, `down` row-parallel); `forward_rows` and `tiled_forward` do the summing
//! and add the replicated bias once after it. Note [tiles]: `tiled_*` run `tile` positions at
//! a time and keep nothing, computing the products again in backward.

use candle_core::{Result, Tensor};
use ds_nn::kernels::grad::{
    bias_backward, gelu_linear_backward, linear, linear_backward, linear_gelu, LinearGrads,
};
use ds_nn::kernels::ops::gelu;
use ds_nn::kernels::rms_swiglu;
use ds_nn::model::tensor_bytes;
use ds_nn::parallel::{row_parallel_linear, Tp};

use crate::loss::tiles;

/// GELU's two forms: PyTorch's tanh approximation or the exact erf one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    Tanh,
    Erf,
}

/// The MLP's nonlinearity, which also decides whether it has a gate projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Gelu(Gelu),
    SwiGlu,
}

/// A linear's weight [out, in] and optional bias [out], this rank's slices.
pub struct Linear {
    pub w: Tensor,
    pub b: Option<Tensor>,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.w, self.b.as_ref())
    }

    /// A row-parallel product: the partial products summed over the group, the replicated
    /// bias added once after.
    pub fn forward_rows(&self, tp: &Tp, x: &Tensor) -> Result<Tensor> {
        row_parallel_linear(tp, x, &self.w, self.b.as_ref())
    }
}

/// The MLP's linears, this rank's slices; `gate` only under SwiGLU.
pub struct MlpWeights {
    pub gate: Option<Linear>,
    pub up: Linear,
    pub down: Linear,
}

/// What the backward reads of the forward: the pre-activations and the activation.
pub enum MlpKept {
    Gelu {
        pre: Tensor,
        act: Tensor,
    },
    SwiGlu {
        gate: Tensor,
        up: Tensor,
        act: Tensor,
    },
}

impl MlpKept {
    pub fn bytes(&self) -> usize {
        match self {
            MlpKept::Gelu { pre, act } => tensor_bytes(pre) + tensor_bytes(act),
            MlpKept::SwiGlu { gate, up, act } => [gate, up, act].map(tensor_bytes).iter().sum(),
        }
    }

    fn act(&self) -> &Tensor {
        match self {
            MlpKept::Gelu { act, .. } | MlpKept::SwiGlu { act, .. } => act,
        }
    }
}

/// The gradients of the MLP's input (this rank's part under tensor parallelism) and of its
/// weights and up/gate biases; the down bias is the caller's (it is replicated).
pub struct MlpGrads {
    pub dx: Tensor,
    pub gate: Option<(Tensor, Option<Tensor>)>,
    pub up: (Tensor, Option<Tensor>),
    pub down_w: Tensor,
}

impl MlpGrads {
    /// In declaration order: gate's weight and bias, up's, down's weight.
    pub fn declared(self) -> Vec<Tensor> {
        let linear = |(w, b): (Tensor, Option<Tensor>)| std::iter::once(w).chain(b);
        let mut out: Vec<Tensor> = self.gate.into_iter().flat_map(linear).collect();
        out.extend(linear(self.up));
        out.push(self.down_w);
        out
    }

    /// Each weight's gradient plus `other`'s (the input's stays): a tiled backward's sum
    /// over its tiles.
    fn add(self, other: MlpGrads) -> Result<MlpGrads> {
        let pair = |(w, b): (Tensor, Option<Tensor>), (ow, ob): (Tensor, Option<Tensor>)| {
            let b = match (b, ob) {
                (Some(b), Some(ob)) => Some((b + ob)?),
                _ => None,
            };
            Ok::<_, candle_core::Error>(((w + ow)?, b))
        };
        Ok(MlpGrads {
            dx: self.dx,
            gate: match (self.gate, other.gate) {
                (Some(g), Some(og)) => Some(pair(g, og)?),
                _ => None,
            },
            up: pair(self.up, other.up)?,
            down_w: (self.down_w + other.down_w)?,
        })
    }
}

impl Activation {
    /// The activation of `x` [.., d] and what the backward reads of it.
    pub fn hidden(self, w: &MlpWeights, x: &Tensor) -> Result<MlpKept> {
        Ok(match self {
            Activation::Gelu(Gelu::Tanh) => {
                let (pre, act) = match &w.up.b {
                    Some(b) => linear_gelu(x, &w.up.w, b)?,
                    None => {
                        let pre = w.up.forward(x)?;
                        let act = gelu(&pre)?;
                        (pre, act)
                    }
                };
                MlpKept::Gelu { pre, act }
            }
            Activation::Gelu(Gelu::Erf) => {
                let pre = w.up.forward(x)?;
                let act = pre.gelu_erf()?;
                MlpKept::Gelu { pre, act }
            }
            Activation::SwiGlu => {
                let gate = w
                    .gate
                    .as_ref()
                    .expect("invariant: SwiGLU has a gate")
                    .forward(x)?;
                let up = w.up.forward(x)?;
                let act = swiglu(&gate, &up)?;
                MlpKept::SwiGlu { gate, up, act }
            }
        })
    }

    /// The output of `x` [.., d], down's bias added here where `with_bias`, and what the
    /// backward reads.
    pub fn forward(self, w: &MlpWeights, x: &Tensor, with_bias: bool) -> Result<(Tensor, MlpKept)> {
        let kept = self.hidden(w, x)?;
        let bias = w.down.b.as_ref().filter(|_| with_bias);
        Ok((linear(kept.act(), &w.down.w, bias)?, kept))
    }

    /// The output of the gathered input `x`, down row-parallel over `tp` (its bias added
    /// once, after the sum).
    pub fn forward_rows(self, tp: &Tp, w: &MlpWeights, x: &Tensor) -> Result<(Tensor, MlpKept)> {
        let kept = self.hidden(w, x)?;
        Ok((w.down.forward_rows(tp, kept.act())?, kept))
    }

    /// From the output's gradient `dy`: the input's and the weights', from what the forward
    /// `kept`, else from the products computed again.
    pub fn backward(
        self,
        w: &MlpWeights,
        x: &Tensor,
        kept: Option<MlpKept>,
        dy: &Tensor,
    ) -> Result<MlpGrads> {
        let kept = match kept {
            Some(k) => k,
            None => self.hidden(w, x)?,
        };
        match kept {
            MlpKept::Gelu { pre, act } => {
                let down = match self {
                    Activation::Gelu(Gelu::Tanh) => {
                        gelu_linear_backward(&act, &pre, &w.down.w, dy)?
                    }
                    _ => {
                        let d = linear_backward(&act, &w.down.w, dy)?;
                        LinearGrads {
                            dx: gelu_erf_backward(&pre, &d.dx)?,
                            dw: d.dw,
                        }
                    }
                };
                let (dx, up) = input_grads(x, &w.up, &down.dx)?;
                Ok(MlpGrads {
                    dx,
                    gate: None,
                    up,
                    down_w: down.dw,
                })
            }
            MlpKept::SwiGlu { gate, up, act } => {
                let down = linear_backward(&act, &w.down.w, dy)?;
                let (dgate, dup) = swiglu_backward(&gate, &up, &down.dx)?;
                let g = w.gate.as_ref().expect("invariant: SwiGLU has a gate");
                let (dx_gate, gate) = input_grads(x, g, &dgate)?;
                let (dx_up, up) = input_grads(x, &w.up, &dup)?;
                Ok(MlpGrads {
                    dx: (dx_gate + dx_up)?,
                    gate: Some(gate),
                    up,
                    down_w: down.dw,
                })
            }
        }
    }

    /// The output of the gathered input `x` [B, T, d], `tile` positions at a time, down's
    /// partial products summed over `tp` and its bias added after.
    pub fn tiled_forward(self, tp: &Tp, w: &MlpWeights, x: &Tensor, tile: usize) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let rows = x.reshape((b * t, d))?;
        let mut parts = Vec::new();
        for r in tiles(b * t, tile) {
            let kept = self.hidden(w, &rows.narrow(0, r.start, r.len())?)?;
            parts.push(linear(kept.act(), &w.down.w, None)?);
        }
        let partial = Tensor::cat(&parts, 0)?.reshape((b, t, d))?;
        add_bias(tp.reduce(&partial)?, w.down.b.as_ref())
    }

    /// The backward of `tiled_forward` (its `dy` gathered too), each tile's products computed
    /// again and its weights' gradients added up; the input's gradient this rank's part.
    pub fn tiled_backward(
        self,
        w: &MlpWeights,
        x: &Tensor,
        dy: &Tensor,
        tile: usize,
    ) -> Result<MlpGrads> {
        let (b, t, d) = x.dims3()?;
        let (x, dy) = (x.reshape((b * t, d))?, dy.reshape((b * t, d))?);
        let (mut dx, mut sum) = (Vec::new(), None::<MlpGrads>);
        for r in tiles(b * t, tile) {
            let rows = |v: &Tensor| v.narrow(0, r.start, r.len());
            let g = self.backward(w, &rows(&x)?, None, &rows(&dy)?)?;
            dx.push(g.dx.clone());
            sum = Some(match sum {
                None => g,
                Some(s) => s.add(g)?,
            });
        }
        let mut sum = sum.expect("invariant: at least one position");
        sum.dx = Tensor::cat(&dx, 0)?.reshape((b, t, d))?;
        Ok(sum)
    }
}

/// The gradients of a column linear's input and of its weight and bias from its output's.
fn input_grads(x: &Tensor, l: &Linear, dy: &Tensor) -> Result<(Tensor, (Tensor, Option<Tensor>))> {
    let g = linear_backward(x, &l.w, dy)?;
    let db = l.b.as_ref().map(|b| bias_backward(dy, b)).transpose()?;
    Ok((g.dx, (g.dw, db)))
}

fn add_bias(y: Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `silu(gate) * up`, through ds-nn's fused kernel where it applies.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if let Some(fused) = rms_swiglu::swiglu(gate, up)? {
        return Ok(fused);
    }
    gate.silu()? * up
}

/// The gradients of `swiglu`'s gate and up from its output's `dy`:
/// silu'(g) = s(g) (1 + g (1 - s(g))) with s the logistic function.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    if let Some(fused) = rms_swiglu::swiglu_backward(gate, up, dy)? {
        return Ok(fused);
    }
    let s = (gate.neg()?.exp()? + 1.0)?.recip()?;
    let dsilu = (&s * ((gate * (1.0 - &s)?)? + 1.0)?)?;
    let dgate = ((dy * up)? * dsilu)?;
    let dup = (dy * gate.silu()?)?;
    Ok((dgate, dup))
}

/// d/dx x Phi(x) = Phi(x) + x phi(x), times `dy`.
fn gelu_erf_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let cdf = ((x / std::f64::consts::SQRT_2)?.erf()? + 1.0)?.affine(0.5, 0.0)?;
    let pdf = (x.sqr()? * -0.5)?
        .exp()?
        .affine(1.0 / (2.0 * std::f64::consts::PI).sqrt(), 0.0)?;
    dy * (cdf + (x * pdf)?)?
}
