//! One layer's forward and backward on parameters the engine materialised for it.
//!
//! Note [layer-wise backward]: each layer's input is a fresh `Var`, so the layer's autograd
//! graph ends there. Given the gradient `dy` of its output, `(y * dy).sum_all().backward()`
//! yields the layer's parameter gradients and the gradient of its input, which seeds the
//! layer below (candle's `backward()` has no hooks and seeds with ones, hence the product).
//! The loss layer is seeded with its scalar output times the loss scale.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{backprop::GradStore, DType, Device, Storage, Tensor, Var, WithDType};
use candle_nn::VarBuilder;
use ds_comm::Element;
use ds_partition::FlatIndex;

use crate::model::{Context, NamedLayer, Taped};
use crate::{EngineError, Result};

/// An element type the engine computes in: a ds-comm element and a candle dtype.
pub trait Dtype: Element + WithDType {}
impl<T: Element + WithDType> Dtype for T {}

/// A layer's parameters as candle variables, in its declaration order.
pub struct LayerParams {
    pub vars: Vec<Var>,
    names: Vec<String>,
}

impl LayerParams {
    /// Cuts `values` (the layer's flat range, `flat` its first element) into its parameters.
    pub fn new<T: Dtype>(
        index: &FlatIndex,
        ids: Range<usize>,
        flat: usize,
        values: &[T],
        dev: &Device,
    ) -> Result<LayerParams> {
        let mut vars = Vec::with_capacity(ids.len());
        let mut names = Vec::with_capacity(ids.len());
        for e in &index.entries()[ids] {
            let vals = &values[e.offset - flat..e.offset - flat + e.numel()];
            vars.push(Var::from_slice(vals, e.shape.as_slice(), dev)?);
            names.push(e.name.clone());
        }
        Ok(LayerParams { vars, names })
    }

    /// Bytes of the materialised parameters.
    pub fn bytes(&self) -> usize {
        self.vars
            .iter()
            .map(|v| crate::model::tensor_bytes(v.as_tensor()))
            .sum()
    }

    /// A `VarBuilder` over these parameters, under the layer's prefix: the variables
    /// themselves for autograd, or untracked views of them (`tracked` false).
    pub fn var_builder(
        &self,
        prefix: &str,
        dtype: DType,
        dev: &Device,
        tracked: bool,
    ) -> VarBuilder<'static> {
        let map: HashMap<String, Tensor> = self
            .names
            .iter()
            .zip(&self.vars)
            .map(|(n, v)| match tracked {
                true => (n.clone(), v.as_tensor().clone()),
                false => (n.clone(), v.as_tensor().detach()),
            })
            .collect();
        let vb = VarBuilder::from_tensors(map, dtype, dev);
        match prefix {
            "" => vb,
            p => vb.pp(p),
        }
    }

    /// The gradients of these parameters, concatenated in flat order (zeros where a
    /// parameter got none, e.g. unused in this batch).
    pub fn flat_grads<T: Dtype>(&self, grads: &GradStore) -> Result<Vec<T>> {
        let grads: Vec<Option<&Tensor>> = self.vars.iter().map(|v| grads.get(v)).collect();
        self.concat(&grads)
    }

    /// A taped layer's gradients (one per parameter, in order), concatenated in flat order.
    pub fn flat_taped_grads<T: Dtype>(&self, layer: &str, grads: &[Tensor]) -> Result<Vec<T>> {
        if grads.len() != self.vars.len() {
            return Err(EngineError::Invalid(format!(
                "layer {layer}'s backward returned {} gradients for {} parameters",
                grads.len(),
                self.vars.len()
            )));
        }
        for ((g, v), name) in grads.iter().zip(&self.vars).zip(&self.names) {
            if g.dims() != v.dims() {
                return Err(EngineError::Invalid(format!(
                    "the gradient of {name} has shape {:?}, the parameter {:?}",
                    g.dims(),
                    v.dims()
                )));
            }
        }
        self.concat(&grads.iter().map(Some).collect::<Vec<_>>())
    }

    fn concat<T: Dtype>(&self, grads: &[Option<&Tensor>]) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(self.vars.iter().map(|v| v.elem_count()).sum());
        for (g, v) in grads.iter().zip(&self.vars) {
            match g {
                Some(g) => extend_with(&mut out, g)?,
                None => out.resize(out.len() + v.elem_count(), T::default()),
            }
        }
        Ok(out)
    }
}

/// Appends `g`'s elements as `T`: copied once, straight from a CPU tensor's storage.
fn extend_with<T: Dtype>(out: &mut Vec<T>, g: &Tensor) -> Result<()> {
    let g = g.to_dtype(<T as WithDType>::DTYPE)?;
    {
        let (storage, layout) = g.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            out.extend_from_slice(&cpu.as_slice::<T>()?[a..b]);
            return Ok(());
        }
    }
    out.extend(g.flatten_all()?.to_vec1::<T>()?);
    Ok(())
}

/// Runs a layer forward. `input` is a `Var` for every layer but the first.
pub fn forward(
    layer: &NamedLayer,
    params: &LayerParams,
    input: &Tensor,
    cx: &Context,
    dtype: DType,
) -> Result<Tensor> {
    let vb = params.var_builder(&layer.prefix, dtype, input.device(), true);
    Ok(layer.layer.forward(&vb, input, cx)?)
}

/// Runs a layer's taped forward on untracked tensors; `None` if it has none (Note [taped
/// layers] in model/mod.rs).
pub fn forward_taped(
    layer: &NamedLayer,
    params: &LayerParams,
    input: &Tensor,
    cx: &Context,
    dtype: DType,
) -> Result<Option<Taped>> {
    let vb = params.var_builder(&layer.prefix, dtype, input.device(), false);
    Ok(layer.layer.forward_taped(&vb, &input.detach(), cx)?)
}

/// The backward of one layer from its output `y`: `dy` is the upstream gradient, or `None`
/// for the loss layer, which is seeded with `loss_seed` (loss scale / accumulation steps).
pub fn backward(y: &Tensor, dy: Option<&Tensor>, loss_seed: f64) -> Result<GradStore> {
    let seed = match dy {
        Some(dy) => (y * dy)?.sum_all()?,
        None => y.affine(loss_seed, 0.0)?,
    };
    Ok(seed.backward()?)
}

/// A fresh leaf `Var` holding `x`'s values: the next layer's input.
pub fn leaf(x: &Tensor) -> Result<Var> {
    Ok(Var::from_tensor(&x.detach())?)
}
