//! Fused CPU kernels with backward for LayerNorm and the cross-entropy loss. As primitives
//! LayerNorm is ~10 passes forward and ~20 backward, and the loss materialises several
//! [tokens, vocab] temporaries; each is one or two passes here.

use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cpu_storage::{f32_slice, from_f32, map_rows, to_f32};
use super::gpu::fused_on;
#[cfg(feature = "cuda")]
use super::gpu::{self, cuda};
use super::primitive::{by_autograd, layer_norm_primitive, softmax_last_dim};
use super::vmath::{self, exp_shifted};

/// LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * weight + bias.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    x.apply_op3(weight, bias, LayerNorm { eps: eps as f32 })
}

/// Mean cross-entropy of `logits` [n, vocab] against `targets` [n] (u32).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy)
}

/// LayerNorm's gradients (dx, dweight, dbias) from the upstream gradient `dy`.
pub fn layer_norm_backward(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    dy: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    if !fused_on(x.device()) {
        let f = |t: &[Tensor]| layer_norm_primitive(&t[0], &t[1], &t[2], eps);
        let [dx, dw, db]: [Tensor; 3] = by_autograd(&[x, w, b], dy, f)?
            .try_into()
            .expect("three inputs, three gradients");
        return Ok((dx, dw, db));
    }
    let grad = LayerNormGrad { eps: eps as f32 };
    let packed = x
        .contiguous()?
        .apply_op3_no_bwd(w, &dy.contiguous()?, &grad)?;
    let (n, d) = (x.elem_count(), w.elem_count());
    let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
    let dw = packed.narrow(0, n, d)?.to_dtype(w.dtype())?;
    let db = packed.narrow(0, n + d, d)?.to_dtype(w.dtype())?;
    Ok((dx, dw, db))
}

/// The mean cross-entropy of `logits` [n, vocab] (f32) against `targets` [n] (u32), and the
/// rows' softmax, which is all its backward needs.
pub fn cross_entropy_with_probs(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    if !fused_on(logits.device()) {
        let loss = candle_nn::loss::cross_entropy(logits, targets)?;
        return Ok((loss, softmax_last_dim(logits)?));
    }
    let packed = logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &CrossEntropyProbs)?;
    let n = logits.elem_count();
    let loss = packed.narrow(0, n, 1)?.squeeze(0)?;
    Ok((loss, packed.narrow(0, 0, n)?.reshape(logits.shape())?))
}

/// The cross-entropy's gradient straight from `logits` [n, vocab], in their dtype (computed
/// in f32, rounded once): (softmax(logits) - onehot(targets)) * scale, the softmax never in
/// memory.
pub fn cross_entropy_grad(logits: &Tensor, targets: &Tensor, scale: f64) -> Result<Tensor> {
    if !fused_on(logits.device()) {
        let probs = softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        return cross_entropy_backward_primitive(&probs, targets, scale)?.to_dtype(logits.dtype());
    }
    let grad = CrossEntropyGrad {
        scale: scale as f32,
    };
    logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &grad)
}

/// On a GPU: the mean cross-entropy of `logits` [n, vocab], read in their own dtype (no f32
/// copy), and each row's log-sum-exp [n] (f32), in one pass. A GPU's loss keeps these for its
/// backward (`cross_entropy_grad_from_lse`: one more pass over the logits) where the CPU keeps
/// the softmax ([n, vocab] in f32: 3.3 GB at GPT-2's micro-batch of 16): on a GPU the
/// exponentials cost nothing beside the memory traffic, on the CPU they are the cost. None
/// elsewhere, or for a tensor autograd tracks.
pub fn cross_entropy_and_lse(
    logits: &Tensor,
    targets: &Tensor,
) -> Result<Option<(Tensor, Tensor)>> {
    #[cfg(feature = "cuda")]
    return on_gpu::cross_entropy_and_lse(logits, targets);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (logits, targets);
        Ok(None)
    }
}

/// On a GPU: `(softmax(logits) - onehot(targets)) * scale` in the logits' dtype, from the
/// logits and their rows' log-sum-exp (`cross_entropy_and_lse`'s). None elsewhere.
pub fn cross_entropy_grad_from_lse(
    logits: &Tensor,
    lse: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    return on_gpu::cross_entropy_grad_from_lse(logits, lse, targets, scale);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (logits, lse, targets, scale);
        Ok(None)
    }
}

