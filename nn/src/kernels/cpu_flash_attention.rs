//! Causal self-attention on CPU in f32 that never holds a T x T matrix (FlashAttention's
//! online softmax, Dao et al. 2022, on the CPU): per (batch, head) the queries go in blocks
//! of `BLOCK` rows against the key blocks they may see; each block's scores update a running
//! row maximum and sum, and the output accumulates rescaled. Forward keeps the output and one
//! log-sum-exp per row [B, H, T]; backward recomputes each block's probabilities from them
//! (`exp(s - lse)`) and accumulates dq, dk and dv block by block. Memory is linear in T: two
//! BLOCK x BLOCK scratch matrices per call instead of cpu_attention.rs's [B, H, T, T]
//! probabilities, for about one more product of q and k in backward.
//!
//! Same layouts as cpu_attention.rs: read straight out of the fused q|k|v projection
//! [B, T, 3d], the output in heads-side-by-side [B, T, d]. Any other case returns `None`.

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

use super::cpu_attention::{contiguous, f32_slices, Shape};
use super::cpu_matmul::{filled, gemm_into, Mat};
use super::vmath;

/// Query and key rows per block.
const BLOCK: usize = 128;

/// The sequence length from which a model's CPU attention takes this path: below it the
/// probabilities are small and keeping them saves backward a product.
pub const MIN_SEQ: usize = 1024;

/// One head's operands: q, k, v [T, hd] views, and where its output rows go.
#[derive(Clone, Copy)]
struct Head {
    q: Mat,
    k: Mat,
    v: Mat,
    /// The output's first row and its row stride.
    out: *mut f32,
    out_rs: isize,
}

/// Which keys a query sees: those at or before it, and with `window` Some(w) only the last
/// w of them (row i sees i - w + 1 ..= i, transformers' sliding window).
#[derive(Clone, Copy)]
struct Mask {
    scale: f32,
    window: Option<usize>,
}

impl Mask {
    /// The keys of row `i` among `j0 .. j0 + cols`: a range of the block's columns.
    fn seen(&self, i: usize, j0: usize, cols: usize) -> std::ops::Range<usize> {
        let end = (i + 1).saturating_sub(j0).min(cols);
        let first = match self.window {
            Some(w) => (i + 1).saturating_sub(w),
            None => 0,
        };
        first.saturating_sub(j0).min(end)..end
    }

    /// The key blocks a query block `i0 .. i0 + rows` may see.
    fn key_blocks(&self, i0: usize, rows: usize) -> impl Iterator<Item = usize> {
        let first = match self.window {
            Some(w) => (i0 + 1).saturating_sub(w) / BLOCK * BLOCK,
            None => 0,
        };
        (first..i0 + rows).step_by(BLOCK)
    }
}

/// Scratch space for one head at a time.
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Scratch {
    fn new(hd: usize) -> Scratch {
        Scratch {
            a: vec![0.0; BLOCK * BLOCK],
            b: vec![0.0; BLOCK * BLOCK],
            acc: vec![0.0; BLOCK * hd],
            max: vec![0.0; BLOCK],
            sum: vec![0.0; BLOCK],
        }
    }
}

/// A buffer the workers of one kernel call write, each only its own heads' part.
#[derive(Clone, Copy)]
struct Shared(*mut f32);

// SAFETY: the kernels below hand each worker disjoint parts of the buffer.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The buffer's element `at` (a method, so closures capture the whole `Shared`).
    fn at(self, at: usize) -> *mut f32 {
        // SAFETY: callers stay inside the buffer
        unsafe { self.0.add(at) }
    }
}

/// `each(item, scratch)` for every item, on the rayon pool (the rank's threads, its size the
/// launcher's RAYON_NUM_THREADS), one scratch space per worker: heads are independent.
fn par_each<I: Sync>(items: &[I], hd: usize, each: impl Fn(&I, &mut Scratch) + Sync + Send) {
    items
        .par_iter()
        .for_each_init(|| Scratch::new(hd), |scratch, item| each(item, scratch));
}

