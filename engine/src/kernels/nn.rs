//! Differentiable building blocks candle-nn lacks on CPU: candle-nn's fused LayerNorm and
//! last-dim softmax have no backward, so training through them fails. These run the fused
//! kernels, with their backward, on CPU and the primitive compositions (`primitive`, home of
//! the softmax) elsewhere.

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use super::fused_norm_loss;
use super::grad::linear;
use super::primitive::layer_norm_primitive;

/// LayerNorm over the last dimension with weight and bias (computed in f32).
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: vb.get(dim, "weight")?,
            bias: vb.get(dim, "bias")?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// LayerNorm over the last dimension: the fused kernel on CPU, primitives elsewhere.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    match x.device().is_cpu() {
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
    pub fn new(inp: usize, out: usize, vb: VarBuilder) -> Result<Linear> {
        Ok(Linear {
            weight: vb.get((out, inp), "weight")?,
            bias: Some(vb.get(out, "bias")?),
        })
    }

    pub fn no_bias(inp: usize, out: usize, vb: VarBuilder) -> Result<Linear> {
        Ok(Linear {
            weight: vb.get((out, inp), "weight")?,
            bias: None,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(&x.contiguous()?, &self.weight, self.bias.as_ref())
    }
}

/// Mean cross-entropy of `logits` [n, vocab] against `targets` [n] (u32), in f32.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    match logits.device().is_cpu() {
        true => fused_norm_loss::cross_entropy(&logits, targets),
        false => candle_nn::loss::cross_entropy(&logits, targets),
    }
}
