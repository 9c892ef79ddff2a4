//! Causal self-attention on CPU in f32, read straight out of the fused q|k|v projection
//! [B, T, 3, H, hd] and written straight into the heads-side-by-side layout [B, T, H, hd]:
//! per (batch, head), strided gemm calls replace the permute into [3, B, H, T, hd], the
//! transpose back, and in backward the stack and permute of dq, dk, dv (five copies of the
//! activations per block). Any other case returns `None` and the caller uses candle's ops.

use candle_core::{CpuStorage, DType, Device, Layout, Result, Storage, Tensor};

use super::cpu_matmul::{filled, gemm_into, Mat};
use super::ops::{causal_softmax_row, softmax_grad_row};

/// The attention probabilities [B, H, T, T] and the output [B, T, d] of `qkv` [B, T, 3d].
pub fn forward(qkv: &Tensor, heads: usize, scale: f32) -> Result<Option<(Tensor, Tensor)>> {
    let Some(s) = Shape::of(qkv, heads) else {
        return Ok(None);
    };
    let held = contiguous([qkv])?;
    let guards = held.each_ref().map(|t| t.storage_and_layout());
    let Some([src]) = f32_slices(&guards) else {
        return Ok(None);
    };
    let (t, d, hd) = (s.t, s.d, s.hd);
    let mut probs = Vec::new();
    // SAFETY: every (b, h) writes its own T x T block of probs and its own [t, h, :] columns
    // of out, so together they write every element once; operand views stay inside qkv.
    let out = unsafe {
        filled(s.b * t * d, |out| {
            probs = filled(s.b * heads * t * t, |pr| {
                for (b, h) in s.pairs() {
                    let (q, k, v) = s.qkv(src.as_ptr(), b, h);
                    let p = pr.add((b * heads + h) * t * t);
                    gemm_into(t, t, hd, p, t as isize, 1, false, q, k.t());
                    let rows = std::slice::from_raw_parts_mut(p, t * t);
                    for (r, row) in rows.chunks_exact_mut(t).enumerate() {
                        causal_softmax_row(row, r, scale);
                    }
                    let o = out.add(b * t * d + h * hd);
                    gemm_into(t, hd, t, o, d as isize, 1, false, square(p, t), v);
                }
            })
        })
    };
    let dev = Device::Cpu;
    let probs = Tensor::from_vec(probs, (s.b, heads, t, t), &dev)?;
    Ok(Some((probs, Tensor::from_vec(out, (s.b, t, d), &dev)?)))
}

/// The gradient [B, T, 3d] of `qkv` given that of the output, `dout` [B, T, d].
pub fn backward(
    qkv: &Tensor,
    probs: &Tensor,
    dout: &Tensor,
    heads: usize,
    scale: f32,
) -> Result<Option<Tensor>> {
    let Some(s) = Shape::of(qkv, heads) else {
        return Ok(None);
    };
    if [probs, dout]
        .iter()
        .any(|x| x.track_op() || x.dtype() != DType::F32)
    {
        return Ok(None);
    }
    let held = contiguous([qkv, probs, dout])?;
    let guards = held.each_ref().map(|t| t.storage_and_layout());
    let Some([src, pr, dy]) = f32_slices(&guards) else {
        return Ok(None);
    };
    let (t, d, hd) = (s.t, s.d, s.hd);
    if pr.len() != s.b * heads * t * t || dy.len() != s.b * t * d {
        return Ok(None);
    }
    let mut dscores = vec![0f32; t * t];
    // SAFETY: every (b, h) writes its own [t, 0..3, h, :] columns of dqkv, together every
    // element once; operand views stay inside qkv, probs and dout; dscores is t x t.
    let dqkv = unsafe {
        filled(s.b * t * 3 * d, |dqkv| {
            for (b, h) in s.pairs() {
                let (q, k, v) = s.qkv(src.as_ptr(), b, h);
                let p = square(pr.as_ptr().add((b * heads + h) * t * t), t);
                let dy_bh = Mat {
                    ptr: dy.as_ptr().add(b * t * d + h * hd),
                    rs: d as isize,
                    cs: 1,
                };
                let ds = dscores.as_mut_ptr();
                let at = |part: usize| dqkv.add(b * t * 3 * d + part * d + h * hd);
                let rs = 3 * d as isize;
                gemm_into(t, t, hd, ds, t as isize, 1, false, dy_bh, v.t());
                gemm_into(t, hd, t, at(2), rs, 1, false, p.t(), dy_bh);
                let p_rows = std::slice::from_raw_parts(p.ptr, t * t);
                for (y, g) in p_rows.chunks_exact(t).zip(dscores.chunks_exact_mut(t)) {
                    softmax_grad_row(y, g, scale);
                }
                let ds = square(dscores.as_ptr(), t);
                gemm_into(t, hd, t, at(0), rs, 1, false, ds, k);
                gemm_into(t, hd, t, at(1), rs, 1, false, ds.t(), q);
            }
        })
    };
    Ok(Some(Tensor::from_vec(dqkv, (s.b, t, 3 * d), &Device::Cpu)?))
}