/// One head's forward over `t` positions: its output rows, and each row's log-sum-exp in
/// `lse`.
///
/// # Safety
/// The views address t x hd elements each; the output rows are this head's alone.
unsafe fn forward_head(t: usize, hd: usize, x: Head, m: Mask, lse: &mut [f32], s: &mut Scratch) {
    for i0 in (0..t).step_by(BLOCK) {
        let rows = BLOCK.min(t - i0);
        s.max[..rows].fill(f32::NEG_INFINITY);
        s.sum[..rows].fill(0.0);
        s.acc[..rows * hd].fill(0.0);
        for j0 in m.key_blocks(i0, rows) {
            let cols = BLOCK.min(t - j0);
            let (q, k) = (x.q.row(i0), x.k.row(j0).t());
            gemm_into(
                rows,
                cols,
                hd,
                s.a.as_mut_ptr(),
                cols as isize,
                1,
                false,
                q,
                k,
            );
            for (r, row) in s.a[..rows * cols].chunks_exact_mut(cols).enumerate() {
                let seen = m.seen(i0 + r, j0, cols);
                let rescale = online_softmax_row(row, seen, m.scale, &mut s.max[r], &mut s.sum[r]);
                for a in &mut s.acc[r * hd..(r + 1) * hd] {
                    *a *= rescale;
                }
            }
            let p = Mat {
                ptr: s.a.as_ptr(),
                rs: cols as isize,
                cs: 1,
            };
            gemm_into(
                rows,
                hd,
                cols,
                s.acc.as_mut_ptr(),
                hd as isize,
                1,
                true,
                p,
                x.v.row(j0),
            );
        }
        for r in 0..rows {
            let o = x.out.offset((i0 + r) as isize * x.out_rs);
            for (c, a) in s.acc[r * hd..(r + 1) * hd].iter().enumerate() {
                *o.add(c) = a / s.sum[r];
            }
            lse[i0 + r] = s.max[r] + s.sum[r].ln();
        }
    }
}

/// One row of a block's scores: the columns `seen` scaled and turned into exp(s - new max)
/// in place, the others zero, folded into the row's running maximum `m` and sum `l`; returns
/// the factor the row's earlier output must be rescaled by.
fn online_softmax_row(
    row: &mut [f32],
    seen: std::ops::Range<usize>,
    scale: f32,
    m: &mut f32,
    l: &mut f32,
) -> f32 {
    row[..seen.start].fill(0.0);
    row[seen.end..].fill(0.0);
    if seen.is_empty() {
        return 1.0;
    }
    // exp(scale s - the block's max), then shifted to the running max
    let (block_max, mut block_sum) = vmath::exp_shifted(&mut row[seen.clone()], scale);
    let new_max = m.max(block_max);
    let shift = (block_max - new_max).exp();
    if shift != 1.0 {
        row[seen].iter_mut().for_each(|x| *x *= shift);
        block_sum *= shift;
    }
    let rescale = (*m - new_max).exp();
    *l = *l * rescale + block_sum;
    *m = new_max;
    rescale
}

/// One head's gradients, added into dq, dk, dv (row strides `g_rs`): from its output `o` and
/// its gradient `dy` ([T, hd] views), and the forward's `lse`.
///
/// # Safety
/// Every view addresses t x hd elements; dq, dk, dv overlap no operand.
#[allow(clippy::too_many_arguments)]
unsafe fn backward_head(
    t: usize,
    hd: usize,
    x: Head,
    (o, dy): (Mat, Mat),
    lse: &[f32],
    (dq, dk, dv, g_rs): (*mut f32, *mut f32, *mut f32, isize),
    m: Mask,
    s: &mut Scratch,
) {
    // D_i = dy_i . o_i, the softmax backward's row constant (in `acc`, t of them)
    let mut delta = vec![0f32; t];
    for (i, di) in delta.iter_mut().enumerate() {
        let (yr, or) = (dy.row(i).ptr, o.row(i).ptr);
        *di = (0..hd).map(|c| *yr.add(c) * *or.add(c)).sum();
    }
    let at = |g: *mut f32, row: usize| g.offset(row as isize * g_rs);
    for i0 in (0..t).step_by(BLOCK) {
        let rows = BLOCK.min(t - i0);
        for j0 in m.key_blocks(i0, rows) {
            let cols = BLOCK.min(t - j0);
            let (p, dp) = (s.a.as_mut_ptr(), s.b.as_mut_ptr());
            gemm_into(
                rows,
                cols,
                hd,
                p,
                cols as isize,
                1,
                false,
                x.q.row(i0),
                x.k.row(j0).t(),
            );
            for (r, row) in s.a[..rows * cols].chunks_exact_mut(cols).enumerate() {
                let i = i0 + r;
                let seen = m.seen(i, j0, cols);
                vmath::exp_affine(&mut row[seen.clone()], m.scale, lse[i]);
                row[..seen.start].fill(0.0);
                row[seen.end..].fill(0.0);
            }
            let pm = Mat {
                ptr: s.a.as_ptr(),
                rs: cols as isize,
                cs: 1,
            };
            let dyi = dy.row(i0);
            // dv_j += p^T dy_i; dp = dy_i v_j^T
            gemm_into(cols, hd, rows, at(dv, j0), g_rs, 1, true, pm.t(), dyi);
            gemm_into(
                rows,
                cols,
                hd,
                dp,
                cols as isize,
                1,
                false,
                dyi,
                x.v.row(j0).t(),
            );
            // ds = p (dp - D_i) scale, in place of dp
            for r in 0..rows {
                for c in 0..cols {
                    let e = r * cols + c;
                    s.b[e] = s.a[e] * (s.b[e] - delta[i0 + r]) * m.scale;
                }
            }
            let ds = Mat {
                ptr: s.b.as_ptr(),
                rs: cols as isize,
                cs: 1,
            };
            gemm_into(rows, hd, cols, at(dq, i0), g_rs, 1, true, ds, x.k.row(j0));
            gemm_into(
                cols,
                hd,
                rows,
                at(dk, j0),
                g_rs,
                1,
                true,
                ds.t(),
                x.q.row(i0),
            );
        }
    }
}

