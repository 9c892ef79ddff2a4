//! Fused paths for RMSNorm and the SwiGLU product, forward and backward, for untracked tensors:
//! contiguous f32 on the CPU, and in the cuda build any float dtype on a GPU (kernels/gpu, the
//! same arithmetic in f32, rounded once on the store). Each is one pass over rows or elements
//! where candle's primitive compositions take 6-10 (each op a pass and an allocation). `None`
//! means the path does not apply (another device or dtype, or a tensor autograd tracks) and
//! the caller runs the primitive composition, the function these are tested against.

use candle_core::{DType, Result, Storage, Tensor};
use rayon::prelude::*;

/// Rows handed to one task; a fixed number, so that the weight gradient's partial sums, and
/// so its bits, do not depend on the thread count.
const ROWS_PER_TASK: usize = 64;

fn usable(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op())
}

/// The contiguous f32 elements of `t` (a copy; `t` is untracked f32 on the CPU).
fn elements(t: &Tensor) -> Result<Vec<f32>> {
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    match (&*s, l.contiguous_offsets()) {
        (Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) => Ok(v[a..b].to_vec()),
        _ => candle_core::bail!("fused op: expected contiguous f32 CPU storage"),
    }
}

/// `w * (x / sqrt(mean(x^2) + eps))` over the last dimension, and the reciprocal roots
/// [.., 1].
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if let Some(fused) = on_gpu::rms_norm(x, w, eps)? {
        return Ok(Some(fused));
    }
    if !usable(&[x, w]) {
        return Ok(None);
    }
    let (mut y, wv) = (elements(x)?, elements(w)?);
    let r = rms_norm_rows(&mut y, &wv, eps);
    let mut root_shape = x.dims().to_vec();
    *root_shape.last_mut().expect("a norm input has dimensions") = 1;
    Ok(Some((
        Tensor::from_vec(y, x.shape(), x.device())?,
        Tensor::from_vec(r, root_shape, x.device())?,
    )))
}

/// `rms_norm`'s arithmetic in place over contiguous rows of `w.len()`; returns the
/// reciprocal roots, one a row.
pub(crate) fn rms_norm_rows(y: &mut [f32], w: &[f32], eps: f64) -> Vec<f32> {
    let d = w.len();
    let mut r = vec![0f32; y.len() / d.max(1)];
    y.par_chunks_mut(d * ROWS_PER_TASK)
        .zip(r.par_chunks_mut(ROWS_PER_TASK))
        .for_each(|(rows, roots)| {
            for (row, root) in rows.chunks_mut(d).zip(roots.iter_mut()) {
                let mean = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
                *root = 1.0 / (mean + eps as f32).sqrt();
                row.iter_mut()
                    .zip(w)
                    .for_each(|(v, w)| *v = w * (*v * *root));
            }
        });
    r
}

/// RMSNorm's input and weight gradients from the input `x`, its reciprocal roots `r` and
/// `dy`: with n = x r, dx = r (w dy - n mean(w dy n)), dw = the sum over rows of dy n.
pub fn rms_norm_backward(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    dy: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if let Some(fused) = on_gpu::rms_norm_backward(x, r, w, dy)? {
        return Ok(Some(fused));
    }
    if !usable(&[x, r, w, dy]) {
        return Ok(None);
    }
    let d = w.dim(0)?;
    let (xv, rv, wv, mut dx) = (elements(x)?, elements(r)?, elements(w)?, elements(dy)?);
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(xv.par_chunks(d * ROWS_PER_TASK))
        .zip(rv.par_chunks(ROWS_PER_TASK))
        .map(|((dys, xs), roots)| {
            let mut dw = vec![0f32; d];
            for ((g, x), root) in dys.chunks_mut(d).zip(xs.chunks(d)).zip(roots) {
                let mut dot = 0f32;
                for j in 0..d {
                    let n = x[j] * root;
                    dw[j] += g[j] * n;
                    dot += g[j] * wv[j] * n;
                }
                let mean = dot / d as f32;
                for j in 0..d {
                    let n = x[j] * root;
                    g[j] = (g[j] * wv[j] - n * mean) * root;
                }
            }
            dw
        })
        .collect();
    let mut dw = vec![0f32; d];
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    Ok(Some((
        Tensor::from_vec(dx, x.shape(), x.device())?,
        Tensor::from_vec(dw, d, x.device())?,
    )))
}

fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(fused) = on_gpu::swiglu(gate, up)? {
        return Ok(Some(fused));
    }
    if !usable(&[gate, up]) {
        return Ok(None);
    }
    let (mut a, u) = (elements(gate)?, elements(up)?);
    a.par_chunks_mut(1 << 14)
        .zip(u.par_chunks(1 << 14))
        .for_each(|(a, u)| {
            a.iter_mut()
                .zip(u)
                .for_each(|(g, u)| *g = *g * sigmoid(*g) * u)
        });
    Ok(Some(Tensor::from_vec(a, gate.shape(), gate.device())?))
}

