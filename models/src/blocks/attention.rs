//! Causal self-attention, defined once with its backward: the q, k and v projections (one
//! fused linear, GPT's `c_attn`, or three, with grouped key/value heads), rotary positions,
//! per-head RMSNorm of queries and keys (Qwen3), a sliding window (Mistral), the softmax of
//! the scaled scores, and the output projection. A family configures it and names its linears.
//!
//! Under tensor parallelism (Megatron-LM's scheme) the projections are column-parallel (each
//! rank owns whole query and key/value heads, so grouped-query attention stays local), the
//! output projection row-parallel. Under sequence parallelism (Note [ulysses]) the projections
//! hold this rank's positions of all its heads, attention itself whole sequences of a part
//! of them.
//!
//! Two layouts of q, k and v, chosen by the projection: the fused projection keeps them packed
//! side by side [B, T, 3 h hd], as the fused CPU attention kernels and the flash kernels read
//! them; three projections keep them as heads [B, h, T, hd] (the rotary positions and the
//! norms act on heads). Both take the blockwise (flash) path where `flash_attention::wanted`
//! says so: long sequences on the CPU, bf16 and f16 on a GPU; the softmax's probabilities are
//! then never whole, only each row's log-sum-exp is kept (memory linear in T).

use candle_core::{DType, Result, Tensor, D};
use ds_nn::kernels::grad::{bias_backward, linear_backward};
use ds_nn::kernels::ops::{causal_softmax, causal_softmax_backward};
use ds_nn::kernels::primitive::softmax_last_dim;
use ds_nn::kernels::{cpu_attention, flash_attention};
use ds_nn::model::tensor_bytes;
use ds_nn::parallel::{Sp, Tp};

use super::mlp::Linear;
use super::norm::{rms_norm, rms_norm_backward};
use super::rope::{self, Rope};

/// The block's shape and layout; its weights come with each call.
#[derive(Clone)]
pub struct Attention {
    /// This rank's query heads and key/value heads (under tensor parallelism), and their size.
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Copies of each key/value head made before Ulysses' exchange (1 unless the sequence-
    /// parallel size exceeds the rank's key/value heads).
    pub kv_copies: usize,
    /// Rotary positions (three projections only).
    pub rope: Option<Rope>,
    /// The per-head norms' epsilon, where the weights have them.
    pub norm_eps: f64,
    /// Each position sees this many positions, itself included (a sliding window).
    pub window: Option<usize>,
    pub tp: Tp,
    pub sp: Sp,
}

/// How q, k and v come from the block's input, this rank's slices.
pub enum Projection {
    /// One linear [3 h hd, d]: q|k|v side by side, h heads each.
    Fused(Linear),
    /// Three linears, k and v of `kv_heads` heads.
    Separate([Linear; 3]),
}

pub struct AttentionWeights {
    pub qkv: Projection,
    /// The per-head RMSNorm weights of queries and keys [head_dim], where there are.
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub o: Linear,
}

/// What the backward reads of the forward.
pub struct AttentionKept {
    heads: Heads,
    softmax: Softmax,
    /// Under the per-head norms: the queries and keys before them, and their reciprocal roots.
    normed: Option<[Tensor; 4]>,
    /// The heads side by side [B, T, h hd], the output projection's input (this rank's
    /// positions).
    out: Tensor,
    /// Under sequence parallelism, attention's own output: whole sequences, this rank's part
    /// of the heads.
    heads_out: Option<Tensor>,
}

/// Attention's input: packed q|k|v [B, T, 3 h hd] (whole sequences), or rotated queries
/// [B, h, T, hd], rotated keys and values [B, g, T, hd].
enum Heads {
    Packed(Tensor),
    Split([Tensor; 3]),
}

/// What the backward reads of the softmax: the probabilities [B, h, T, T], or each row's
/// log-sum-exp [B, h, T] (the blockwise path).
enum Softmax {
    Probs(Tensor),
    LogSumExp(Tensor),
}

/// The gradients of the block's input (this rank's positions, summed over the
/// tensor-parallel group) and of its parameters.
pub struct AttentionGrads {
    pub dx: Tensor,
    /// Each projection's weight and bias, in declaration order.
    pub qkv: Vec<(Tensor, Option<Tensor>)>,
    /// The per-head norms' weights, summed over the group.
    pub qk_norm: Option<[Tensor; 2]>,
    pub o_weight: Tensor,
    /// The output projection's replicated bias: from this rank's positions, for the caller
    /// to sum over the group with its other replicated parameters.
    pub o_bias: Option<Tensor>,
}