/// The output [B, T, d] and the rows' log-sum-exp of the scaled, causally masked scores
/// [B, H, T] of `qkv` [B, T, 3d] (the GPT's fused projection).
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
    let mut lse = vec![0f32; s.b * heads * t];
    let rows = Shared(lse.as_mut_ptr());
    let mask = Mask {
        scale,
        window: None,
    };
    let pairs: Vec<(usize, usize)> = s.pairs().collect();
    // SAFETY: every (b, h) writes its own [t, h, :] columns of out (each row once) and its
    // own lse rows; operand views stay inside qkv.
    let out = unsafe {
        filled(s.b * t * d, |out| {
            let out = Shared(out);
            par_each(&pairs, hd, |&(b, h), scratch| {
                let (q, k, v) = s.qkv(src.as_ptr(), b, h);
                let head = Head {
                    q,
                    k,
                    v,
                    out: out.at(b * t * d + h * hd),
                    out_rs: d as isize,
                };
                let lse = std::slice::from_raw_parts_mut(rows.at((b * heads + h) * t), t);
                forward_head(t, hd, head, mask, lse, scratch);
            })
        })
    };
    let dev = Device::Cpu;
    let out = Tensor::from_vec(out, (s.b, t, d), &dev)?;
    Ok(Some((out, Tensor::from_vec(lse, (s.b, heads, t), &dev)?)))
}

/// The gradient [B, T, 3d] of `qkv` given that of the output, `dout` [B, T, d], from the
/// forward's output `out` and log-sum-exp `lse`.
pub fn backward(
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    heads: usize,
    scale: f32,
) -> Result<Option<Tensor>> {
    let Some(s) = Shape::of(qkv, heads) else {
        return Ok(None);
    };
    if ![out, lse, dout].iter().all(|x| untracked_f32(x)) {
        return Ok(None);
    }
    let held = contiguous([qkv, out, lse, dout])?;
    let guards = held.each_ref().map(|t| t.storage_and_layout());
    let Some([src, o, lse, dy]) = f32_slices(&guards) else {
        return Ok(None);
    };
    let (t, d, hd) = (s.t, s.d, s.hd);
    if o.len() != s.b * t * d || dy.len() != s.b * t * d || lse.len() != s.b * heads * t {
        return Ok(None);
    }
    // dq, dk and dv accumulate over blocks: zeros first
    let mut dqkv = vec![0f32; s.b * t * 3 * d];
    let g = Shared(dqkv.as_mut_ptr());
    let mask = Mask {
        scale,
        window: None,
    };
    let pairs: Vec<(usize, usize)> = s.pairs().collect();
    par_each(&pairs, hd, |&(b, h), scratch| {
        let view = |m: &[f32]| Mat {
            ptr: m[b * t * d + h * hd..].as_ptr(),
            rs: d as isize,
            cs: 1,
        };
        // SAFETY: the views stay inside qkv, out and dout; the gradient views are this
        // (b, h)'s columns of dqkv, which no operand reads.
        unsafe {
            let (q, k, v) = s.qkv(src.as_ptr(), b, h);
            let head = Head {
                q,
                k,
                v,
                out: std::ptr::null_mut(),
                out_rs: 0,
            };
            let at = |part: usize| g.at(b * t * 3 * d + part * d + h * hd);
            let grads = (at(0), at(1), at(2), 3 * d as isize);
            let lse = &lse[(b * heads + h) * t..(b * heads + h + 1) * t];
            backward_head(t, hd, head, (view(o), view(dy)), lse, grads, mask, scratch);
        }
    });
    Ok(Some(Tensor::from_vec(dqkv, (s.b, t, 3 * d), &Device::Cpu)?))
}

