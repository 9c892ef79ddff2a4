//! What a training program tells DeepSpeed besides the ds_config: Hugging Face's
//! `TrainingArguments` (the subset that fills a ds_config and builds the program's optimizer
//! and schedule), with HF's names and defaults (transformers 5.24 training_args.py).
//!
//! Each field is `Some` only when the user gave it: a given value must agree with a number the
//! config holds (HF's mismatch check), a default never contradicts the config (see Note
//! [given and default] in auto.rs).

use serde::Serialize;

use crate::error::{ConfigError, Result};

/// HF TrainingArguments' defaults.
pub const DEFAULT_MICRO_BATCH: i64 = 8;
pub const DEFAULT_GRAD_ACCUM: i64 = 1;
pub const DEFAULT_LR: f64 = 5e-5;
pub const DEFAULT_WEIGHT_DECAY: f64 = 0.0;
pub const DEFAULT_BETAS: (f64, f64) = (0.9, 0.999);
pub const DEFAULT_EPS: f64 = 1e-8;
pub const DEFAULT_MAX_GRAD_NORM: f64 = 1.0;

/// The training arguments the user gave (flags of `train`, `bench train`, `config check`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TrainingArgs {
    pub per_device_train_batch_size: Option<i64>,
    pub gradient_accumulation_steps: Option<i64>,
    pub learning_rate: Option<f64>,
    pub weight_decay: Option<f64>,
    pub adam_beta1: Option<f64>,
    pub adam_beta2: Option<f64>,
    pub adam_epsilon: Option<f64>,
    pub max_grad_norm: Option<f64>,
    /// HF 5's `warmup_steps`: a whole number of steps when >= 1, else a ratio of the total.
    pub warmup_steps: Option<f64>,
    pub lr_scheduler_type: Option<LrSchedulerType>,
    pub fp16: Option<bool>,
    pub bf16: Option<bool>,
    /// The schedule's length (`scheduler.params.total_num_steps`); `train --steps` only says
    /// when to stop.
    pub max_steps: Option<i64>,
}

/// HF's `lr_scheduler_type` values that ds-rs implements (transformers' SchedulerType).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedulerType {
    Linear,
    Cosine,
    CosineWithRestarts,
    Polynomial,
    Constant,
    ConstantWithWarmup,
    InverseSqrt,
}

impl LrSchedulerType {
    pub const ALL: [(&'static str, LrSchedulerType); 7] = [
        ("linear", LrSchedulerType::Linear),
        ("cosine", LrSchedulerType::Cosine),
        ("cosine_with_restarts", LrSchedulerType::CosineWithRestarts),
        ("polynomial", LrSchedulerType::Polynomial),
        ("constant", LrSchedulerType::Constant),
        ("constant_with_warmup", LrSchedulerType::ConstantWithWarmup),
        ("inverse_sqrt", LrSchedulerType::InverseSqrt),
    ];

    /// HF's schedules that need arguments ds-rs does not take (`lr_scheduler_kwargs`, a
    /// metric): named so that the refusal says what they are.
    const NOT_IMPLEMENTED: [&'static str; 5] = [
        "reduce_lr_on_plateau",
        "cosine_with_min_lr",
        "cosine_warmup_with_min_lr",
        "warmup_stable_decay",
        "greedy",
    ];

    pub fn parse(name: &str) -> Result<LrSchedulerType> {
        if let Some((_, t)) = Self::ALL.iter().find(|(n, _)| *n == name) {
            return Ok(*t);
        }
        let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
        let why = match Self::NOT_IMPLEMENTED.contains(&name) {
            true => "a Hugging Face schedule ds-rs does not implement; use one of",
            false => "one of",
        };
        Err(ConfigError::invalid(
            "--lr_scheduler_type",
            format!("'{name}'"),
            format!("{why} {}", names.join(", ")),
        ))
    }

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, t)| *t == self)
            .map(|(n, _)| *n)
            .expect("invariant: every type is in ALL")
    }
}

