//! Building blocks of hand-written backward passes (Note [taped layers] in model/mod.rs): the
//! linear map and its gradients.

use candle_core::{Result, Tensor};

use super::cpu_matmul;
use super::ops::{add_bias, column_sum};

/// `x W^T (+ b)` over the last dimension: x [.., in], W [out, in] (candle-nn's layout).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let mut shape = x.dims().to_vec();
    let (x2, wt) = (rows(x)?, w.t()?);
    let y = match cpu_matmul::matmul(&x2, &wt, b)? {
        Some(y) => y,
        None => {
            let y = x2.matmul(&wt)?;
            match b {
                Some(b) => add_bias(&y, b)?,
                None => y,
            }
        }
    };
    *shape.last_mut().expect("a linear input has dimensions") = w.dim(0)?;
    y.reshape(shape)
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