/// Grouped-query attention over q [B, h, T, hd] and k, v [B, g, T, hd] (query head i reads
/// key/value head i / (h / g)), causally masked, with `window` Some(w) the sliding window:
/// the output [B, T, h hd] (heads side by side) and the rows' log-sum-exp [B, h, T].
pub fn forward_grouped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Option<(Tensor, Tensor)>> {
    let Some(g) = Grouped::of(q, k, v) else {
        return Ok(None);
    };
    let held = contiguous([q, k, v])?;
    let guards = held.each_ref().map(|t| t.storage_and_layout());
    let Some([qs, ks, vs]) = f32_slices(&guards) else {
        return Ok(None);
    };
    let (t, hd, width) = (g.t, g.hd, g.h * g.hd);
    let mut lse = vec![0f32; g.b * g.h * t];
    let rows = Shared(lse.as_mut_ptr());
    let mask = Mask { scale, window };
    let pairs: Vec<(usize, usize)> = g.pairs().collect();
    // SAFETY: every (b, head) writes its own [t, head, :] columns of out and its own lse
    // rows; the operand views stay inside q, k and v.
    let out = unsafe {
        filled(g.b * t * width, |out| {
            let out = Shared(out);
            par_each(&pairs, hd, |&(b, h), scratch| {
                let (q, k, v) = g.views((qs, ks, vs), b, h);
                let head = Head {
                    q,
                    k,
                    v,
                    out: out.at(b * t * width + h * hd),
                    out_rs: width as isize,
                };
                let lse = std::slice::from_raw_parts_mut(rows.at((b * g.h + h) * t), t);
                forward_head(t, hd, head, mask, lse, scratch);
            })
        })
    };
    let dev = Device::Cpu;
    let out = Tensor::from_vec(out, (g.b, t, width), &dev)?;
    Ok(Some((out, Tensor::from_vec(lse, (g.b, g.h, t), &dev)?)))
}

