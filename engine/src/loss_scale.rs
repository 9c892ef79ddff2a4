//! fp16 loss scaling as DeepSpeed 0.19.8 does it, including when a step is skipped and what
//! rank 0 logs about it.
//!
//! Two owners of the scale update it differently, and ds-rs follows the one its ZeRO stage uses:
//! - ZeRO stages 1-3 build `CreateLossScaler(...)` (deepspeed/runtime/fp16/loss_scaler.py): a
//!   `DynamicLossScaler` with hysteresis that raises once an overflow hits `min_loss_scale`,
//!   or a static `LossScaler`.
//! - Stage 0 wraps the optimizer in `FP16_Optimizer` (fused_optimizer.py), whose
//!   `_update_scale` on a `LossScaleConfig` has no hysteresis at all (`hysteresis` and
//!   `consecutive_hysteresis` are ignored) and floors the scale at `min_loss_scale`.
//!
//! Either way `update` runs once per optimizer step, overflow or not, and an overflow skips
//! the step (the engine then also leaves the LR schedule where it is). Without fp16 (bf16,
//! fp32) the scale is 1 and a non-finite gradient still skips the step.

use ds_config::precision::Fp16Config;
use ds_config::{ConfigError, ZeroStage};

/// DeepSpeed's fixed growth / shrink factor.
const SCALE_FACTOR: f64 = 2.0;

/// The mutable part of a scaler, as checkpoints record it.
pub use ds_checkpoint::LossScaleState;

/// DeepSpeed's `DynamicLossScaler` settings, from the `fp16` section.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Dynamic {
    /// `loss_scale_window`: clean steps between two doublings.
    scale_window: i64,
    /// `min_loss_scale`.
    min_scale: f64,
    /// `hysteresis` (DeepSpeed's `delayed_shift`): overflows tolerated before shrinking.
    delayed_shift: i64,
    consecutive_hysteresis: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// fp16 off: scale 1.
    Unscaled,
    Static,
    Dynamic(Dynamic),
}

/// The loss scaler of one training run.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    mode: Mode,
    /// Stage 0 (`FP16_Optimizer`) rather than ZeRO's `DynamicLossScaler`.
    stage0: bool,
    state: LossScaleState,
    /// Whether DeepSpeed's `cur_scale` is still a Python int (2**initial_scale_power, an int
    /// static scale, or an int min_loss_scale that `max` picked): only its log text differs.
    py_int: bool,
}

/// What `update` decided for this step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// The optimizer step, and the LR schedule's step, are skipped.
    pub skipped: bool,
    /// The lines DeepSpeed's rank 0 logs for this update, in order.
    pub log: Vec<LogLine>,
}

/// One log line; DeepSpeed prints them on rank 0 only.
#[derive(Debug, Clone, PartialEq)]
pub struct LogLine {
    pub level: LogLevel,
    pub text: String,
}

/// DeepSpeed's logging level for a line: all are `info` except ZeRO's static-scale overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Info,
    Warning,
}

/// `DynamicLossScaler` raises this when an overflow hits a scale already at `min_loss_scale`;
/// DeepSpeed's run ends there. The scaler is left as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")]
pub struct ScaleAtMinimum {
    pub cur_scale: f64,
}

impl LossScaler {
    /// The scaler DeepSpeed builds for this `fp16` section under ZeRO `stage`: none when fp16
    /// is off, static for `loss_scale` > 0, else dynamic from 2^initial_scale_power.
    pub fn new(fp16: &Fp16Config, stage: ZeroStage) -> Result<LossScaler, ConfigError> {
        let mode = match (fp16.enabled, fp16.loss_scale) {
            (false, _) => Mode::Unscaled,
            (true, s) if s != 0.0 => Mode::Static,
            (true, _) => Mode::Dynamic(Dynamic {
                scale_window: positive("loss_scale_window", fp16.loss_scale_window)?,
                min_scale: positive("min_loss_scale", fp16.min_loss_scale)? as f64,
                delayed_shift: fp16.hysteresis,
                consecutive_hysteresis: fp16.consecutive_hysteresis,
            }),
        };
        let cur_scale = match mode {
            Mode::Unscaled => 1.0,
            _ => fp16.initial_loss_scale(),
        };
        Ok(LossScaler {
            mode,
            stage0: stage == ZeroStage::Disabled,
            state: LossScaleState {
                cur_scale,
                cur_iter: 0,
                last_overflow_iter: -1,
                cur_hysteresis: match mode {
                    Mode::Dynamic(d) => d.delayed_shift,
                    _ => 0,
                },
            },
            py_int: cur_scale.fract() == 0.0,
        })
    }

