//! The element loops over flat buffers that a step runs: adding gradients, scaling them,
//! their sum of squares, writing master values into the compute-dtype parameters, zeroing,
//! copying.
//!
//! Each runs where its slices live: as a host loop, or, when every slice lies in the same
//! GPU's buffers (`buffer::gpu::one_gpu`), as a kernel on that GPU (kernels/vector.cu), with
//! the same rounding, so either gives the same bits. Slices split between the host and a GPU
//! run on the host (correct, the pages migrating; the stores avoid it on the hot path).

use ds_comm::Element;

use crate::Result;

/// `dst[i] += src[i]`, rounded to `T`.
pub fn accumulate<T: Element>(dst: &mut [T], src: &[T]) -> Result<()> {
    zip_into("accumulate", dst, src, |d, s| {
        T::from_f32(d.to_f32() + s.to_f32())
    })
}

/// `buf[i] *= k`, rounded to `T`; nothing for `None`.
pub fn scale<T: Element>(buf: &mut [T], k: Option<f32>) -> Result<()> {
    let Some(k) = k else {
        return Ok(());
    };
    #[cfg(feature = "cuda")]
    if let Some(gpu) = one_gpu(&[Span::of(buf)]) {
        let (mut b, mut k, mut n) = (ptr(buf), k, buf.len() as u64);
        return launch::<T>(
            &gpu,
            "scale",
            buf.len(),
            &mut [arg(&mut b), arg(&mut k), arg(&mut n)],
        );
    }
    buf.iter_mut()
        .for_each(|v| *v = T::from_f32(v.to_f32() * k));
    Ok(())
}

/// `dst[i] = src[i]` rounded to `T`.
pub fn convert_into<T: Element>(dst: &mut [T], src: &[f32]) -> Result<()> {
    #[cfg(feature = "cuda")]
    if gpu_of(Span::of(dst)).is_some() && gpu_of(Span::of(src)).is_none() {
        return convert_up(dst, src);
    }
    zip_into("convert", dst, src, |_, s| T::from_f32(s))
}

/// `convert_into` from host values into a GPU buffer (the host optimizer's master copy into
/// the parameters): rounded on the host a piece at a time, each piece one DMA transfer. A host
/// loop over the buffer's managed pages would migrate them to the host, and the next kernel
/// would migrate them back.
#[cfg(feature = "cuda")]
fn convert_up<T: Element>(dst: &mut [T], src: &[f32]) -> Result<()> {
    const PIECE: usize = 1 << 22;
    let mut piece: Vec<T> = Vec::with_capacity(PIECE.min(dst.len()));
    for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
        piece.clear();
        piece.extend(s.iter().map(|&v| T::from_f32(v)));
        copy(d, &piece)?;
    }
    Ok(())
}

/// `dst[i] = f(dst[i], src[i])`: the kernel `kernel` (over `T`) where both are on one GPU.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))] // `kernel`
fn zip_into<T: Element, S: Copy>(
    kernel: &str,
    dst: &mut [T],
    src: &[S],
    f: impl Fn(T, S) -> T,
) -> Result<()> {
    debug_assert_eq!(dst.len(), src.len());
    #[cfg(feature = "cuda")]
    if let Some(gpu) = one_gpu(&[Span::of(dst), Span::of(src)]) {
        let (mut d, mut s, mut n) = (ptr(dst), ptr(src), dst.len() as u64);
        let mut args = [arg(&mut d), arg(&mut s), arg(&mut n)];
        return launch::<T>(&gpu, kernel, dst.len(), &mut args);
    }
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = f(*d, *s));
    Ok(())
}

/// `dst = src`; where either is a GPU buffer, one transfer on the GPU's copy engines.
pub fn copy<T: Element>(dst: &mut [T], src: &[T]) -> Result<()> {
    assert_eq!(dst.len(), src.len(), "vector::copy: lengths differ");
    #[cfg(feature = "cuda")]
    if let Some(gpu) = gpu_of(Span::of(dst)).or_else(|| gpu_of(Span::of(src))) {
        return gpu.copy(dst, src);
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// Zeros `buf`.
pub fn zero<T: Element>(buf: &mut [T]) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = one_gpu(&[Span::of(buf)]) {
        // all-zero bits are 0 in every element type
        return gpu.zero_fill(ptr(buf), std::mem::size_of_val(buf));
    }
    buf.fill(T::default());
    Ok(())
}

/// The sum of squares in f64; not finite when any element is inf or NaN.
pub fn sum_squares<T: Element>(g: &[T]) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = one_gpu(&[Span::of(g)]) {
        return gpu_sum_squares(&gpu, g);
    }
    Ok(host_sum_squares(g))
}

/// Over 8 running partial sums: one serial chain of f64 adds waits on each add's latency,
/// 8 independent ones vectorise.
fn host_sum_squares<T: Element>(g: &[T]) -> f64 {
    const LANES: usize = 8;
    let mut lanes = [0f64; LANES];
    let mut chunks = g.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let v = c[i].to_f32() as f64;
            lanes[i] += v * v;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|v| (v.to_f32() as f64).powi(2))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

#[cfg(feature = "cuda")]
use gpu_side::*;

#[cfg(feature = "cuda")]
mod gpu_side {
    //! Launching vector.cu's kernels on slices of GPU buffers.

    use std::ffi::c_void;
    use std::sync::Arc;

    pub(super) use crate::buffer::gpu::{arg, device_ptr as ptr, gpu_of, one_gpu, Span};
    use crate::buffer::gpu::{suffix, Gpu, Managed};
    use ds_comm::Element;

    use crate::Result;

    /// Launches `base`_f32/_bf16/_f16 (by `T`) over `n` elements.
    pub(super) fn launch<T: Element>(
        gpu: &Gpu,
        base: &str,
        n: usize,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let name = format!("{base}_{}", suffix(T::DTYPE));
        // SAFETY: every caller passes the kernel's parameters in order, with device pointers
        // of GPU buffers holding `n` elements (checked by `one_gpu`).
        unsafe { gpu.vector_kernels()?.launch(gpu, &name, n, args) }
    }

    /// The sum of squares into one f64 in GPU memory, then read back.
    pub(super) fn gpu_sum_squares<T: Element>(gpu: &Arc<Gpu>, g: &[T]) -> Result<f64> {
        let mut out = Managed::<f64>::zeroed(gpu, 1)?;
        let (mut p, mut n, mut o) = (ptr(g), g.len() as u64, ptr(out.as_slice()));
        launch::<T>(
            gpu,
            "sum_squares",
            g.len(),
            &mut [arg(&mut p), arg(&mut n), arg(&mut o)],
        )?;
        Ok(out.as_mut_slice()[0])
    }
}
