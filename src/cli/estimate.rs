//! `ds-rs estimate`: DeepSpeed's model-state estimators (`--zero-stage 2|3 --params N`), or
//! ds-rs's own memory model of a config, a model and a layout (`--config`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use ds_autotune::deepspeed_estimate::{parse_count, table, zero2_rows, zero3_rows, Cluster};
use ds_autotune::memory::{estimate, Run};

#[derive(clap::Args, Debug)]
pub struct EstimateArgs {
    /// The ZeRO stage whose DeepSpeed estimator to run: 2 or 3.
    #[arg(long, conflicts_with = "config")]
    zero_stage: Option<u8>,
    /// The model's parameter count: an integer or a number with K, M, B or T (7.5B, 350M).
    #[arg(long, conflicts_with = "config")]
    params: Option<String>,
    /// ds-rs's own estimate of this ds_config, per rank.
    #[arg(long)]
    config: Option<PathBuf>,
    /// With --config: the model, as `train --model` takes it (a preset, a model JSON, a
    /// Hugging Face model directory).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// With --config: tokens per sample (default: the model's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// With --config: the ranks of the job.
    #[arg(long, default_value_t = 1)]
    world_size: usize,
    #[command(flatten)]
    layout: crate::flags::LayoutArgs,
    /// With --config: positions per tile of the MLPs and the logits and loss (train's
    /// --tile).
    #[arg(long)]
    tile: Option<usize>,
    /// With --config: rows per micro-batch (default: the config's
    /// train_micro_batch_size_per_gpu).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// The parameters of the largest layer (ZeRO-3: the parameters gathered at once).
    #[arg(long)]
    largest_layer_params: Option<String>,
    #[arg(long, default_value_t = 1)]
    num_gpus_per_node: u64,
    #[arg(long, default_value_t = 1)]
    num_nodes: u64,
    /// DeepSpeed's slack factor on the CPU side.
    #[arg(long, default_value_t = 1.5)]
    additional_buffer_factor: f64,
    /// A JSON list of rows instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &EstimateArgs) -> anyhow::Result<ExitCode> {
    match &args.config {
        Some(path) => ds_rs_model(args, path),
        None => deepspeed(args),
    }
}

/// ds-rs's own model of the config's layout: one line (or JSON object) per rank.
fn ds_rs_model(args: &EstimateArgs, path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let model = ds_models::ModelSpec::resolve(&args.model, args.seq_len)?.with_tile(args.tile);
    // the job `train` would run: its default steps and training arguments
    let overrides = ds_engine::Overrides {
        layout: args.layout.flags(),
        training: Some(ds_config::TrainingArgs::default()),
        run_steps: Some(crate::train::DEFAULT_STEPS),
    };
    let source = ds_engine::ConfigSource::File(path);
    let plan = ds_engine::JobPlan::new(source, args.world_size, &overrides, Some(&model))?;
    let config = plan.config;
    let ranks = estimate(&Run {
        config: &config,
        model: &model,
        micro_batch: args.micro_batch,
    })?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "ranks": ranks }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "ds-rs memory estimate: --model {}, {} ({} ranks), ZeRO stage {}",
        args.model,
        config.dims,
        config.dims.world_size,
        config.zero_stage()
    );
    println!(
        " rank | stage | tp | dp | params | grads | optimizer | activations (without / with checkpointing) x in flight | layer | buckets | predicted peak RSS | on disk   (MiB)"
    );
    for r in &ranks {
        println!(
            " {:4} | {:5} | {:2} | {:2} | {:6.1} | {:5.1} | {:9.1} | {:.1} ({:.1} / {:.1}) x {} | {:5.1} | {:7.1} | {:18.1} | {:.1}",
            r.rank,
            r.stage,
            r.tp_rank,
            r.dp_rank,
            mib(r.params_bytes),
            mib(r.grads_bytes),
            mib(r.optimizer_states_bytes),
            mib(r.activations_bytes),
            mib(r.activations_without_checkpointing_bytes),
            mib(r.activations_with_checkpointing_bytes),
            r.micro_batches_in_flight,
            mib(r.layer_bytes),
            mib(r.comm_buffers_bytes),
            mib(r.predicted_peak_bytes),
            mib(r.offloaded_bytes),
        );
    }
    println!(
        "predicted peak RSS = model states + activations x in flight + layer + buckets + the logits' gradient (or the optimizer's NVMe stream, the larger) + {:.0} MiB of the process itself; on disk: what NVMe offload keeps out of memory",
        mib(ranks.first().map_or(0, |r| r.fixed_bytes))
    );
    Ok(ExitCode::SUCCESS)
}

/// DeepSpeed's estimators.
fn deepspeed(args: &EstimateArgs) -> anyhow::Result<ExitCode> {
    let (Some(stage), Some(params)) = (args.zero_stage, &args.params) else {
        bail!("estimate needs --zero-stage and --params (DeepSpeed's estimators), or --config (ds-rs's own model)");
    };
    let total = parse_count(params).map_err(|e| anyhow::anyhow!("--params {e}"))?;
    if args.num_gpus_per_node == 0 || args.num_nodes == 0 {
        bail!("--num-gpus-per-node and --num-nodes must be at least 1");
    }
    let factor = args.additional_buffer_factor;
    if !(factor.is_finite() && factor > 0.0) {
        bail!("--additional-buffer-factor {factor}: expected a positive number");
    }
    let cluster = Cluster {
        gpus_per_node: args.num_gpus_per_node,
        nodes: args.num_nodes,
        buffer_factor: factor,
    };
    let (rows, largest) = match stage {
        2 => (zero2_rows(total, &cluster), None),
        3 => {
            let text = args.largest_layer_params.as_deref().context(
                "--zero-stage 3 needs --largest-layer-params (the parameters of the largest layer)",
            )?;
            let largest =
                parse_count(text).map_err(|e| anyhow::anyhow!("--largest-layer-params {e}"))?;
            (zero3_rows(total, largest, &cluster), Some(largest))
        }
        s => bail!("--zero-stage {s}: DeepSpeed has estimators for stages 2 and 3"),
    };
    match args.json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", table(&rows, total, largest, &cluster)),
    }
    Ok(ExitCode::SUCCESS)
}
