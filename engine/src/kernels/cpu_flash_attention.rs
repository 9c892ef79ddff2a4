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

use super::cpu_attention::{f32_slice, Shape};
use super::cpu_matmul::{filled, gemm_into, Mat};

/// Query and key rows per block.
const BLOCK: usize = 64;

/// The sequence length from which a model's CPU attention takes this path: below it the
/// probabilities are small and keeping them saves backward a product.
pub const MIN_SEQ: usize = 1024;

/// The output [B, T, d] and the rows' log-sum-exp of the scaled, masked scores [B, H, T] of
/// `qkv` [B, T, 3d].
pub fn forward(qkv: &Tensor, heads: usize, scale: f32) -> Result<Option<(Tensor, Tensor)>> {
    let Some(s) = Shape::of(qkv, heads) else {
        return Ok(None);
    };
    let qkv = qkv.contiguous()?;
    let (storage, layout) = qkv.storage_and_layout();
    let Some(src) = f32_slice(&storage, layout.contiguous_offsets()) else {
        return Ok(None);
    };
    let (t, d, hd) = (s.t, s.d, s.hd);
    let mut lse = vec![0f32; s.b * heads * t];
    let mut scores = vec![0f32; BLOCK * BLOCK];
    let mut acc = vec![0f32; BLOCK * hd];
    let (mut max, mut sum) = (vec![0f32; BLOCK], vec![0f32; BLOCK]);
    // SAFETY: every (b, h) writes its own [t, h, :] columns of out (each row once, at the end
    // of its query block) and its own lse rows; operand views stay inside qkv and the
    // scratch matrices, which no product reads and writes at once.
    let out = unsafe {
        filled(s.b * t * d, |out| {
            for (b, h) in s.pairs() {
                let (q, k, v) = s.qkv(src.as_ptr(), b, h);
                for i0 in (0..t).step_by(BLOCK) {
                    let rows = BLOCK.min(t - i0);
                    max[..rows].fill(f32::NEG_INFINITY);
                    sum[..rows].fill(0.0);
                    acc[..rows * hd].fill(0.0);
                    // key blocks up to the last query's position
                    for j0 in (0..i0 + rows).step_by(BLOCK) {
                        let cols = BLOCK.min(t - j0);
                        let sc = scores.as_mut_ptr();
                        gemm_into(
                            rows,
                            cols,
                            hd,
                            sc,
                            cols as isize,
                            1,
                            false,
                            q.row(i0),
                            k.row(j0).t(),
                        );
                        let block = &mut scores[..rows * cols];
                        for (r, row) in block.chunks_exact_mut(cols).enumerate() {
                            let (m, l) = (&mut max[r], &mut sum[r]);
                            let rescale = online_softmax_row(row, i0 + r, j0, scale, m, l);
                            for a in &mut acc[r * hd..(r + 1) * hd] {
                                *a *= rescale;
                            }
                        }
                        let p = Mat {
                            ptr: scores.as_ptr(),
                            rs: cols as isize,
                            cs: 1,
                        };
                        gemm_into(
                            rows,
                            hd,
                            cols,
                            acc.as_mut_ptr(),
                            hd as isize,
                            1,
                            true,
                            p,
                            v.row(j0),
                        );
                    }
                    for r in 0..rows {
                        let o = out.add(b * t * d + (i0 + r) * d + h * hd);
                        for (c, a) in acc[r * hd..(r + 1) * hd].iter().enumerate() {
                            *o.add(c) = a / sum[r];
                        }
                        lse[(b * heads + h) * t + i0 + r] = max[r] + sum[r].ln();
                    }
                }
            }
        })
    };
    let dev = Device::Cpu;
    let out = Tensor::from_vec(out, (s.b, t, d), &dev)?;
    Ok(Some((out, Tensor::from_vec(lse, (s.b, heads, t), &dev)?)))
}

