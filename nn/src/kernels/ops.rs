//! Fused CPU kernels with their backward for the GPT's hot elementwise work: tanh-GELU and
//! the causal softmax. Composed of candle's primitive ops, each of these takes 5-10 passes
//! over memory forward and as many backward (GELU's backward alone calls `powf`); here each is
//! one pass. On other devices the primitive composition runs instead (same function).

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};

use super::cpu_storage::{f32_slice, from_f32, map_rows};
use super::gpu::fused_on;
#[cfg(feature = "cuda")]
use super::gpu::{self, cuda};
use super::primitive::{by_autograd, softmax_last_dim};
use super::vmath::{self, exp_shifted, tanh};

/// tanh-approximated GELU, as torch's `gelu(approximate="tanh")`.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    match fused_on(x.device()) {
        true => x.apply_op1(Gelu),
        false => x.gelu(),
    }
}

/// Softmax over the last dimension of square [.., T, T] scores times `scale`, where row i only
/// sees columns 0..=i (later columns get probability 0, as with a -inf mask).
pub fn causal_softmax(x: &Tensor, scale: f64) -> Result<Tensor> {
    if fused_on(x.device()) {
        return x.contiguous()?.apply_op1(CausalSoftmax {
            scale: scale as f32,
        });
    }
    let x = (x * scale)?;
    let t = x.dim(D::Minus1)?;
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), x.device())?.to_dtype(x.dtype())?;
    softmax_last_dim(&x.broadcast_add(&mask)?)
}

/// `x + bias` over the last dimension. candle's broadcast add reduces the bias gradient with a
/// strided sum over every leading dimension, about 15x the cost of one pass over the
/// activation; here it is one column sum.
pub fn add_bias(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    match x.device().is_cpu() {
        true => x.contiguous()?.apply_op2(&bias.contiguous()?, AddBias),
        false => x.broadcast_add(bias),
    }
}

/// The sum of the rows of `dy` [n, k], shaped and typed like `like` (k elements): a bias
/// gradient.
pub fn column_sum(dy: &Tensor, like: &Tensor) -> Result<Tensor> {
    match fused_on(dy.device()) {
        true => dy.contiguous()?.apply_op2_no_bwd(like, &ColumnSum),
        false => dy.sum(0)?.reshape(like.shape())?.to_dtype(like.dtype()),
    }
}

/// GELU's backward: `dy * gelu'(x)`.
pub fn gelu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    match fused_on(x.device()) {
        true => x
            .contiguous()?
            .apply_op2_no_bwd(&dy.contiguous()?, &GeluGrad),
        false => by_autograd(&[x], dy, |t| t[0].gelu()).map(|mut g| g.remove(0)),
    }
}

/// The causal softmax's backward from its output `y`: `scale * y * (dy - sum(dy * y))` per row.
pub fn causal_softmax_backward(y: &Tensor, dy: &Tensor, scale: f64) -> Result<Tensor> {
    if fused_on(y.device()) {
        let grad = CausalSoftmaxGrad {
            scale: scale as f32,
        };
        return y.contiguous()?.apply_op2_no_bwd(&dy.contiguous()?, &grad);
    }
    let dot = (dy * y)?.sum_keepdim(D::Minus1)?;
    (dy.broadcast_sub(&dot)? * y)? * scale
}

struct AddBias;
struct ColumnSum;

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "ds-add-bias"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, b) = (f32_slice(s1, l1)?, f32_slice(s2, l2)?);
        if b.is_empty() || x.len() % b.len() != 0 {
            candle_core::bail!(
                "add_bias: bias of {} does not divide {:?}",
                b.len(),
                l1.dims()
            );
        }
        let y = map_rows(&x, b.len(), |row| {
            row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v += b)
        });
        Ok((from_f32(s1.dtype(), y), l1.shape().clone()))
    }
    fn bwd(
        &self,
        _x: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(dy.clone()), Some(column_sum(dy, bias)?)))
    }
}

