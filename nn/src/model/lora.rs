//! LoRA (Hu et al., 2021; PEFT's `LoraConfig`): low-rank adapters on chosen linear weights,
//! the rest of the model frozen. A weight `W` [out, in] becomes `W + (alpha / r) B A` with
//! `A` [r, in] (PEFT's Kaiming-uniform start) and `B` [out, r] (zeros, so training starts
//! from the base model), named `<module>.lora_A.weight` and `<module>.lora_B.weight` as PEFT
//! names them.
//!
//! Note [adapters through the VarBuilder]: the adapted layer's code is not touched. The layer
//! reads its parameters from a `VarBuilder`; the LoRA layer hands it one that answers a
//! request for an adapted weight with `W + s B A`, computed from the adapters the engine
//! materialised beside it. Under autograd the gradient reaches `A` and `B` through that sum;
//! a layer with its own backward (a `Tape`) returns the gradient of the weight it read, and
//! the chain rule gives the adapters': `dA = s Bᵀ dW`, `dB = s dW Aᵀ`.

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::{Context, Grads, Init, Layer, Model, ParamSpec, Tape, Taped};
use crate::{NnError, Result};

/// Which linear weights get adapters, and their rank and scale.
#[derive(Debug, Clone)]
pub struct LoraConfig {
    /// The adapters' rank r.
    pub r: usize,
    /// The scale's numerator: the update is `alpha / r` times `B A`.
    pub alpha: f64,
    /// A regular expression searched in each linear module's full name (the weight's name
    /// without `.weight`): `"(q|v)_proj$"` adapts the attention's query and value projections.
    pub target_modules: String,
}

/// One adapted weight, by its name within the layer.
#[derive(Debug, Clone)]
struct Adapter {
    weight: String,
    a: String,
    b: String,
    /// The weight's [out, in] and the rank.
    out: usize,
    inp: usize,
    r: usize,
    scale: f64,
}

impl Adapter {
    fn specs(&self) -> [ParamSpec; 2] {
        let bound = 1.0 / (self.inp as f64).sqrt();
        [
            ParamSpec::new(
                &self.a,
                &[self.r, self.inp],
                Init::Uniform {
                    lo: -bound,
                    hi: bound,
                },
            )
            .adapter(),
            ParamSpec::new(&self.b, &[self.out, self.r], Init::Zeros).adapter(),
        ]
    }
}

impl Model {
    /// Adds LoRA adapters to the linear weights `cfg.target_modules` names and freezes every
    /// other parameter. A target that matches no two-dimensional weight is an error.
    pub fn lora(mut self, cfg: &LoraConfig) -> Result<Model> {
        let re = regex::Regex::new(&cfg.target_modules).map_err(|e| {
            NnError::Invalid(format!("lora target_modules {:?}: {e}", cfg.target_modules))
        })?;
        if cfg.r == 0 {
            return Err(NnError::Invalid("lora r must be at least 1".into()));
        }
        let mut adapted = 0;
        for l in &mut self.layers {
            let adapters: Vec<Adapter> = l
                .params()
                .iter()
                .zip(l.layer.params())
                .filter_map(|(full, local)| {
                    let module = full.name.strip_suffix(".weight")?;
                    let [out, inp] = full.shape[..] else {
                        return None;
                    };
                    let base = local.name.strip_suffix(".weight")?.to_string();
                    re.is_match(module).then(|| Adapter {
                        weight: local.name.clone(),
                        a: format!("{base}.lora_A.weight"),
                        b: format!("{base}.lora_B.weight"),
                        out,
                        inp,
                        r: cfg.r,
                        scale: cfg.alpha / cfg.r as f64,
                    })
                })
                .collect();
            adapted += adapters.len();
            let inner = std::mem::replace(&mut l.layer, Box::new(Nothing));
            l.layer = Box::new(LoraLayer { inner, adapters });
        }
        if adapted == 0 {
            let some: Vec<String> = self.params().into_iter().take(4).map(|p| p.name).collect();
            return Err(NnError::Invalid(format!(
                "lora target_modules {:?} matches no linear weight of the model (its names look like {some:?})",
                cfg.target_modules
            )));
        }
        Ok(self)
    }
}

/// A placeholder while a layer is moved into its LoRA wrapper.
struct Nothing;

