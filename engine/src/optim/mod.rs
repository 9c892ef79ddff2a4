//! `optim`: the optimizers that update one rank's shard of the flat fp32 master buffer.
//!
//! ZeRO gives each rank a contiguous range of the flat fp32 master parameters; the engine hands
//! that range, its (averaged, unscaled, clipped) gradient and the scheduler's learning rate to an
//! [`Optimizer`], which owns the moment buffers for exactly that range. This module owns the
//! update rules (Adam/AdamW as DeepSpeed's CPU Adam computes them, torch's SGD), their state
//! for checkpoints, and the `ds-rs bench adam` micro-benchmark. It knows nothing of ranks,
//! partitioning or schedules: the learning rate and (for OneCycle) the momentum come from outside.
//!
//! Each update is one fused pass over the shard, cut into `BLOCK`-element blocks that rayon
//! spreads over its threads; inside a block the loop runs over fixed `LANES`-wide chunks so that
//! LLVM vectorises it without bounds checks.

mod adam;
mod bench;
#[cfg(feature = "cuda")]
mod gpu;
mod sgd;
mod sgd_params;
#[cfg(test)]
mod tests;

use ds_comm::Element;
use ds_config::optim::{OptimizerParams, TypedSection};
use ds_config::ConfigError;
use ds_partition::Placement;
use rayon::prelude::*;

pub use adam::{Adam, AdamParams};
pub use bench::{bench_adam, bench_convert, BenchResult, ConvertResult};
pub use sgd::Sgd;
pub use sgd_params::SgdParams;

/// Elements per rayon task: 64K f32 = 256 KiB per buffer, large enough that scheduling costs
/// nothing next to the memory traffic, small enough to balance two to a few dozen threads.
const BLOCK: usize = 1 << 16;

/// Elements per inner chunk: a fixed width the vectoriser unrolls into 4/8/16-wide SIMD
/// (SSE2 in a default build, plus a run-time-selected AVX2 copy of the Adam kernel; whatever
/// the CPU has with `-C target-cpu=native`).
const LANES: usize = 16;

/// The optimizer's input from reduced gradients in the compute dtype: each times `k` (the
/// loss scale's inverse and the clip coefficient), in f32. On rayon's threads in `BLOCK`s, as
/// the update itself: a conversion and a product an element leave one thread bound by its
/// core, not by memory, on a many-core host (the offloaded step's whole shard passes here).
pub fn scaled_f32<T: Element>(dst: &mut [f32], src: &[T], k: f32) {
    assert_eq!(dst.len(), src.len(), "scaled_f32: lengths differ");
    dst.par_chunks_mut(BLOCK)
        .zip(src.par_chunks(BLOCK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, g)| *d = g.to_f32() * k));
}

/// An optimizer acting on one flat fp32 shard, whose length is fixed at construction.
pub trait Optimizer: Send {
    /// One update of `params` (the fp32 master shard) from `grads` (same length, fp32, already
    /// averaged, unscaled and clipped) at learning rate `lr`.
    ///
    /// # Panics
    /// If `params` or `grads` is not [`Optimizer::shard_len`] long: a bug in the caller, never
    /// a consequence of user input.
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f64) {
        assert_eq!(
            params.len(),
            self.shard_len(),
            "step: params length != shard length"
        );
        self.begin(lr);
        self.update(0, params, grads, Group::DEFAULT);
    }

    /// The parameter groups the shard's parts belong to (`Group(i)` is `groups[i]`); until
    /// set, one group with the optimizer's own settings.
    fn set_groups(&mut self, groups: Vec<GroupHyper>);

    /// Starts a step at learning rate `lr` (counts it); [`Optimizer::update`] then applies it
    /// to consecutive parts of the shard, so that the caller never needs the whole shard's
    /// gradients in fp32 at once. The result is the same however the shard is cut.
    fn begin(&mut self, lr: f64);

    /// Applies the step begun last to the shard's elements `at..at + params.len()`, with the
    /// settings of the part's parameter group.
    ///
    /// # Panics
    /// If the part is outside the shard, `grads` is not as long as `params`, or no step was
    /// begun: bugs in the caller.
    fn update(&mut self, at: usize, params: &mut [f32], grads: &[f32], group: Group);

    /// The step begun last over the shard's elements `at..at + params.len()` on the GPU, when
    /// `params` (of the master shard), `grads` (in the compute dtype, to be multiplied by `k`
    /// first, as the caller does before [`Optimizer::update`]) and this optimizer's state all
    /// lie in one GPU's buffers: Ok(true) once done there; Ok(false) where the caller must run
    /// the host path.
    fn update_on_gpu(
        &mut self,
        at: usize,
        params: &mut [f32],
        grads: TypedGrads<'_>,
        k: f32,
        group: Group,
    ) -> Result<bool, OptimError> {
        let _ = (at, params, grads, k, group);
        Ok(false)
    }

    /// The shard length the state was allocated for.
    fn shard_len(&self) -> usize;

    /// Bytes of optimizer state held (moment buffers), for the engine's memory report.
    fn state_bytes(&self) -> usize;

    /// The named state buffers (torch's names: `exp_avg`, `exp_avg_sq`, `momentum_buffer`)
    /// and the number of steps taken, for checkpoints.
    fn state(&self) -> OptimizerState<'_>;

    /// The names of the state buffers [`Optimizer::state`] gives once stepping, known before
    /// the first step: the files an offloaded optimizer keeps (empty: no state).
    fn state_names(&self) -> Vec<&'static str>;

    /// The state buffers in [`Optimizer::state_names`] order, for an optimizer that holds one
    /// chunk of an offloaded shard: the chunk's values are copied in before
    /// `update(0, ..)` and out after it. Valid after [`Optimizer::begin`].
    fn state_mut(&mut self) -> Vec<&mut [f32]>;

    /// Restores what [`Optimizer::state`] gave; an error names the offending buffer.
    fn load_state(&mut self, state: &OptimizerState<'_>) -> Result<(), OptimError>;

    /// Sets Adam's beta1 / SGD's momentum, for schedules that cycle momentum (OneCycle).
    fn set_momentum(&mut self, momentum: f64);
}

