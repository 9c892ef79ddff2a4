//! Building blocks of hand-written backward passes (Note [taped layers]): the linear map and
//! its gradients, and candle's autograd as the fallback for kernels a device lacks.

use candle_core::{Result, Tensor, Var};

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

/// The gradients of `f` at `inputs` for the upstream gradient `dy`, by candle's autograd:
/// the backward of a kernel on devices that have only candle's primitive ops.
pub fn by_autograd(
    inputs: &[&Tensor],
    dy: &Tensor,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let vars = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.detach()))
        .collect::<Result<Vec<Var>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = (f(&ts)? * dy)?.sum_all()?.backward()?;
    vars.iter()
        .map(|v| match grads.get(v.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => v.as_tensor().zeros_like(),
        })
        .collect()
}