/// The gate's and up's gradients from `dy`: silu'(g) = s(g) (1 + g (1 - s(g))).
pub fn swiglu_backward(
    gate: &Tensor,
    up: &Tensor,
    dy: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    if let Some(fused) = on_gpu::swiglu_backward(gate, up, dy)? {
        return Ok(Some(fused));
    }
    if !usable(&[gate, up, dy]) {
        return Ok(None);
    }
    let (g, u, mut dg) = (elements(gate)?, elements(up)?, elements(dy)?);
    let mut du = vec![0f32; dg.len()];
    dg.par_chunks_mut(1 << 14)
        .zip(du.par_chunks_mut(1 << 14))
        .zip(g.par_chunks(1 << 14).zip(u.par_chunks(1 << 14)))
        .for_each(|((dg, du), (g, u))| {
            for i in 0..dg.len() {
                let s = sigmoid(g[i]);
                let dy = dg[i];
                du[i] = dy * g[i] * s;
                dg[i] = dy * u[i] * s * (1.0 + g[i] * (1.0 - s));
            }
        });
    Ok(Some((
        Tensor::from_vec(dg, gate.shape(), gate.device())?,
        Tensor::from_vec(du, gate.shape(), gate.device())?,
    )))
}

/// The same four on a GPU: the inputs in the activation's dtype (the weight converted to it),
/// RMSNorm's roots in f32, and dweight returned in the weight's dtype.
#[cfg(feature = "cuda")]
mod on_gpu {
    use candle_core::{DType, Result, Shape, Tensor};

    use super::super::gpu::{self, cuda::on_tensors};

    fn on_cuda(t: &Tensor) -> bool {
        t.device().is_cuda() && !t.track_op()
    }

    pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<(Tensor, Tensor)>> {
        if !on_cuda(x) {
            return Ok(None);
        }
        let (dtype, d) = (x.dtype(), w.elem_count());
        let rows = x.elem_count() / d.max(1);
        let mut roots = x.dims().to_vec();
        *roots.last_mut().expect("a norm input has dimensions") = 1;
        let outputs = [(dtype, x.shape().clone()), (DType::F32, Shape::from(roots))];
        let out = on_tensors(&[x, &w.to_dtype(dtype)?], &outputs, |k, a, o| {
            gpu::rms_norm(k, dtype, [a[0], a[1]], [o[0], o[1]], rows, d, eps as f32)
        })?;
        Ok(out.map(|mut v| {
            let r = v.pop().expect("two outputs");
            (v.pop().expect("two outputs"), r)
        }))
    }

    pub(super) fn rms_norm_backward(
        x: &Tensor,
        r: &Tensor,
        w: &Tensor,
        dy: &Tensor,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if !on_cuda(x) {
            return Ok(None);
        }
        let (dtype, d) = (x.dtype(), w.elem_count());
        let rows = x.elem_count() / d.max(1);
        let (r, wt, dy) = (
            r.to_dtype(DType::F32)?,
            w.to_dtype(dtype)?,
            dy.to_dtype(dtype)?,
        );
        let outputs = [(dtype, x.shape().clone()), (dtype, w.shape().clone())];
        let out = on_tensors(&[x, &r, &wt, &dy], &outputs, |k, a, o| {
            gpu::rms_norm_backward(k, dtype, [a[0], a[1], a[2], a[3]], [o[0], o[1]], rows, d)
        })?;
        out.map(|mut v| {
            let dw = v.pop().expect("two outputs").to_dtype(w.dtype())?;
            Ok((v.pop().expect("two outputs"), dw))
        })
        .transpose()
    }

    pub(super) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
        if !on_cuda(gate) {
            return Ok(None);
        }
        let (dtype, n) = (gate.dtype(), gate.elem_count());
        let outputs = [(dtype, gate.shape().clone())];
        let out = on_tensors(&[gate, &up.to_dtype(dtype)?], &outputs, |k, a, o| {
            gpu::swiglu(k, dtype, [a[0], a[1]], o[0], n)
        })?;
        Ok(out.map(|mut v| v.remove(0)))
    }

    pub(super) fn swiglu_backward(
        gate: &Tensor,
        up: &Tensor,
        dy: &Tensor,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if !on_cuda(gate) {
            return Ok(None);
        }
        let (dtype, n) = (gate.dtype(), gate.elem_count());
        let (up, dy) = (up.to_dtype(dtype)?, dy.to_dtype(dtype)?);
        let out = on_tensors(
            &[gate, &up, &dy],
            &[(dtype, Shape::from(2 * n))],
            |k, a, o| gpu::swiglu_backward(k, dtype, [a[0], a[1], a[2]], o[0], n),
        )?;
        out.map(|v| {
            let both = &v[0];
            let dg = both.narrow(0, 0, n)?.reshape(gate.shape())?;
            Ok((dg, both.narrow(0, n, n)?.reshape(gate.shape())?))
        })
        .transpose()
    }
}
