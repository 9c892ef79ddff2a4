//! Rotary position embeddings in the split-halves convention (Hugging Face's `rotate_half`),
//! fused for untracked contiguous f32 CPU tensors, and in the cuda build for untracked GPU
//! tensors of any float dtype (kernels/gpu): `x cos + rotate_half(x) sin` and its backward in
//! one pass each, where the composition of narrows, a concatenation and four products takes
//! six. `None` where the path does not apply; the caller composes candle's ops.

use candle_core::{DType, Result, Storage, Tensor};
use rayon::prelude::*;

fn slice(t: &Tensor) -> Option<Vec<f32>> {
    if !t.device().is_cpu() || t.dtype() != DType::F32 || t.track_op() {
        return None;
    }
    let t = t.contiguous().ok()?;
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => Some(v[a..b].to_vec()),
        _ => None,
    }
}

/// `x cos + rotate_half(x) sin` for x [.., T, hd] and tables [T, hd]; with `transpose`, the
/// backward (`dy cos + rotate_half^T(dy sin)`).
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, transpose: bool) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return rotate_on_gpu(x, cos, sin, transpose);
    }
    let (Some(xv), Some(c), Some(s)) = (slice(x), slice(cos), slice(sin)) else {
        return Ok(None);
    };
    let (t, hd) = cos.dims2()?;
    let out = rotate_rows(&xv, &c, &s, (t, hd), transpose);
    Ok(Some(Tensor::from_vec(out, x.shape(), x.device())?))
}

/// `rotate` on a GPU: the tables converted to `x`'s dtype.
#[cfg(feature = "cuda")]
fn rotate_on_gpu(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    transpose: bool,
) -> Result<Option<Tensor>> {
    use super::gpu::{self, cuda::on_tensors};
    let (dtype, n, tables) = (x.dtype(), x.elem_count(), cos.dims2()?);
    let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
    let out = on_tensors(
        &[x, &cos, &sin],
        &[(dtype, x.shape().clone())],
        |k, a, o| gpu::rotary(k, dtype, [a[0], a[1], a[2]], o[0], n, tables, transpose),
    )?;
    Ok(out.map(|mut v| v.remove(0)))
}

/// `rotate`'s arithmetic over contiguous f32 data: x [.., t, hd], tables [t, hd].
pub(crate) fn rotate_rows(
    xv: &[f32],
    c: &[f32],
    s: &[f32],
    (t, hd): (usize, usize),
    transpose: bool,
) -> Vec<f32> {
    let half = hd / 2;
    let mut out = vec![0f32; xv.len()];
    out.par_chunks_mut(t * hd)
        .zip(xv.par_chunks(t * hd))
        .for_each(|(o, x)| {
            for p in 0..t {
                let (x, o) = (&x[p * hd..(p + 1) * hd], &mut o[p * hd..(p + 1) * hd]);
                let (c, s) = (&c[p * hd..(p + 1) * hd], &s[p * hd..(p + 1) * hd]);
                for i in 0..half {
                    let j = i + half;
                    match transpose {
                        false => {
                            o[i] = x[i] * c[i] - x[j] * s[i];
                            o[j] = x[j] * c[j] + x[i] * s[j];
                        }
                        true => {
                            o[i] = x[i] * c[i] + x[j] * s[j];
                            o[j] = x[j] * c[j] - x[i] * s[i];
                        }
                    }
                }
            }
        });
    out
}

/// `x cos + rotate_half(x) sin`.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    rotate(x, cos, sin, false)
}

/// The gradient of `apply`'s input from its output's `dy`.
pub fn apply_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    rotate(dy, cos, sin, true)
}
