//! candle-nn modules as layers: the user's code builds its modules from a `VarBuilder` as it
//! would anywhere else, and the engine finds the parameters by watching that build.
//!
//! Note [discovering parameters]: `Model::module` runs the user's constructor once against a
//! recording `VarBuilder` backend, which notes each parameter's name, shape and initialiser
//! (candle-nn's `Init` hints, so `candle_nn::linear` gets PyTorch's Kaiming weights) and hands
//! back a zero-stride view of a single zero: the whole model is never allocated, so a ZeRO-3
//! rank can describe a model larger than its memory. At every forward the engine builds the
//! module again, from a `VarBuilder` over the values it materialised for that module (gathered
//! under ZeRO-3, sliced under tensor parallelism); building a candle-nn module only clones
//! tensor handles. Each module is one gather unit: the engine gathers, recomputes and frees
//! parameters module by module, as FSDP does for its wrapped units.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::{Context, Init, Layer, Model, ParamSpec};
use crate::{NnError, Result};

type Build<M> = dyn Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync;
type Run<M> = dyn Fn(&M, &Tensor, &Context) -> candle_core::Result<Tensor> + Send + Sync;
type Function = dyn Fn(&Tensor, &Context) -> candle_core::Result<Tensor> + Send + Sync;

/// A layer made of a candle-nn module: built from the layer's `VarBuilder` at each forward,
/// then run on the layer's input.
struct ModuleLayer<M> {
    build: Box<Build<M>>,
    run: Box<Run<M>>,
    params: Vec<ParamSpec>,
}

impl<M: 'static> Layer for ModuleLayer<M> {
    fn params(&self) -> Vec<ParamSpec> {
        self.params.clone()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> candle_core::Result<Tensor> {
        let module = (self.build)(vb.clone())?;
        (self.run)(&module, x, cx)
    }
}

/// A parameterless step between modules (a reshape, an activation, a loss).
struct FunctionLayer(Box<Function>);

impl Layer for FunctionLayer {
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    fn forward(&self, _: &VarBuilder, x: &Tensor, cx: &Context) -> candle_core::Result<Tensor> {
        (self.0)(x, cx)
    }
}

impl Model {
    /// Appends the candle-nn module `build` makes, with its parameters under `prefix`, as one
    /// gather unit; its `forward` takes the previous module's output. A plain constructor
    /// (`|vb| candle_nn::linear(64, 10, vb)`, `|vb| Block::new(&cfg, vb)`) is enough.
    pub fn module<M, B>(self, prefix: &str, build: B) -> Result<Model>
    where
        M: candle_core::Module + 'static,
        B: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
    {
        self.module_with(prefix, build, |m: &M, x, _| m.forward(x))
    }

    /// As `module`, for a module whose forward also reads the micro-batch's other tensors
    /// (`cx.input("attention_mask")`): `run(module, x, cx)` computes its output.
    pub fn module_with<M, B, F>(self, prefix: &str, build: B, run: F) -> Result<Model>
    where
        M: 'static,
        B: Fn(VarBuilder) -> candle_core::Result<M> + Send + Sync + 'static,
        F: Fn(&M, &Tensor, &Context) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        let params = discover(prefix, &build)?;
        if params.is_empty() {
            return Err(NnError::Invalid(format!(
                "module {prefix:?} reads no parameter from its VarBuilder, so it is no gather unit; add a parameterless step with Model::function"
            )));
        }
        let full = |p: &ParamSpec| match prefix {
            "" => p.name.clone(),
            _ => format!("{prefix}.{}", p.name),
        };
        let existing = self.params();
        if let Some(p) = params
            .iter()
            .find(|p| existing.iter().any(|e| e.name == full(p)))
        {
            return Err(NnError::Invalid(format!(
                "parameter {} is built twice, by an earlier module and by module {prefix:?}: a parameter belongs to one module",
                full(p)
            )));
        }
        let layer = ModuleLayer {
            build: Box::new(build),
            run: Box::new(run),
            params,
        };
        Ok(self.layer(prefix, layer))
    }

    /// Appends a step without parameters: `f(x, cx)` is its output.
    pub fn function<F>(self, f: F) -> Model
    where
        F: Fn(&Tensor, &Context) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        self.layer("", FunctionLayer(Box::new(f)))
    }
}

/// The parameters `build` reads, in the order it reads them (Note [discovering parameters]).
fn discover<M>(prefix: &str, build: &Build<M>) -> Result<Vec<ParamSpec>> {
    let seen = Arc::new(Mutex::new(Recorded::default()));
    let vb = VarBuilder::from_backend(Box::new(Recorder(seen.clone())), DType::F32, Device::Cpu);
    let built = build(vb);
    let recorded = std::mem::take(&mut *seen.lock().expect("invariant: not poisoned"));
    let at = |name: &str| match prefix {
        "" => name.to_string(),
        _ => format!("{prefix}.{name}"),
    };
    if let Some(name) = recorded.twice {
        return Err(NnError::Invalid(format!(
            "parameter {} is built twice in module {prefix:?} (its VarBuilder was asked for it twice): a parameter belongs to one module",
            at(&name)
        )));
    }
    if let Some(name) = recorded.unshaped {
        return Err(NnError::Invalid(format!(
            "module {prefix:?} reads {} without a shape (VarBuilder::get_unchecked): ds-rs creates each parameter, so it needs its shape",
            at(&name)
        )));
    }
    built.map_err(|e| NnError::Invalid(format!("building module {prefix:?}: {e}")))?;
    Ok(recorded.params)
}

#[derive(Default)]
struct Recorded {
    params: Vec<ParamSpec>,
    /// A name read twice.
    twice: Option<String>,
    /// A name read without its shape.
    unshaped: Option<String>,
}

/// The recording backend of Note [discovering parameters].
struct Recorder(Arc<Mutex<Recorded>>);

impl SimpleBackend for Recorder {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut seen = self.0.lock().expect("invariant: not poisoned");
        if seen.params.iter().any(|p| p.name == name) {
            seen.twice.get_or_insert_with(|| name.to_string());
        }
        let spec = ParamSpec::new(name, shape.dims(), init_of(init, &shape));
        seen.params.push(spec);
        Tensor::zeros((), dtype, dev)?.broadcast_as(shape)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        let mut seen = self.0.lock().expect("invariant: not poisoned");
        seen.unshaped.get_or_insert_with(|| name.to_string());
        Err(candle_core::Error::Msg(format!("{name}: no shape")))
    }

    fn contains_tensor(&self, _: &str) -> bool {
        // optional parameters are absent, as from an empty checkpoint: the module is built
        // with the parameters it creates itself
        false
    }
}

/// candle-nn's initialiser as the engine's (Kaiming's deviation from the parameter's fans,
/// as candle-nn's `Init::var` computes it).
fn init_of(init: candle_nn::Init, shape: &Shape) -> Init {
    match init {
        candle_nn::Init::Const(0.0) => Init::Zeros,
        candle_nn::Init::Const(1.0) => Init::Ones,
        candle_nn::Init::Const(v) => Init::Const(v),
        candle_nn::Init::Randn { mean, stdev } => Init::Normal { mean, std: stdev },
        candle_nn::Init::Uniform { lo, up } => Init::Uniform { lo, hi: up },
        candle_nn::Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => Init::normal(std),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    Init::Uniform {
                        lo: -bound,
                        hi: bound,
                    }
                }
            }
        }
    }
}
