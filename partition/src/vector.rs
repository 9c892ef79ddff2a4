//! The element loops over flat buffers that a step runs: adding gradients, scaling them,
//! their sum of squares, writing master values into the compute-dtype parameters, zeroing,
//! copying.
//!
//! Each runs where its slices live: as a host loop, or, when every slice lies in the same
//! GPU's buffers (`buffer::gpu::one_gpu`), as a kernel on that GPU (kernels/vector.cu), with
//! the same rounding, so either gives the same bits. Slices split between the host and a GPU
//! run on the host (correct, the pages migrating; the stores avoid it on the hot path).
//!
//! The element-wise host loops of large slices run on rayon's threads in blocks: an element
//! is converted to f32 and back, which keeps one core from the memory's pace on a many-core
//! host (the publish of an offloaded step passes the whole shard). Each element is computed
//! alone, so the bits do not depend on the threads; the sum of squares stays one loop.

use ds_comm::Element;
use rayon::prelude::*;

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
    let serial = |b: &mut [T]| b.iter_mut().for_each(|v| *v = T::from_f32(v.to_f32() * k));
    match buf.len() > HOST_BLOCK {
        true => buf.par_chunks_mut(HOST_BLOCK).for_each(serial),
        false => serial(buf),
    }
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
/// the parameters): rounded on the host a piece at a time, each piece copied up while the
/// next is rounded (`Gpu::stream_up`). A host loop over the buffer's managed pages would
/// migrate them to the host, and the next kernel would migrate them back.
#[cfg(feature = "cuda")]
fn convert_up<T: Element>(dst: &mut [T], src: &[f32]) -> Result<()> {
    let gpu = gpu_of(Span::of(dst)).expect("invariant: the caller checked dst is a GPU's");
    gpu.stream_up(dst, PIECE, |at, out| {
        host_zip(out, &src[at..at + out.len()], |_, v| T::from_f32(v))
    })
}

/// Elements a GPU buffer is moved to or from the host in at a time (8 MiB of bf16).
#[cfg(feature = "cuda")]
const PIECE: usize = 1 << 22;

/// `f(at, values)` over `src` in pieces of at most `piece` elements, each in host memory: a
/// host buffer's own slices, or a GPU buffer's copied down, the next piece's copy running
/// while `f` reads this one (`Gpu::stream_down`; a host loop over managed pages would migrate
/// them to the host and back).
pub fn for_each_host_piece<T: Element>(
    src: &[T],
    piece: usize,
    mut f: impl FnMut(usize, &[T]) -> Result<()>,
) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(gpu) = gpu_of(Span::of(src)) {
        return gpu.stream_down(src, piece, f);
    }
    for (i, part) in src.chunks(piece.max(1)).enumerate() {
        f(i * piece.max(1), part)?;
    }
    Ok(())
}

/// Elements a rayon task takes in the host loops (256 KiB of f32), and so the least a loop
/// is split at.
const HOST_BLOCK: usize = 1 << 16;

/// `dst[i] = f(dst[i], src[i])`: the kernel `kernel` (over `T`) where both are on one GPU.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))] // `kernel`
fn zip_into<T: Element, S: Copy + Sync>(
    kernel: &str,
    dst: &mut [T],
    src: &[S],
    f: impl Fn(T, S) -> T + Sync,
) -> Result<()> {
    debug_assert_eq!(dst.len(), src.len());
    #[cfg(feature = "cuda")]
    if let Some(gpu) = one_gpu(&[Span::of(dst), Span::of(src)]) {
        let (mut d, mut s, mut n) = (ptr(dst), ptr(src), dst.len() as u64);
        let mut args = [arg(&mut d), arg(&mut s), arg(&mut n)];
        return launch::<T>(&gpu, kernel, dst.len(), &mut args);
    }
    host_zip(dst, src, f);
    Ok(())
}

/// `dst[i] = f(dst[i], src[i])` on the host, in blocks on rayon's threads when large.
fn host_zip<T: Element, S: Copy + Sync>(dst: &mut [T], src: &[S], f: impl Fn(T, S) -> T + Sync) {
    let serial = |d: &mut [T], s: &[S]| d.iter_mut().zip(s).for_each(|(d, s)| *d = f(*d, *s));
    match dst.len() > HOST_BLOCK {
        true => dst
            .par_chunks_mut(HOST_BLOCK)
            .zip(src.par_chunks(HOST_BLOCK))
            .for_each(|(d, s)| serial(d, s)),
        false => serial(dst, src),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Values in about ±4 that every 16-bit type must round, element i of stream `seed`.
    fn values(seed: u32, n: usize) -> Vec<f32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 * 8.0 - 4.0)
            .collect()
    }

    /// The loops split over threads (three blocks and a ragged end) give every element what
    /// one loop through `half`'s own conversions gives it.
    fn host_loops_match_one_loop<T: Element>(to: fn(T) -> f32, from: fn(f32) -> T) {
        let n = 3 * HOST_BLOCK + 5;
        let (a, b, m) = (values(1, n), values(2, n), values(3, n));
        let a: Vec<T> = a.into_iter().map(from).collect();
        let b: Vec<T> = b.into_iter().map(from).collect();
        let bits = |v: &[T]| v.iter().map(|x| to(*x).to_bits()).collect::<Vec<_>>();

        let mut got = a.clone();
        accumulate(&mut got, &b).unwrap();
        let want: Vec<T> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| from(to(*x) + to(*y)))
            .collect();
        assert_eq!(bits(&got), bits(&want), "accumulate");

        scale(&mut got, Some(0.37)).unwrap();
        let want: Vec<T> = want.iter().map(|x| from(to(*x) * 0.37)).collect();
        assert_eq!(bits(&got), bits(&want), "scale");

        convert_into(&mut got, &m).unwrap();
        let want: Vec<T> = m.iter().map(|x| from(*x)).collect();
        assert_eq!(bits(&got), bits(&want), "convert");
    }

    #[test]
    fn host_pieces_are_the_slices_in_order() {
        let v: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let mut seen = Vec::new();
        for_each_host_piece(&v, 4, |at, piece| {
            seen.push((at, piece.to_vec()));
            Ok(())
        })
        .unwrap();
        let want = [(0, &v[0..4]), (4, &v[4..8]), (8, &v[8..10])];
        let want: Vec<(usize, Vec<f32>)> = want.iter().map(|(a, p)| (*a, p.to_vec())).collect();
        assert_eq!(seen, want);
        for_each_host_piece(&[] as &[f32], 4, |_, _| panic!("a piece of nothing")).unwrap();
    }

    #[test]
    fn host_loops_in_blocks_match_one_loop() {
        host_loops_match_one_loop::<f32>(|x| x, |x| x);
        host_loops_match_one_loop::<bf16>(bf16::to_f32, bf16::from_f32);
        host_loops_match_one_loop::<f16>(f16::to_f32, f16::from_f32);
    }
}
