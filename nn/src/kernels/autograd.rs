//! Fused ops with their backward for a user's own candle model (issue 36, item 4): RMSNorm,
//! rotary embeddings in candle-nn's `rope` convention, and the last-dimension softmax.
//! candle-nn's fused `rms_norm`, `rope` and `softmax_last_dim` have no backward, so a model
//! built from them cannot train; these are drop-in replacements that candle's autograd
//! differentiates (custom ops whose `bwd` runs ds-rs's fused backward kernels on the CPU, and
//! for RMSNorm and rope on a GPU in the cuda build), and compositions of candle's ops elsewhere
//! (other devices and dtypes), which are also what they are tested against.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};

use super::cpu_storage::{f32_slice, from_f32, map_rows};
#[cfg(feature = "cuda")]
use super::gpu::{self, cuda, Launcher};
use super::primitive::softmax_last_dim as softmax_primitive;
use super::{rms_swiglu, rotary, vmath};
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;

/// Whether the fused CPU path applies.
fn fused(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// Whether a fused path applies to RMSNorm and rope: the CPU's (f32), or in the cuda build a
/// GPU's (kernels/gpu, any float dtype, rounded once).
fn fused_here(x: &Tensor) -> bool {
    fused(x) || (cfg!(feature = "cuda") && x.device().is_cuda())
}

/// `w * x / sqrt(mean(x^2) + eps)` over the last dimension (candle-nn's `ops::rms_norm`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused_here(x) && fused_here(w) {
        return x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps });
    }
    rms_norm_primitive(x, w, eps)
}

/// RMSNorm from candle's ops, normalised in f32.
pub fn rms_norm_primitive(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&r)?.to_dtype(dtype)?.broadcast_mul(w)
}

struct RmsNorm {
    eps: f64,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "ds-rms-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let mut y = f32_slice(s1, l1)?.into_owned();
        rms_swiglu::rms_norm_rows(&mut y, &f32_slice(s2, l2)?, self.eps);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dtype, n, d) = (s1.dtype(), l1.shape().elem_count(), l2.shape().elem_count());
        let rows = n / d.max(1);
        let y = cuda::with_output(&s1.device, dtype, n, &[(s1, l1), (s2, l2)], |k, a, y| {
            // the roots are the backward's to recompute (as on the CPU)
            let (_roots, at) = k.scratch(rows.max(1))?;
            gpu::rms_norm(k, dtype, [a[0], a[1]], [y, at], rows, d, self.eps as f32)
        })?;
        Ok((y, l1.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w, dy) = (x.detach(), w.detach(), dy.detach().contiguous()?);
        let refused = || candle_core::Error::Msg("rms_norm: the fused path refused".into());
        // the reciprocal roots again: one pass, cheaper than keeping them per call
        let (_, r) = rms_swiglu::rms_norm(&x, &w, self.eps)?.ok_or_else(refused)?;
        let (dx, dw) = rms_swiglu::rms_norm_backward(&x, &r, &w, &dy)?.ok_or_else(refused)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Rotary embeddings as candle-nn's `rotary_emb::rope` (split halves, Hugging Face's
/// `rotate_half`): x [b, h, t, d], cos and sin [t, d/2].
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (
        Tensor::cat(&[cos, cos], D::Minus1)?,
        Tensor::cat(&[sin, sin], D::Minus1)?,
    );
    if fused_here(x) && fused_here(&cos) {
        return x
            .contiguous()?
            .apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope);
    }
    rope_primitive(x, &cos, &sin)
}

/// `x cos + rotate_half(x) sin` from candle's ops, with whole tables [t, d].
pub fn rope_primitive(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let (a, b) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let rotated = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

struct Rope;

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "ds-rope"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, cos, sin) = (f32_slice(s1, l1)?, f32_slice(s2, l2)?, f32_slice(s3, l3)?);
        let tables = l2.shape().dims2()?;
        let y = rotary::rotate_rows(&x, &cos, &sin, tables, false);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dtype, n, tables) = (s1.dtype(), l1.shape().elem_count(), l2.shape().dims2()?);
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let y = cuda::with_output(&s1.device, dtype, n, &inputs, |k, a, y| {
            gpu::rotary(k, dtype, [a[0], a[1], a[2]], y, n, tables, false)
        })?;
        Ok((y, l1.shape().clone()))
    }
    /// The tables are constants (no gradient), as in every rotary embedding.
    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = rotary::apply_backward(&dy.detach().contiguous()?, &cos.detach(), &sin.detach())?
            .ok_or_else(|| candle_core::Error::Msg("rope: the fused path refused".into()))?;
        Ok((Some(dx), None, None))
    }
}