/// One row of a block's scores (query position `i`, keys from `j0`) scaled and causally
/// masked, turned into exp(s - new max) in place, folded into the row's running maximum `m`
/// and sum `l`; returns the factor the row's earlier output must be rescaled by.
fn online_softmax_row(
    row: &mut [f32],
    i: usize,
    j0: usize,
    scale: f32,
    m: &mut f32,
    l: &mut f32,
) -> f32 {
    let seen = (i + 1).saturating_sub(j0).min(row.len());
    let block_max = row[..seen]
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x * scale));
    let new_max = m.max(block_max);
    if new_max == f32::NEG_INFINITY {
        row.fill(0.0);
        return 1.0;
    }
    let rescale = (*m - new_max).exp();
    let mut block_sum = 0.0;
    for x in &mut row[..seen] {
        *x = (*x * scale - new_max).exp();
        block_sum += *x;
    }
    row[seen..].fill(0.0);
    *l = *l * rescale + block_sum;
    *m = new_max;
    rescale
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
    let untracked_f32 = |x: &&Tensor| !x.track_op() && x.dtype() == DType::F32;
    if ![out, lse, dout].iter().all(untracked_f32) {
        return Ok(None);
    }
    let (qkv, out, lse, dout) = (
        qkv.contiguous()?,
        out.contiguous()?,
        lse.contiguous()?,
        dout.contiguous()?,
    );
    let (sq, lq) = qkv.storage_and_layout();
    let (so, lo) = out.storage_and_layout();
    let (sl, ll) = lse.storage_and_layout();
    let (sd, ld) = dout.storage_and_layout();
    let (Some(src), Some(o), Some(lse), Some(dy)) = (
        f32_slice(&sq, lq.contiguous_offsets()),
        f32_slice(&so, lo.contiguous_offsets()),
        f32_slice(&sl, ll.contiguous_offsets()),
        f32_slice(&sd, ld.contiguous_offsets()),
    ) else {
        return Ok(None);
    };
    let (t, d, hd) = (s.t, s.d, s.hd);
    if o.len() != s.b * t * d || dy.len() != s.b * t * d || lse.len() != s.b * heads * t {
        return Ok(None);
    }
    // dq, dk and dv accumulate over blocks: zeros first
    let mut dqkv = vec![0f32; s.b * t * 3 * d];
    let dqkv_ptr = dqkv.as_mut_ptr();
    let (mut p, mut dp) = (vec![0f32; BLOCK * BLOCK], vec![0f32; BLOCK * BLOCK]);
    let mut delta = vec![0f32; t];
    let at = |m: &[f32], b: usize, h: usize| Mat {
        ptr: m[b * t * d + h * hd..].as_ptr(),
        rs: d as isize,
        cs: 1,
    };
    for (b, h) in s.pairs() {
        // D_i = dout_i . out_i, the softmax backward's row constant
        for (i, di) in delta.iter_mut().enumerate() {
            let row = b * t * d + i * d + h * hd;
            *di = (0..hd).map(|c| dy[row + c] * o[row + c]).sum();
        }
        let lse = &lse[(b * heads + h) * t..(b * heads + h + 1) * t];
        // SAFETY: q, k, v, dout views stay inside their buffers; the dq, dk, dv views are this
        // (b, h)'s columns of dqkv, which no operand reads; p and dp are BLOCK x BLOCK.
        unsafe {
            let (q, k, v) = s.qkv(src.as_ptr(), b, h);
            let dy_bh = at(dy, b, h);
            let grad = |part: usize, row: usize| {
                dqkv_ptr.add(b * t * 3 * d + row * 3 * d + part * d + h * hd)
            };
            let rs = 3 * d as isize;
            for j0 in (0..t).step_by(BLOCK) {
                let cols = BLOCK.min(t - j0);
                // query blocks that see these keys: from the one holding position j0
                for i0 in (j0 / BLOCK * BLOCK..t).step_by(BLOCK) {
                    let rows = BLOCK.min(t - i0);
                    gemm_into(
                        rows,
                        cols,
                        hd,
                        p.as_mut_ptr(),
                        cols as isize,
                        1,
                        false,
                        q.row(i0),
                        k.row(j0).t(),
                    );
                    for (r, row) in p[..rows * cols].chunks_exact_mut(cols).enumerate() {
                        let i = i0 + r;
                        for (c, x) in row.iter_mut().enumerate() {
                            *x = match j0 + c <= i {
                                true => (*x * scale - lse[i]).exp(),
                                false => 0.0,
                            };
                        }
                    }
                    let pm = Mat {
                        ptr: p.as_ptr(),
                        rs: cols as isize,
                        cs: 1,
                    };
                    let dyi = dy_bh.row(i0);
                    // dv_j += p^T dout_i; dp = dout_i v_j^T
                    gemm_into(cols, hd, rows, grad(2, j0), rs, 1, true, pm.t(), dyi);
                    gemm_into(
                        rows,
                        cols,
                        hd,
                        dp.as_mut_ptr(),
                        cols as isize,
                        1,
                        false,
                        dyi,
                        v.row(j0).t(),
                    );
                    // ds = p (dp - D_i) scale, in dp
                    for r in 0..rows {
                        for c in 0..cols {
                            let x = r * cols + c;
                            dp[x] = p[x] * (dp[x] - delta[i0 + r]) * scale;
                        }
                    }
                    let ds = Mat {
                        ptr: dp.as_ptr(),
                        rs: cols as isize,
                        cs: 1,
                    };
                    gemm_into(rows, hd, cols, grad(0, i0), rs, 1, true, ds, k.row(j0));
                    gemm_into(cols, hd, rows, grad(1, j0), rs, 1, true, ds.t(), q.row(i0));
                }
            }
        }
    }
    Ok(Some(Tensor::from_vec(dqkv, (s.b, t, 3 * d), &Device::Cpu)?))
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
