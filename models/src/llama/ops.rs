//! The Llama block's elementwise pieces with their backward: grouped-query heads and the
//! sliding-window softmax (RMSNorm and SwiGLU are shared blocks, blocks/). Composed of candle's
//! ops, so they run on every device.

use candle_core::{DType, Result, Tensor, D};

pub use crate::blocks::{rms_norm, rms_norm_backward};
use ds_nn::kernels::primitive::softmax_last_dim;

/// Each of `k`'s heads [B, g, T, hd] repeated `n` times in place ([B, g n, T, hd]), as
/// transformers' `repeat_kv`: query head i reads key head i / n.
pub fn repeat_heads(k: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(k.clone());
    }
    let (b, g, t, hd) = k.dims4()?;
    k.unsqueeze(2)?
        .expand((b, g, n, t, hd))?
        .contiguous()?
        .reshape((b, g * n, t, hd))
}

/// The transpose of `repeat_heads`: each group of `n` heads' gradients summed.
pub fn sum_repeated_heads(dk: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(dk.clone());
    }
    let (b, h, t, hd) = dk.dims4()?;
    dk.reshape((b, h / n, n, t, hd))?.sum(2)
}

/// Softmax of `scale * x` over the last dimension of [.., T, T] scores where row i sees
/// columns i - w + 1 ..= i (transformers' sliding-window causal mask).
pub fn window_softmax(x: &Tensor, scale: f64, w: usize) -> Result<Tensor> {
    let t = x.dim(D::Minus1)?;
    let mask: Vec<f32> = (0..t * t)
        .map(|k| {
            let (i, j) = (k / t, k % t);
            match j <= i && i - j < w {
                true => 0.0,
                false => f32::NEG_INFINITY,
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), x.device())?;
    let scores = (x.to_dtype(DType::F32)? * scale)?.broadcast_add(&mask)?;
    softmax_last_dim(&scores)?.to_dtype(x.dtype())
}