/// A parameter group's settings, as an entry of torch's `param_groups` overrides the
/// optimizer's: its weight decay (None: the optimizer's) and its learning rate as a multiple
/// of the scheduled one (HF's and Megatron's groups leave biases and norm weights without
/// decay; a group may also train slower or faster).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupHyper {
    pub weight_decay: Option<f64>,
    pub lr_scale: f64,
}

impl GroupHyper {
    /// The optimizer's own settings.
    pub const DEFAULT: GroupHyper = GroupHyper {
        weight_decay: None,
        lr_scale: 1.0,
    };
    /// No weight decay, the scheduled learning rate.
    pub const NO_DECAY: GroupHyper = GroupHyper {
        weight_decay: Some(0.0),
        lr_scale: 1.0,
    };
}

/// The parameter group of a part of the shard: an index into the optimizer's groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group(pub usize);

impl Group {
    /// The first group: the optimizer's own settings unless told otherwise.
    pub const DEFAULT: Group = Group(0);
}

/// A view of an optimizer's state: steps taken and named fp32 buffers of the shard's length.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState<'a> {
    pub step: u64,
    pub buffers: Vec<(&'a str, &'a [f32])>,
}

/// A shard's gradients in the compute dtype, as [`Optimizer::update_on_gpu`] takes them.
#[derive(Debug, Clone, Copy)]
pub struct TypedGrads<'a> {
    pub bytes: &'a [u8],
    pub dtype: ds_comm::DType,
}

impl<'a> TypedGrads<'a> {
    pub fn of<T: ds_comm::Element>(grads: &'a [T]) -> TypedGrads<'a> {
        TypedGrads {
            bytes: bytemuck::cast_slice(grads),
            dtype: T::DTYPE,
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// What can go wrong building an optimizer or loading its state.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    #[error(transparent)]
    Config(#[from] ConfigError),

    #[error("optimizer state '{name}': {found} values, expected {expected} (the shard length)")]
    StateLength {
        name: String,
        expected: usize,
        found: usize,
    },

    #[error("optimizer state on the device: {0}")]
    Device(String),

    #[error("optimizer state '{name}': missing from the checkpoint")]
    MissingState { name: &'static str },

    #[error("optimizer state '{name}': not a buffer of {optimizer}")]
    UnknownState {
        name: String,
        optimizer: &'static str,
    },
}

/// The optimizer for typed config params, with state for `shard_len` elements at `place`
/// (beside the master copy; SGD's momentum is always in host memory).
/// `lr` is not kept: the engine passes the scheduled rate to every [`Optimizer::step`].
pub fn build(
    params: &OptimizerParams,
    shard_len: usize,
    place: &Placement,
) -> Result<Box<dyn Optimizer>, OptimError> {
    match params {
        OptimizerParams::Adam {
            betas,
            eps,
            weight_decay,
            adam_w_mode,
            bias_correction,
            ..
        } => {
            let hp = AdamParams {
                betas: *betas,
                eps: *eps,
                weight_decay: *weight_decay,
                adam_w_mode: *adam_w_mode,
                bias_correction: *bias_correction,
            };
            Ok(Box::new(Adam::placed(hp, shard_len, place)?))
        }
        other => Err(ConfigError::invalid(
            "optimizer.type",
            format!("'{}'", type_name(other)),
            "adam, adamw or SGD (ds-rs has no update rule for it yet)",
        )
        .into()),
    }
}

/// The optimizer of a config's `optimizer` section, including torch's `SGD`, which DeepSpeed
/// takes from `torch.optim` by its exact name.
pub fn build_from_section(
    section: &TypedSection,
    shard_len: usize,
    place: &Placement,
) -> Result<Box<dyn Optimizer>, OptimError> {
    if section.type_name == "SGD" {
        let hp = SgdParams::parse(section.params.as_ref())?;
        return Ok(Box::new(Sgd::new(hp, shard_len)));
    }
    build(&OptimizerParams::parse(section)?, shard_len, place)
}

fn type_name(params: &OptimizerParams) -> &'static str {
    match params {
        OptimizerParams::Adam { .. } => "adam",
        OptimizerParams::Lamb { .. } => "lamb",
        OptimizerParams::Adagrad { .. } => "adagrad",
        OptimizerParams::Lion { .. } => "lion",
    }
}

/// Checks a loaded buffer's length against the shard; the error names the buffer.
fn check_len(name: &str, buf: &[f32], shard_len: usize) -> Result<(), OptimError> {
    if buf.len() == shard_len {
        return Ok(());
    }
    Err(OptimError::StateLength {
        name: name.to_string(),
        expected: shard_len,
        found: buf.len(),
    })
}
