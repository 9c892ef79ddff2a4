//! fused.cu on the host (Note [kernels on the host]): the calls of this module's parent,
//! launched into kernels/emu's scheduler, against the CPU kernels.

use std::ffi::{c_char, c_int, c_void, CString};

use candle_core::{DType, Device, Result, Tensor};
use half::{bf16, f16};

use super::launch::Launch;
use super::{Arg, Launcher};

extern "C" {
    /// kernels/emu/emu.cpp: 0 ran, 1 no such kernel, 2 the launch failed (why on stderr).
    fn ds_emu_launch(
        name: *const c_char,
        grid: u32,
        block: u32,
        shared: u32,
        reversed: c_int,
        args: *mut *mut c_void,
    ) -> c_int;
}

/// The emulator as a `Launcher`: addresses are host addresses. `reversed` runs the warps and
/// lanes of each block from the last, the other order a race could show in.
pub(super) struct Emu {
    reversed: bool,
}

impl Launcher for Emu {
    type Scratch = Vec<f32>;
    /// NaN-filled, so a kernel that reads scratch it never wrote shows it (a GPU's is garbage).
    fn scratch(&self, len: usize) -> Result<(Vec<f32>, u64)> {
        let mut v = vec![f32::NAN; len];
        let at = v.as_mut_ptr() as u64;
        Ok((v, at))
    }
    fn launch(&self, kernel: &str, at: Launch, args: &[Arg]) -> Result<()> {
        // Each argument's bytes at the start of its own u64 (little-endian), as cuLaunchKernel
        // reads a u32 or f32 through the pointer to it.
        let mut values: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) | Arg::U64(p) => p,
                Arg::U32(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut pointers: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        let name = CString::new(kernel).expect("kernel names have no NUL");
        // SAFETY: `pointers` holds one pointer per argument of `kernel` (the parent module's
        // calls match fused.cu's signatures: what these tests check), each to a live u64; the
        // addresses among them are the tests' live buffers.
        let order = self.reversed as c_int;
        let status = unsafe {
            ds_emu_launch(
                name.as_ptr(),
                at.grid,
                at.block,
                at.shared,
                order,
                pointers.as_mut_ptr(),
            )
        };
        match status {
            0 => Ok(()),
            1 => candle_core::bail!("emulator: no kernel {kernel}"),
            _ => candle_core::bail!("emulator: {kernel} on {at:?} failed (see stderr)"),
        }
    }
}

/// A tensor's elements in host memory the kernels can address: 8-byte aligned.
struct HostBuf {
    /// 16-byte words: the buffer starts on a 16-byte boundary, as cudaMalloc's do (256), so
    /// the kernels' paths for aligned rows (fused.cu's `packed`) run here too.
    words: Vec<u128>,
    dtype: DType,
    len: usize,
}

impl HostBuf {
    fn of(t: &Tensor) -> HostBuf {
        let t = t.flatten_all().unwrap();
        let bytes: Vec<u8> = match t.dtype() {
            DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>().unwrap()).to_vec(),
            DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<bf16>().unwrap()).to_vec(),
            DType::F16 => bytemuck::cast_slice(&t.to_vec1::<f16>().unwrap()).to_vec(),
            DType::U32 => bytemuck::cast_slice(&t.to_vec1::<u32>().unwrap()).to_vec(),
            other => panic!("no host buffer for {other:?}"),
        };
        let mut buf = HostBuf::zeroed(t.dtype(), t.elem_count());
        bytemuck::cast_slice_mut::<u128, u8>(&mut buf.words)[..bytes.len()].copy_from_slice(&bytes);
        buf
    }
    /// Filled with NaN's bits (0xff bytes) where it is float, so unwritten elements show.
    fn zeroed(dtype: DType, len: usize) -> HostBuf {
        let words = vec![u128::MAX; (len * dtype.size_in_bytes()).div_ceil(16)];
        HostBuf { words, dtype, len }
    }
    fn at(&self) -> u64 {
        self.words.as_ptr() as u64
    }
    fn to_f32(&self) -> Vec<f32> {
        let bytes =
            &bytemuck::cast_slice::<u128, u8>(&self.words)[..self.len * self.dtype.size_in_bytes()];
        match self.dtype {
            DType::F32 => bytemuck::cast_slice::<u8, f32>(bytes).to_vec(),
            DType::BF16 => bytemuck::cast_slice::<u8, bf16>(bytes)
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            DType::F16 => bytemuck::cast_slice::<u8, f16>(bytes)
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            other => panic!("no f32 view of {other:?}"),
        }
    }
}

