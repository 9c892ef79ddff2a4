//! The calls of kernels/flash.cu: causal attention without the T x T matrix, forward and
//! backward, on the tensor cores (bf16 and f16 storage; head sizes launch::FLASH_HEAD_DIMS).

use candle_core::{DType, Result};

use super::{launch, run, Arg, Launcher};

/// One attention call: `batch` sequences of `t` positions, `heads` query heads sharing
/// `kv_heads` key/value heads of `hd` each; the element strides per batch, head and position
/// of q (and dq) and of k and v (and dk, dv); the output and its gradient are [B, T, H, hd]
/// and the log-sum-exp [B, H, T] in f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FlashShape {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub t: usize,
    pub hd: usize,
    pub q_strides: [usize; 3],
    pub kv_strides: [usize; 3],
    pub scale: f32,
    /// Each query sees only its last `window` keys; 0: every earlier key.
    pub window: usize,
}

impl FlashShape {
    /// Whether the kernels take this call: their head sizes, whole groups of query heads, and
    /// 16-byte rows (the tiles are copied 16 bytes at a time).
    pub fn supported(&self, dtype: DType) -> bool {
        let rows_aligned = [self.q_strides, self.kv_strides]
            .iter()
            .flatten()
            .all(|s| s % 8 == 0);
        matches!(dtype, DType::BF16 | DType::F16)
            && launch::FLASH_HEAD_DIMS.contains(&self.hd)
            && self.kv_heads > 0
            && self.heads % self.kv_heads == 0
            && rows_aligned
            && self.t <= u32::MAX as usize
    }

    /// The arguments every flash kernel takes after its pointers, in flash.cu's order.
    fn args(&self) -> Vec<Arg> {
        let mut a = vec![
            Arg::U32(self.heads as u32),
            Arg::U32(self.kv_heads as u32),
            Arg::U32(self.t as u32),
            Arg::U32(self.window as u32),
        ];
        a.extend(self.q_strides.iter().map(|&s| Arg::U64(s as u64)));
        a.extend(self.kv_strides.iter().map(|&s| Arg::U64(s as u64)));
        a.push(Arg::F32(self.scale));
        a
    }

    fn check(&self, dtype: DType) -> Result<()> {
        if !self.supported(dtype) {
            candle_core::bail!("flash attention: no kernel for {dtype:?} and {self:?}");
        }
        Ok(())
    }
}

/// The output [B, T, H, hd] at `out` and the log-sum-exp [B, H, T] (f32) at `lse` of q, k, v.
pub(crate) fn forward<L: Launcher>(
    l: &L,
    dtype: DType,
    [q, k, v]: [u64; 3],
    [out, lse]: [u64; 2],
    s: &FlashShape,
) -> Result<()> {
    s.check(dtype)?;
    let at = launch::flash_tiles(s.batch, s.heads, s.t, s.hd)?;
    let ptrs = [q, k, v, out, lse].map(Arg::Ptr);
    let name = format!("flash_fwd_hd{}", s.hd);
    run(l, &name, dtype, at, &[&ptrs[..], &s.args()].concat())
}

/// dq, dk and dv (at the strides of q, k and v) from the forward's inputs, output and
/// log-sum-exp and the output's gradient `dout` [B, T, H, hd].
pub(crate) fn backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [q, k, v, out, dout, lse]: [u64; 6],
    [dq, dk, dv]: [u64; 3],
    s: &FlashShape,
) -> Result<()> {
    s.check(dtype)?;
    let rows = s.batch * s.heads * s.t;
    let (_keep, d) = l.scratch(rows)?;
    let dot_args = [
        Arg::Ptr(out),
        Arg::Ptr(dout),
        Arg::Ptr(d),
        Arg::U32(s.heads as u32),
        Arg::U32(s.t as u32),
        Arg::U32(s.hd as u32),
        Arg::U64(rows as u64),
    ];
    run(
        l,
        "flash_bwd_dot",
        dtype,
        launch::flash_dot(rows)?,
        &dot_args,
    )?;
    let inputs = [q, k, v, dout, lse, d].map(Arg::Ptr);
    let keys = launch::flash_tiles(s.batch, s.kv_heads, s.t, s.hd)?;
    let dkdv = [&inputs[..], &[Arg::Ptr(dk), Arg::Ptr(dv)], &s.args()].concat();
    run(l, &format!("flash_bwd_dkdv_hd{}", s.hd), dtype, keys, &dkdv)?;
    let queries = launch::flash_tiles(s.batch, s.heads, s.t, s.hd)?;
    let dq_args = [&inputs[..], &[Arg::Ptr(dq)], &s.args()].concat();
    run(
        l,
        &format!("flash_bwd_dq_hd{}", s.hd),
        dtype,
        queries,
        &dq_args,
    )
}
