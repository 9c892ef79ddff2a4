//! The run-control arguments of transformers' example scripts (`run_clm.py` under
//! `deepspeed`) and of the Trainer, spelled as they spell them, so that their command line
//! works as it is. `train` folds each into its own flag (src/train/hf_args.rs); where both
//! spellings are given and disagree, that is an error.

use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone, Default)]
#[command(
    next_help_heading = "The Hugging Face Trainer's run arguments (run_clm.py's command line)"
)]
pub struct TrainerRunArgs {
    /// The ds_config (the Trainer's spelling of --config).
    #[arg(long)]
    pub deepspeed: Option<PathBuf>,
    /// A Hugging Face model directory (the Trainer's spelling of --model).
    #[arg(long, conflicts_with = "model")]
    pub model_name_or_path: Option<String>,
    /// The training text or JSON lines (the Trainer's spelling of --data).
    #[arg(long, conflicts_with = "data")]
    pub train_file: Option<String>,
    /// The validation text or JSON lines (the Trainer's spelling of --eval-data).
    #[arg(long)]
    pub validation_file: Option<String>,
    /// Tokens per sample (run_clm's spelling of --seq-len).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Where checkpoints (every --save_steps), the metrics and, after the last step, the
    /// trained model (a Hugging Face directory, for a --model_name_or_path model) go. A
    /// directory that holds a checkpoint is resumed from, as run_clm.py does.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Train into a non-empty --output_dir from step 0 instead of resuming from it.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool)]
    pub overwrite_output_dir: Option<bool>,
    /// Train (what `train` does; accepted as run_clm.py's command lines carry it).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool)]
    pub do_train: Option<bool>,
    /// Evaluate on the validation data after the last step (`train` always does).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = hf_bool)]
    pub do_eval: Option<bool>,
    /// Passes over the training data (the Trainer's spelling of --epochs); --max_steps > 0
    /// overrides it, as in the Trainer.
    #[arg(long)]
    pub num_train_epochs: Option<f64>,
    /// A progress line every N steps [default: the config's steps_per_print].
    #[arg(long)]
    pub logging_steps: Option<u64>,
    /// When to evaluate during training: no, steps (every --eval_steps) or epoch.
    #[arg(
        long,
        alias = "evaluation_strategy",
        value_enum,
        conflicts_with = "eval_interval"
    )]
    pub eval_strategy: Option<Strategy>,
    /// Evaluate every N steps under --eval_strategy steps [default: --logging_steps].
    #[arg(long)]
    pub eval_steps: Option<u64>,
    /// When to save a checkpoint into --output_dir: no, steps (every --save_steps) or epoch
    /// [default: steps].
    #[arg(long, value_enum)]
    pub save_strategy: Option<Strategy>,
    /// Save every N steps under --save_strategy steps [default: 500].
    #[arg(long)]
    pub save_steps: Option<u64>,
    /// Keep only the newest K checkpoints.
    #[arg(long)]
    pub save_total_limit: Option<usize>,
    /// Resume: from the newest checkpoint of --output_dir (no value, or true), or from the
    /// checkpoint PATH names (a directory of checkpoints, or one checkpoint in it).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "PATH")]
    pub resume_from_checkpoint: Option<String>,
    /// Where the training is reported besides metrics.jsonl: tensorboard (event files under
    /// --logging_dir), none, or all (tensorboard, the one ds-rs writes).
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    pub report_to: Vec<String>,
    /// TensorBoard's directory under --report_to tensorboard [default: OUTPUT_DIR/runs].
    #[arg(long)]
    pub logging_dir: Option<PathBuf>,
}

/// `--eval_strategy` and `--save_strategy`, the Trainer's IntervalStrategy.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    No,
    Steps,
    Epoch,
}

/// A boolean as Hugging Face's argument parser reads one: true/false, yes/no, 1/0, any case.
pub(crate) fn hf_bool(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "yes" | "y" | "1" => Ok(true),
        "false" | "no" | "n" | "0" => Ok(false),
        _ => Err(format!("expected true or false, found {s:?}")),
    }
}
