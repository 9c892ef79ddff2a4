//! The Llama block's elementwise pieces with their backward: RMSNorm (normalised in f32, as
//! transformers' `LlamaRMSNorm`), the SwiGLU product, grouped-query heads and the
//! sliding-window softmax. Composed of candle's ops, so they run on every device; RMSNorm
//! and SwiGLU take ds-engine's fused path where it applies (untracked f32 on the CPU, any
//! float dtype on a GPU in the cuda build).

use candle_core::{DType, Result, Tensor, D};
use ds_nn::kernels::primitive::softmax_last_dim;
use ds_nn::kernels::rms_swiglu;

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

/// `silu(gate) * up`.
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