/// The cross-entropy's gradient from the softmax `probs`: (probs - onehot(targets)) * scale.
pub fn cross_entropy_backward(probs: &Tensor, targets: &Tensor, scale: f64) -> Result<Tensor> {
    if !fused_on(probs.device()) {
        return cross_entropy_backward_primitive(probs, targets, scale);
    }
    let grad = ProbsGrad {
        scale: scale as f32,
    };
    probs
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &grad)
}

/// `cross_entropy_backward` from candle's ops, for devices without the fused kernel: the rows
/// scaled, then -scale added at each row's target. Not through a one-hot matrix: candle's
/// `one_hot` builds it in host memory (n x vocab floats: 3.3 GB for GPT-2's 16 x 1024 tokens).
fn cross_entropy_backward_primitive(
    probs: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let n = probs.dim(0)?;
    let at = targets.reshape((n, 1))?;
    let minus = Tensor::full(-scale as f32, (n, 1), probs.device())?.to_dtype(probs.dtype())?;
    (probs * scale)?.scatter_add(&at, &minus, 1)
}

struct LayerNorm {
    eps: f32,
}
/// Gradients of LayerNorm packed in one flat tensor: dx (n*d), then dweight (d), dbias (d).
struct LayerNormGrad {
    eps: f32,
}
struct CrossEntropy;
/// The rows' softmax (n*v) then the mean loss (1), in f32.
struct CrossEntropyProbs;
struct ProbsGrad {
    scale: f32,
}
struct CrossEntropyGrad {
    /// The upstream gradient of the mean loss divided by the row count.
    scale: f32,
}

/// Mean and 1/std of one row.
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = vmath::sum(row) / n;
    let var = vmath::sum_sq_dev(row, mean) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "ds-layer-norm"
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
        let (x, w, b) = (f32_slice(s1, l1)?, f32_slice(s2, l2)?, f32_slice(s3, l3)?);
        let y = map_rows(&x, w.len(), |row| {
            let (mean, rstd) = moments(row, self.eps);
            for ((v, w), b) in row.iter_mut().zip(w.iter()).zip(b.iter()) {
                *v = (*v - mean) * rstd * w + b;
            }
        });
        Ok((from_f32(s1.dtype(), y), l1.shape().clone()))
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
        let (dtype, n, d) = (s1.dtype(), l1.shape().elem_count(), l2.shape().elem_count());
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let y = cuda::with_output(&s1.device, dtype, n, &inputs, |k, a, y| {
            gpu::layer_norm(k, dtype, [a[0], a[1], a[2]], y, n / d.max(1), d, self.eps)
        })?;
        Ok((y, l1.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = layer_norm_backward(x, w, _b, dy, self.eps as f64)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "ds-layer-norm-grad"
    }
    /// Per row, with xhat = (x - mean) * rstd and g = dy * w:
    /// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dw += dy * xhat; db += dy.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, dy) = (f32_slice(s1, l1)?, f32_slice(s2, l2)?, f32_slice(s3, l3)?);
        let d = w.len();
        let mut out = vec![0f32; x.len() + 2 * d];
        let (dx, dwb) = out.split_at_mut(x.len());
        let (dw, db) = dwb.split_at_mut(d);
        let (mut xhat, mut g) = (vec![0f32; d], vec![0f32; d]);
        for ((xr, gr), dxr) in x
            .chunks_exact(d)
            .zip(dy.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
        {
            let (mean, rstd) = moments(xr, self.eps);
            // elementwise loops and lane-wise sums (vmath), so all of it vectorises
            for i in 0..d {
                xhat[i] = (xr[i] - mean) * rstd;
                g[i] = gr[i] * w[i];
                dw[i] += gr[i] * xhat[i];
                db[i] += gr[i];
            }
            let g_mean = vmath::sum(&g) / d as f32;
            let gx_mean = vmath::dot(&g, &xhat) / d as f32;
            for i in 0..d {
                dxr[i] = rstd * (g[i] - g_mean - xhat[i] * gx_mean);
            }
        }
        let dtype = s1.dtype();
        let n = out.len();
        // dx keeps x's dtype; dw and db are converted by the caller to the weight's dtype.
        Ok((from_f32(dtype, out), Shape::from(n)))
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
        let (dtype, n, d) = (s1.dtype(), l1.shape().elem_count(), l2.shape().elem_count());
        let inputs = [(s1, l1), (s2, l2), (s3, l3)];
        let out = cuda::with_output(&s1.device, dtype, n + 2 * d, &inputs, |k, a, out| {
            gpu::layer_norm_backward(k, dtype, [a[0], a[1], a[2]], out, n / d.max(1), d, self.eps)
        })?;
        Ok((out, Shape::from(n + 2 * d)))
    }
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "ds-cross-entropy"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (mut logits, targets) = (to_f32(s1, l1)?, targets(s2, l2)?);
        let v = logits.len() / targets.len().max(1);
        let mut total = 0f64;
        for (row, &t) in logits.chunks_exact_mut(v).zip(&targets) {
            let target = row[t as usize];
            let (max, sum) = exp_shifted(row, 1.0);
            total += (sum.ln() + max - target) as f64;
        }
        let loss = (total / targets.len().max(1) as f64) as f32;
        Ok((from_f32(s1.dtype(), vec![loss]), Shape::from(())))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let loss = cuda_rows((s1, l1), (s2, l2), DType::F32, 1, |k, a, out, rows, v| {
            gpu::cross_entropy(k, a, out, rows, v)
        })?;
        Ok((loss, Shape::from(())))
    }
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        dloss: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = dloss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let n = targets.elem_count().max(1) as f32;
        let grad = logits.apply_op2_no_bwd(targets, &CrossEntropyGrad { scale: g / n })?;
        Ok((Some(grad), None))
    }
}