    /// A scaler resumed from a checkpoint's state (DeepSpeed restores `cur_scale` even for a
    /// static scale).
    pub fn from_state(
        fp16: &Fp16Config,
        stage: ZeroStage,
        state: LossScaleState,
    ) -> Result<LossScaler, ConfigError> {
        let mut scaler = LossScaler::new(fp16, stage)?;
        scaler.set_state(state);
        Ok(scaler)
    }

    /// Resumes this scaler from a checkpoint's state.
    pub fn set_state(&mut self, state: LossScaleState) {
        self.state = state;
        self.py_int = false;
    }

    /// The factor the loss is multiplied by before backward.
    pub fn scale(&self) -> f64 {
        self.state.cur_scale
    }

    /// Dynamic scaling (DeepSpeed's `dynamic_loss_scale` checkpoint field).
    pub fn dynamic(&self) -> bool {
        matches!(self.mode, Mode::Dynamic(_))
    }

    /// What a checkpoint saves; `from_state` resumes from it.
    pub fn state(&self) -> LossScaleState {
        self.state
    }

    /// Records one optimizer step whose gradients did (`overflow`) or did not overflow.
    pub fn update(&mut self, overflow: bool) -> Result<StepOutcome, ScaleAtMinimum> {
        let log = match (self.mode, self.stage0) {
            (Mode::Dynamic(d), false) => self.update_dynamic(d, overflow)?,
            (Mode::Dynamic(d), true) => self.update_fp16_optimizer(d, overflow),
            (Mode::Static, true) if overflow => vec![
                info(format!(
                    "Grad overflow on iteration: {}",
                    self.state.cur_iter
                )),
                info(format!("Using static loss scale of: {}", self.scale_text())),
            ],
            // BF16_Optimizer (stage 0 without fp16) skips without a word.
            (Mode::Static | Mode::Unscaled, _) if !overflow || self.stage0 => Vec::new(),
            (Mode::Static | Mode::Unscaled, _) => vec![LogLine {
                level: LogLevel::Warning,
                text: "[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, \
                       weights were not updated."
                    .to_string(),
            }],
        };
        self.state.cur_iter += 1;
        Ok(StepOutcome {
            skipped: overflow,
            log,
        })
    }

    /// `DynamicLossScaler.update_scale`, line for line (except `cur_iter += 1`).
    fn update_dynamic(
        &mut self,
        d: Dynamic,
        overflow: bool,
    ) -> Result<Vec<LogLine>, ScaleAtMinimum> {
        if overflow {
            let line = self.overflow_dynamic(d)?;
            self.state.last_overflow_iter = self.state.cur_iter as i64;
            return Ok(vec![info(line)]);
        }
        let mut log = Vec::new();
        if d.consecutive_hysteresis {
            log.push(info(format!(
                "Consecutive hysteresis is enabled. Restoring hysteresis to {}",
                d.delayed_shift
            )));
            self.state.cur_hysteresis = d.delayed_shift;
        }
        if self.window_done(d) {
            if !d.consecutive_hysteresis {
                self.state.cur_hysteresis = d.delayed_shift;
            }
            self.grow();
        }
        Ok(log)
    }

    /// An overflow under `DynamicLossScaler`: shrink the scale once hysteresis is used up
    /// (never, for `hysteresis` <= 0, as in DeepSpeed), else use up one unit of it.
    fn overflow_dynamic(&mut self, d: Dynamic) -> Result<String, ScaleAtMinimum> {
        let attempted = self.state.cur_scale;
        if d.delayed_shift != 1 && self.state.cur_hysteresis != 1 {
            let line = hysteresis_message(attempted, self.state.cur_hysteresis);
            self.state.cur_hysteresis = self.state.cur_hysteresis.saturating_sub(1);
            return Ok(line);
        }
        if attempted == d.min_scale {
            return Err(ScaleAtMinimum {
                cur_scale: attempted,
            });
        }
        self.state.cur_scale = self.shrunk(d.min_scale);
        Ok(overflow_message(attempted, self.state.cur_scale))
    }

