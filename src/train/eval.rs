//! `ds-rs eval`: a model's mean loss and perplexity on a token source, in any layout (run
//! it under `launch` for several ranks): from a model directory's weights, `--init`, or the
//! newest checkpoint of `--load-dir`. The source is read whole, in consecutive windows of
//! `seq + 1` tokens, each global batch split over the ranks as training splits it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use ds_comm::{init, options_for, Groups};
use ds_data::{DataLoader, SampleOrder};
use ds_engine::EngineOptions;

use super::TrainArgs;

#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// The ds_config: the micro-batch, precision and ZeRO layout (default: the built-in).
    #[arg(long, env = "DS_RS_CONFIG")]
    config: Option<PathBuf>,
    /// As `train --model`: a preset, a GPT model JSON or a Hugging Face model directory.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Tokens per window (default: the model's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// As `train --data`: an indexed dataset, a token file, text, a blend, markov or uniform.
    #[arg(long)]
    data: String,
    /// The tokenizer.json for text --data (default: the --model directory's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Token width of a .bin file: u16 or u32.
    #[arg(long, default_value = "u16")]
    token_width: String,
    /// The weights (a safetensors file or a model directory), instead of --model's own.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Evaluate the newest checkpoint of this directory (any layout it was saved in).
    #[arg(long)]
    load_dir: Option<PathBuf>,
    /// Global batches to evaluate (default: every whole one the source holds).
    #[arg(long)]
    batches: Option<u64>,
    #[arg(long)]
    tp: Option<usize>,
    #[arg(long)]
    pp: Option<usize>,
    /// Seed of the initial weights when none are read, and of the Markov data.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    #[command(flatten)]
    backend: crate::flags::BackendArg,
    #[command(flatten)]
    device: crate::flags::DeviceArg,
}

impl EvalArgs {
    /// The training arguments that plan the same job (no steps are trained).
    fn as_train(&self) -> anyhow::Result<TrainArgs> {
        let (mut t, _) = crate::flags::parse_args::<TrainArgs>("train", ["train"])?;
        t.config = self.config.clone();
        t.model = self.model.clone();
        t.seq_len = self.seq_len;
        t.data = self.data.clone();
        t.tokenizer = self.tokenizer.clone();
        t.token_width = self.token_width.clone();
        t.init = self.init.clone();
        t.layout.tp = self.tp;
        t.layout.pp = self.pp;
        t.seed = self.seed;
        t.steps = Some(1);
        t.backend = self.backend.clone();
        t.device = self.device.clone();
        Ok(t)
    }
}

pub fn run(args: &EvalArgs) -> anyhow::Result<ExitCode> {
    let t = args.as_train()?;
    let mut env = options_for(args.backend.dist_backend).context("reading the rank environment")?;
    env.gpu = args.device.gpu_ordinal();
    let (model, plan) = super::plan(&t, env.world_size)?;
    let comm = init(&env).context("joining the job")?;
    let groups = Groups::new(&comm, plan.config.dims)?;
    let opts = EngineOptions {
        seed: args.seed,
        init: args.init.clone().or_else(|| model.weights.clone()),
        device: args.device.open()?,
        ..EngineOptions::default()
    };
    let mut engine = plan.engine(&model, &groups, opts.clone())?;
    let from = match &args.load_dir {
        Some(dir) => {
            let m = engine
                .load_checkpoint(dir, None)?
                .with_context(|| format!("--load-dir {}: no checkpoint", dir.display()))?;
            format!("{} at step {}", dir.join(&m.tag).display(), m.global_steps)
        }
        None => match &opts.init {
            Some(p) => p.display().to_string(),
            None => format!("seeded initial weights (seed {})", args.seed),
        },
    };
    let s = engine.settings().clone();
    let width = super::data::token_width(&args.token_width)?;
    let layout = super::data::Layout::of(&model, &s, &groups, args.seed);
    let data = super::data::DataArgs {
        data: &args.data,
        eval_data: None,
        split: None,
        tokenizer: super::data::tokenizer_path(args.tokenizer.as_deref(), &args.model),
        shuffle: false,
        packing: false,
        width,
    };
    let samples = super::data::whole(&args.data, &data, &layout)
        .with_context(|| format!("--data {}", args.data))?;
    let order = SampleOrder::new(
        layout.seq,
        layout.micro_batch,
        layout.grad_accum,
        layout.rank,
        layout.world,
    )?;
    let whole = samples.len() / order.global_batch();
    let batches = args.batches.unwrap_or(whole).min(whole);
    if batches == 0 {
        anyhow::bail!(
            "--data {}: fewer windows of {} tokens than one global batch ({} samples)",
            args.data,
            model.seq_len + 1,
            order.global_batch()
        );
    }
    let name = samples.name().to_string();
    let loader = DataLoader::new(samples, order, model.vocab_size())
        .with_context(|| format!("--data {}", args.data))?;
    let mut sum = 0.0f64;
    for b in 0..batches {
        sum += engine.eval_batch(|k| {
            loader
                .micro_batch(b, k)
                .map_err(ds_engine::EngineError::input)
        })? as f64;
    }
    let loss = sum / batches as f64;
    if comm.rank() == 0 {
        let tokens = batches * order.global_batch() * model.seq_len as u64;
        println!(
            "{}",
            serde_json::json!({"eval_loss": loss, "perplexity": loss.exp(), "tokens": tokens,
                "batches": batches, "data": name, "weights": from, "model": args.model})
        );
    }
    Ok(ExitCode::SUCCESS)
}
