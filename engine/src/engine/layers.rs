//! One layer's forward and backward on parameters the engine materialised for it.
//!
//! Note [layer-wise backward]: each layer's input is a fresh `Var`, so the layer's autograd
//! graph ends there. Given the gradient `dy` of its output, `(y * dy).sum_all().backward()`
//! yields the layer's parameter gradients and the gradient of its input, which seeds the
//! layer below (candle's `backward()` has no hooks and seeds with ones, hence the product).
//! The loss layer is seeded with its scalar output times the loss scale.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::OnceLock;

use candle_core::{backprop::GradStore, DType, Device, Shape, Storage, Tensor, Var, WithDType};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use ds_partition::{FlatIndex, Values};

use crate::model::{Context, NamedLayer, Taped};
use crate::{EngineError, Result};

pub use ds_nn::Dtype;

/// A layer's parameters as candle tensors, in its declaration order: views of one flat
/// tensor of the layer's range.
///
/// Note [one copy per layer]: a gathered range (ZeRO-3) becomes the flat tensor as it is,
/// with no copy; a borrowed one (stages 0-2) is copied once. Autograd needs variables of its
/// own, so a layer without a tape gets them made from the views (a copy) on first use.
///
/// The tensors are the dense parameters, then this rank's experts (expert parallelism), then
/// the frozen ones (Model::freeze): the first `trainable` train, the rest the layer reads as
/// plain tensors, so autograd computes no gradient for them.
pub struct LayerParams {
    tensors: Vec<Tensor>,
    names: Vec<String>,
    /// Each parameter's whole shape, which a module may ask for in place of its slice.
    logical: Vec<Vec<usize>>,
    trainable: usize,
    /// In the layer's declaration order (`Layer::params`): which store each parameter is in.
    declared: Vec<Kind>,
    vars: OnceLock<Vec<Var>>,
}

/// Which store holds a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dense,
    /// One of this expert-parallel rank's experts (`ParamSpec::expert`).
    Expert,
    Frozen,
}

impl LayerParams {
    /// Cuts `values` (the layer's flat range, `flat` its first element) into its parameters.
    pub fn new<T: Dtype>(
        index: &FlatIndex,
        ids: Range<usize>,
        flat: usize,
        values: Values<'_, T>,
        dev: &Device,
    ) -> Result<LayerParams> {
        let len = values.len();
        let whole = match values {
            Values::Gathered(v) if v.on_host() => Tensor::from_vec(v.into_vec(), len, dev)?,
            values => match crate::device::tensor_from_buffer(&values, dev)? {
                Some(on_device) => on_device,
                None => Tensor::from_slice(&values, len, dev)?,
            },
        };
        let mut tensors = Vec::with_capacity(ids.len());
        let mut names = Vec::with_capacity(ids.len());
        let mut logical = Vec::with_capacity(ids.len());
        for e in &index.entries()[ids] {
            let view = whole.narrow(0, e.offset - flat, e.numel())?;
            tensors.push(view.reshape(e.shape.as_slice())?);
            names.push(e.name.clone());
            logical.push(e.logical_shape.clone());
        }
        Ok(LayerParams {
            trainable: tensors.len(),
            declared: vec![Kind::Dense; tensors.len()],
            tensors,
            names,
            logical,
            vars: OnceLock::new(),
        })
    }

    /// These (dense) parameters, then the layer's `experts` and `frozen` ones, when it has
    /// them; `declared` says which store each of the layer's parameters, in declaration
    /// order, is in.
    pub fn with_others(
        mut self,
        experts: Option<LayerParams>,
        frozen: Option<LayerParams>,
        declared: &[Kind],
    ) -> LayerParams {
        for (part, trains) in [(experts, true), (frozen, false)] {
            if let Some(p) = part {
                self.tensors.extend(p.tensors);
                self.names.extend(p.names);
                self.logical.extend(p.logical);
            }
            if trains {
                self.trainable = self.tensors.len();
            }
        }
        self.declared = declared.to_vec();
        self
    }

    /// How many of the trainable tensors are dense (the experts follow).
    pub fn dense(&self) -> usize {
        self.declared.iter().filter(|k| **k == Kind::Dense).count()
    }

    /// Bytes of the materialised parameters (and of autograd's copies, when made).
    pub fn bytes(&self) -> usize {
        let vars = self.vars.get().map_or(0, |v| {
            v.iter()
                .map(|v| crate::model::tensor_bytes(v.as_tensor()))
                .sum()
        });
        vars + self
            .tensors
            .iter()
            .map(crate::model::tensor_bytes)
            .sum::<usize>()
    }

