//! The ds-rs engine: the model API, the training loop over ZeRO stages 0-3 (`Engine`),
//! optimizers, LR schedules and mixed precision with loss scaling. The models themselves
//! (the built-in GPT, Hugging Face's families) are ds-models'.
//!
//! It owns every parameter (DESIGN.md invariant 1): layers read their weights from a
//! `VarBuilder` the engine fills, and forward and backward run layer by layer, so gathering,
//! recomputation and communication happen between layers, never inside user code. Where a
//! parameter lives and how gradients are reduced is ds-partition's business; how ranks talk is
//! ds-comm's.
//!
//! Modules import one way: `model` (the API: `Layer`, `ParamSpec`, `Model`) and `kernels`
//! (differentiable ops and CPU fast paths) know nothing of each other or of anything above;
//! `parallel` (tensor parallelism) uses both; the engine uses everything and nothing below it
//! knows the engine.

mod error;
mod job;
pub mod monitor;

/// The model layer (ds-nn), which the engine trains: its modules under the engine's name too,
/// so a program that embeds the engine needs one crate.
pub use ds_nn::{device, kernels, model, nn, parallel};
pub use ds_nn::{Architecture, Batch, CpuOffload, Device, Inputs, Targets, IGNORE};
pub use error::{BoxError, EngineError, Result};
pub use job::Job;
pub use plan::{ConfigSource, JobPlan, LayoutFlags, Overrides};
pub mod checkpoint;
pub mod crash_point;
mod engine;
pub mod loss_scale;
pub mod optim;
pub mod plan;
pub mod schedule;

/// NVMe offload's I/O between two readings (`Timings::swap`).
pub use ds_partition::swap::IoTotals;
pub use engine::{
    check_optimizer, lr_schedule, optimizer_section, pipeline_layout, program_optimizer_line,
    DecayGroups, Dtype, Engine, EngineOptions, MemoryReport, ParamGroup, PipeLayout, Precision,
    Settings, StepOutcome, Timings, STEP_PIECE,
};