/// The sizes of an attention over `qkv` [B, T, 3d] with `heads` heads.
pub(super) struct Shape {
    pub b: usize,
    pub t: usize,
    pub d: usize,
    pub heads: usize,
    pub hd: usize,
}

impl Shape {
    /// `None` where this path does not apply: not an untracked f32 CPU [B, T, 3d] tensor.
    pub fn of(qkv: &Tensor, heads: usize) -> Option<Shape> {
        let (b, t, d3) = qkv.dims3().ok()?;
        let usable = qkv.device().is_cpu() && qkv.dtype() == DType::F32 && !qkv.track_op();
        let d = d3 / 3;
        (usable && heads > 0 && d3 % 3 == 0 && d % heads == 0 && d > 0).then_some(Shape {
            b,
            t,
            d,
            heads,
            hd: d / heads,
        })
    }

    pub fn pairs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.b).flat_map(move |b| (0..self.heads).map(move |h| (b, h)))
    }

    /// Head h of batch element b: q, k and v as [T, hd] views of the q|k|v buffer.
    ///
    /// # Safety
    /// `src` holds B * T * 3d elements.
    pub unsafe fn qkv(&self, src: *const f32, b: usize, h: usize) -> (Mat, Mat, Mat) {
        let base = src.add(b * self.t * 3 * self.d + h * self.hd);
        let view = |part: usize| Mat {
            ptr: base.add(part * self.d),
            rs: 3 * self.d as isize,
            cs: 1,
        };
        (view(0), view(1), view(2))
    }
}

/// A contiguous t x t matrix.
fn square(ptr: *const f32, t: usize) -> Mat {
    Mat {
        ptr,
        rs: t as isize,
        cs: 1,
    }
}

/// Each tensor made contiguous (a copy only where it is not).
pub(super) fn contiguous<const N: usize>(tensors: [&Tensor; N]) -> Result<[Tensor; N]> {
    let all = tensors
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<Vec<_>>>()?;
    Ok(all
        .try_into()
        .unwrap_or_else(|_| unreachable!("N tensors in, N out")))
}

/// The f32 elements of contiguous tensors' held storages (`storage_and_layout`), or None
/// where one is not an f32 CPU storage.
pub(super) fn f32_slices<'a, G: std::ops::Deref<Target = Storage>, const N: usize>(
    guards: &'a [(G, &Layout); N],
) -> Option<[&'a [f32]; N]> {
    let mut out: [&[f32]; N] = [&[]; N];
    for (o, (s, l)) in out.iter_mut().zip(guards) {
        *o = f32_slice(s, l.contiguous_offsets())?;
    }
    Some(out)
}

fn f32_slice(s: &Storage, offsets: Option<(usize, usize)>) -> Option<&[f32]> {
    match (s, offsets) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Some(&v[a..b]),
        _ => None,
    }
}