    /// `FP16_Optimizer._update_scale` for a dynamic scale (except `cur_iter += 1`).
    fn update_fp16_optimizer(&mut self, d: Dynamic, overflow: bool) -> Vec<LogLine> {
        let prev = self.scale_text();
        if overflow {
            self.state.cur_scale = self.shrunk(d.min_scale);
            self.state.last_overflow_iter = self.state.cur_iter as i64;
            return vec![
                info(format!(
                    "\nGrad overflow on iteration {}",
                    self.state.cur_iter
                )),
                info(format!(
                    "Reducing dynamic loss scale from {prev} to {}",
                    self.scale_text()
                )),
            ];
        }
        if !self.window_done(d) {
            return Vec::new();
        }
        self.grow();
        vec![
            info(format!(
                "No Grad overflow for {} iterations",
                d.scale_window
            )),
            info(format!(
                "Increasing dynamic loss scale from {prev} to {}",
                self.scale_text()
            )),
        ]
    }

    /// `max(cur_scale / scale_factor, min_scale)`; Python's max keeps the int min_scale only
    /// when it is strictly larger.
    fn shrunk(&mut self, min_scale: f64) -> f64 {
        let half = self.state.cur_scale / SCALE_FACTOR;
        self.py_int = min_scale > half;
        half.max(min_scale)
    }

    fn grow(&mut self) {
        self.state.cur_scale *= SCALE_FACTOR;
        self.py_int = false;
    }

    /// A whole `loss_scale_window` of clean steps since the last overflow (or the start).
    fn window_done(&self, d: Dynamic) -> bool {
        let stable_interval = self.state.cur_iter as i64 - self.state.last_overflow_iter - 1;
        stable_interval > 0 && stable_interval % d.scale_window == 0
    }

    /// `cur_scale` as Python's str() prints it.
    fn scale_text(&self) -> String {
        if self.py_int {
            py_int(self.state.cur_scale)
        } else {
            py_float(self.state.cur_scale)
        }
    }
}

/// The line `DynamicLossScaler` logs when an overflow shrinks the scale (rank 0 only).
pub fn overflow_message(attempted: f64, next: f64) -> String {
    format!(
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {}, reducing to {}",
        py_int(attempted),
        py_int(next)
    )
}

/// The line `DynamicLossScaler` logs when an overflow only uses up hysteresis.
pub fn hysteresis_message(attempted: f64, cur_hysteresis: i64) -> String {
    format!(
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {}, but hysteresis \
         is {cur_hysteresis}. Reducing hysteresis to {}",
        py_int(attempted),
        cur_hysteresis.saturating_sub(1)
    )
}

fn info(text: String) -> LogLine {
    LogLine {
        level: LogLevel::Info,
        text,
    }
}

fn positive(key: &str, value: i64) -> Result<i64, ConfigError> {
    if value <= 0 {
        return Err(ConfigError::invalid(
            &format!("fp16.{key}"),
            value,
            "a value > 0 when dynamic loss scaling is enabled (loss_scale = 0)",
        ));
    }
    Ok(value)
}

/// Python's `int(x)` printed: exact below 2^128 (a loss scale never gets near that).
fn py_int(x: f64) -> String {
    if x.is_finite() && x.abs() < 2f64.powi(127) {
        return (x.trunc() as i128).to_string();
    }
    format!("{}", x.trunc())
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form outside [1e-4, 1e16).
fn py_float(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "nan"
        } else if x > 0.0 {
            "inf"
        } else {
            "-inf"
        }
        .to_string();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if x == 0.0 || (-4..16).contains(&exp) {
        let plain = x.to_string();
        return if plain.contains('.') {
            plain
        } else {
            plain + ".0"
        };
    }
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exp.abs())
}

#[cfg(test)]
mod tests;