impl AttentionKept {
    /// Bytes of what the backward reads.
    pub fn bytes(&self) -> usize {
        let heads = match &self.heads {
            Heads::Packed(qkv) => tensor_bytes(qkv),
            Heads::Split(qkv) => qkv.iter().map(tensor_bytes).sum(),
        };
        let softmax = match &self.softmax {
            Softmax::Probs(p) | Softmax::LogSumExp(p) => tensor_bytes(p),
        };
        heads
            + softmax
            + tensor_bytes(&self.out)
            + self.heads_out.as_ref().map_or(0, tensor_bytes)
            + self
                .normed
                .iter()
                .flatten()
                .map(tensor_bytes)
                .sum::<usize>()
    }
}

impl Attention {
    /// The output projection's output from the block's input `x` [B, t, d] (this rank's
    /// positions), and what the backward reads.
    pub fn forward(&self, w: &AttentionWeights, x: &Tensor) -> Result<(Tensor, AttentionKept)> {
        let x = self.tp.gather(x)?;
        let kept = match &w.qkv {
            Projection::Fused(l) => self.packed(l.forward(&x)?)?,
            Projection::Separate(l) => self.split(l, w.qk_norm.as_ref(), &x)?,
        };
        Ok((w.o.forward_rows(&self.tp, &kept.out)?, kept))
    }