/// Runs `call` on the emulator with `inputs` (their host addresses) and an output of `len`
/// elements of `dtype`; returns the output as f32 (see `emulate_outputs`).
fn emulate(
    inputs: &[&Tensor],
    dtype: DType,
    len: usize,
    call: impl Fn(&Emu, &[u64], u64) -> Result<()>,
) -> Vec<f32> {
    let mut outs = emulate_outputs(inputs, &[(dtype, len)], |l, a, o| call(l, a, o[0]));
    outs.remove(0)
}

/// Runs `call` on the emulator with `inputs` and `outputs` (dtype, length), in both orders of
/// warps; returns the outputs as f32, the same (bit for bit) in both: a block's result may not
/// depend on how its warps interleave.
pub(super) fn emulate_outputs(
    inputs: &[&Tensor],
    outputs: &[(DType, usize)],
    call: impl Fn(&Emu, &[u64], &[u64]) -> Result<()>,
) -> Vec<Vec<f32>> {
    let bufs: Vec<HostBuf> = inputs.iter().map(|t| HostBuf::of(t)).collect();
    let addresses: Vec<u64> = bufs.iter().map(HostBuf::at).collect();
    let [forward, reversed] = [false, true].map(|reversed| {
        let outs: Vec<HostBuf> = outputs
            .iter()
            .map(|&(d, n)| HostBuf::zeroed(d, n))
            .collect();
        let at: Vec<u64> = outs.iter().map(HostBuf::at).collect();
        call(&Emu { reversed }, &addresses, &at).unwrap();
        outs
    });
    let same = forward
        .iter()
        .zip(&reversed)
        .all(|(a, b)| a.words == b.words);
    assert!(same, "the result depends on the order the warps run in");
    forward.iter().map(HostBuf::to_f32).collect()
}

/// `f` of `inputs` upcast to f32 (the CPU kernels' arithmetic), each result rounded to
/// `dtype` once: what a kernel that computes in f32 and rounds on the store must give.
fn reference(
    inputs: &[&Tensor],
    dtype: DType,
    f: impl Fn(&[Tensor]) -> Vec<Tensor>,
) -> Vec<Vec<f32>> {
    let up: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F32).unwrap())
        .collect();
    f(&up)
        .iter()
        .map(|t| flat(&t.to_dtype(dtype).unwrap()))
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `got` against the CPU kernel's `want`: within `rel * (1 + |want|)`. f32: 1e-5 (two f32
/// evaluations of one formula, different summation orders); bf16 and f16: one unit in the last
/// place (both round the same f32 result once, which may straddle a rounding boundary).
fn assert_close(what: &str, got: &[f32], want: &[f32], dtype: DType) {
    let rel = match dtype {
        DType::BF16 => 2f32.powi(-7),
        DType::F16 => 2f32.powi(-10),
        _ => 1e-5,
    };
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        assert!(
            d <= rel * (1.0 + w.abs()),
            "{what} {dtype:?}: element {i}: {g} vs the CPU's {w}"
        );
        worst = worst.max(d / (1.0 + w.abs()));
    }
    println!(
        "{what} {dtype:?}: {} elements, largest difference {worst:.2e} (bound {rel:.1e})",
        got.len()
    );
}