    /// The variables autograd differentiates (the trainable parameters), made on first use.
    fn vars(&self) -> Result<&[Var]> {
        if self.vars.get().is_none() {
            let vars = self.tensors[..self.trainable]
                .iter()
                .map(|t| Ok(Var::from_tensor(t)?))
                .collect::<Result<Vec<_>>>()?;
            let _ = self.vars.set(vars);
        }
        Ok(self.vars.get().expect("invariant: set above"))
    }

    /// A `VarBuilder` over these parameters, under the layer's prefix: variables for
    /// autograd (`tracked`), or the untracked tensors themselves.
    pub fn var_builder(
        &self,
        prefix: &str,
        dtype: DType,
        dev: &Device,
        tracked: bool,
    ) -> Result<VarBuilder<'static>> {
        let tensors: Vec<Tensor> = match tracked {
            true => {
                let vars = self.vars()?.iter().map(|v| v.as_tensor().clone());
                vars.chain(self.tensors[self.trainable..].iter().cloned())
                    .collect()
            }
            false => self.tensors.clone(),
        };
        let held = tensors.into_iter().zip(self.logical.iter().cloned());
        let map: HashMap<String, (Tensor, Vec<usize>)> =
            self.names.iter().cloned().zip(held).collect();
        let vb = VarBuilder::from_backend(Box::new(Materialised(map)), dtype, dev.clone());
        Ok(match prefix {
            "" => vb,
            p => vb.pp(p),
        })
    }

    /// The gradients of these parameters from autograd (zeros where a parameter got none,
    /// e.g. unused in this batch).
    pub fn graph_grads<T: Dtype>(&self, grads: &GradStore) -> Result<LayerGrads<T>> {
        let tensors = self.vars()?.iter().map(|v| match grads.get(v) {
            Some(g) => Ok(g.clone()),
            None => Ok(v.zeros_like()?),
        });
        LayerGrads::new(tensors.collect::<Result<Vec<_>>>()?)
    }

    /// A taped layer's gradients (one per parameter, in declaration order), checked against
    /// the parameters' shapes, in the order of the tensors: the dense ones, then the
    /// experts'; those of frozen parameters are dropped.
    pub fn taped_grads<T: Dtype>(&self, layer: &str, grads: Vec<Tensor>) -> Result<LayerGrads<T>> {
        if grads.len() != self.declared.len() {
            return Err(EngineError::Model(format!(
                "layer {layer}'s backward returned {} gradients for {} parameters",
                grads.len(),
                self.declared.len()
            )));
        }
        let (mut dense, mut experts) = (Vec::new(), Vec::new());
        for (g, kind) in grads.into_iter().zip(&self.declared) {
            match kind {
                Kind::Dense => dense.push(g),
                Kind::Expert => experts.push(g),
                Kind::Frozen => {}
            }
        }
        let grads: Vec<Tensor> = dense.into_iter().chain(experts).collect();
        for ((g, v), name) in grads.iter().zip(&self.tensors).zip(&self.names) {
            if g.dims() != v.dims() {
                return Err(EngineError::Model(format!(
                    "the gradient of {name} has shape {:?}, the parameter {:?}",
                    g.dims(),
                    v.dims()
                )));
            }
        }
        LayerGrads::new(grads)
    }
}

/// A layer's materialised parameters by full name, with their whole shapes.
///
/// Note [slices under whole shapes]: a module written for one process asks its `VarBuilder`
/// for the whole shape (`candle_nn::linear(d, 4 * d, vb)`); under tensor parallelism the
/// engine holds only this rank's slice of a split parameter, and hands it over for either
/// shape, as DeepSpeed's AutoTP swaps a layer's weight for its slice. The module then
/// computes on the slice; its code marks the tensor-parallel regions (`parallel::Tp`).
struct Materialised(HashMap<String, (Tensor, Vec<usize>)>);

impl SimpleBackend for Materialised {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let (t, logical) = self.0.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "the engine holds no parameter {name} for this layer (the layer asked for a parameter it did not declare)"
            ))
        })?;
        if t.dims() != shape.dims() && logical != shape.dims() {
            return Err(candle_core::Error::Msg(format!(
                "{name} has shape {logical:?}, the layer asked for {:?}",
                shape.dims()
            )));
        }
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let (t, _) = self.0.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "the engine holds no parameter {name} for this layer"
            ))
        })?;
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// A layer's parameter gradients in the compute dtype, handed to the gradient store in
/// place: each parameter's elements straight from the tensor's storage, no flat copy.
pub struct LayerGrads<T> {
    tensors: Vec<Tensor>,
    dtype: std::marker::PhantomData<T>,
}

