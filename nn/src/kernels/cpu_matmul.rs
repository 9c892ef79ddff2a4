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
    let row = match bias {
        Some(bias) => match bias.contiguous()?.to_vec1::<f32>() {
            Ok(row) if row.len() == n => Some(row),
            _ => return Ok(None),
        },
        None => None,
    };
    // SAFETY: the operands address a's and b's elements under their layouts (the storage
    // guards are held); dst has m*n elements: with a bias, all written with the bias rows
    // first; without, gemm writes every one.
    let dst = unsafe {
        filled(m * n, |dst| match &row {
            Some(row) => {
                for i in 0..m {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), dst.add(i * n), n);
                }
                gemm_into(m, n, k, dst, n as isize, 1, true, pa, pb);
            }
            None => gemm_into(m, n, k, dst, n as isize, 1, false, pa, pb),
        })
    };
    Ok(Some(Tensor::from_vec(dst, (m, n), &Device::Cpu)?))
}

/// A vector of `n` elements written by `fill` through the pointer it gets, without zeroing
/// them first.
///
/// # Safety
/// `fill` writes all n elements.
pub(crate) unsafe fn filled(n: usize, fill: impl FnOnce(*mut f32)) -> Vec<f32> {
    let mut v: Vec<MaybeUninit<f32>> = Vec::with_capacity(n);
    fill(v.as_mut_ptr().cast::<f32>());
    v.set_len(n);
    // MaybeUninit<f32> has f32's layout, and every element is initialised now.
    let mut v = std::mem::ManuallyDrop::new(v);
    Vec::from_raw_parts(v.as_mut_ptr().cast::<f32>(), v.len(), v.capacity())
}

/// dst (m x n, strides dst_rs and dst_cs) = [dst +] a (m x k) b (k x n), on candle's thread
/// count.
///
/// # Safety
/// Every element of a, b and dst lies inside its allocation; dst overlaps neither operand;
/// with `add` false every element of dst is written whatever it held.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_into(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    dst_cs: isize,
    add: bool,
    a: Mat,
    b: Mat,
) {
    if k == 0 {
        // gemm writes nothing then; the product is zero
        if !add {
            for i in 0..m {
                for j in 0..n {
                    *dst.offset(i as isize * dst_rs + j as isize * dst_cs) = 0.0;
                }
            }
        }
        return;
    }
    let parallelism = match candle_core::utils::get_num_threads() {
        t if t > 1 => Parallelism::Rayon(t),
        _ => Parallelism::None,
    };
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dst_cs,
        dst_rs,
        add,
        a.ptr,
        a.cs,
        a.rs,
        b.ptr,
        b.cs,
        b.rs,
        1.0,
        1.0,
        false,
        false,
        false,
        parallelism,
    );
}

/// A matrix operand: where its elements start, and its row and column strides.
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

impl Mat {
    /// The view from row `i` on.
    ///
    /// # Safety
    /// Row `i` lies inside the operand's allocation.
    pub unsafe fn row(self, i: usize) -> Mat {
        Mat {
            ptr: self.ptr.offset(i as isize * self.rs),
            ..self
        }
    }

    /// The transposed view of the same elements.
    pub fn t(self) -> Mat {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

fn f32_ptr(s: &Storage, l: &Layout) -> Option<Mat> {
    let Storage::Cpu(CpuStorage::F32(v)) = s else {
        return None;
    };
    let (stride, offset) = (l.stride(), l.start_offset());
    // the last element read must lie inside the storage
    let dims = l.dims();
    let last = offset + (dims[0].max(1) - 1) * stride[0] + (dims[1].max(1) - 1) * stride[1];
    (last < v.len() || dims.contains(&0)).then(|| Mat {
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
