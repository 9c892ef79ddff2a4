//! The ds-rs engine: training only. The job plan (`JobPlan`, `Job`), `Engine` (initialize,
//! forward/backward/step, train_batch) over ZeRO stages 0-3 (ds-partition's stores),
//! optimizers, LR schedules, mixed precision with loss scaling, the pipeline executor,
//! checkpoints and monitors.
//!
//! It owns every parameter: layers (ds-nn's model API) read their weights from a `VarBuilder`
//! the engine fills, and forward and backward run layer by layer, so gathering, recomputation
//! and communication happen between layers, never inside a model's code. It knows a model only
//! through ds-nn (`Model`, `Architecture`), never a family (ds-models) or a data source
//! (ds-data). ds-nn's modules are re-exported under the engine's name, so a program that embeds
//! the engine needs this one crate.

mod error;
mod job;
pub mod monitor;

/// The checkpoint formats (ds-checkpoint), which the engine saves and loads.
pub use ds_checkpoint::{self as checkpoint, crash_point};
/// The model layer (ds-nn), which the engine trains: its modules under the engine's name too,
/// so a program that embeds the engine needs one crate.
pub use ds_nn::{device, kernels, model, nn, parallel};
pub use ds_nn::{Architecture, Batch, CpuOffload, Device, Inputs, Targets, IGNORE};
pub use error::{BoxError, EngineError, Result};
pub use job::Job;
pub use plan::{ConfigSource, JobPlan, LayoutFlags, Overrides};
mod engine;
pub mod loss_scale;
pub mod optim;
pub mod plan;
pub mod schedule;

/// NVMe offload's I/O between two readings (`Timings::swap`).
pub use ds_partition::swap::IoTotals;
pub use engine::{
    check_optimizer, lr_schedule, monitor_events, optimizer_section, pipeline_layout,
    program_optimizer_line, progress_line, steps_per_print, swap_note, wall_clock_line,
    DecayGroups, Dtype, Engine, EngineOptions, MemoryReport, ParamGroup, PipeLayout, Precision,
    Settings, StepOutcome, Timings, STEP_PIECE,
};