/// Softmax over the last dimension (candle-nn's `ops::softmax_last_dim`), with a backward.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        return x.contiguous()?.apply_op1(Softmax);
    }
    softmax_primitive(x)
}

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "ds-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let width = l.shape().dims().last().copied().unwrap_or(1);
        let y = map_rows(&f32_slice(s, l)?, width, |row| {
            let (_, sum) = vmath::exp_shifted(row, 1.0);
            row.iter_mut().for_each(|v| *v /= sum);
        });
        Ok((from_f32(s.dtype(), y), l.shape().clone()))
    }
    /// dx = y (dy - sum(dy y)) over each row.
    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dot = (dy * y)?.sum_keepdim(D::Minus1)?;
        Ok(Some((y * dy.broadcast_sub(&dot)?)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// Values in about [-2, 2] from a fixed formula.
    fn values(shape: &[usize], k: usize) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| (((i * 37 + k * 11) % 41) as f32 - 20.0) / 10.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// The output and the gradients of `inputs` of `f` under a weighted sum (so every output
    /// element has its own upstream gradient).
    fn forward_backward(
        inputs: &[Tensor],
        f: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(t).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let weights = values(y.dims(), 3);
        let grads = (&y * &weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g = ts.iter().map(|t| grads.get(t).unwrap().clone()).collect();
        (y, g)
    }

    /// Each fused op against candle's composition: outputs and every gradient within 1e-5
    /// (f32 sums of a few dozen terms in another order).
    fn agree(
        what: &str,
        inputs: &[Tensor],
        fused: impl Fn(&[Tensor]) -> Result<Tensor>,
        reference: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) {
        let (y, g) = forward_backward(inputs, fused);
        let (y_ref, g_ref) = forward_backward(inputs, reference);
        assert!(
            max_diff(&y, &y_ref) < 1e-5,
            "{what}: output differs by {}",
            max_diff(&y, &y_ref)
        );
        for (i, (a, b)) in g.iter().zip(&g_ref).enumerate() {
            assert!(
                max_diff(a, b) < 1e-5,
                "{what}: gradient {i} differs by {}",
                max_diff(a, b)
            );
        }
    }

    #[test]
    fn rms_norm_rope_and_softmax_train_as_their_compositions() {
        let (x, w) = (values(&[3, 4, 16], 1), values(&[16], 2));
        agree(
            "rms_norm",
            &[x.clone(), w],
            |t| rms_norm(&t[0], &t[1], 1e-6),
            |t| rms_norm_primitive(&t[0], &t[1], 1e-6),
        );
        let q = values(&[2, 3, 5, 8], 4);
        let angles = values(&[5, 4], 5);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let whole = |t: &Tensor| Tensor::cat(&[t, t], D::Minus1).unwrap();
        let (cw, sw) = (whole(&cos), whole(&sin));
        agree(
            "rope",
            &[q],
            |t| rope(&t[0], &cos, &sin),
            |t| rope_primitive(&t[0], &cw, &sw),
        );
        agree(
            "softmax",
            &[x],
            |t| softmax_last_dim(&t[0]),
            |t| softmax_primitive(&t[0]),
        );
    }

    #[test]
    fn candle_nn_agrees_on_the_forward() {
        // the ops are drop-in replacements: the same values as candle-nn's (forward-only) ones
        let (x, w) = (values(&[3, 16], 1), values(&[16], 2));
        let theirs = candle_nn::ops::rms_norm(&x, &w, 1e-6).unwrap();
        assert!(max_diff(&rms_norm(&x, &w, 1e-6).unwrap(), &theirs) < 1e-5);
        let q = values(&[1, 2, 5, 8], 4);
        let angles = values(&[5, 4], 5);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let theirs = candle_nn::rotary_emb::rope(&q, &cos, &sin).unwrap();
        assert!(max_diff(&rope(&q, &cos, &sin).unwrap(), &theirs) < 1e-5);
        let theirs = candle_nn::ops::softmax_last_dim(&x).unwrap();
        assert!(max_diff(&softmax_last_dim(&x).unwrap(), &theirs) < 1e-6);
    }
}
