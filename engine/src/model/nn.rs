//! Differentiable building blocks candle-nn lacks on CPU: candle-nn's fused LayerNorm and
//! last-dim softmax have no backward, so training through them fails. These are written
//! with candle's primitive ops, which all have one.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;

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
        true => super::fused_norm_loss::layer_norm(x, weight, bias, eps),
        false => layer_norm_primitive(x, weight, bias, eps),
    }
}

/// LayerNorm from candle's primitive ops (normalised in f32), for devices without the kernel.
pub(crate) fn layer_norm_primitive(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed
        .to_dtype(dtype)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
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
        super::grad::linear(&x.contiguous()?, &self.weight, self.bias.as_ref())
    }
}

/// Softmax over the last dimension, stabilised by the row maximum.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Mean cross-entropy of `logits` [n, vocab] against `targets` [n] (u32), in f32.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    match logits.device().is_cpu() {
        true => super::fused_norm_loss::cross_entropy(&logits, targets),
        false => candle_nn::loss::cross_entropy(&logits, targets),
    }
}