impl CustomOp2 for ColumnSum {
    fn name(&self) -> &'static str {
        "ds-column-sum"
    }
    /// The sum of `dy`'s rows, shaped and typed like the bias (the second argument).
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dy = f32_slice(s1, l1)?;
        let mut sum = vec![0f32; l2.shape().elem_count()];
        for row in dy.chunks_exact(sum.len().max(1)) {
            sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
        Ok((from_f32(s2.dtype(), sum), l2.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dtype, k) = (s2.dtype(), l2.shape().elem_count());
        let rows = l1.shape().elem_count() / k.max(1);
        let sum = cuda::with_output(&s1.device, dtype, k, &[(s1, l1)], |g, a, out| {
            gpu::column_sum(g, dtype, a[0], out, rows, k)
        })?;
        Ok((sum, l2.shape().clone()))
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

#[inline(always)]
fn gelu_at(v: f32) -> f32 {
    0.5 * v * (1.0 + tanh(SQRT_2_OVER_PI * (v + GELU_C * v * v * v)))
}

/// `g * gelu'(v)`.
#[inline(always)]
fn gelu_grad_at(v: f32, g: f32) -> f32 {
    let t = tanh(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * v * v);
    g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du)
}

struct Gelu;
struct GeluGrad;
struct CausalSoftmax {
    scale: f32,
}
struct CausalSoftmaxGrad {
    scale: f32,
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "ds-gelu"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s, l)?;
        let y = vmath::map1(&x, gelu_at);
        Ok((from_f32(s.dtype(), y), l.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (dtype, n) = (s.dtype(), l.shape().elem_count());
        let y = cuda::with_output(&s.device, dtype, n, &[(s, l)], |k, a, y| {
            gpu::gelu(k, dtype, a[0], y, n)
        })?;
        Ok((y, l.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(gelu_backward(x, dy)?))
    }
}

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "ds-gelu-grad"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, dy) = (f32_slice(s1, l1)?, f32_slice(s2, l2)?);
        let dx = vmath::map2(&x, &dy, gelu_grad_at);
        Ok((from_f32(s1.dtype(), dx), l1.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dtype, n) = (s1.dtype(), l1.shape().elem_count());
        let dx = cuda::with_output(&s1.device, dtype, n, &[(s1, l1), (s2, l2)], |k, a, dx| {
            gpu::gelu_backward(k, dtype, [a[0], a[1]], dx, n)
        })?;
        Ok((dx, l1.shape().clone()))
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "ds-causal-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let t = square_last_dims(l)?;
        let mut r = 0;
        let y = map_rows(&f32_slice(s, l)?, t, |row| {
            causal_softmax_row(row, r % t, self.scale);
            r += 1;
        });
        Ok((from_f32(s.dtype(), y), l.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (dtype, t, n) = (s.dtype(), square_last_dims(l)?, l.shape().elem_count());
        let y = cuda::with_output(&s.device, dtype, n, &[(s, l)], |k, a, y| {
            gpu::causal_softmax(k, dtype, a[0], y, n / t.max(1), t, self.scale)
        })?;
        Ok((y, l.shape().clone()))
    }
    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(causal_softmax_backward(y, dy, self.scale as f64)?))
    }
}

impl CustomOp2 for CausalSoftmaxGrad {
    fn name(&self) -> &'static str {
        "ds-causal-softmax-grad"
    }
    /// dx = scale * y * (dy - sum(dy * y)) per row.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let t = square_last_dims(l1)?;
        let (y, dy) = (f32_slice(s1, l1)?, f32_slice(s2, l2)?);
        let mut rows = y.chunks_exact(t);
        let dx = map_rows(&dy, t, |gr| {
            let yr = rows.next().expect("y and dy have the same shape");
            softmax_grad_row(yr, gr, self.scale);
        });
        Ok((from_f32(s1.dtype(), dx), l1.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dtype, t, n) = (s1.dtype(), square_last_dims(l1)?, l1.shape().elem_count());
        let dx = cuda::with_output(&s1.device, dtype, n, &[(s1, l1), (s2, l2)], |k, a, dx| {
            gpu::softmax_backward(k, dtype, [a[0], a[1]], dx, n / t.max(1), t, self.scale)
        })?;
        Ok((dx, l1.shape().clone()))
    }
}

