//! DeepSpeed's autotuning trial hook (runtime/engine.py `_autotuning_exit`): when a trial's
//! ds_config has `autotuning.enabled` and a `metric_path` (the autotuner writes both), the
//! engine times its optimizer steps from `start_profile_step` to `end_profile_step` and rank 0
//! writes DeepSpeed's metrics file there. Where DeepSpeed then ends the process, ds-rs says so
//! in the step's outcome (`StepOutcome::trial_complete`) and leaves the ending to the caller:
//! a program that reads it stops its loop, and the autotuner stops a trial whose metrics are
//! written, so a program embedding the engine is tuned through its own loop without knowing
//! it. Without a `metric_path` the section only configures `ds-rs launch --autotuning` and
//! the engine trains as usual.

use std::path::PathBuf;
use std::time::Instant;

use ds_config::Config;

use crate::{EngineError, Result};

pub struct TrialProbe {
    start: u64,
    end: u64,
    path: PathBuf,
    samples_per_step: f64,
    rank0: bool,
    /// When step `start` ended (at initialisation for a start of 0).
    began: Option<Instant>,
}

impl TrialProbe {
    pub fn new(config: &Config, samples_per_step: usize, rank0: bool) -> Option<TrialProbe> {
        let at = &config.autotuning;
        let path = at.metric_path.as_ref().filter(|_| at.enabled)?;
        let end = at.end_profile_step.max(1) as u64;
        let start = (at.start_profile_step.max(0) as u64).min(end - 1);
        Some(TrialProbe {
            start,
            end,
            path: PathBuf::from(path),
            samples_per_step: samples_per_step as f64,
            rank0,
            began: (start == 0).then(Instant::now),
        })
    }

    /// After the optimizer step that made `global_steps`: starts the clock at
    /// `start_profile_step`; at `end_profile_step` writes the metrics and says the trial is
    /// complete.
    pub fn after_step(&mut self, global_steps: u64) -> Result<bool> {
        if global_steps == self.start {
            self.began = Some(Instant::now());
        }
        let Some(began) = self.began.filter(|_| global_steps >= self.end) else {
            return Ok(false);
        };
        let latency = began.elapsed().as_secs_f64() / (global_steps - self.start) as f64;
        if self.rank0 {
            let metrics = serde_json::json!({
                "latency": latency,
                "throughput": self.samples_per_step / latency,
                "start_profile_step": self.start,
                "end_profile_step": global_steps,
            });
            // whole or absent: the autotuner may read it as soon as it is there
            let partial = self.path.with_extension("partial");
            std::fs::write(&partial, metrics.to_string())
                .and_then(|_| std::fs::rename(&partial, &self.path))
                .map_err(|e| {
                    EngineError::Setting(format!(
                        "autotuning.metric_path {}: {e}",
                        self.path.display()
                    ))
                })?;
        }
        // DeepSpeed's trial ends here, on every rank, after the same step
        self.began = None;
        Ok(true)
    }
}
