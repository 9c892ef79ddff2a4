//! CPU storage as f32 for the custom ops' `cpu_fwd`: an input's contiguous elements (borrowed
//! when they are f32 already), a row-by-row copy to transform in place, and the output back
//! in the op's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result};
use half::{bf16, f16};

/// A copy of `src` made row by row, each row of `width` handed to `f` as soon as it is copied
/// (while it is in cache) to be transformed in place.
pub(crate) fn map_rows(src: &[f32], width: usize, mut f: impl FnMut(&mut [f32])) -> Vec<f32> {
    let mut out = Vec::with_capacity(src.len());
    for row in src.chunks(width.max(1)) {
        let at = out.len();
        out.extend_from_slice(row);
        f(&mut out[at..]);
    }
    out
}

/// The contiguous elements of `s` as f32, borrowed when they are f32 already.
pub(crate) fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<std::borrow::Cow<'a, [f32]>> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(std::borrow::Cow::Borrowed(&v[a..b])),
        _ => Ok(std::borrow::Cow::Owned(to_f32(s, l)?)),
    }
}

/// The contiguous elements of `s` as f32.
pub(crate) fn to_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("fused op: input must be contiguous")
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        other => candle_core::bail!("fused op: unsupported dtype {:?}", other.dtype()),
    })
}

pub(crate) fn from_f32(dtype: DType, v: Vec<f32>) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}