impl CustomOp2 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "ds-cross-entropy-grad"
    }
    /// (softmax(row) - onehot(target)) * scale.
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (mut logits, targets) = (to_f32(s1, l1)?, targets(s2, l2)?);
        let v = logits.len() / targets.len().max(1);
        for (row, &t) in logits.chunks_exact_mut(v).zip(&targets) {
            let (_, sum) = exp_shifted(row, 1.0);
            let k = self.scale / sum;
            row.iter_mut().for_each(|x| *x *= k);
            row[t as usize] -= self.scale;
        }
        Ok((from_f32(s1.dtype(), logits), l1.shape().clone()))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        // in the logits' dtype, as the CPU's
        let (n, dtype) = (l1.shape().elem_count(), s1.dtype());
        let grad = cuda_rows((s1, l1), (s2, l2), dtype, n, |k, a, out, rows, v| {
            gpu::cross_entropy_grad(k, dtype, a, None, out, rows, v, self.scale)
        })?;
        Ok((grad, l1.shape().clone()))
    }
}

impl CustomOp2 for CrossEntropyProbs {
    fn name(&self) -> &'static str {
        "ds-cross-entropy-probs"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (logits, targets) = (f32_slice(s1, l1)?, targets(s2, l2)?);
        let v = logits.len() / targets.len().max(1);
        let mut out = vec![0f32; logits.len() + 1];
        let mut total = 0f64;
        for ((row, p), &t) in logits
            .chunks_exact(v)
            .zip(out.chunks_exact_mut(v))
            .zip(&targets)
        {
            if t as usize >= v {
                candle_core::bail!("cross entropy: target {t} is outside the vocabulary of {v}");
            }
            p.copy_from_slice(row);
            let (max, sum) = exp_shifted(p, 1.0);
            total += (sum.ln() + max - row[t as usize]) as f64;
            let inv = 1.0 / sum;
            p.iter_mut().for_each(|x| *x *= inv);
        }
        let n = out.len();
        out[n - 1] = (total / targets.len().max(1) as f64) as f32;
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = l1.shape().elem_count();
        let out = cuda_rows(
            (s1, l1),
            (s2, l2),
            DType::F32,
            n + 1,
            |k, a, out, rows, v| gpu::cross_entropy_probs(k, a, out, rows, v),
        )?;
        Ok((out, Shape::from(n + 1)))
    }
}

