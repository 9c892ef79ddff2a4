//! Element types the CPU collectives move and the reductions over them.
//!
//! bf16 and f16 are reduced in f32 and rounded once per hop, as NCCL does: the wire carries
//! the element type, the arithmetic does not lose more than one rounding per step.

use bytemuck::Pod;

use crate::convert;
use half::{bf16, f16};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The type names nccl-tests prints.
    pub fn nccl_name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::BF16 => "bfloat16",
            DType::F16 => "half",
        }
    }

    pub fn parse(s: &str) -> Option<DType> {
        match s {
            "f32" | "fp32" | "float" | "float32" => Some(DType::F32),
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "half" | "float16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// How the values of the ranks combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Avg,
    Max,
}

/// An element type of the collectives: plain old data with an f32 view for the arithmetic.
pub trait Element: Pod + Default + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// `half`'s rules without its branches (convert.rs: loops over them vectorise).
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline]
    fn to_f32(self) -> f32 {
        convert::f16_bits_to_f32(self.to_bits())
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        f16::from_bits(convert::f32_to_f16_bits(v))
    }
}

/// The reduction of one received piece into local data: `dst[i] = combine(dst[i], src[i])`,
/// then multiplied by `scale` when given (the 1/n of Avg on the final hop).
pub(crate) fn combine<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp, scale: Option<f32>) {
    combine_into(dst, None, src, op, scale)
}

/// As `combine`, with the local operand read from `a` instead of `dst` when given (an
/// out-of-place reduction: one pass instead of a copy and then a fold).
pub(crate) fn combine_into<T: Element>(
    dst: &mut [T],
    a: Option<&[T]>,
    src: &[T],
    op: ReduceOp,
    scale: Option<f32>,
) {
    debug_assert_eq!(dst.len(), src.len());
    let k = scale.unwrap_or(1.0);
    if T::DTYPE == DType::F32 {
        // f32 needs no conversion: one pass, which the compiler vectorises.
        let d: &mut [f32] = bytemuck::cast_slice_mut(dst);
        return match a {
            None => combine_f32(d, as_f32(src), op, k),
            Some(a) => combine3_f32(d, as_f32(a), as_f32(src), op, k),
        };
    }
    // Blocks keep the f32 temporaries in L1 and let the compiler vectorise each loop.
    const BLOCK: usize = 256;
    let (mut acc, mut conv) = ([0f32; BLOCK], [0f32; BLOCK]);
    for start in (0..src.len()).step_by(BLOCK) {
        let end = (start + BLOCK).min(src.len());
        let acc = &mut acc[..end - start];
        load(acc, &a.unwrap_or(&*dst)[start..end]);
        combine_f32(acc, src_f32(&src[start..end], &mut conv), op, k);
        dst[start..end]
            .iter_mut()
            .zip(acc.iter())
            .for_each(|(d, x)| *d = T::from_f32(*x));
    }
}

/// A slice of `T` that is f32 (checked by the caller) as f32.
fn as_f32<T: Element>(v: &[T]) -> &[f32] {
    bytemuck::cast_slice(v)
}

/// `dst[i] = combine(a[i], src[i]) * scale`.
fn combine3_f32(dst: &mut [f32], a: &[f32], src: &[f32], op: ReduceOp, scale: f32) {
    let it = dst.iter_mut().zip(a.iter().zip(src));
    match op {
        ReduceOp::Sum | ReduceOp::Avg => it.for_each(|(d, (x, y))| *d = (x + y) * scale),
        ReduceOp::Max => it.for_each(|(d, (x, y))| *d = x.max(*y) * scale),
    }
}

fn src_f32<'a, T: Element>(src: &[T], buf: &'a mut [f32]) -> &'a [f32] {
    let buf = &mut buf[..src.len()];
    load(buf, src);
    buf
}

/// `scale` 1.0 multiplies exactly, so Sum and Max are unchanged by it.
fn combine_f32(dst: &mut [f32], src: &[f32], op: ReduceOp, scale: f32) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => dst
            .iter_mut()
            .zip(src)
            .for_each(|(x, y)| *x = (*x + y) * scale),
        ReduceOp::Max => dst
            .iter_mut()
            .zip(src)
            .for_each(|(x, y)| *x = x.max(*y) * scale),
    }
}

fn load<T: Element>(acc: &mut [f32], from: &[T]) {
    acc.iter_mut().zip(from).for_each(|(x, v)| *x = v.to_f32());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_sums_maxes_and_scales_in_f32() {
        let mut d = vec![1.0f32, -2.0, 3.5];
        combine(&mut d, &[0.5, 4.0, -1.0], ReduceOp::Sum, None);
        assert_eq!(d, vec![1.5, 2.0, 2.5]);
        combine(&mut d, &[2.0, 1.0, 3.0], ReduceOp::Max, None);
        assert_eq!(d, vec![2.0, 2.0, 3.0]);
        let mut out = vec![0.0f32; 3];
        combine(&mut out, &[2.0, 4.0, 6.0], ReduceOp::Avg, Some(0.5));
        assert_eq!(out, vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn bf16_is_added_in_f32_and_rounded_once() {
        // 256 + 1 + 1 in bf16 steps would stay at 256 (8 bits of mantissa); one f32 sum of
        // 1 + 1 added to 256 is 258, which bf16 represents exactly.
        let mut d = vec![bf16::from_f32(256.0); 300];
        let s = vec![bf16::from_f32(2.0); 300];
        combine(&mut d, &s, ReduceOp::Sum, None);
        assert!(d.iter().all(|v| v.to_f32() == 258.0));
        let mut h = vec![f16::from_f32(1.5); 5];
        combine(&mut h, &[f16::from_f32(-3.0); 5], ReduceOp::Max, None);
        assert!(h.iter().all(|v| v.to_f32() == 1.5));
    }
}
