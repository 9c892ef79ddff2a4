//! Building blocks of hand-written backward passes (Note [taped layers] in model/mod.rs): the
//! linear map and its gradients, and the MLP's linear with GELU, whose bias and activation
//! a GPU folds into the product (cuBLASLt's epilogues, kernels/gpu/lt.rs).

use candle_core::{Result, Tensor};

use super::cpu_matmul;
use super::ops::{add_bias, column_sum, gelu, gelu_backward};

/// `x W^T (+ b)` over the last dimension: x [.., in], W [out, in] (candle-nn's layout).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (x2, wt) = (rows(x)?, w.t()?);
    let fast = match cpu_matmul::matmul(&x2, &wt, b)? {
        Some(y) => Some(y),
        None => gpu_linear(&x2, w, b)?,
    };
    let y = match fast {
        Some(y) => y,
        None => {
            let y = x2.matmul(&wt)?;
            match b {
                Some(b) => add_bias(&y, b)?,
                None => y,
            }
        }
    };
    y.reshape(output_shape(x, w)?)
}

/// The shape of `linear(x, w, _)`: x's, with w's output features last.
fn output_shape(x: &Tensor, w: &Tensor) -> Result<Vec<usize>> {
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("a linear input has dimensions") = w.dim(0)?;
    Ok(shape)
}

/// `linear` with a bias on a GPU: the bias added in the product's epilogue (None elsewhere).
fn gpu_linear(x2: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let (Some(b), true) = (b, x2.device().is_cuda()) {
        return super::gpu::lt::linear(x2, w, b);
    }
    let _ = (x2, w, b);
    Ok(None)
}

/// `f = linear(x, w, b)` and `gelu(f)` (tanh): on a GPU one product whose epilogue adds the
/// bias, keeps f and writes its GELU.
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        if let Some((f, g)) = super::gpu::lt::linear_gelu(&rows(x)?, w, b)? {
            let shape = output_shape(x, w)?;
            return Ok((f.reshape(shape.as_slice())?, g.reshape(shape)?));
        }
    }
    let f = linear(x, w, Some(b))?;
    let g = gelu(&f)?;
    Ok((f, g))
}

/// The backward of `linear(gelu(f), w, _)` given the upstream `dy`: `dx` is the gradient of
/// the pre-activation f (on a GPU from one product whose epilogue multiplies by GELU's
/// derivative), `dw` that of w; `g` is gelu(f).
pub fn gelu_linear_backward(
    g: &Tensor,
    f: &Tensor,
    w: &Tensor,
    dy: &Tensor,
) -> Result<LinearGrads> {
    #[cfg(feature = "cuda")]
    if dy.device().is_cuda() {
        let (dy2, f2) = (rows(dy)?, rows(f)?);
        if let Some(df) = super::gpu::lt::input_grad_through_gelu(&dy2, w, &f2)? {
            return Ok(LinearGrads {
                dx: df.reshape(f.shape())?,
                dw: product(&dy2.t()?, &rows(g)?)?,
            });
        }
    }
    let proj = linear_backward(g, w, dy)?;
    Ok(LinearGrads {
        dx: gelu_backward(f, &proj.dx)?,
        dw: proj.dw,
    })
}

/// The gradients of `linear`'s input and weight given the upstream `dy`.
pub struct LinearGrads {
    pub dx: Tensor,
    pub dw: Tensor,
}

/// dx = dy W, dW = dy^T x.
pub fn linear_backward(x: &Tensor, w: &Tensor, dy: &Tensor) -> Result<LinearGrads> {
    let (x2, dy2) = (rows(x)?, rows(dy)?);
    Ok(LinearGrads {
        dx: product(&dy2, w)?.reshape(x.shape())?,
        dw: product(&dy2.t()?, &x2)?,
    })
}

/// The gradient of `linear`'s bias `b`: the column sums of `dy`.
pub fn bias_backward(dy: &Tensor, b: &Tensor) -> Result<Tensor> {
    column_sum(&rows(dy)?, b)
}

/// `a b` through the CPU fast path where it applies, else candle's matmul.
fn product(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    match cpu_matmul::matmul(a, b, None)? {
        Some(y) => Ok(y),
        None => a.matmul(b),
    }
}

/// `x` as a matrix of rows over its last dimension.
fn rows(x: &Tensor) -> Result<Tensor> {
    let last = x.dims().last().copied().unwrap_or(1);
    x.reshape((x.elem_count() / last.max(1), last))
}
