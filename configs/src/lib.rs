//! ds-config: DeepSpeed's ds_config, read exactly as DeepSpeed 0.19.8 reads it.
//!
//! Two steps, as in ripgrep's low/high args: `load` reads the file into a `Value` tree (hjson,
//! duplicate keys rejected, Python's int/float distinction kept); `resolve` applies DeepSpeed's
//! defaults, fills the batch triad for a parallel layout, checks every section with DeepSpeed's
//! rules and returns an immutable `Config`. HF-style "auto" values are filled by `auto::fill`
//! from the training arguments (`TrainingArgs`, Hugging Face's), before `resolve`.
//!
//! This crate owns the config model and its validation. It never reads the environment, never
//! panics on input, and knows nothing of ranks, devices or tensors.

pub mod auto;
pub mod batch;
mod coerce;
mod dims;
pub mod error;
pub mod expert_parallel;
mod extras;
pub mod hjson;
mod lenient;
pub mod monitor;
pub mod optim;
pub mod precision;
mod removed;
mod resolve;
pub mod runtime;
mod section;
mod summary;
mod toplevel;
pub mod training_args;
mod unimplemented;
pub mod value;
pub mod zero;

use std::path::Path;

pub use auto::FillContext;
pub use batch::PyNum;
pub use error::{ConfigError, NotImplemented, Result};
pub use resolve::{parallel_dims, Config, ParallelDims};
pub use summary::summary_json;
pub use toplevel::expand_legacy_zero;
pub use training_args::{LrSchedulerType, TrainingArgs};
pub use value::Value;
pub use zero::{OffloadDevice, ZeroStage};

/// The largest config file ds-rs reads (a ds_config is a few KB; this bounds memory).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Reads and parses a config file (hjson, as DeepSpeed reads it).
pub fn load(path: &Path) -> Result<Value> {
    let io = |reason: String| ConfigError::Io {
        file: path.to_path_buf(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| io(e.to_string()))?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(io(format!(
            "{} bytes is larger than the {MAX_FILE_BYTES}-byte limit",
            meta.len()
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    hjson::parse_bytes(&bytes).map_err(|source| ConfigError::Parse {
        file: path.to_path_buf(),
        source,
    })
}

/// Fills "auto" values from the training arguments as Hugging Face's Trainer does (a given
/// argument that contradicts the config is an error), then resolves for `dims`. The result
/// keeps the arguments and the filled document (`Config::training`, `Config::document`).
pub fn resolve_with_args(
    doc: &Value,
    dims: &ParallelDims,
    args: &TrainingArgs,
    ctx: &FillContext,
) -> Result<Config> {
    args.check()?;
    let mut doc = doc.clone();
    let (filled, unused) = match &mut doc {
        Value::Dict(root) => (auto::fill(root, args, ctx)?, auto::unused_flags(root, args)),
        _ => (Vec::new(), Vec::new()),
    };
    let mut config = resolve::resolve(&doc, dims, filled)?;
    config.warnings.extend(unused);
    config.training = Some(args.clone());
    config.schedule_steps = args.max_steps.or(ctx.run_steps);
    Ok(config)
}

/// Resolves a parsed document as DeepSpeed would, with no "auto" filled.
pub fn resolve(doc: &Value, dims: &ParallelDims) -> Result<Config> {
    resolve::resolve(doc, dims, Vec::new())
}
