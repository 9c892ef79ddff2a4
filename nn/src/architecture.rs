//! What a job's plan asks of a model (ds-engine's `JobPlan`), so that the engine knows a
//! model family only through this trait.

use std::path::PathBuf;

use ds_config::Config;

use crate::model::Model;
use crate::parallel::Parallel;

/// What the plan asks of a model: its width (ZeRO's "auto" bucket sizes), whether it splits in
/// the config's layout, and its layers (the pipeline's stages, the engine). ds-models'
/// `ModelSpec` is one; a program's own model can be another.
pub trait Architecture {
    /// The model's name in messages, as the user gave it (`--model tiny`).
    fn describe(&self) -> String;
    fn hidden_size(&self) -> usize;
    /// Whether the model divides in the config's layout (tensor, expert, pipeline, sequence
    /// parallelism, tiling, the config's expert_parallel section); why not.
    fn check_layout(&self, config: &Config) -> std::result::Result<(), String>;
    /// The model's layers, split over `parallel`.
    fn build(&self, parallel: &Parallel) -> std::result::Result<Model, String>;
    /// The weights the model starts from when the run names none (a model directory's).
    fn weights(&self) -> Option<PathBuf> {
        None
    }
}