impl<T: Dtype> LayerGrads<T> {
    fn new(tensors: Vec<Tensor>) -> Result<LayerGrads<T>> {
        let tensors = tensors
            .into_iter()
            .map(|t| Ok(t.to_dtype(<T as WithDType>::DTYPE)?.contiguous()?))
            .collect::<Result<Vec<_>>>()?;
        Ok(LayerGrads {
            tensors,
            dtype: std::marker::PhantomData,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The gradients from the `at`-th on (the experts'), left out of these.
    pub fn split_off(&mut self, at: usize) -> LayerGrads<T> {
        LayerGrads {
            tensors: self.tensors.split_off(at),
            dtype: std::marker::PhantomData,
        }
    }

    /// The gradients times `k`.
    pub fn scale(&mut self, k: f64) -> Result<()> {
        for t in &mut self.tensors {
            *t = t.affine(k, 0.0)?;
        }
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(crate::model::tensor_bytes).sum()
    }

    /// Calls `f` with the gradients as consecutive slices in flat order: borrowed from CPU
    /// storage; from a GPU's, copied into a GPU buffer when `to_gpu` (the gradient store is
    /// on the GPU) and handed as one slice, which the store adds with one kernel where a slice
    /// a tensor took a launch and a wait each; else copied out to host memory.
    pub fn with_parts<R>(&self, to_gpu: bool, f: impl FnOnce(&[&[T]]) -> Result<R>) -> Result<R> {
        let guards: Vec<_> = self
            .tensors
            .iter()
            .map(|t| t.storage_and_layout())
            .collect();
        let mut parts: Vec<&[T]> = Vec::with_capacity(guards.len());
        for (storage, layout) in &guards {
            match (&**storage, layout.contiguous_offsets()) {
                (Storage::Cpu(cpu), Some((a, b))) => parts.push(&cpu.as_slice::<T>()?[a..b]),
                _ => break,
            }
        }
        if parts.len() == guards.len() {
            return f(&parts);
        }
        drop(parts);
        drop(guards);
        // `f` moves into the staging closure only if it is called
        let mut f = Some(f);
        if to_gpu {
            let staged =
                crate::device::with_staged_grads::<T, R, EngineError>(&self.tensors, |all| {
                    (f.take().expect("called once"))(&[all])
                })?;
            if let Some(r) = staged {
                return Ok(r);
            }
        }
        let f = f.expect("not taken: nothing was staged");
        let owned = self
            .tensors
            .iter()
            .map(|t| Ok(t.flatten_all()?.to_vec1::<T>()?))
            .collect::<Result<Vec<_>>>()?;
        f(&owned.iter().map(Vec::as_slice).collect::<Vec<_>>())
    }
}

/// Runs a layer forward. `input` is a `Var` for every layer but the first.
pub fn forward(
    layer: &NamedLayer,
    params: &LayerParams,
    input: &Tensor,
    cx: &Context,
    dtype: DType,
) -> Result<Tensor> {
    let vb = params.var_builder(&layer.prefix, dtype, input.device(), true)?;
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
    let vb = params.var_builder(&layer.prefix, dtype, input.device(), false)?;
    Ok(layer.layer.forward_taped(&vb, &input.detach(), cx)?)
}

/// The backward of one layer from its output `y`: `dy` is the upstream gradient, or `None`
/// for the loss layer, which is seeded with `loss_seed` (loss scale / accumulation steps).
/// The losses the layer added (`added`) are part of the model's: seeded with `loss_seed` too.
pub fn backward(
    y: &Tensor,
    dy: Option<&Tensor>,
    loss_seed: f64,
    added: Option<&Tensor>,
) -> Result<GradStore> {
    let mut seed = match dy {
        Some(dy) => (y * dy)?.sum_all()?,
        None => y.affine(loss_seed, 0.0)?,
    };
    if let Some(added) = added {
        let added = added.affine(loss_seed, 0.0)?.to_dtype(seed.dtype())?;
        seed = (seed + added)?;
    }
    Ok(seed.backward()?)
}

/// The losses a layer added, summed into one scalar (in f32); None when it added none.
pub fn sum_losses(losses: Vec<Tensor>) -> Result<Option<Tensor>> {
    let mut sum: Option<Tensor> = None;
    for l in losses {
        let l = l.to_dtype(candle_core::DType::F32)?.sum_all()?;
        sum = Some(match sum {
            None => l,
            Some(s) => (s + l)?,
        });
    }
    Ok(sum)
}

/// A fresh leaf `Var` holding `x`'s values: the next layer's input.
pub fn leaf(x: &Tensor) -> Result<Var> {
    Ok(Var::from_tensor(&x.detach())?)
}
