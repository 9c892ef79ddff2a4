//! Differentiable building blocks candle-nn lacks on CPU: candle-nn's fused LayerNorm,
//! RMSNorm and last-dim softmax have no backward, so training through them fails (or, for
//! its LayerNorm module, silently stops the gradient: candle issue #2168). These run the
//! fused kernels, with their backward, on CPU and the primitive compositions elsewhere. The
//! modules are built as candle-nn's (same constructors, names and initialisers) and are
//! candle `Module`s, so a user's model swaps them in for candle-nn's.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};

pub use super::autograd::{rms_norm, rope, softmax_last_dim};
use super::fused_norm_loss;
use super::gpu::fused_on;
use super::grad::linear;
use super::primitive::layer_norm_primitive;

/// LayerNorm over the last dimension with weight and bias (computed in f32).
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Weight 1 and bias 0, as `candle_nn::layer_norm`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(dim, "bias", Init::Const(0.0))?,
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// RMSNorm over the last dimension with a weight (Llama's), differentiable.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Weight 1, as `candle_nn::rms_norm`.
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: vb.get_with_hints(dim, "weight", Init::Const(1.0))?,
            eps,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.weight, self.eps)
    }
}

/// LayerNorm over the last dimension: the fused kernel on CPU and CUDA, primitives elsewhere.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    match fused_on(x.device()) {
        true => fused_norm_loss::layer_norm(x, weight, bias, eps),
        false => layer_norm_primitive(x, weight, bias, eps),
    }
}

/// `x W^T + b` with candle-nn's Linear layout ([out, in] weight), the bias added by the fused
/// `add_bias`.
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Initialised as `candle_nn::linear` (PyTorch's: Kaiming weights, a uniform bias).
    pub fn new(inp: usize, out: usize, vb: VarBuilder) -> Result<Linear> {
        let bound = 1.0 / (inp as f64).sqrt();
        let bias = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let weight = Linear::no_bias(inp, out, vb.clone())?.weight;
        Ok(Linear {
            weight,
            bias: Some(vb.get_with_hints(out, "bias", bias)?),
        })
    }

    pub fn no_bias(inp: usize, out: usize, vb: VarBuilder) -> Result<Linear> {
        let init = candle_nn::init::DEFAULT_KAIMING_NORMAL;
        Ok(Linear {
            weight: vb.get_with_hints((out, inp), "weight", init)?,
            bias: None,
        })
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(&x.contiguous()?, &self.weight, self.bias.as_ref())
    }
}

/// Mean cross-entropy of `logits` [n, vocab] against `targets` [n] (u32), in f32.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    // untracked logits on a GPU: one pass in their own dtype, no f32 copy
    if let Some((loss, _lse)) = fused_norm_loss::cross_entropy_and_lse(logits, targets)? {
        return Ok(loss);
    }
    let logits = logits.to_dtype(DType::F32)?;
    match fused_on(logits.device()) {
        true => fused_norm_loss::cross_entropy(&logits, targets),
        false => candle_nn::loss::cross_entropy(&logits, targets),
    }
}
