//! The model API: a model is an ordered list of layers; a layer declares its parameters
//! (`ParamSpec`) and computes its output from a `VarBuilder` the engine fills with the values
//! it has materialised for that layer at that moment (ARCHITECTURE.md invariant 1). The loss is the
//! last layer. The engine runs forward and backward layer by layer, so it can gather (ZeRO-3),
//! recompute (activation checkpointing), slice (TP: `ParamSpec::split`) and, later, place (PP)
//! each layer without hooks into the layer's code.

mod init;
mod lora;
mod module;
pub mod weights;

use candle_core::Tensor;
use candle_nn::VarBuilder;

pub use ds_partition::Split;
pub use init::{fill_values, init_values};
pub use lora::LoraConfig;

/// How a parameter's initial value is drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    Const(f64),
    Normal { mean: f64, std: f64 },
    Uniform { lo: f64, hi: f64 },
}

impl Init {
    /// Normal with mean 0.
    pub fn normal(std: f64) -> Init {
        Init::Normal { mean: 0.0, std }
    }
}

/// A logical parameter: full name, full shape and initialiser, whatever the layout, and how
/// tensor parallelism splits it (the layer then reads its slice, in the local shape).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    pub split: Split,
    /// A copy of the parameter of this name (DeepSpeed's TiedLayerSpec): the same initial
    /// values, and the two gradients summed before every step, so the two stay equal.
    pub tied: Option<String>,
    /// A norm layer's parameter (LayerNorm, RMSNorm): no weight decay in HF's parameter
    /// groups, which find them by the layer's type.
    pub norm: bool,
    /// Weights files hold this matrix transposed, [in, out] (Hugging Face GPT-2's `Conv1D`):
    /// read (and exported) through the transpose.
    pub stored_transposed: bool,
    /// The parameter does not train (`Model::freeze`): no gradient, no optimizer state, never
    /// communicated as a gradient; stored as the ZeRO stage stores parameters.
    pub frozen: bool,
    /// An adapter added to a model (LoRA's A and B): a weights file of the base model does
    /// not hold it, so it starts from its initialiser when the run starts from one.
    pub adapter: bool,
    /// One of a mixture's experts (under expert parallelism, one this rank holds: `Ep`): at
    /// ep > 1 its gradient is averaged over the whole data-parallel world but reduced, and
    /// ZeRO shards it, over the expert-data-parallel group only (the ranks holding the same
    /// experts); at ep 1 it is stored as any parameter.
    pub expert: bool,
}

impl ParamSpec {
    /// A parameter every tensor-parallel rank holds whole.
    pub fn new(name: &str, shape: &[usize], init: Init) -> ParamSpec {
        ParamSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            init,
            split: Split::Replicated,
            tied: None,
            norm: false,
            stored_transposed: false,
            frozen: false,
            adapter: false,
            expert: false,
        }
    }

    /// One of this expert-parallel rank's experts (see `expert`).
    pub fn expert(mut self) -> ParamSpec {
        self.expert = true;
        self
    }

    /// An adapter added to a model (see `adapter`).
    pub fn adapter(mut self) -> ParamSpec {
        self.adapter = true;
        self
    }

    /// Weights files hold this matrix transposed (see `stored_transposed`).
    pub fn stored_transposed(mut self) -> ParamSpec {
        self.stored_transposed = true;
        self
    }

    /// Its shape in weights files.
    pub fn stored_shape(&self) -> Vec<usize> {
        match self.stored_transposed {
            true => self.shape.iter().rev().copied().collect(),
            false => self.shape.clone(),
        }
    }

    /// This parameter belongs to a norm layer (see `norm`).
    pub fn norm(mut self) -> ParamSpec {
        self.norm = true;
        self
    }

    /// This parameter tied to `owner` (a layer's use of another layer's parameter).
    pub fn tied_to(mut self, owner: &str) -> ParamSpec {
        self.tied = Some(owner.to_string());
        self
    }

    /// The name its initial values are drawn under: the owner's, for a tied copy.
    pub fn value_name(&self) -> &str {
        self.tied.as_deref().unwrap_or(&self.name)
    }

    /// The same parameter split over the tensor-parallel group.
    pub fn split(mut self, split: Split) -> ParamSpec {
        self.split = split;
        self
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a layer sees of the current micro-batch besides its input: the micro-batch's named
/// tensors, and the next-token targets of a model whose last layer is the loss.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    inputs: &'a crate::Inputs,
    targets: Option<&'a crate::Targets>,
    /// Losses the layer adds to the model's (`add_loss`), when the engine takes them.
    added: Option<&'a std::cell::RefCell<Vec<Tensor>>>,
    evaluating: bool,
}

/// The inputs of a context made from targets alone.
static NO_INPUTS: crate::Inputs = crate::Inputs::new();