/// Deterministic values in [-scale, scale), varied enough for softmaxes and norms.
pub(super) fn values(shape: &[usize], seed: u64, scale: f32, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn layer_norm_forward_matches_the_cpu_kernel() {
    // widths below, at and above a block's four elements a thread, and GPT-2's 768; a Pack a
    // thread at 768 (and 1500 in f32), not at 7 (nor 1500 in bf16 and f16)
    for (rows, d) in [(5, 7), (3, 768), (4, 1500)] {
        for dtype in DTYPES {
            let x = (values(&[rows, d], 1, 3.0, dtype) + 0.5).unwrap();
            let (w, b) = (values(&[d], 2, 1.0, dtype), values(&[d], 3, 0.5, dtype));
            let want = flat(&super::super::fused_norm_loss::layer_norm(&x, &w, &b, 1e-5).unwrap());
            let got = emulate(&[&x, &w, &b], dtype, rows * d, |l, a, y| {
                super::layer_norm(l, dtype, [a[0], a[1], a[2]], y, rows, d, 1e-5)
            });
            assert_close(&format!("layer_norm {rows}x{d}"), &got, &want, dtype);
        }
    }
}

#[test]
fn layer_norm_backward_matches_the_cpu_kernel() {
    // 600 rows: more than the pass's 512 blocks, so blocks take several rows each; widths of
    // whole Packs (40, 48: a thread a Pack) and not (33)
    for (rows, d) in [(6, 40), (600, 33), (600, 48)] {
        for dtype in DTYPES {
            let x = values(&[rows, d], 4, 2.0, dtype);
            let (w, b) = (values(&[d], 5, 1.0, dtype), values(&[d], 6, 1.0, dtype));
            let dy = values(&[rows, d], 7, 1.0, dtype);
            let (dx, dw, db) =
                super::super::fused_norm_loss::layer_norm_backward(&x, &w, &b, &dy, 1e-5).unwrap();
            let want = [flat(&dx), flat(&dw), flat(&db)].concat();
            let got = emulate(&[&x, &w, &dy], dtype, rows * d + 2 * d, |l, a, out| {
                super::layer_norm_backward(l, dtype, [a[0], a[1], a[2]], out, rows, d, 1e-5)
            });
            assert_close(
                &format!("layer_norm_backward {rows}x{d}"),
                &got,
                &want,
                dtype,
            );
        }
    }
}

#[test]
fn gelu_forward_and_backward_match_the_cpu_kernels() {
    let n = 3 * 256 + 17;
    for dtype in DTYPES {
        let x = values(&[n], 8, 4.0, dtype);
        let dy = values(&[n], 9, 1.0, dtype);
        let want = flat(&super::super::ops::gelu(&x).unwrap());
        let got = emulate(&[&x], dtype, n, |l, a, y| super::gelu(l, dtype, a[0], y, n));
        assert_close("gelu", &got, &want, dtype);
        let want = flat(&super::super::ops::gelu_backward(&x, &dy).unwrap());
        let got = emulate(&[&x, &dy], dtype, n, |l, a, dx| {
            super::gelu_backward(l, dtype, [a[0], a[1]], dx, n)
        });
        assert_close("gelu_backward", &got, &want, dtype);
    }
}

#[test]
fn causal_softmax_forward_and_backward_match_the_cpu_kernels() {
    // t 40: the early rows see fewer columns than the block has threads
    let (b, h, t, scale) = (2, 3, 40, 0.125);
    let rows = b * h * t;
    for dtype in DTYPES {
        let x = values(&[b, h, t, t], 10, 8.0, dtype);
        let y = super::super::ops::causal_softmax(&x, scale).unwrap();
        let got = emulate(&[&x], dtype, rows * t, |l, a, out| {
            super::causal_softmax(l, dtype, a[0], out, rows, t, scale as f32)
        });
        assert_close("causal_softmax", &got, &flat(&y), dtype);
        let dy = values(&[b, h, t, t], 11, 1.0, dtype);
        let want = flat(&super::super::ops::causal_softmax_backward(&y, &dy, scale).unwrap());
        let got = emulate(&[&y, &dy], dtype, rows * t, |l, a, dx| {
            super::softmax_backward(l, dtype, [a[0], a[1]], dx, rows, t, scale as f32)
        });
        assert_close("softmax_backward", &got, &want, dtype);
    }
}

#[test]
fn cross_entropy_and_its_gradient_match_the_cpu_kernels() {
    use super::super::fused_norm_loss::{cross_entropy_backward, cross_entropy_with_probs};
    let (rows, v) = (7, 1000);
    let logits = values(&[rows, v], 12, 6.0, DType::F32);
    let targets = Tensor::new(&[0u32, 999, 5, 5, 500, 17, 998], &Device::Cpu).unwrap();
    let (loss, probs) = cross_entropy_with_probs(&logits, &targets).unwrap();
    let want = [flat(&probs), vec![loss.to_scalar::<f32>().unwrap()]].concat();
    let got = emulate(
        &[&logits, &targets],
        DType::F32,
        rows * v + 1,
        |l, a, out| super::cross_entropy_probs(l, [a[0], a[1]], out, rows, v),
    );
    assert_close("cross_entropy_probs", &got, &want, DType::F32);
    for dtype in DTYPES {
        let want = flat(
            &cross_entropy_backward(&probs, &targets, 0.25)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        );
        let got = emulate(&[&probs, &targets], dtype, rows * v, |l, a, d| {
            super::cross_entropy_backward(l, dtype, [a[0], a[1]], d, rows, v, 0.25)
        });
        assert_close("cross_entropy_backward", &got, &want, dtype);
    }
}

#[test]
fn the_loss_alone_and_the_gradient_from_logits_match_the_cpu_kernels() {
    // rows of 800 are read 16 bytes at a time (fused.cu's `packed`), rows of 777 an element
    for v in [777, 800] {
        loss_and_gradient_from_logits(v);
    }
}

fn loss_and_gradient_from_logits(v: usize) {
    use super::super::fused_norm_loss::cross_entropy_grad;
    let rows = 5;
    let logits = values(&[rows, v], 14, 6.0, DType::F32);
    let targets = Tensor::new(&[776u32, 0, 3, 3, 400], &Device::Cpu).unwrap();
    let want = super::super::nn::cross_entropy(&logits, &targets).unwrap();
    let got = emulate(&[&logits, &targets], DType::F32, 1, |l, a, out| {
        super::cross_entropy(l, [a[0], a[1]], out, rows, v)
    });
    assert_close(
        "cross_entropy",
        &got,
        &[want.to_scalar::<f32>().unwrap()],
        DType::F32,
    );
    for dtype in DTYPES {
        // the logits in `dtype`, and the CPU's f32 kernels on those very values
        let stored = logits.to_dtype(dtype).unwrap();
        let exact = stored.to_dtype(DType::F32).unwrap();
        let loss = super::super::nn::cross_entropy(&exact, &targets).unwrap();
        let lse = exact.log_sum_exp(1).unwrap();
        let got = emulate_outputs(
            &[&stored, &targets],
            &[(DType::F32, 1), (DType::F32, rows)],
            |l, a, o| super::cross_entropy_and_lse(l, dtype, [a[0], a[1]], [o[0], o[1]], rows, v),
        );
        let want_loss = [loss.to_scalar::<f32>().unwrap()];
        assert_close(
            "cross_entropy_and_lse loss",
            &got[0],
            &want_loss,
            DType::F32,
        );
        assert_close(
            "cross_entropy_and_lse lse",
            &got[1],
            &flat(&lse),
            DType::F32,
        );

        let want = cross_entropy_grad(&exact, &targets, 0.2)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let recomputed = emulate(&[&stored, &targets], dtype, rows * v, |l, a, d| {
            super::cross_entropy_grad(l, dtype, [a[0], a[1]], None, d, rows, v, 0.2)
        });
        assert_close("cross_entropy_grad", &recomputed, &flat(&want), dtype);
        let kept = Tensor::from_vec(got[1].clone(), rows, &Device::Cpu).unwrap();
        let from_lse = emulate(&[&stored, &targets, &kept], dtype, rows * v, |l, a, d| {
            super::cross_entropy_grad(l, dtype, [a[0], a[1]], Some(a[2]), d, rows, v, 0.2)
        });
        assert_close(
            "cross_entropy_grad from lse",
            &from_lse,
            &flat(&want),
            dtype,
        );
    }
}

#[test]
fn column_sums_match_the_cpu_kernel() {
    // 700 rows: more than the first pass's 512 blocks
    for (rows, k) in [(3, 5), (700, 96)] {
        for dtype in DTYPES {
            let dy = values(&[rows, k], 15, 1.0, dtype);
            let like = Tensor::zeros(k, dtype, &Device::Cpu).unwrap();
            let want = flat(&super::super::ops::column_sum(&dy, &like).unwrap());
            let got = emulate(&[&dy], dtype, k, |l, a, out| {
                super::column_sum(l, dtype, a[0], out, rows, k)
            });
            assert_close(&format!("column_sum {rows}x{k}"), &got, &want, dtype);
        }
    }
}

#[test]
fn a_target_outside_the_vocabulary_makes_the_loss_nan() {
    let (rows, v) = (2, 50);
    let logits = values(&[rows, v], 13, 1.0, DType::F32);
    let targets = Tensor::new(&[3u32, 50], &Device::Cpu).unwrap();
    let got = emulate(
        &[&logits, &targets],
        DType::F32,
        rows * v + 1,
        |l, a, out| super::cross_entropy_probs(l, [a[0], a[1]], out, rows, v),
    );
    assert!(got[rows * v].is_nan(), "loss {}", got[rows * v]);
    assert!(
        got[..rows * v].iter().all(|p| p.is_finite()),
        "the softmax rows are still written"
    );
}

#[test]
fn no_rows_launch_nothing_and_the_mean_is_zero() {
    let logits = Tensor::zeros((0, 10), DType::F32, &Device::Cpu).unwrap();
    let targets = Tensor::zeros(0, DType::U32, &Device::Cpu).unwrap();
    let got = emulate(&[&logits, &targets], DType::F32, 1, |l, a, out| {
        super::cross_entropy_probs(l, [a[0], a[1]], out, 0, 10)
    });
    assert_eq!(got, vec![0.0]);
}

#[test]
fn rms_norm_forward_and_backward_match_the_cpu_kernels() {
    use super::super::rms_swiglu::{rms_norm, rms_norm_backward};
    // a Pack a thread at 64; not at 7, nor at 33 (600 and 520 rows: blocks take several rows)
    for (rows, d) in [(5, 7), (600, 64), (520, 33)] {
        for dtype in DTYPES {
            let x = values(&[rows, d], 16, 2.0, dtype);
            let w = values(&[d], 17, 1.0, dtype);
            let dy = values(&[rows, d], 18, 1.0, dtype);
            let norm = |t: &[Tensor]| rms_norm(&t[0], &t[1], 1e-6).unwrap().unwrap();
            let want = [
                reference(&[&x, &w], dtype, |t| vec![norm(t).0]).remove(0),
                // the roots stay f32 whatever the storage
                reference(&[&x, &w], DType::F32, |t| vec![norm(t).1]).remove(0),
            ];
            let got = emulate_outputs(
                &[&x, &w],
                &[(dtype, rows * d), (DType::F32, rows)],
                |l, a, o| super::rms_norm(l, dtype, [a[0], a[1]], [o[0], o[1]], rows, d, 1e-6),
            );
            assert_close(&format!("rms_norm {rows}x{d}"), &got[0], &want[0], dtype);
            assert_close("rms_norm roots", &got[1], &want[1], DType::F32);
            // the backward from the CPU's roots of the f32 inputs, as the forward kept them
            let roots = Tensor::from_vec(want[1].clone(), (rows, 1), &Device::Cpu).unwrap();
            let want = reference(&[&x, &w, &dy], dtype, |t| {
                let (dx, dw) = rms_norm_backward(&t[0], &roots, &t[1], &t[2])
                    .unwrap()
                    .unwrap();
                vec![dx, dw]
            });
            let outputs = [(dtype, rows * d), (dtype, d)];
            let got = emulate_outputs(&[&x, &roots, &w, &dy], &outputs, |l, a, o| {
                super::rms_norm_backward(l, dtype, [a[0], a[1], a[2], a[3]], [o[0], o[1]], rows, d)
            });
            assert_close(
                &format!("rms_norm_backward dx {rows}x{d}"),
                &got[0],
                &want[0],
                dtype,
            );
            assert_close(
                &format!("rms_norm_backward dw {rows}x{d}"),
                &got[1],
                &want[1],
                dtype,
            );
        }
    }
}

#[test]
fn swiglu_forward_and_backward_match_the_cpu_kernels() {
    // 2 x 256 + 8 elements are moved 16 bytes at a time (fused.cu's swiglu_*_packs), + 9 one
    for n in [2 * 256 + 8, 2 * 256 + 9] {
        swiglu_of(n);
    }
}

fn swiglu_of(n: usize) {
    use super::super::rms_swiglu::{swiglu, swiglu_backward};
    for dtype in DTYPES {
        let (g, u) = (values(&[n], 19, 5.0, dtype), values(&[n], 20, 2.0, dtype));
        let dy = values(&[n], 21, 1.0, dtype);
        let want = reference(&[&g, &u], dtype, |t| {
            vec![swiglu(&t[0], &t[1]).unwrap().unwrap()]
        });
        let got = emulate(&[&g, &u], dtype, n, |l, a, y| {
            super::swiglu(l, dtype, [a[0], a[1]], y, n)
        });
        assert_close("swiglu", &got, &want[0], dtype);
        let want = reference(&[&g, &u, &dy], dtype, |t| {
            let (dg, du) = swiglu_backward(&t[0], &t[1], &t[2]).unwrap().unwrap();
            vec![dg, du]
        });
        let got = emulate(&[&g, &u, &dy], dtype, 2 * n, |l, a, out| {
            super::swiglu_backward(l, dtype, [a[0], a[1], a[2]], out, n)
        });
        assert_close(
            "swiglu_backward",
            &got,
            &[want[0].clone(), want[1].clone()].concat(),
            dtype,
        );
    }
}

/// Head sizes 8 (f32 a pair of Packs a thread; bf16 and f16, whose Pack is 8, an element a
/// thread), 64 and 128 (every dtype in pairs of Packs), and 12 (an element a thread).
#[test]
fn rotary_forward_and_backward_match_the_cpu_kernels() {
    for hd in [8, 12, 64, 128] {
        rotary_matches_the_cpu_kernels(hd);
    }
}

fn rotary_matches_the_cpu_kernels(hd: usize) {
    use super::super::rotary::{apply, apply_backward};
    let (b, h, t) = (2, 3, 5);
    let n = b * h * t * hd;
    for dtype in DTYPES {
        let x = values(&[b, h, t, hd], 22, 2.0, dtype);
        let (cos, sin) = (
            values(&[t, hd], 23, 1.0, dtype),
            values(&[t, hd], 24, 1.0, dtype),
        );
        for transpose in [false, true] {
            let want = reference(&[&x, &cos, &sin], dtype, |a| {
                let y = match transpose {
                    false => apply(&a[0], &a[1], &a[2]),
                    true => apply_backward(&a[0], &a[1], &a[2]),
                };
                vec![y.unwrap().unwrap()]
            });
            let got = emulate(&[&x, &cos, &sin], dtype, n, |l, a, y| {
                super::rotary(l, dtype, [a[0], a[1], a[2]], y, n, (t, hd), transpose)
            });
            assert_close(
                &format!("rotary hd={hd} transpose={transpose}"),
                &got,
                &want[0],
                dtype,
            );
        }
    }
}

#[test]
fn rows_summed_by_index_match_index_add() {
    use super::super::scatter_rows::group_positions;
    // 40 positions over 11 rows: repeated indices, rows no position holds (2, 9, 10)
    let (n, rows, d) = (40, 11, 37);
    let ids: Vec<u32> = (0..n as u32)
        .map(|p| [0, 1, 3, 4, 5, 6, 7, 8][(p * p % 13 % 8) as usize])
        .collect();
    let g = group_positions(&ids, rows).unwrap();
    let ids_t = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let order = Tensor::new(g.order.as_slice(), &Device::Cpu).unwrap();
    let first = Tensor::new(g.first.as_slice(), &Device::Cpu).unwrap();
    for dtype in DTYPES {
        let src = values(&[n, d], 25, 3.0, dtype);
        let want = reference(&[&src], dtype, |a| {
            let zeros = Tensor::zeros((rows, d), DType::F32, &Device::Cpu).unwrap();
            vec![zeros.index_add(&ids_t, &a[0], 0).unwrap()]
        });
        let got = emulate(&[&src, &order, &first], dtype, rows * d, |l, a, out| {
            super::sum_rows_by_index(l, dtype, [a[0], a[1], a[2]], out, (rows, d))
        });
        assert_close("sum_rows_by_index", &got, &want[0], dtype);
        for r in [2, 9, 10] {
            assert!(
                got[r * d..(r + 1) * d].iter().all(|&x| x == 0.0),
                "row {r} is zero"
            );
        }
    }
}