impl Layer for Nothing {
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }
    fn forward(&self, _: &VarBuilder, x: &Tensor, _: &Context) -> candle_core::Result<Tensor> {
        Ok(x.clone())
    }
}

/// A layer with its parameters frozen and adapters on some of its weights.
struct LoraLayer {
    inner: Box<dyn Layer>,
    adapters: Vec<Adapter>,
}

impl Layer for LoraLayer {
    fn params(&self) -> Vec<ParamSpec> {
        let frozen = self.inner.params().into_iter().map(|mut p| {
            p.frozen = true;
            p
        });
        frozen
            .chain(self.adapters.iter().flat_map(Adapter::specs))
            .collect()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> candle_core::Result<Tensor> {
        self.inner.forward(&adapted(vb, &self.adapters), x, cx)
    }

    fn forward_taped(
        &self,
        vb: &VarBuilder,
        x: &Tensor,
        cx: &Context,
    ) -> candle_core::Result<Option<Taped>> {
        let Some(taped) = self
            .inner
            .forward_taped(&adapted(vb, &self.adapters), x, cx)?
        else {
            return Ok(None);
        };
        let tape = LoraTape {
            inner: taped.tape,
            adapters: self.adapters.clone(),
            weights: self.inner.params().iter().map(|p| p.name.clone()).collect(),
        };
        Ok(Some(Taped {
            output: taped.output,
            tape: Box::new(tape),
        }))
    }

    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        self.inner.forward_flops(shape)
    }
}

/// `vb` with each adapted weight read as `W + s B A` (Note [adapters through the VarBuilder]).
fn adapted<'a>(vb: &VarBuilder<'a>, adapters: &[Adapter]) -> VarBuilder<'a> {
    let backend = Adapted {
        base: vb.clone(),
        adapters: adapters.to_vec(),
    };
    VarBuilder::from_backend(Box::new(backend), vb.dtype(), vb.device().clone())
}

struct Adapted<'a> {
    base: VarBuilder<'a>,
    adapters: Vec<Adapter>,
}

impl Adapted<'_> {
    /// `s B A` of `adapter`.
    fn delta(&self, adapter: &Adapter) -> candle_core::Result<Tensor> {
        let a = self.base.get((adapter.r, adapter.inp), &adapter.a)?;
        let b = self.base.get((adapter.out, adapter.r), &adapter.b)?;
        b.matmul(&a)?.affine(adapter.scale, 0.0)
    }
}

impl SimpleBackend for Adapted<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let w = self.base.get_with_hints_dtype(shape, name, init, dtype)?;
        let Some(adapter) = self.adapters.iter().find(|a| a.weight == name) else {
            return Ok(w);
        };
        if w.dims() != [adapter.out, adapter.inp] {
            return Err(candle_core::Error::Msg(format!(
                "{name}: LoRA on a weight split by tensor parallelism is not supported yet"
            )));
        }
        w + self.delta(adapter)?.to_dtype(dtype)?
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _: &Device) -> candle_core::Result<Tensor> {
        self.base.get_unchecked_dtype(name, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.base.contains_tensor(name)
    }
}

/// A taped layer's backward, then the adapters' gradients from their weights'.
struct LoraTape {
    inner: Box<dyn Tape>,
    adapters: Vec<Adapter>,
    /// The inner layer's parameter names, in the order of its gradients.
    weights: Vec<String>,
}

impl Tape for LoraTape {
    fn seed_added_loss(&mut self, seed: f64) {
        self.inner.seed_added_loss(seed);
    }

    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> candle_core::Result<Grads> {
        let mut grads = self.inner.backward(dy, &adapted(vb, &self.adapters))?;
        for adapter in &self.adapters {
            let at = self.weights.iter().position(|w| *w == adapter.weight);
            let dw = &grads.params[at.expect("invariant: an adapter's weight is the layer's")];
            let a = vb.get((adapter.r, adapter.inp), &adapter.a)?;
            let b = vb.get((adapter.out, adapter.r), &adapter.b)?;
            let dw = dw.to_dtype(a.dtype())?;
            let da = b.t()?.matmul(&dw)?.affine(adapter.scale, 0.0)?;
            let db = dw.matmul(&a.t()?)?.affine(adapter.scale, 0.0)?;
            grads.params.extend([da, db]);
        }
        Ok(grads)
    }

    fn activation_bytes(&self) -> usize {
        self.inner.activation_bytes()
    }
}
