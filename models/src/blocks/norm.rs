//! The norms over a block's features: LayerNorm (GPT, GPT-2) and RMSNorm (the Llama family,
//! normalised in f32 as transformers' `LlamaRMSNorm`), one type with its forward and backward
//! and its parameters under the family's names. Both take ds-nn's fused kernels where they
//! apply.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;
use ds_nn::kernels::fused_norm_loss::layer_norm_backward;
use ds_nn::kernels::nn::layer_norm;
use ds_nn::kernels::rms_swiglu;
use ds_nn::model::{tensor_bytes, Init, ParamSpec};

/// A norm over the last dimension, its weight (and LayerNorm's bias) named by the family.
#[derive(Debug, Clone)]
pub enum Norm {
    Layer {
        weight: String,
        bias: String,
        hidden: usize,
        eps: f64,
    },
    Rms {
        weight: String,
        hidden: usize,
        eps: f64,
    },
}

/// What a norm's backward needs beside its input: RMSNorm's reciprocal root.
pub(crate) enum NormKept {
    Layer,
    Rms(Tensor),
}

impl NormKept {
    pub(crate) fn bytes(&self) -> usize {
        match self {
            NormKept::Layer => 0,
            NormKept::Rms(r) => tensor_bytes(r),
        }
    }
}

impl Norm {
    /// Its parameters: ones for the weight, zeros for the bias, marked as a norm's (no weight
    /// decay in Hugging Face's groups).
    pub fn params(&self) -> Vec<ParamSpec> {
        match self {
            Norm::Layer {
                weight,
                bias,
                hidden,
                ..
            } => vec![
                ParamSpec::new(weight, &[*hidden], Init::Ones).norm(),
                ParamSpec::new(bias, &[*hidden], Init::Zeros).norm(),
            ],
            Norm::Rms { weight, hidden, .. } => {
                vec![ParamSpec::new(weight, &[*hidden], Init::Ones).norm()]
            }
        }
    }

    fn weights(&self, vb: &VarBuilder) -> Result<Vec<Tensor>> {
        match self {
            Norm::Layer {
                weight,
                bias,
                hidden,
                ..
            } => Ok(vec![vb.get(*hidden, weight)?, vb.get(*hidden, bias)?]),
            Norm::Rms { weight, hidden, .. } => Ok(vec![vb.get(*hidden, weight)?]),
        }
    }

    /// The normalised `x`, and what the backward keeps.
    pub(crate) fn forward(&self, vb: &VarBuilder, x: &Tensor) -> Result<(Tensor, NormKept)> {
        let w = self.weights(vb)?;
        match self {
            Norm::Layer { eps, .. } => Ok((layer_norm(x, &w[0], &w[1], *eps)?, NormKept::Layer)),
            Norm::Rms { eps, .. } => {
                let (h, r) = rms_norm(x, &w[0], *eps)?;
                Ok((h, NormKept::Rms(r)))
            }
        }
    }

    /// The input's gradient and the parameters' (in `params` order) from the output's `dh`.
    pub(crate) fn backward(
        &self,
        vb: &VarBuilder,
        x: &Tensor,
        kept: &NormKept,
        dh: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let w = self.weights(vb)?;
        match (self, kept) {
            (Norm::Layer { eps, .. }, _) => {
                let (dx, dw, db) = layer_norm_backward(x, &w[0], &w[1], dh, *eps)?;
                Ok((dx, vec![dw, db]))
            }
            (Norm::Rms { .. }, NormKept::Rms(r)) => {
                let (dx, dw) = rms_norm_backward(x, r, &w[0], dh)?;
                Ok((dx, vec![dw]))
            }
            (Norm::Rms { .. }, NormKept::Layer) => {
                candle_core::bail!("invariant: an RMSNorm keeps its reciprocal root")
            }
        }
    }
}

/// `w * (x / sqrt(mean(x^2) + eps))`, the normalisation in f32 and cast back before the
/// weight; also returns the reciprocal root [.., 1] (f32) for the backward.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    if let Some(fused) = rms_swiglu::rms_norm(x, w, eps)? {
        return Ok(fused);
    }
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let n = xf.broadcast_mul(&r)?.to_dtype(x.dtype())?;
    Ok((n.broadcast_mul(w)?, r))
}

/// RMSNorm's gradients of the input and the weight, from the input `x`, its reciprocal
/// root `r` and the output's `dy`: with n = x r, dx = r (w dy - n mean(w dy n)) and
/// dw = sum over positions of dy n.
pub fn rms_norm_backward(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if let Some(fused) = rms_swiglu::rms_norm_backward(x, r, w, dy)? {
        return Ok(fused);
    }
    let n = x.to_dtype(DType::F32)?.broadcast_mul(r)?;
    let dn = dy.broadcast_mul(w)?.to_dtype(DType::F32)?;
    let dot = (&dn * &n)?.mean_keepdim(D::Minus1)?;
    let dx = (dn - n.broadcast_mul(&dot)?)?.broadcast_mul(r)?;
    let d = w.dim(0)?;
    let dw = (dy.to_dtype(DType::F32)? * &n)?
        .reshape(((), d))?
        .sum(0)?
        .to_dtype(w.dtype())?;
    Ok((dx.to_dtype(x.dtype())?, dw))
}