    /// From the gradient `dy` of the output (this rank's positions) and the block's input `x`.
    pub fn backward(
        &self,
        w: &AttentionWeights,
        kept: AttentionKept,
        x: &Tensor,
        dy: &Tensor,
    ) -> Result<AttentionGrads> {
        let o = linear_backward(&kept.out, &w.o.w, &self.tp.gather(dy)?)?;
        let o_bias = w.o.b.as_ref().map(|b| bias_backward(dy, b)).transpose()?;
        let (dprojected, qk_norm) = match &kept.heads {
            Heads::Packed(_) => (vec![self.packed_backward(&kept, &o.dx)?], None),
            Heads::Split(_) => {
                let (d, dnorms) = self.split_backward(&kept, w.qk_norm.as_ref(), &o.dx)?;
                // replicated weights over this rank's heads: summed over the group
                let dnorms = match dnorms {
                    Some([q, k]) => Some([self.tp.sum(&q)?, self.tp.sum(&k)?]),
                    None => None,
                };
                (d.to_vec(), dnorms)
            }
        };
        let linears: Vec<&Linear> = match &w.qkv {
            Projection::Fused(l) => vec![l],
            Projection::Separate(l) => l.iter().collect(),
        };
        let xg = self.tp.gather(x)?;
        let (mut dx, mut qkv) = (None::<Tensor>, Vec::new());
        for (l, d) in linears.into_iter().zip(dprojected) {
            let g = linear_backward(&xg, &l.w, &d)?;
            dx = Some(match dx {
                Some(acc) => (acc + g.dx)?,
                None => g.dx,
            });
            qkv.push((
                g.dw,
                l.b.as_ref().map(|b| bias_backward(&d, b)).transpose()?,
            ));
        }
        let dx = self
            .tp
            .reduce(&dx.expect("invariant: at least one projection"))?;
        Ok(AttentionGrads {
            dx,
            qkv,
            qk_norm,
            o_weight: o.dw,
            o_bias,
        })
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// The packed layout's forward from the fused projection's output [B, t, 3 h hd].
    fn packed(&self, qkv: Tensor) -> Result<AttentionKept> {
        let (h, sp) = (self.heads, &self.sp);
        if sp.size() == 1 {
            return self.packed_whole(h, qkv);
        }
        let (b, t, d3) = qkv.dims3()?;
        let hd = d3 / 3 / h;
        let n = h / sp.size();
        let qkv = sp.to_heads(&qkv.reshape((b, t, 3, h, hd))?)?;
        let whole_t = qkv.dim(1)?;
        let mut a = self.packed_whole(n, qkv.reshape((b, whole_t, 3 * n * hd))?)?;
        let heads_out = a.out.reshape((b, whole_t, 1, n, hd))?;
        a.out = sp.to_sequence(&heads_out)?.reshape((b, t, h * hd))?;
        a.heads_out = Some(heads_out.reshape((b, whole_t, n * hd))?);
        Ok(a)
    }

    /// `h` heads of whole sequences' packed q|k|v [B, T, 3 h hd].
    fn packed_whole(&self, h: usize, qkv: Tensor) -> Result<AttentionKept> {
        let (b, t, d3) = qkv.dims3()?;
        let d = d3 / 3;
        let s = self.scale() as f32;
        let kept = |qkv, softmax, out| AttentionKept {
            heads: Heads::Packed(qkv),
            softmax,
            normed: None,
            out,
            heads_out: None,
        };
        if flash_attention::wanted(t, qkv.device(), qkv.dtype()) {
            if let Some((out, lse)) = flash_attention::forward(&qkv, h, s)? {
                return Ok(kept(qkv, Softmax::LogSumExp(lse), out));
            }
        }
        if let Some((probs, out)) = cpu_attention::forward(&qkv, h, s)? {
            return Ok(kept(qkv, Softmax::Probs(probs), out));
        }
        let (q, k, v) = unpack(h, &qkv)?;
        let probs = causal_softmax(&q.matmul(&k.t()?)?, self.scale())?;
        let out = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        Ok(kept(qkv, Softmax::Probs(probs), out))
    }

    /// The gradient of the fused projection's output [B, t, 3 h hd] from that of `out`,
    /// through the exchanges of the forward under sequence parallelism.
    fn packed_backward(&self, kept: &AttentionKept, dout: &Tensor) -> Result<Tensor> {
        let (h, sp) = (self.heads, &self.sp);
        let Some(heads_out) = &kept.heads_out else {
            return self.packed_core_backward(kept, h, &kept.out, dout);
        };
        let (b, t, d) = dout.dims3()?;
        let (hd, n) = (d / h, h / sp.size());
        let dheads = sp.to_heads(&dout.reshape((b, t, 1, h, hd))?)?;
        let whole_t = dheads.dim(1)?;
        let dheads = dheads.reshape((b, whole_t, n * hd))?;
        let dqkv = self.packed_core_backward(kept, n, heads_out, &dheads)?;
        let dqkv = sp.to_sequence(&dqkv.reshape((b, whole_t, 3, n, hd))?)?;
        dqkv.reshape((b, t, 3 * d))
    }

    /// The gradient of the packed q|k|v [B, T, 3d] of `h` heads from that of their output.
    fn packed_core_backward(
        &self,
        kept: &AttentionKept,
        h: usize,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<Tensor> {
        let Heads::Packed(qkv) = &kept.heads else {
            unreachable!("invariant: the packed layout's tape")
        };
        let (b, t, d) = dout.dims3()?;
        let hd = d / h;
        let s = self.scale() as f32;
        let probs = match &kept.softmax {
            Softmax::LogSumExp(lse) => {
                let grads = flash_attention::backward(qkv, out, lse, dout, h, s)?;
                return grads.ok_or_else(declined);
            }
            Softmax::Probs(p) => p,
        };
        if let Some(dqkv) = cpu_attention::backward(qkv, probs, dout, h, s)? {
            return Ok(dqkv);
        }
        let (q, k, v) = unpack(h, qkv)?;
        let dheads = dout.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous()?;
        let dprobs = dheads.matmul(&v.t()?)?;
        let dv = probs.t()?.matmul(&dheads)?;
        let dscores = causal_softmax_backward(probs, &dprobs, self.scale())?;
        let dq = dscores.matmul(&k)?;
        let dk = dscores.t()?.matmul(&q)?;
        // [3, b, H, t, hd] back to [b, t, 3, H, hd]
        Tensor::stack(&[dq, dk, dv], 0)?
            .permute((1, 3, 0, 2, 4))?
            .contiguous()?
            .reshape((b, t, 3 * d))
    }

    /// The heads layout's forward from the block's gathered input `x`.
    fn split(
        &self,
        [wq, wk, wv]: &[Linear; 3],
        qk_norm: Option<&(Tensor, Tensor)>,
        x: &Tensor,
    ) -> Result<AttentionKept> {
        let (hd, sp, r) = (self.head_dim, &self.sp, self.kv_copies);
        let (q, k) = (
            split_heads(sp, &wq.forward(x)?, self.heads, hd, 1)?,
            split_heads(sp, &wk.forward(x)?, self.kv_heads, hd, r)?,
        );
        // the heads attention runs here: all of them, or this rank's part of the sequences'
        let (h, t) = (q.dim(1)?, q.dim(2)?);
        let (q, k, normed) = match qk_norm {
            Some((nq, nk)) => {
                let (qn, rq) = rms_norm(&q, nq, self.norm_eps)?;
                let (kn, rk) = rms_norm(&k, nk, self.norm_eps)?;
                (qn, kn, Some([q, rq, k, rk]))
            }
            None => (q, k, None),
        };
        let (q, k) = match &self.rope {
            Some(rope) => {
                let (cos, sin) = rope.tables(hd, 0, t, x.dtype(), x.device())?;
                (rope::apply(&q, &cos, &sin)?, rope::apply(&k, &cos, &sin)?)
            }
            None => (q, k),
        };
        let v = split_heads(sp, &wv.forward(x)?, self.kv_heads, hd, r)?;
        let window = self.window.filter(|w| *w < t);
        let (out, softmax) = match flash_attention::wanted(t, q.device(), q.dtype()) {
            true => {
                let s = self.scale() as f32;
                match flash_attention::forward_grouped(&q, &k, &v, s, window)? {
                    Some((out, lse)) => (out, Softmax::LogSumExp(lse)),
                    None => self.grouped_probs(&q, &k, &v, window)?,
                }
            }
            false => self.grouped_probs(&q, &k, &v, window)?,
        };
        let (out, heads_out) = match sp.size() {
            1 => (out, None),
            n => (join_heads(sp, &out, h * n, hd, 1)?, Some(out)),
        };
        Ok(AttentionKept {
            heads: Heads::Split([q, k, v]),
            softmax,
            normed,
            out,
            heads_out,
        })
    }

    /// Grouped-query attention through the whole probabilities: the heads side by side
    /// [B, T, h hd] and the probabilities.
    fn grouped_probs(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        window: Option<usize>,
    ) -> Result<(Tensor, Softmax)> {
        let (b, h, t, hd) = q.dims4()?;
        let g = k.dim(1)?;
        let scores = q.matmul(&repeat_heads(k, h / g)?.t()?)?;
        let probs = match window {
            Some(w) => window_softmax(&scores, self.scale(), w)?,
            None => causal_softmax(&scores, self.scale())?,
        };
        let out = probs
            .matmul(&repeat_heads(v, h / g)?)?
            .transpose(1, 2)?
            .reshape((b, t, h * hd))?;
        Ok((out, Softmax::Probs(probs)))
    }

    /// The gradients of the q, k and v projections' outputs [B, t, width] from `dout`, and
    /// those of the per-head norms' weights (this rank's heads' part) where there are.
    fn split_backward(
        &self,
        kept: &AttentionKept,
        qk_norm: Option<&(Tensor, Tensor)>,
        dout: &Tensor,
    ) -> Result<([Tensor; 3], Option<[Tensor; 2]>)> {
        let Heads::Split([q, _, _]) = &kept.heads else {
            unreachable!("invariant: the heads layout's tape")
        };
        let (b, h, t, hd) = q.dims4()?;
        let sp = &self.sp;
        let dout = match sp.size() {
            1 => dout.clone(),
            n => {
                let (_, local, _) = dout.dims3()?;
                let whole = sp.to_heads(&dout.reshape((b, local, 1, h * n, hd))?)?;
                whole.reshape((b, t, h * hd))?
            }
        };
        let [dq, dk, dv] = self.split_core_backward(kept, &dout)?;
        let (dq, dk) = match &self.rope {
            Some(rope) => {
                let (cos, sin) = rope.tables(hd, 0, t, dout.dtype(), dout.device())?;
                (
                    rope::apply_backward(&dq, &cos, &sin)?,
                    rope::apply_backward(&dk, &cos, &sin)?,
                )
            }
            None => (dq, dk),
        };
        let (dq, dk, dnorms) = match (&kept.normed, qk_norm) {
            (Some([q, rq, k, rk]), Some((wq, wk))) => {
                let (dq, dwq) = rms_norm_backward(q, rq, wq, &dq)?;
                let (dk, dwk) = rms_norm_backward(k, rk, wk, &dk)?;
                (dq, dk, Some([dwq, dwk]))
            }
            _ => (dq, dk, None),
        };
        let flat = |g: Tensor| -> Result<Tensor> {
            let heads = g.dim(1)?;
            g.transpose(1, 2)?.contiguous()?.reshape((b, t, heads * hd))
        };
        let (kv, r) = (self.kv_heads, self.kv_copies);
        let dq = join_heads(sp, &flat(dq)?, h * sp.size(), hd, 1)?;
        let dk = join_heads(sp, &flat(dk)?, kv, hd, r)?;
        let dv = join_heads(sp, &flat(dv)?, kv, hd, r)?;
        Ok(([dq, dk, dv], dnorms))
    }

    /// The gradients of the rotated queries, the rotated keys and the values from `dout`.
    fn split_core_backward(&self, kept: &AttentionKept, dout: &Tensor) -> Result<[Tensor; 3]> {
        let Heads::Split([q, k, v]) = &kept.heads else {
            unreachable!("invariant: the heads layout's tape")
        };
        let (b, h, t, hd) = q.dims4()?;
        let n = h / k.dim(1)?;
        let probs = match &kept.softmax {
            Softmax::LogSumExp(lse) => {
                let (s, window) = (self.scale() as f32, self.window.filter(|w| *w < t));
                let out = kept.heads_out.as_ref().unwrap_or(&kept.out);
                let grads =
                    flash_attention::backward_grouped((q, k, v), out, lse, dout, s, window)?;
                return grads.ok_or_else(declined);
            }
            Softmax::Probs(p) => p,
        };
        let dheads = dout.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous()?;
        let (kr, vr) = (repeat_heads(k, n)?, repeat_heads(v, n)?);
        let dprobs = dheads.matmul(&vr.t()?)?;
        let dv = sum_repeated_heads(&probs.t()?.matmul(&dheads)?, n)?;
        let dscores = causal_softmax_backward(probs, &dprobs, self.scale())?;
        let dq = dscores.matmul(&kr)?;
        let dk = sum_repeated_heads(&dscores.t()?.matmul(q)?, n)?;
        Ok([dq, dk, dv])
    }
}

fn declined() -> candle_core::Error {
    candle_core::Error::Msg("attention: the blockwise backward declined the forward it ran".into())
}

/// q, k and v [B, H, T, hd] of the packed q|k|v [B, T, 3d]: one copy into [3, B, H, T, hd],
/// of which they are views.
fn unpack(h: usize, qkv: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, d3) = qkv.dims3()?;
    let hd = d3 / 3 / h;
    let heads = qkv
        .reshape((b, t, 3, h, hd))?
        .permute((2, 0, 3, 1, 4))?
        .contiguous()?;
    Ok((heads.get(0)?, heads.get(1)?, heads.get(2)?))
}

/// A projection's output [B, t, n hd] at this rank's positions as heads [B, m, T, hd] of
/// whole sequences (Note [ulysses]): each head first copied `replicas` times, then this
/// rank's n replicas / sp of them. Without sequence parallelism: its n heads.
fn split_heads(sp: &Sp, y: &Tensor, n: usize, hd: usize, replicas: usize) -> Result<Tensor> {
    let (b, t, _) = y.dims3()?;
    let y = y.reshape((b, t, n, 1, hd))?;
    let y = match replicas {
        1 => y,
        r => y.broadcast_as((b, t, n, r, hd))?.contiguous()?,
    };
    let y = sp.to_heads(&y.reshape((b, t, 1, n * replicas, hd))?)?;
    let (_, whole, _, m, _) = y.dims5()?;
    y.reshape((b, whole, m, hd))?.transpose(1, 2)?.contiguous()
}

/// The inverse of `split_heads` for [B, T, m hd] (heads side by side): back at this rank's
/// positions [B, t, n hd], the copies of each head summed (a gradient's).
fn join_heads(sp: &Sp, y: &Tensor, n: usize, hd: usize, replicas: usize) -> Result<Tensor> {
    if sp.size() == 1 {
        return Ok(y.clone());
    }
    let (b, whole, width) = y.dims3()?;
    let y = sp.to_sequence(&y.reshape((b, whole, 1, width / hd, hd))?)?;
    let t = y.dim(1)?;
    let y = y.reshape((b, t, n, replicas, hd))?;
    let y = match replicas {
        1 => y,
        _ => y.sum_keepdim(3)?,
    };
    y.reshape((b, t, n * hd))
}

/// Each of `k`'s heads [B, g, T, hd] repeated `n` times in place ([B, g n, T, hd]), as
/// transformers' `repeat_kv`: query head i reads key head i / n.
fn repeat_heads(k: &Tensor, n: usize) -> Result<Tensor> {
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
fn sum_repeated_heads(dk: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(dk.clone());
    }
    let (b, h, t, hd) = dk.dims4()?;
    dk.reshape((b, h / n, n, t, hd))?.sum(2)
}

/// Softmax of `scale * x` over the last dimension of [.., T, T] scores where row i sees
/// columns i - w + 1 ..= i (transformers' sliding-window causal mask).
fn window_softmax(x: &Tensor, scale: f64, w: usize) -> Result<Tensor> {
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