impl CustomOp2 for ProbsGrad {
    fn name(&self) -> &'static str {
        "ds-cross-entropy-probs-grad"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (probs, targets) = (f32_slice(s1, l1)?, targets(s2, l2)?);
        let v = probs.len() / targets.len().max(1);
        let mut g: Vec<f32> = probs.iter().map(|p| p * self.scale).collect();
        for (row, &t) in g.chunks_exact_mut(v).zip(&targets) {
            row[t as usize] -= self.scale;
        }
        Ok((from_f32(s1.dtype(), g), l1.shape().clone()))
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
        let out = cuda_rows((s1, l1), (s2, l2), dtype, n, |k, a, out, rows, v| {
            gpu::cross_entropy_backward(k, dtype, a, out, rows, v, self.scale)
        })?;
        Ok((out, l1.shape().clone()))
    }
}

/// A cross-entropy op's `cuda_fwd` over rows [rows, v] (logits or their softmax) and their
/// targets [rows]: `len` elements of `dtype`, written by `call` from the two inputs' addresses,
/// the output's, the row count and the vocabulary.
#[cfg(feature = "cuda")]
fn cuda_rows(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    dtype: DType,
    len: usize,
    call: impl FnOnce(&cuda::Cuda, [u64; 2], u64, usize, usize) -> Result<()>,
) -> Result<CudaStorage> {
    let (n, rows) = (l1.shape().elem_count(), l2.shape().elem_count());
    let v = n / rows.max(1);
    cuda::with_output(
        &s1.device,
        dtype,
        len,
        &[(s1, l1), (s2, l2)],
        |k, a, out| call(k, [a[0], a[1]], out, rows, v),
    )
}

/// The loss kept as the logits and their log-sum-exp, on tensors on a GPU.
#[cfg(feature = "cuda")]
mod on_gpu {
    use candle_core::{DType, Result, Shape, Tensor};

    use super::super::gpu::{self, cuda::on_tensors};

    /// The rows and the vocabulary of `logits` [n, v]; None unless they are on a GPU,
    /// untracked, with u32 targets [n] on the same GPU.
    fn rows_of(logits: &Tensor, targets: &Tensor) -> Result<Option<(usize, usize)>> {
        let usable = logits.device().is_cuda()
            && targets.device().same_device(logits.device())
            && !logits.track_op()
            && targets.dtype() == DType::U32
            && logits.rank() == 2;
        if !usable {
            return Ok(None);
        }
        let (n, v) = logits.dims2()?;
        if targets.elem_count() != n {
            candle_core::bail!(
                "cross entropy: {n} rows of logits, {} targets",
                targets.elem_count()
            );
        }
        Ok(Some((n, v)))
    }

    pub(super) fn cross_entropy_and_lse(
        logits: &Tensor,
        targets: &Tensor,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some((n, v)) = rows_of(logits, targets)? else {
            return Ok(None);
        };
        let dtype = logits.dtype();
        let outputs = [(DType::F32, Shape::from(())), (DType::F32, Shape::from(n))];
        let out = on_tensors(&[logits, targets], &outputs, |k, a, o| {
            gpu::cross_entropy_and_lse(k, dtype, [a[0], a[1]], [o[0], o[1]], n, v)
        })?;
        Ok(out.map(|v| {
            let [loss, lse]: [Tensor; 2] = v.try_into().expect("two outputs");
            (loss, lse)
        }))
    }

    pub(super) fn cross_entropy_grad_from_lse(
        logits: &Tensor,
        lse: &Tensor,
        targets: &Tensor,
        scale: f64,
    ) -> Result<Option<Tensor>> {
        let Some((n, v)) = rows_of(logits, targets)? else {
            return Ok(None);
        };
        if lse.dtype() != DType::F32 || lse.elem_count() != n {
            candle_core::bail!("cross entropy: {n} rows of logits, a log-sum-exp of {lse:?}");
        }
        let dtype = logits.dtype();
        let outputs = [(dtype, logits.shape().clone())];
        let out = on_tensors(&[logits, targets, lse], &outputs, |k, a, o| {
            let scale = scale as f32;
            gpu::cross_entropy_grad(k, dtype, [a[0], a[1]], Some(a[2]), o[0], n, v, scale)
        })?;
        Ok(out.map(|mut v| v.remove(0)))
    }
}