/// `forward_grouped`'s backward: dq [B, h, T, hd], dk and dv [B, g, T, hd] (summed over the
/// query heads that share them) from the gradient of the output `dout` [B, T, h hd].
#[allow(clippy::too_many_arguments)]
pub fn backward_grouped(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Option<[Tensor; 3]>> {
    let Some(g) = Grouped::of(q, k, v) else {
        return Ok(None);
    };
    if ![out, lse, dout].iter().all(|x| untracked_f32(x)) {
        return Ok(None);
    }
    let held = contiguous([q, k, v, out, lse, dout])?;
    let guards = held.each_ref().map(|t| t.storage_and_layout());
    let Some([qs, ks, vs, o, lse, dy]) = f32_slices(&guards) else {
        return Ok(None);
    };
    let (t, hd, width) = (g.t, g.hd, g.h * g.hd);
    if o.len() != g.b * t * width || dy.len() != o.len() || lse.len() != g.b * g.h * t {
        return Ok(None);
    }
    let mut dq = vec![0f32; qs.len()];
    let (mut dk, mut dv) = (vec![0f32; ks.len()], vec![0f32; vs.len()]);
    let (dqp, dkp, dvp) = (
        Shared(dq.as_mut_ptr()),
        Shared(dk.as_mut_ptr()),
        Shared(dv.as_mut_ptr()),
    );
    let mask = Mask { scale, window };
    // the query heads of a key/value head add into its gradients: one worker per group
    let groups: Vec<(usize, usize)> = (0..g.b)
        .flat_map(|b| (0..g.g).map(move |kv| (b, kv)))
        .collect();
    let per = g.per_group();
    par_each(&groups, hd, |&(b, kv), scratch| {
        for h in kv * per..(kv + 1) * per {
            let view = |m: &[f32]| Mat {
                ptr: m[b * t * width + h * hd..].as_ptr(),
                rs: width as isize,
                cs: 1,
            };
            // SAFETY: the views stay inside their tensors; dq's head rows are this head's, dk's
            // and dv's its group's (this worker's alone), which no operand reads.
            unsafe {
                let (q, k, v) = g.views((qs, ks, vs), b, h);
                let head = Head {
                    q,
                    k,
                    v,
                    out: std::ptr::null_mut(),
                    out_rs: 0,
                };
                let group = (b * g.g + kv) * t * hd;
                let grads = (
                    dqp.at((b * g.h + h) * t * hd),
                    dkp.at(group),
                    dvp.at(group),
                    hd as isize,
                );
                let lse = &lse[(b * g.h + h) * t..(b * g.h + h + 1) * t];
                backward_head(t, hd, head, (view(o), view(dy)), lse, grads, mask, scratch);
            }
        }
    });
    let dev = Device::Cpu;
    Ok(Some([
        Tensor::from_vec(dq, (g.b, g.h, t, hd), &dev)?,
        Tensor::from_vec(dk, (g.b, g.g, t, hd), &dev)?,
        Tensor::from_vec(dv, (g.b, g.g, t, hd), &dev)?,
    ]))
}

/// The sizes of a grouped-query attention.
struct Grouped {
    b: usize,
    h: usize,
    g: usize,
    t: usize,
    hd: usize,
}

impl Grouped {
    /// `None` where this path does not apply: not untracked f32 CPU tensors q [B, h, T, hd],
    /// k and v [B, g, T, hd] with g dividing h.
    fn of(q: &Tensor, k: &Tensor, v: &Tensor) -> Option<Grouped> {
        let (b, h, t, hd) = q.dims4().ok()?;
        let (b2, g, t2, hd2) = k.dims4().ok()?;
        let same = (b, t, hd) == (b2, t2, hd2) && v.dims() == k.dims();
        let usable = [q, k, v].iter().all(|x| untracked_f32(x));
        (same && usable && g > 0 && h % g == 0).then_some(Grouped { b, h, g, t, hd })
    }

    fn per_group(&self) -> usize {
        self.h / self.g
    }

    fn pairs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.b).flat_map(move |b| (0..self.h).map(move |h| (b, h)))
    }

    /// Query head `h` of batch element `b` and its key/value head, [T, hd] views.
    fn views(&self, (q, k, v): (&[f32], &[f32], &[f32]), b: usize, h: usize) -> (Mat, Mat, Mat) {
        let (t, hd) = (self.t, self.hd);
        let kv = (b * self.g + h / self.per_group()) * t * hd;
        let view = |m: &[f32], at: usize| Mat {
            ptr: m[at..].as_ptr(),
            rs: hd as isize,
            cs: 1,
        };
        (view(q, (b * self.h + h) * t * hd), view(k, kv), view(v, kv))
    }
}

