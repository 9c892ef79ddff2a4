//! The linear layers' matrix products on CPU in f32, straight through the `gemm` crate that
//! candle itself calls, for two savings candle's `matmul` cannot make: the output is not
//! zero-filled first (gemm writes every element), and a bias is fused by starting the output
//! from the bias rows (dst = bias + a b). Any other case, and any operand autograd tracks
//! (this product records no graph), returns `None` and the caller uses candle's ops.

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, Device, Layout, Result, Storage, Tensor};
use gemm::Parallelism;

/// `a b (+ bias)` for f32 CPU matrices a [m, k], b [k, n] of any strides, bias [n].
pub fn matmul(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    let tracked = a.track_op() || b.track_op() || bias.is_some_and(|b| b.track_op());
    if tracked || !a.device().is_cpu() || a.rank() != 2 || b.rank() != 2 {
        return Ok(None);
    }
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if k != k2 {
        return Ok(None); // candle reports the mismatch
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Some(pa), Some(pb)) = (f32_ptr(&sa, la), f32_ptr(&sb, lb)) else {
        return Ok(None);
    };
    let mut dst: Vec<MaybeUninit<f32>> = Vec::with_capacity(m * n);
    let fused_bias = match bias {
        Some(bias) => {
            let bias = bias.contiguous()?;
            let Ok(row) = bias.to_vec1::<f32>() else {
                return Ok(None);
            };
            if row.len() != n {
                return Ok(None);
            }
            for _ in 0..m {
                dst.extend(row.iter().map(|v| MaybeUninit::new(*v)));
            }
            true
        }
        None => false,
    };
    let parallelism = match candle_core::utils::get_num_threads() {
        t if t > 1 => Parallelism::Rayon(t),
        _ => Parallelism::None,
    };
    // SAFETY: the pointers address a's and b's elements under their layouts (the storage
    // guards are held until the end of this function); dst has room for m*n elements, every
    // one of which gemm writes (it reads them first only when they hold the bias); k = 0 is
    // excluded since gemm then writes nothing.
    unsafe {
        if k == 0 && !fused_bias {
            return Ok(Some(Tensor::zeros(
                (m, n),
                candle_core::DType::F32,
                &Device::Cpu,
            )?));
        }
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().cast::<f32>(),
            1,
            n as isize,
            fused_bias,
            pa.ptr,
            pa.cs,
            pa.rs,
            pb.ptr,
            pb.cs,
            pb.rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        dst.set_len(m * n);
    }
    // SAFETY: every element was written above; MaybeUninit<f32> has f32's layout.
    let dst: Vec<f32> = unsafe {
        let mut dst = std::mem::ManuallyDrop::new(dst);
        Vec::from_raw_parts(dst.as_mut_ptr().cast::<f32>(), dst.len(), dst.capacity())
    };
    Ok(Some(Tensor::from_vec(dst, (m, n), &Device::Cpu)?))
}

/// Where a matrix's elements start, and its row and column strides.
struct Strided {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

fn f32_ptr(s: &Storage, l: &Layout) -> Option<Strided> {
    let Storage::Cpu(CpuStorage::F32(v)) = s else {
        return None;
    };
    let (stride, offset) = (l.stride(), l.start_offset());
    // the last element read must lie inside the storage
    let dims = l.dims();
    let last = offset + (dims[0].max(1) - 1) * stride[0] + (dims[1].max(1) - 1) * stride[1];
    (last < v.len() || dims.contains(&0)).then(|| Strided {
        ptr: v[offset..].as_ptr(),
        rs: stride[0] as isize,
        cs: stride[1] as isize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, k: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * k % 31) as f32 - 15.0) / 8.0).collect()
    }

    /// Against a float64 triple loop, for plain, transposed and biased operands.
    #[test]
    fn matches_a_float64_product() {
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 1, 1), (5, 3, 7), (17, 33, 9), (64, 40, 48)] {
            let a = Tensor::from_vec(values(m * k, 7), (m, k), &dev).unwrap();
            let bt = Tensor::from_vec(values(n * k, 11), (n, k), &dev).unwrap();
            let b = bt.t().unwrap(); // [k, n] with column-major strides
            let bias = Tensor::from_vec(values(n, 5), n, &dev).unwrap();
            let (av, btv, biasv) = (values(m * k, 7), values(n * k, 11), values(n, 5));
            for with_bias in [false, true] {
                let got = matmul(&a, &b, with_bias.then_some(&bias)).unwrap().unwrap();
                let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let mut want = if with_bias { biasv[j] as f64 } else { 0.0 };
                        for p in 0..k {
                            want += av[i * k + p] as f64 * btv[j * k + p] as f64;
                        }
                        let g = got[i * n + j] as f64;
                        // k products rounded to f32, each below 4: k * 2^-24 * 16 * k bounds it
                        assert!(
                            (g - want).abs() <= 1e-6 * (k * k) as f64 + 1e-6,
                            "{g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn other_cases_are_left_to_candle() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((2, 3), candle_core::DType::BF16, &dev).unwrap();
        assert!(matmul(&a, &a.t().unwrap(), None).unwrap().is_none());
        let a3 = Tensor::zeros((2, 2, 3), candle_core::DType::F32, &dev).unwrap();
        assert!(matmul(&a3, &a3, None).unwrap().is_none());
    }
}