fn targets(s: &CpuStorage, l: &Layout) -> Result<Vec<u32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("cross entropy: targets must be contiguous")
    };
    match s {
        CpuStorage::U32(v) => Ok(v[a..b].to_vec()),
        other => candle_core::bail!(
            "cross entropy: targets must be u32, got {:?}",
            other.dtype()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn grads_of(
        f: impl Fn(&[&Tensor]) -> Result<Tensor>,
        inputs: &[Var],
        w: &Tensor,
    ) -> Vec<Vec<f32>> {
        let ts: Vec<&Tensor> = inputs.iter().map(|v| v.as_tensor()).collect();
        let y = f(&ts).unwrap();
        let mut out = vec![y.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
        let seed = match y.rank() {
            0 => (&y * 3.0).unwrap(),
            _ => (&y * w).unwrap().sum_all().unwrap(),
        };
        let g = seed.backward().unwrap();
        for v in inputs {
            out.push(
                g.get(v.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
        }
        out
    }

    fn close(a: &[Vec<f32>], b: &[Vec<f32>]) {
        assert_eq!(a.len(), b.len(), "gradient counts");
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.len(), y.len(), "gradient sizes");
            for (p, q) in x.iter().zip(y) {
                // two f32 evaluations of one formula, different summation orders
                assert!((p - q).abs() <= 2e-5 * (1.0 + q.abs()), "{p} vs {q}");
            }
        }
    }

    fn vals(n: usize, k: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * k % 97) as f32 - 48.0) / 13.0)
            .collect()
    }

    #[test]
    fn layer_norm_matches_the_primitive_composition() {
        let dev = Device::Cpu;
        let x = Var::from_slice(&vals(5 * 16, 37), (5, 16), &dev).unwrap();
        let w = Var::from_slice(&vals(16, 11), 16, &dev).unwrap();
        let b = Var::from_slice(&vals(16, 5), 16, &dev).unwrap();
        let up = Tensor::from_vec(vals(5 * 16, 23), (5, 16), &dev).unwrap();
        let inputs = [x, w, b];
        let fused = grads_of(|t| layer_norm(t[0], t[1], t[2], 1e-5), &inputs, &up);
        let prim = grads_of(
            |t| {
                let c = t[0].broadcast_sub(&t[0].mean_keepdim(D::Minus1)?)?;
                let var = c.sqr()?.mean_keepdim(D::Minus1)?;
                c.broadcast_div(&(var + 1e-5)?.sqrt()?)?
                    .broadcast_mul(t[1])?
                    .broadcast_add(t[2])
            },
            &inputs,
            &up,
        );
        close(&fused, &prim);
    }

    #[test]
    fn cross_entropy_matches_candle_nn() {
        let dev = Device::Cpu;
        let logits = Var::from_slice(&vals(6 * 10, 41), (6, 10), &dev).unwrap();
        let t = Tensor::new(&[3u32, 0, 9, 4, 4, 7], &dev).unwrap();
        let none = Tensor::zeros((), DType::F32, &dev).unwrap();
        let inputs = [logits];
        let fused = grads_of(|x| cross_entropy(x[0], &t), &inputs, &none);
        let reference = grads_of(|x| candle_nn::loss::cross_entropy(x[0], &t), &inputs, &none);
        close(&fused, &reference);
    }

    #[test]
    fn the_primitive_cross_entropy_gradient_matches_the_fused_kernel() {
        let dev = Device::Cpu;
        let logits = Tensor::from_slice(&vals(6 * 10, 7), (6, 10), &dev).unwrap();
        let t = Tensor::new(&[3u32, 0, 9, 4, 4, 7], &dev).unwrap();
        let (_, probs) = cross_entropy_with_probs(&logits, &t).unwrap();
        let flat = |x: Tensor| x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let fused = flat(cross_entropy_backward(&probs, &t, 0.25).unwrap());
        let prim = flat(cross_entropy_backward_primitive(&probs, &t, 0.25).unwrap());
        close(&[fused], &[prim]);
    }
}
