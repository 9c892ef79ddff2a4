//! `ds-rs config check FILE`: the verdict DeepSpeed 0.19.8 would give, and the resolved values.

use std::path::PathBuf;
use std::process::ExitCode;

use ds_config::{Config, FillContext};

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The ds_config file (JSON or hjson, as DeepSpeed reads it).
    file: PathBuf,
    /// Total number of ranks.
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    /// Tensor-parallel degree (default: the config's tensor_parallel.autotp_size, else 1).
    #[arg(long)]
    tp: Option<usize>,
    /// Pipeline-parallel degree.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Print exactly one JSON object: {"ok": true, ...} or {"ok": false, "error": ...}.
    #[arg(long)]
    json: bool,
    /// The model's hidden size (`train` takes it from --model): fills "auto" ZeRO bucket
    /// sizes as the HF Trainer does.
    #[arg(long)]
    hidden_size: Option<i64>,
    /// The steps `train` would run: the schedule's total when --max_steps is not given.
    #[arg(long)]
    steps: Option<i64>,
    /// Fill "auto" values exactly as `train` does with these arguments.
    #[command(flatten)]
    training: crate::flags::TrainingArgsCli,
}

pub fn run(args: &CheckArgs) -> anyhow::Result<ExitCode> {
    // The layout as `train` and `launch` decide it, so all three agree on the dp degree.
    let training = args.training.to_args()?;
    let result = ds_config::load(&args.file).and_then(|doc| {
        let dims = ds_config::parallel_dims(&doc, args.world_size, args.tp, Some(args.pp))?;
        let ctx = FillContext {
            data_parallel: dims.dp() as i64,
            hidden_size: args.hidden_size,
            run_steps: args.steps,
        };
        ds_config::resolve_with_args(&doc, &dims, &training, &ctx)
    });
    let result = result.map(with_refusals);
    if args.json {
        println!("{}", ds_config::summary_json(&result));
    } else {
        match &result {
            Ok(c) => print_human(c),
            Err(e) => eprintln!("error: {}: {e}", args.file.display()),
        }
    }
    Ok(if result.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// DeepSpeed accepts the settings ds-rs cannot carry out yet, so the verdict stays "ok"; a
/// warning says that `train` and `launch` refuse them.
fn with_refusals(mut c: Config) -> Config {
    if let Err(e) = c.check_filled() {
        c.warnings.push(format!("{e}; `ds-rs train` refuses it"));
    }
    let refused = c.not_implemented().into_iter().map(|n| {
        format!(
            "{}; `ds-rs train` and `ds-rs launch` refuse it",
            n.describe()
        )
    });
    c.warnings.extend(refused.collect::<Vec<_>>());
    c
}

fn print_human(c: &Config) {
    let z = &c.zero_optimization;
    let dev = |d: Option<&'static str>| d.unwrap_or("none");
    println!(
        "ok: DeepSpeed 0.19.8 accepts this config at world size {} (tp {}, pp {})",
        c.dims.world_size, c.dims.tp, c.dims.pp
    );
    println!(
        "  batch        train_batch_size {} = micro {} x grad_accum {} x dp {}",
        c.train_batch_size,
        c.train_micro_batch_size_per_gpu,
        c.gradient_accumulation_steps,
        c.data_parallel_size
    );
    println!(
        "  zero         stage {}, offload optimizer {}, offload param {}",
        u8::from(z.stage),
        dev(z.offload_optimizer.as_ref().and_then(|o| o.device.name())),
        dev(z.offload_param.as_ref().and_then(|o| o.device.name()))
    );
    println!(
        "  buckets      reduce {}, allgather {}, overlap_comm {}, contiguous_gradients {}",
        z.reduce_bucket_size, z.allgather_bucket_size, z.overlap_comm, z.contiguous_gradients
    );
    let precision = if c.fp16.enabled {
        "fp16"
    } else if c.bf16.enabled {
        "bf16"
    } else {
        "fp32"
    };
    println!(
        "  precision    {precision}, gradient_clipping {}",
        c.scalars.gradient_clipping
    );
    let name = |s: &Option<ds_config::optim::TypedSection>| {
        s.as_ref()
            .map_or("none".to_string(), |s| s.type_name.clone())
    };
    println!(
        "  optimizer    {}, scheduler {}",
        name(&c.optimizer),
        name(&c.scheduler)
    );
    if let Some(line) = ds_engine::program_optimizer_line(c) {
        println!("  train        {line}");
    }
    for (path, value) in &c.auto_filled {
        println!("  auto         {path} = {value}");
    }
    for w in &c.warnings {
        println!("warning: {w}");
    }
}