fn untracked_f32(x: &Tensor) -> bool {
    !x.track_op() && x.dtype() == DType::F32 && x.device().is_cpu()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu_attention;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// The largest difference relative to the largest reference value.
    fn rel(got: &[f32], want: &[f32]) -> f32 {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst / scale
    }

    /// Grouped-query attention with and without a sliding window against candle's autograd
    /// of the attention that holds the probabilities: the output, dq, and dk, dv summed over
    /// the query heads that share them.
    #[test]
    fn grouped_heads_and_windows_equal_autograd() {
        use candle_core::Var;
        let dev = Device::Cpu;
        for (b, h, g, t, hd, window) in [
            (1, 4, 2, 150, 8, None),
            (2, 2, 1, 70, 4, Some(20)),
            (1, 3, 3, 130, 8, Some(100)),
        ] {
            let scale = 1.0 / (hd as f32).sqrt();
            let var = |n: usize, shape: (usize, usize, usize, usize), seed: u64| {
                Var::from_vec(values(n, seed), shape, &dev).unwrap()
            };
            let q = var(b * h * t * hd, (b, h, t, hd), 1);
            let k = var(b * g * t * hd, (b, g, t, hd), 2);
            let v = var(b * g * t * hd, (b, g, t, hd), 3);
            let dout = Tensor::from_vec(values(b * t * h * hd, 4), (b, t, h * hd), &dev).unwrap();
            // the reference: repeated heads, a -inf mask, softmax, all through autograd
            let repeat = |x: &Tensor| {
                x.unsqueeze(2)
                    .unwrap()
                    .broadcast_as((b, g, h / g, t, hd))
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .reshape((b, h, t, hd))
                    .unwrap()
            };
            let mask: Vec<f32> = (0..t * t)
                .map(|e| {
                    let (i, j) = (e / t, e % t);
                    let inside = j <= i && window.is_none_or(|w| i - j < w);
                    if inside {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let mask = Tensor::from_vec(mask, (t, t), &dev).unwrap();
            let scores = q
                .as_tensor()
                .matmul(&repeat(k.as_tensor()).t().unwrap())
                .unwrap();
            let scores = (scores * scale as f64)
                .unwrap()
                .broadcast_add(&mask)
                .unwrap();
            let probs = crate::kernels::primitive::softmax_last_dim(&scores).unwrap();
            let want = probs
                .matmul(&repeat(v.as_tensor()))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((b, t, h * hd))
                .unwrap();
            let grads = (&want * &dout)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let (qd, kd, vd) = (
                q.as_tensor().detach(),
                k.as_tensor().detach(),
                v.as_tensor().detach(),
            );
            let (out, lse) = forward_grouped(&qd, &kd, &vd, scale, window)
                .unwrap()
                .unwrap();
            let [dq, dk, dv] = backward_grouped((&qd, &kd, &vd), &out, &lse, &dout, scale, window)
                .unwrap()
                .unwrap();
            let what = format!("b {b} h {h} g {g} t {t} window {window:?}");
            assert!(rel(&flat(&out), &flat(&want)) < 1e-5, "{what}: output");
            for (name, got, x) in [("dq", &dq, &q), ("dk", &dk, &k), ("dv", &dv, &v)] {
                let want = flat(grads.get(x.as_tensor()).unwrap());
                assert!(rel(&flat(got), &want) < 1e-5, "{what}: {name}");
            }
        }
    }

    /// Against the attention that holds the probabilities (cpu_attention.rs, itself checked
    /// against candle's ops): the output, the log-sum-exp (from those probabilities' scores)
    /// and dq, dk, dv, for sequences shorter than a block, of one block, and of several
    /// blocks with a partial last one.
    #[test]
    fn equals_the_attention_that_holds_the_probabilities() {
        let dev = Device::Cpu;
        for (b, t, heads, hd) in [(2, 5, 2, 4), (1, 64, 2, 8), (2, 150, 3, 8), (1, 257, 1, 16)] {
            let d = heads * hd;
            let scale = 1.0 / (hd as f32).sqrt();
            let qkv =
                Tensor::from_vec(values(b * t * 3 * d, t as u64), (b, t, 3 * d), &dev).unwrap();
            let dout = Tensor::from_vec(values(b * t * d, 7 + t as u64), (b, t, d), &dev).unwrap();
            let (probs, want_out) = cpu_attention::forward(&qkv, heads, scale).unwrap().unwrap();
            let want_dqkv = cpu_attention::backward(&qkv, &probs, &dout, heads, scale)
                .unwrap()
                .unwrap();
            let (out, lse) = forward(&qkv, heads, scale).unwrap().unwrap();
            let dqkv = backward(&qkv, &out, &lse, &dout, heads, scale)
                .unwrap()
                .unwrap();
            let what = format!("b {b} t {t} heads {heads} hd {hd}");
            // f32 sums in other orders: a few ulps of the largest value
            assert!(rel(&flat(&out), &flat(&want_out)) < 1e-5, "{what}: output");
            assert!(rel(&flat(&dqkv), &flat(&want_dqkv)) < 1e-5, "{what}: dqkv");
            // row i's probability of key 0 is exp(s_i0 - lse_i): lse from the held probabilities
            let (probs, lse) = (flat(&probs), flat(&lse));
            let q = flat(&qkv);
            for bh in 0..b * heads {
                let (bb, h) = (bh / heads, bh % heads);
                for i in 0..t {
                    let s0: f32 = (0..hd)
                        .map(|c| {
                            q[bb * t * 3 * d + i * 3 * d + h * hd + c]
                                * q[bb * t * 3 * d + d + h * hd + c]
                        })
                        .sum::<f32>()
                        * scale;
                    let p0 = probs[bh * t * t + i * t];
                    let got = (s0 - lse[bh * t + i]).exp();
                    assert!(
                        (got - p0).abs() <= 1e-5 * p0.max(1e-3),
                        "{what}: lse row {i}: {got} vs {p0}"
                    );
                }
            }
        }
    }
}
