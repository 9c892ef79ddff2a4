//! The primitive compositions: LayerNorm and softmax from candle's own ops, and candle's
//! autograd as the backward of any function. They run on devices without a fused kernel and
//! are what each kernel is tested against; being candle's ops alone, they sit below every
//! other kernel.

use candle_core::{DType, Result, Tensor, Var, D};

/// Softmax over the last dimension, stabilised by the row maximum.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// LayerNorm from candle's primitive ops (normalised in f32), for devices without the kernel.
pub(crate) fn layer_norm_primitive(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed
        .to_dtype(dtype)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

/// The gradients of `f` at `inputs` for the upstream gradient `dy`, by candle's autograd:
/// the backward of a kernel on devices that have only candle's primitive ops.
pub(crate) fn by_autograd(
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