/// Row `r` of causal scores in place: the softmax of its first r+1 entries times `scale`,
/// zeros after them (as a -inf mask gives).
pub(crate) fn causal_softmax_row(row: &mut [f32], r: usize, scale: f32) {
    let (seen, masked) = row.split_at_mut(r + 1);
    let (_, sum) = exp_shifted(seen, scale);
    let inv = 1.0 / sum;
    seen.iter_mut().for_each(|v| *v *= inv);
    masked.fill(0.0);
}

/// One row of the softmax's backward in place: `g = scale * y * (g - sum(g * y))`.
pub(crate) fn softmax_grad_row(y: &[f32], g: &mut [f32], scale: f32) {
    let dot = vmath::dot(y, g);
    g.iter_mut()
        .zip(y)
        .for_each(|(g, y)| *g = scale * y * (*g - dot));
}

fn square_last_dims(l: &Layout) -> Result<usize> {
    match l.dims() {
        [.., a, b] if a == b => Ok(*b),
        d => candle_core::bail!("causal softmax needs square [.., T, T] scores, got {d:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Forward and gradient against candle's own primitive composition of the same function.
    fn check(
        fused: impl Fn(&Tensor) -> Result<Tensor>,
        reference: impl Fn(&Tensor) -> Result<Tensor>,
        shape: &[usize],
    ) {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
            .collect();
        let w = Tensor::from_vec(w, shape, &Device::Cpu).unwrap();
        let run = |f: &dyn Fn(&Tensor) -> Result<Tensor>| {
            let x = Var::from_slice(&vals, shape, &Device::Cpu).unwrap();
            let y = f(x.as_tensor()).unwrap();
            let g = (&y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = g
                .get(x.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), dx)
        };
        let (y1, g1) = run(&fused);
        let (y2, g2) = run(&reference);
        // both are f32 evaluations of one formula; they differ by a few ulps
        for (a, b) in y1.iter().zip(&y2).chain(g1.iter().zip(&g2)) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn add_bias_matches_broadcast_add() {
        let b = Var::from_slice(&[0.5f32, -1.0, 2.0, 0.25, 3.0], 5, &Device::Cpu).unwrap();
        let bias = b.as_tensor().clone();
        check(
            |x| add_bias(x, &bias),
            |x| x.broadcast_add(&bias),
            &[2, 3, 5],
        );
        // the bias gradient: column sums of the upstream gradient, against broadcast_add's
        let x = Tensor::ones((4, 5), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::arange(0f32, 20.0, &Device::Cpu)
            .unwrap()
            .reshape((4, 5))
            .unwrap();
        let grad = |y: Tensor| {
            let g = (y * &w).unwrap().sum_all().unwrap().backward().unwrap();
            g.get(b.as_tensor()).unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(
            grad(add_bias(&x, b.as_tensor()).unwrap()),
            grad(x.broadcast_add(b.as_tensor()).unwrap())
        );
    }

    #[test]
    fn gelu_matches_candles_composition() {
        check(gelu, |x| x.gelu(), &[3, 50]);
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() {
        let masked = |x: &Tensor| {
            let t = x.dim(D::Minus1)?;
            let m: Vec<f32> = (0..t * t)
                .map(|i| {
                    if i % t > i / t {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let m = Tensor::from_vec(m, (t, t), x.device())?;
            softmax_last_dim(&x.broadcast_add(&m)?)
        };
        check(
            |x| causal_softmax(x, 0.37),
            |x| masked(&(x * 0.37)?),
            &[2, 3, 7, 7],
        );
    }
}
