//! Hugging Face's training arguments on the command line (`train`, `bench train`,
//! `config check`), spelled as TrainingArguments spells them, with short aliases. Each is
//! optional: a flag left out takes the config's number, else HF's default (see Note [given and
//! default] in ds-config's auto.rs).

use ds_config::{LrSchedulerType, TrainingArgs};

#[derive(clap::Args, Debug, Clone, Default)]
#[command(
    next_help_heading = "Training arguments (Hugging Face's names; fill \"auto\" and build the optimizer a config leaves out)"
)]
pub struct TrainingArgsCli {
    /// Micro-batch per rank [default: the config's, else 8].
    #[arg(long = "per_device_train_batch_size", visible_alias = "micro-batch")]
    pub per_device_train_batch_size: Option<i64>,
    /// Gradient accumulation steps [default: the config's, else 1].
    #[arg(long = "gradient_accumulation_steps", visible_alias = "grad-accum")]
    pub gradient_accumulation_steps: Option<i64>,
    /// Peak learning rate [default: the config's, else 5e-5].
    #[arg(long = "learning_rate", visible_alias = "lr")]
    pub learning_rate: Option<f64>,
    /// AdamW's weight decay; the optimizer ds-rs builds skips biases and norm weights [default: 0].
    #[arg(long = "weight_decay")]
    pub weight_decay: Option<f64>,
    /// Adam's beta1 [default: 0.9].
    #[arg(long = "adam_beta1")]
    pub adam_beta1: Option<f64>,
    /// Adam's beta2 [default: 0.999].
    #[arg(long = "adam_beta2")]
    pub adam_beta2: Option<f64>,
    /// Adam's epsilon [default: 1e-8].
    #[arg(long = "adam_epsilon")]
    pub adam_epsilon: Option<f64>,
    /// Gradient clipping by global norm (0: off) [default: the config's, else 1.0].
    #[arg(long = "max_grad_norm")]
    pub max_grad_norm: Option<f64>,
    /// Linear warmup: steps when >= 1, a ratio of the total below 1 [default: 0].
    #[arg(long = "warmup_steps")]
    pub warmup_steps: Option<f64>,
    /// Warmup as a ratio of the total steps (transformers 4's spelling of --warmup_steps < 1).
    #[arg(long = "warmup_ratio", conflicts_with = "warmup_steps")]
    pub warmup_ratio: Option<f64>,
    /// The schedule when the config has no scheduler section: linear, cosine,
    /// cosine_with_restarts, polynomial, constant, constant_with_warmup, inverse_sqrt
    /// [default: linear when ds-rs builds the optimizer, else the config's optimizer's lr].
    #[arg(long = "lr_scheduler_type")]
    pub lr_scheduler_type: Option<String>,
    /// Mixed precision in fp16 (`--fp16 false` to say no) [default: the config's].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fp16: Option<bool>,
    /// Mixed precision in bf16 (`--bf16 false` to say no) [default: the config's].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub bf16: Option<bool>,
    /// The schedule's total steps (scheduler.params.total_num_steps) [default: the steps this
    /// run trains].
    #[arg(long = "max_steps")]
    pub max_steps: Option<i64>,
}

impl TrainingArgsCli {
    /// The arguments as ds-config takes them; an unknown schedule name is an error here.
    pub fn to_args(&self) -> anyhow::Result<TrainingArgs> {
        let lr_scheduler_type = self
            .lr_scheduler_type
            .as_deref()
            .map(LrSchedulerType::parse)
            .transpose()?;
        if let Some(r) = self.warmup_ratio.filter(|r| !(0.0..1.0).contains(r)) {
            anyhow::bail!("--warmup_ratio: found {r}, expected a ratio in [0, 1)");
        }
        let args = TrainingArgs {
            per_device_train_batch_size: self.per_device_train_batch_size,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            learning_rate: self.learning_rate,
            weight_decay: self.weight_decay,
            adam_beta1: self.adam_beta1,
            adam_beta2: self.adam_beta2,
            adam_epsilon: self.adam_epsilon,
            max_grad_norm: self.max_grad_norm,
            warmup_steps: self.warmup_steps.or(self.warmup_ratio),
            lr_scheduler_type,
            fp16: self.fp16,
            bf16: self.bf16,
            max_steps: self.max_steps,
        };
        args.check()?;
        Ok(args)
    }
}
