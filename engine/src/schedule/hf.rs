//! Hugging Face's LR schedules (transformers 5.24 optimization.py, `get_scheduler`), which the
//! Trainer builds from `lr_scheduler_type` when the ds_config has no `scheduler` section.
//! Each is a torch `LambdaLR`: the optimizer step taken after `s` scheduler steps uses
//! `base_lr * lambda(s)`, the first step `lambda(0)` (unlike DeepSpeed's schedules, whose
//! constructor sets the first lr). The arithmetic is Python's (f64), in the same order, so
//! the values equal transformers' bit for bit (fixtures/hf_lr_reference.json).

use ds_config::{ConfigError, LrSchedulerType};

/// polynomial's defaults: `lr_end=1e-7`, `power=1.0`.
const POLY_LR_END: f64 = 1e-7;
/// inverse_sqrt's timescale without warmup.
const INVERSE_SQRT_TIMESCALE: i64 = 10_000;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct HfSchedule {
    kind: LrSchedulerType,
    base_lr: f64,
    warmup: i64,
    total: i64,
}

impl HfSchedule {
    /// `warmup` and `total` are HF's `num_warmup_steps` and `num_training_steps`.
    pub(super) fn new(
        kind: LrSchedulerType,
        base_lr: f64,
        warmup: u64,
        total: u64,
    ) -> Result<HfSchedule, ConfigError> {
        let int = |n: u64, what: &str| {
            i64::try_from(n).map_err(|_| ConfigError::invalid(what, n, "a step count below 2^63"))
        };
        if kind == LrSchedulerType::Polynomial && base_lr <= POLY_LR_END {
            return Err(ConfigError::invalid(
                "--learning_rate",
                base_lr,
                format!("more than polynomial's lr_end ({POLY_LR_END})"),
            ));
        }
        Ok(HfSchedule {
            kind,
            base_lr,
            warmup: int(warmup, "--warmup_steps")?,
            total: int(total, "--max_steps")?,
        })
    }

    /// The lr of the optimizer step taken after `s` applied steps.
    pub(super) fn lr(&self, s: u64) -> f64 {
        let s = i64::try_from(s).unwrap_or(i64::MAX);
        self.base_lr * self.lambda(s)
    }

    fn lambda(&self, s: i64) -> f64 {
        use LrSchedulerType as T;
        let (w, total) = (self.warmup, self.total);
        let ramp = || s as f64 / w.max(1) as f64;
        let progress = || (s - w) as f64 / (total - w).max(1) as f64;
        match self.kind {
            T::Constant => 1.0,
            T::ConstantWithWarmup if s < w => s as f64 / (w as f64).max(1.0),
            T::ConstantWithWarmup => 1.0,
            _ if s < w => ramp(),
            T::Linear => 0f64.max((total - s) as f64 / (total - w).max(1) as f64),
            T::Cosine => {
                let cycles = 0.5;
                0f64.max(0.5 * (1.0 + (std::f64::consts::PI * cycles * 2.0 * progress()).cos()))
            }
            T::CosineWithRestarts => {
                let p = progress();
                if p >= 1.0 {
                    return 0.0;
                }
                let cycles = 1.0;
                0f64.max(0.5 * (1.0 + (std::f64::consts::PI * ((cycles * p) % 1.0)).cos()))
            }
            T::Polynomial => self.polynomial(s),
            T::InverseSqrt => {
                let timescale = if w == 0 { INVERSE_SQRT_TIMESCALE } else { w };
                let shift = timescale - w;
                1.0 / ((s + shift) as f64 / timescale as f64).sqrt()
            }
        }
    }

    /// After warmup: `decay / lr_init` with `decay = (lr_init - lr_end) * pct_remaining^1 +
    /// lr_end`, and `lr_end / lr_init` past the total.
    fn polynomial(&self, s: i64) -> f64 {
        let lr_init = self.base_lr;
        if s > self.total {
            return POLY_LR_END / lr_init;
        }
        let lr_range = lr_init - POLY_LR_END;
        let decay_steps = self.total - self.warmup;
        let pct_remaining = 1.0 - (s - self.warmup) as f64 / decay_steps as f64;
        let decay = lr_range * pct_remaining + POLY_LR_END;
        decay / lr_init
    }
}