impl<'a> Context<'a> {
    pub fn new(inputs: &'a crate::Inputs) -> Context<'a> {
        Context {
            inputs,
            targets: inputs.targets(),
            added: None,
            evaluating: false,
        }
    }

    /// This context, in an evaluation's forward when `on` (`evaluating`).
    pub fn in_evaluation(mut self, on: bool) -> Context<'a> {
        self.evaluating = on;
        self
    }

    /// Whether the forward is an evaluation (DeepSpeed's modules in `eval()` mode: an MoE
    /// gate's `eval_capacity_factor`) rather than training.
    pub fn evaluating(&self) -> bool {
        self.evaluating
    }

    /// This context, collecting the losses a layer adds into `added`.
    pub fn adding_into(mut self, added: &'a std::cell::RefCell<Vec<Tensor>>) -> Context<'a> {
        self.added = Some(added);
        self
    }

    /// Adds `loss`, a scalar computed from this layer's parameters or input (an MoE router's
    /// load-balancing loss), to the model's loss: its gradient joins the layer's in backward
    /// at the same scale as the model's loss (Megatron's `MoEAuxLossAutoScaler`), and
    /// `Engine::added_loss` reports its value. candle's autograd differentiates the loss a
    /// plain `forward` adds; a taped forward's tape differentiates its own, seeded by
    /// `Tape::seed_added_loss`.
    pub fn add_loss(&self, loss: Tensor) -> candle_core::Result<()> {
        match self.added {
            Some(added) => {
                added.borrow_mut().push(loss);
                Ok(())
            }
            None => Err(candle_core::Error::Msg(
                "add_loss: this layer runs where no loss can be added (a test context)".into(),
            )),
        }
    }

    /// A context that holds only `targets` (a pipeline's last stage, a test of a loss layer).
    pub fn of_targets(targets: &'a crate::Targets) -> Context<'a> {
        Context {
            inputs: &NO_INPUTS,
            targets: Some(targets),
            added: None,
            evaluating: false,
        }
    }

    /// Target token ids [batch, seq] (u32; `crate::IGNORE` where a target does not count)
    /// and the micro-batch's loss weight, for the loss layer.
    pub fn targets(&self) -> candle_core::Result<&'a crate::Targets> {
        self.targets.ok_or_else(|| {
            candle_core::Error::Msg(
                "a loss layer needs next-token targets: train on a Batch (or Inputs::with_targets)"
                    .into(),
            )
        })
    }

    /// The micro-batch's tensor `name` (an attention mask, labels, positions).
    pub fn input(&self, name: &str) -> candle_core::Result<&'a Tensor> {
        self.inputs.get(name).ok_or_else(|| {
            let have: Vec<&str> = self.inputs.iter().map(|(n, _)| n).collect();
            candle_core::Error::Msg(format!(
                "the batch has no tensor named {name:?} (it has {have:?})"
            ))
        })
    }
}

/// One layer: an ordinary candle computation over parameters the engine provides.
pub trait Layer: Send + Sync {
    /// The parameters this layer reads from its `VarBuilder`, with names relative to it.
    fn params(&self) -> Vec<ParamSpec>;
    /// The layer's output. The first layer gets the input token ids [batch, seq] (u32); the
    /// last returns the scalar loss.
    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> candle_core::Result<Tensor>;
    /// A forward that keeps what the layer's own backward needs (Note [taped layers]). The
    /// engine calls it first, with plain (untracked) tensors; `None` means the layer has no
    /// backward of its own and candle's autograd differentiates `forward`.
    fn forward_taped(
        &self,
        vb: &VarBuilder,
        x: &Tensor,
        cx: &Context,
    ) -> candle_core::Result<Option<Taped>> {
        let _ = (vb, x, cx);
        Ok(None)
    }
    /// Floating-point operations (2 per multiply-add) of one forward over an input of `shape`,
    /// for the flops profiler; None when the layer does not say.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        let _ = shape;
        None
    }
}

/// Note [tapes hold no parameters]: where the parameter store keeps every parameter whole
/// (ZeRO 0-2), holding each layer's materialised copy from forward to backward would add a whole
/// model to the step; the engine drops it after forward and copies the layer's range again for
/// its backward (one memcpy per layer). At ZeRO-3 the layers that keep their graph keep their
/// gathered parameters instead (a second gather costs communication).
///
/// Note [taped layers]: candle's autograd allocates a zero-filled gradient for every tensor a
/// gradient reaches and adds each contribution into it, and it keeps every intermediate of the
/// graph. A layer that knows its own derivative (the built-in GPT's) returns a `Tape` instead:
/// only what its backward reads, and a backward that writes each gradient once.
pub trait Tape: Send {
    /// The gradients, given `dy`, the gradient of the layer's output (for the loss layer, a
    /// scalar: the loss seed), and `vb`, the layer's parameters with the values its forward
    /// read. A tape does not keep the parameters itself: the engine may release them between
    /// forward and backward and materialise them again (Note [tapes hold no parameters]).
    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> candle_core::Result<Grads>;
    /// The seed of the model's loss (the loss scale over the accumulation steps), given
    /// before `backward`: a forward that added a loss (`Context::add_loss`) differentiates it
    /// in its own backward, times this seed.
    fn seed_added_loss(&mut self, seed: f64) {
        let _ = seed;
    }
    /// Bytes of the activations the tape keeps (its tensors other than the layer's
    /// parameters, which the engine counts), for the memory report.
    fn activation_bytes(&self) -> usize;
}