impl TrainingArgs {
    /// Checks ranges, so that a bad argument is one error naming the flag before anything runs.
    pub fn check(&self) -> Result<()> {
        let positive = |flag: &str, v: Option<i64>| match v {
            Some(n) if n <= 0 => Err(ConfigError::invalid(flag, n, "a positive integer")),
            _ => Ok(()),
        };
        positive(
            "--per_device_train_batch_size",
            self.per_device_train_batch_size,
        )?;
        positive(
            "--gradient_accumulation_steps",
            self.gradient_accumulation_steps,
        )?;
        positive("--max_steps", self.max_steps)?;
        let at_least_zero = |flag: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x >= 0.0) => {
                Err(ConfigError::invalid(flag, x, "a number >= 0"))
            }
            _ => Ok(()),
        };
        at_least_zero("--learning_rate", self.learning_rate)?;
        at_least_zero("--weight_decay", self.weight_decay)?;
        at_least_zero("--max_grad_norm", self.max_grad_norm)?;
        at_least_zero("--warmup_steps", self.warmup_steps)?;
        at_least_zero("--adam_epsilon", self.adam_epsilon)?;
        for (flag, beta) in [
            ("--adam_beta1", self.adam_beta1),
            ("--adam_beta2", self.adam_beta2),
        ] {
            if let Some(b) = beta.filter(|b| !(0.0..1.0).contains(b)) {
                return Err(ConfigError::invalid(flag, b, "a number in [0, 1)"));
            }
        }
        if self.fp16 == Some(true) && self.bf16 == Some(true) {
            return Err(ConfigError::conflict(
                "--bf16",
                "--fp16 and --bf16 cannot both be on",
            ));
        }
        Ok(())
    }

    pub fn lr(&self) -> f64 {
        self.learning_rate.unwrap_or(DEFAULT_LR)
    }

    pub fn betas(&self) -> (f64, f64) {
        (
            self.adam_beta1.unwrap_or(DEFAULT_BETAS.0),
            self.adam_beta2.unwrap_or(DEFAULT_BETAS.1),
        )
    }

    pub fn eps(&self) -> f64 {
        self.adam_epsilon.unwrap_or(DEFAULT_EPS)
    }

    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(DEFAULT_WEIGHT_DECAY)
    }

    pub fn max_grad_norm(&self) -> f64 {
        self.max_grad_norm.unwrap_or(DEFAULT_MAX_GRAD_NORM)
    }

    /// HF's `get_warmup_steps`: `int(w)` when w >= 1, else `ceil(total * w)`; None when the
    /// ratio needs a total that is not known.
    pub fn warmup(&self, total: Option<i64>) -> Option<i64> {
        let w = self.warmup_steps.unwrap_or(0.0);
        if w >= 1.0 {
            Some(w as i64)
        } else if w == 0.0 {
            Some(0)
        } else {
            total.map(|t| (t as f64 * w).ceil() as i64)
        }
    }

    /// Whether the program builds the LR schedule (`scheduler_type`): the config has no
    /// `scheduler` section, and either no `optimizer` section (HF's Trainer builds both) or a
    /// schedule type was asked for; a config optimizer alone keeps its lr, as under DeepSpeed.
    pub fn builds_schedule(&self, has_optimizer: bool, has_scheduler: bool) -> bool {
        !has_scheduler && (!has_optimizer || self.lr_scheduler_type.is_some())
    }

    /// The schedule the program builds when the config has no `scheduler` section: the given
    /// type, else HF's default (linear) when the program also builds the optimizer.
    pub fn scheduler_type(&self) -> LrSchedulerType {
        self.lr_scheduler_type.unwrap_or(LrSchedulerType::Linear)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_names_are_hf_names() {
        assert_eq!(
            LrSchedulerType::parse("cosine").unwrap(),
            LrSchedulerType::Cosine
        );
        let err = LrSchedulerType::parse("cosin").unwrap_err().to_string();
        assert!(
            err.starts_with("--lr_scheduler_type: found 'cosin', expected one of linear"),
            "{err}"
        );
        let err = LrSchedulerType::parse("warmup_stable_decay")
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not implement"), "{err}");
    }

    #[test]
    fn bad_arguments_name_their_flag() {
        let bad = [
            TrainingArgs {
                per_device_train_batch_size: Some(0),
                ..TrainingArgs::default()
            },
            TrainingArgs {
                gradient_accumulation_steps: Some(-2),
                ..TrainingArgs::default()
            },
            TrainingArgs {
                adam_beta2: Some(1.0),
                ..TrainingArgs::default()
            },
            TrainingArgs {
                fp16: Some(true),
                bf16: Some(true),
                ..TrainingArgs::default()
            },
        ];
        let flags = [
            "--per_device_train_batch_size",
            "--gradient_accumulation_steps",
            "--adam_beta2",
            "--bf16",
        ];
        for (args, flag) in bad.iter().zip(flags) {
            assert_eq!(args.check().unwrap_err().path(), Some(flag));
        }
        assert!(TrainingArgs::default().check().is_ok());
    }

    /// transformers' get_warmup_steps: steps when >= 1, a ceil'd ratio below.
    #[test]
    fn warmup_is_steps_or_a_ratio() {
        let w = |x: f64| TrainingArgs {
            warmup_steps: Some(x),
            ..TrainingArgs::default()
        };
        assert_eq!(w(5.0).warmup(None), Some(5));
        assert_eq!(w(0.1).warmup(Some(95)), Some(10));
        assert_eq!(w(0.1).warmup(None), None);
        assert_eq!(TrainingArgs::default().warmup(None), Some(0));
    }
}
