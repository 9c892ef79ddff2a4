//! The calls of kernels/flash.cu: causal attention without the T x T matrix, forward and
//! backward, on the tensor cores (bf16 and f16 storage; head sizes launch::FLASH_HEAD_DIMS).

use candle_core::{DType, Result};

use super::launch::{self, FlashKernel, Launch};
use super::{run, Arg, Launcher};

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
    /// Whether the kernels take this call: their head sizes, whole groups of query heads,
    /// 16-byte rows (the tiles are copied 16 bytes at a time), and tiles whose rows span less
    /// than 4 GiB (a row is found from the tile's first by a 32-bit offset).
    pub fn supported(&self, dtype: DType) -> bool {
        let rows_aligned = [self.q_strides, self.kv_strides]
            .iter()
            .flatten()
            .all(|s| s.is_multiple_of(8));
        let position_strides = [self.q_strides[2], self.kv_strides[2], self.heads * self.hd];
        let tiles_addressable = position_strides
            .iter()
            .all(|&s| launch::flash_tile_addressable(self.hd, dtype.size_in_bytes(), s));
        matches!(dtype, DType::BF16 | DType::F16)
            && launch::FLASH_HEAD_DIMS.contains(&self.hd)
            && self.kv_heads > 0
            && self.heads.is_multiple_of(self.kv_heads)
            && rows_aligned
            && tiles_addressable
            && self.t <= u32::MAX as usize
            && self.scale > 0.0
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

    /// The launch of `kernel`: a block per tile of queries (of keys for dK dV).
    fn tiles(&self, kernel: FlashKernel, dtype: DType) -> Result<Launch> {
        let heads = match kernel {
            FlashKernel::KeysBackward => self.kv_heads,
            FlashKernel::Forward | FlashKernel::QueriesBackward => self.heads,
        };
        let rows = [self.batch, heads, self.t];
        launch::flash_tiles(kernel, rows, self.hd, dtype.size_in_bytes())
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
    let at = s.tiles(FlashKernel::Forward, dtype)?;
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
    let keys = s.tiles(FlashKernel::KeysBackward, dtype)?;
    let dkdv = [&inputs[..], &[Arg::Ptr(dk), Arg::Ptr(dv)], &s.args()].concat();
    run(l, &format!("flash_bwd_dkdv_hd{}", s.hd), dtype, keys, &dkdv)?;
    let queries = s.tiles(FlashKernel::QueriesBackward, dtype)?;
    let dq_args = [&inputs[..], &[Arg::Ptr(dq)], &s.args()].concat();
    run(
        l,
        &format!("flash_bwd_dq_hd{}", s.hd),
        dtype,
        queries,
        &dq_args,
    )
}

/// The kernels on tensors on a GPU, for kernels/flash_attention.rs: None where they do not
/// apply (another dtype or head size, a start that is not 16-byte aligned, autograd tracking
/// an input), so the caller's other path runs.
#[cfg(feature = "cuda")]
pub(crate) mod on_gpu {
    use candle_core::{DType, Result, Shape, Tensor};

    use super::super::{cuda, offset};
    use super::{backward, forward, FlashShape};

    /// Whether the kernels may read `t` in place (or its contiguous copy, from element 0).
    fn aligned(t: &Tensor) -> bool {
        !t.is_contiguous() || t.layout().start_offset().is_multiple_of(8)
    }

    /// Element strides per batch, head and position of a contiguous [B, heads, T, hd].
    fn head_major(heads: usize, t: usize, hd: usize) -> [usize; 3] {
        [heads * t * hd, t * hd, hd]
    }

    /// GPT's fused projection qkv [B, T, 3d]: the output [B, T, d] and the log-sum-exp.
    pub(crate) fn fused_forward(
        qkv: &Tensor,
        heads: usize,
        scale: f32,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let (b, t, d3) = qkv.dims3()?;
        let (d, dtype) = (d3 / 3, qkv.dtype());
        let s = fused_shape(b, t, d, heads, scale);
        if !s.supported(dtype) || !aligned(qkv) {
            return Ok(None);
        }
        let outputs = forward_outputs(&s, dtype, Shape::from((b, t, d)));
        let outs = cuda::on_tensors(&[qkv], &outputs, |l, a, o| {
            let qkv = [0, d, 2 * d].map(|x| offset(a[0], x, dtype));
            forward(l, dtype, qkv, [o[0], o[1]], &s)
        })?;
        Ok(outs.map(out_and_lse))
    }

    /// The forward's outputs: attention's output (of `out`) and the log-sum-exp [B, H, T].
    fn forward_outputs(s: &FlashShape, dtype: DType, out: Shape) -> [(DType, Shape); 2] {
        let lse = Shape::from((s.batch, s.heads, s.t));
        [(dtype, out), (DType::F32, lse)]
    }

    fn out_and_lse(outputs: Vec<Tensor>) -> (Tensor, Tensor) {
        let [out, lse]: [Tensor; 2] = outputs.try_into().expect("two outputs");
        (out, lse)
    }

    /// The gradient [B, T, 3d] of `fused_forward`'s qkv from that of its output.
    pub(crate) fn fused_backward(
        qkv: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        heads: usize,
        scale: f32,
    ) -> Result<Option<Tensor>> {
        let (b, t, d3) = qkv.dims3()?;
        let (d, dtype) = (d3 / 3, qkv.dtype());
        let s = fused_shape(b, t, d, heads, scale);
        let dout = dout.to_dtype(dtype)?;
        if !s.supported(dtype) || ![qkv, out, &dout].iter().all(|x| aligned(x)) {
            return Ok(None);
        }
        let outs = cuda::on_tensors(
            &[qkv, out, &dout, lse],
            &[(dtype, qkv.shape().clone())],
            |l, a, o| {
                let [q, k, v] = [0, d, 2 * d].map(|x| offset(a[0], x, dtype));
                let grads = [0, d, 2 * d].map(|x| offset(o[0], x, dtype));
                backward(l, dtype, [q, k, v, a[1], a[2], a[3]], grads, &s)
            },
        )?;
        Ok(outs.map(|mut v| v.remove(0)))
    }

    fn fused_shape(b: usize, t: usize, d: usize, heads: usize, scale: f32) -> FlashShape {
        let strides = [t * 3 * d, d / heads, 3 * d];
        FlashShape {
            batch: b,
            heads,
            kv_heads: heads,
            t,
            hd: d / heads,
            q_strides: strides,
            kv_strides: strides,
            scale,
            window: 0,
        }
    }

    fn grouped_shape(
        q: &Tensor,
        k: &Tensor,
        scale: f32,
        window: Option<usize>,
    ) -> Result<FlashShape> {
        let (b, h, t, hd) = q.dims4()?;
        let g = k.dim(1)?;
        Ok(FlashShape {
            batch: b,
            heads: h,
            kv_heads: g,
            t,
            hd,
            q_strides: head_major(h, t, hd),
            kv_strides: head_major(g, t, hd),
            scale,
            window: window.unwrap_or(0),
        })
    }

    /// q [B, H, T, hd], k and v [B, G, T, hd]: the output [B, T, H hd] and the log-sum-exp.
    pub(crate) fn grouped_forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
        window: Option<usize>,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let s = grouped_shape(q, k, scale, window)?;
        let dtype = q.dtype();
        if !s.supported(dtype) || ![q, k, v].iter().all(|x| aligned(x) && x.dtype() == dtype) {
            return Ok(None);
        }
        let outputs = forward_outputs(&s, dtype, Shape::from((s.batch, s.t, s.heads * s.hd)));
        let outs = cuda::on_tensors(&[q, k, v], &outputs, |l, a, o| {
            forward(l, dtype, [a[0], a[1], a[2]], [o[0], o[1]], &s)
        })?;
        Ok(outs.map(out_and_lse))
    }

    /// `grouped_forward`'s backward: dq, dk and dv in the shapes of q, k and v.
    pub(crate) fn grouped_backward(
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        scale: f32,
        window: Option<usize>,
    ) -> Result<Option<[Tensor; 3]>> {
        let s = grouped_shape(q, k, scale, window)?;
        let dtype = q.dtype();
        let dout = dout.to_dtype(dtype)?;
        let inputs = [q, k, v, out, &dout];
        if !s.supported(dtype) || !inputs.iter().all(|x| aligned(x) && x.dtype() == dtype) {
            return Ok(None);
        }
        let shapes = [q, k, v].map(|x| (dtype, x.shape().clone()));
        let outs = cuda::on_tensors(&[q, k, v, out, &dout, lse], &shapes, |l, a, o| {
            let ins = [a[0], a[1], a[2], a[3], a[4], a[5]];
            backward(l, dtype, ins, [o[0], o[1], o[2]], &s)
        })?;
        Ok(outs.map(|v| v.try_into().expect("three outputs")))
    }
}
