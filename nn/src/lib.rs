//! ds-nn: what a model needs and nothing of training. Tensors and kernels for the CPU and
//! CUDA (`kernels`), the model API (`model`: `Layer`, `ParamSpec`, `Model`, weights files),
//! tensor, sequence and expert parallel layers and mappings (`parallel`), device placement
//! (`device`) and the micro-batch (`Batch`).
//!
//! A model is an ordered list of layers; each declares its parameters and computes from a
//! `VarBuilder` its owner fills, so whoever trains it (ds-engine) can gather, slice, place and
//! recompute layers without hooks into the layer's code. This crate knows nothing of ZeRO,
//! optimizers, schedules or checkpoints, and nothing of a model family (ds-models).
//!
//! Modules import one way: `model` and `kernels` know nothing of each other; `parallel`
//! uses both; `device` is used by `kernels` for the GPU's buffers.

mod architecture;
mod batch;
pub mod device;
mod error;
pub mod kernels;
pub mod model;
/// candle-nn's modules and ops with a backward (RMSNorm, LayerNorm, softmax, rotary
/// embeddings, the cross-entropy), for users' models.
pub use kernels::nn;
pub mod parallel;

pub use architecture::Architecture;
pub use batch::{Batch, Inputs, Targets, IGNORE};
pub use candle_core::Device;
pub use device::CpuOffload;
pub use error::{NnError, Result};

use candle_core::WithDType;
use ds_comm::Element;

/// An element type a model computes in: a ds-comm element and a candle dtype.
pub trait Dtype: Element + WithDType {}
impl<T: Element + WithDType> Dtype for T {}