/// Bytes of a tensor's elements.
pub fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// A taped forward's output and what its backward needs.
pub struct Taped {
    pub output: Tensor,
    pub tape: Box<dyn Tape>,
}

/// A layer's gradients: of its input (`None` for token ids) and of each parameter, in the
/// order of `Layer::params`.
pub struct Grads {
    pub input: Option<Tensor>,
    pub params: Vec<Tensor>,
}

/// A layer placed in the model under a name prefix ("" for top-level names).
pub struct NamedLayer {
    pub prefix: String,
    pub layer: Box<dyn Layer>,
    /// Full names matching one of these do not train (`Model::freeze`).
    frozen: Vec<regex::Regex>,
}

impl NamedLayer {
    /// A name for reports: the prefix, else the modules of its parameters ("wte+wpe",
    /// "ln_f+lm_head"), else "loss" for a layer without parameters.
    pub fn display_name(&self) -> String {
        if !self.prefix.is_empty() {
            return self.prefix.clone();
        }
        let mut modules: Vec<String> = Vec::new();
        for p in self.layer.params() {
            let m = p.name.split('.').next().unwrap_or("").to_string();
            if !modules.contains(&m) {
                modules.push(m);
            }
        }
        if modules.is_empty() {
            "loss".into()
        } else {
            modules.join("+")
        }
    }

    /// The layer's parameters with their full names, the frozen ones marked.
    pub fn params(&self) -> Vec<ParamSpec> {
        self.layer
            .params()
            .into_iter()
            .map(|mut p| {
                if !self.prefix.is_empty() {
                    p.name = format!("{}.{}", self.prefix, p.name);
                }
                p.frozen |= self.frozen.iter().any(|f| f.is_match(&p.name));
                p
            })
            .collect()
    }
}

/// An ordered list of layers, the last of which computes the loss.
#[derive(Default)]
pub struct Model {
    layers: Vec<NamedLayer>,
    /// Parameters of the whole model that other ranks hold instead of this one (an
    /// expert-parallel rank's layers declare its own experts only), full names: a weights
    /// file of the whole model holds them too.
    elsewhere: Vec<ParamSpec>,
}

impl Model {
    pub fn new() -> Model {
        Model::default()
    }

    /// Appends a layer whose parameter names start with `prefix` ("" for none).
    pub fn layer(mut self, prefix: &str, layer: impl Layer + 'static) -> Model {
        self.layers.push(NamedLayer {
            prefix: prefix.to_string(),
            layer: Box::new(layer),
            frozen: Vec::new(),
        });
        self
    }

    /// Freezes the parameters whose full names match `pattern` (a regular expression searched
    /// in the name; `"^model\\.embed"`, `".*"`): they keep their initial values, hold no
    /// gradient or optimizer state and are never communicated as gradients. A pattern that
    /// matches no parameter is an error.
    pub fn freeze(mut self, pattern: &str) -> crate::Result<Model> {
        let re = regex::Regex::new(pattern)
            .map_err(|e| crate::NnError::Invalid(format!("freeze pattern {pattern:?}: {e}")))?;
        if !self.params().iter().any(|p| re.is_match(&p.name)) {
            let some: Vec<String> = self.params().into_iter().take(4).map(|p| p.name).collect();
            return Err(crate::NnError::Invalid(format!(
                "freeze pattern {pattern:?} matches no parameter of the model (its names look like {some:?})"
            )));
        }
        for l in &mut self.layers {
            l.frozen.push(re.clone());
        }
        Ok(self)
    }

    pub fn layers(&self) -> &[NamedLayer] {
        &self.layers
    }

    /// Every parameter in layer order.
    pub fn params(&self) -> Vec<ParamSpec> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }

    /// The model with `specs` (full names) declared as held by other ranks (see
    /// `elsewhere`).
    pub fn held_elsewhere(mut self, specs: Vec<ParamSpec>) -> Model {
        self.elsewhere.extend(specs);
        self
    }

    /// Parameters of the whole model other ranks hold instead of this one.
    pub fn elsewhere(&self) -> &[ParamSpec] {
        &self.elsewhere
    }

    /// Only the layers in `ranges` (a pipeline stage's model chunks), in order.
    pub fn into_stage(self, ranges: &[std::ops::Range<usize>]) -> Model {
        Model {
            layers: self
                .layers
                .into_iter()
                .enumerate()
                .filter(|(i, _)| ranges.iter().any(|r| r.contains(i)))
                .map(|(_, l)| l)
                .collect(),
            elsewhere: self.elsewhere,
        }
    }
}
