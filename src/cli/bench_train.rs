//! `ds-rs bench train`: the peer benchmark's training measurement (../shared/bench:
//! train_ds.py) for ds-rs: the same model preset, ds_config, token stream and sample order,
//! 3 warm-up + 20 timed steps, median step time on rank 0, tokens/s and peak RSS per rank.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use ds_comm::{init, options_for, Groups};
use ds_data::{SampleOrder, SyntheticTokens, Windows};
use ds_engine::parallel::Tp;
use ds_engine::Batch;
use ds_engine::EngineOptions;
use ds_models::ModelSpec;

#[derive(clap::Args, Debug, Clone)]
pub struct TrainBenchArgs {
    /// The model, as `train --model` takes it: a preset (the peer's tiny, small, gpt2, or
    /// llama-small, ...), a GPT model JSON or a Hugging Face model directory.
    #[arg(long = "model", alias = "preset", default_value = "tiny")]
    model: String,
    /// Tokens per sample (default: the model's).
    #[arg(long)]
    seq_len: Option<usize>,
    /// The ds_config (e.g. ../shared/bench/configs/zero2.json).
    #[arg(long)]
    config: PathBuf,
    /// Ranks to start on this host (ignored inside `ds-rs launch`).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Initial weights (safetensors under the model's parameter names).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Write the initial weights (safetensors, the model's parameter names) here first.
    #[arg(long)]
    save_init: Option<PathBuf>,
    /// Before training, load the newest checkpoint of this directory (a ds-rs one, or a
    /// DeepSpeed one imported by `ds-rs checkpoint import-deepspeed`) and go on from its
    /// step, the data where it stopped (the peer's --load-dir).
    #[arg(long)]
    load_dir: Option<PathBuf>,
    /// After the last step, save a checkpoint here (tag global_stepN; the peer's --save-dir).
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    layout: crate::flags::LayoutArgs,
    /// Positions per tile of the MLPs and the logits and loss (train's --tile).
    #[arg(long)]
    tile: Option<usize>,
    #[command(flatten)]
    training: crate::flags::TrainingArgsCli,
    #[command(flatten)]
    backend: crate::flags::BackendArg,
    #[command(flatten)]
    device: crate::flags::DeviceArg,
}

pub fn run(args: &TrainBenchArgs) -> anyhow::Result<ExitCode> {
    if crate::cli::local_ranks::inside_job() {
        return run_rank(args);
    }
    crate::cli::local_ranks::start_ranks(args.nproc, args.backend.dist_backend, "auto")
}

fn run_rank(args: &TrainBenchArgs) -> anyhow::Result<ExitCode> {
    let model = ModelSpec::resolve(&args.model, args.seq_len)?.with_tile(args.tile);
    let mut env = options_for(args.backend.dist_backend).context("reading the rank environment")?;
    env.gpu = args.device.gpu_ordinal();
    // "auto" values and a missing optimizer as `train` fills them
    let overrides = ds_engine::Overrides {
        layout: args.layout.flags(),
        training: Some(args.training.to_args()?),
        run_steps: Some((args.warmup + args.steps) as u64),
    };
    let source = ds_engine::ConfigSource::File(&args.config);
    let plan = ds_engine::JobPlan::new(source, env.world_size, &overrides, Some(&model))?;
    let (cfg, dims) = (&plan.config, plan.config.dims);
    // DeepSpeed's comms logger times every collective of rank 0 (its table printed after the
    // result)
    env.comms_logger = cfg.comms_logger.clone().filter(|c| c.enabled);
    let comm = init(&env).context("joining the job")?;
    let groups = Groups::new(&comm, dims)?;
    let rank = comm.rank();
    let opts = EngineOptions {
        init: args.init.clone(),
        device: args.device.open()?,
        // the benchmark prints its own report, and times the steps itself
        report: false,
        ..EngineOptions::default()
    };
    let mut engine = plan.engine(&model, &groups, opts)?;
    if let Some(path) = &args.save_init {
        engine.save_weights(path)?;
    }
    let s = engine.settings().clone();
    // The peer's stream: uniform tokens (V, 2^20 tokens, seed 1234) in windows of T+1.
    let source = SyntheticTokens::new(
        model.vocab_size(),
        SyntheticTokens::PEER_LEN,
        SyntheticTokens::PEER_SEED,
    )?;
    let source = Windows::new(std::sync::Arc::new(source), model.seq_len)?;
    // tensor- and sequence-parallel peers train on the same samples
    let (replica, replicas) = (groups.replica(), dims.replicas());
    let order = SampleOrder::new(
        model.seq_len,
        s.micro_batch,
        s.grad_accum,
        replica,
        replicas,
    )?;
    let sp = groups.sp();
    let start = match &args.load_dir {
        Some(dir) => {
            engine
                .load_checkpoint(dir, None)?
                .with_context(|| format!("{}: no checkpoint (no `latest`)", dir.display()))?;
            engine.global_steps()
        }
        None => 0,
    };
    let mut m = Measured::default();
    let device = engine.device();
    for step in start..start + (args.warmup + args.steps) as u64 {
        let batches: Vec<Batch> = (0..s.grad_accum)
            .map(|k| {
                let b = order.micro_batch(&source, step, k)?;
                Ok::<_, ds_data::DataError>(b.sequence_shard(sp.rank(), sp.size()))
            })
            .collect::<Result<_, _>>()?;
        let t0 = Instant::now();
        let (loss, _) = engine.train_batch(|k| Ok(batches[k].clone()))?;
        m.times.push(t0.elapsed().as_secs_f64());
        m.losses.push(loss);
        m.parts.push(engine.take_timings());
        m.gpu = crate::train::gpu_peak(m.gpu.take(), &device);
    }
    if let Some(dir) = &args.save_dir {
        let tag = format!("global_step{}", engine.global_steps());
        engine.save_checkpoint(
            dir,
            &tag,
            serde_json::json!({"step": engine.global_steps()}),
        )?;
    }
    m.memory = crate::train::gather_memory(&comm.world(), &engine.memory_report())?;
    let bubble = measured_bubble(&comm.world(), &groups, args.warmup, &m)?;
    if rank == 0 {
        report(args, &s, dims, &model, &m);
        if let Some(table) = comm.comms_summary() {
            println!("{table}");
        }
        if dims.pp > 1 {
            let whole = model.build(&Tp::none()).map_err(anyhow::Error::msg)?;
            let layout = ds_engine::pipeline_layout(cfg, &whole)?;
            print_bubble(&bubble, &layout, s.grad_accum, args.json);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Each stage's idle fraction over the timed steps (time waiting for its neighbours over the
/// step time; the mean over the stage's ranks), gathered from every rank.
fn measured_bubble(
    world: &ds_comm::Group,
    groups: &ds_comm::Groups,
    warmup: usize,
    m: &Measured,
) -> anyhow::Result<Vec<f64>> {
    let timed = warmup.min(m.times.len());
    let wait: f64 = m.parts[timed..]
        .iter()
        .map(|t| t.pipe_wait.as_secs_f64())
        .sum();
    let total: f64 = m.times[timed..].iter().sum();
    let micros = |s: f64| (s * 1e6) as u64;
    let mine = [groups.grid().stage_id() as u64, micros(wait), micros(total)];
    let all = world.all_gather_u64(&mine)?;
    let stages = groups.dims().pp;
    let mut per_stage = vec![(0.0, 0.0); stages];
    for r in all.chunks(3) {
        let (w, t) = &mut per_stage[r[0] as usize];
        *w += r[1] as f64;
        *t += r[2] as f64;
    }
    Ok(per_stage.iter().map(|(w, t)| w / t.max(1.0)).collect())
}

/// The measured idle fraction per stage beside the schedule's figure in theory: 1F1B's
/// (p - 1) / (m + p - 1), or with v virtual stages the interleaved (p - 1) / (v m + p - 1).
fn print_bubble(idle: &[f64], layout: &ds_engine::PipeLayout, micro_batches: usize, json: bool) {
    let (stages, chunks) = (layout.stages, layout.chunks);
    let p = stages as f64;
    let one_f_one_b = (p - 1.0) / (micro_batches as f64 + p - 1.0);
    let interleaved = layout.interleaved_bubble(micro_batches);
    let row = serde_json::json!({
        "pipeline": {"stages": stages, "virtual_stages": chunks, "micro_batches": micro_batches,
                     "idle_fraction_per_stage": idle, "theoretical_1f1b": one_f_one_b,
                     "theoretical_interleaved": interleaved}
    });
    match json {
        true => println!("{row}"),
        false => {
            let idle: Vec<String> = idle.iter().map(|f| format!("{:.3}", f)).collect();
            let theory = match interleaved {
                Some(t) => format!("interleaved x {chunks}: (p-1)/(vm+p-1) = {t:.3}; 1F1B's (p-1)/(m+p-1) = {one_f_one_b:.3}"),
                None => format!("1F1B's (p-1)/(m+p-1) = {one_f_one_b:.3}"),
            };
            println!(
                "pipeline bubble: {stages} stages, {micro_batches} micro-batches: idle fraction per stage {} ({theory})",
                idle.join(", ")
            );
        }
    }
}

/// What the steps measured on this rank, and every rank's peak RSS.
#[derive(Default)]
struct Measured {
    times: Vec<f64>,
    losses: Vec<f32>,
    parts: Vec<ds_engine::Timings>,
    memory: Vec<crate::train::RankMemory>,
    /// Rank 0's GPU memory: the driver's count after each step at its most, and the
    /// process's allocation peak (None on the CPU).
    gpu: Option<ds_engine::device::GpuInfo>,
}

fn report(
    args: &TrainBenchArgs,
    s: &ds_engine::Settings,
    dims: ds_config::ParallelDims,
    model: &ModelSpec,
    m: &Measured,
) {
    let (times, losses, parts) = (&m.times, &m.losses, &m.parts);
    let rss: Vec<f64> = m.memory.iter().map(|r| r.peak_rss_mib).collect();
    // wall_clock_breakdown: median forward / backward / step time of the timed steps
    let part_ms = |f: fn(&ds_engine::Timings) -> std::time::Duration| {
        let mut v: Vec<f64> = parts[args.warmup.min(parts.len())..]
            .iter()
            .map(|t| 1e3 * f(t).as_secs_f64())
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let mut timed = times[args.warmup.min(times.len())..].to_vec();
    timed.sort_by(f64::total_cmp);
    let median = timed.get(timed.len() / 2).copied().unwrap_or(f64::NAN);
    let tokens = (dims.replicas() * s.micro_batch * s.grad_accum * model.seq_len) as f64;
    // NVMe offload's I/O per timed step, and its rate while reading or writing
    let mut swap = ds_engine::IoTotals::default();
    for t in &parts[args.warmup.min(parts.len())..] {
        swap += t.swap;
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let per_step = |b: u64| mib(b) / args.steps.max(1) as f64;
    let row = serde_json::json!({
        "preset": args.model, "config": args.config.display().to_string(),
        "zero_stage": u8::from(s.zero.stage), "nproc": dims.world_size, "dp": dims.dp(), "tp": dims.tp, "sp": dims.sp,
        "step_ms_median": 1e3 * median,
        "step_ms_min": 1e3 * timed.first().copied().unwrap_or(f64::NAN),
        "step_ms_max": 1e3 * timed.last().copied().unwrap_or(f64::NAN),
        "tokens_per_s": tokens / median,
        "params": model.n_params(), "micro_batch": s.micro_batch,
        "tflops": model.flops_per_token() * tokens / median / 1e12,
        "loss_first": losses.first(), "loss_after_20": losses.get(20), "loss_last": losses.last(),
        "losses": losses,
        "peak_rss_mib": rss, "memory": m.memory,
        "gpu_memory_used_peak_mib": m.gpu.as_ref().map(|g| mib(g.used_bytes)),
        "gpu_memory_allocated_peak_mib": m.gpu.as_ref().and_then(|g| g.allocated_peak_bytes).map(mib),
        "forward_ms": part_ms(|t| t.forward), "backward_ms": part_ms(|t| t.backward),
        "step_ms": part_ms(|t| t.step),
        "swap_read_mib_per_step": per_step(swap.read_bytes),
        "swap_written_mib_per_step": per_step(swap.written_bytes),
        "swap_io_ms_per_step": 1e3 * swap.busy.as_secs_f64() / args.steps.max(1) as f64,
        "swap_mib_per_s": swap.mib_per_s(),
    });
    if args.json {
        println!("{row}");
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&row).expect("invariant: plain JSON")
        );
        if let Some(line) = crate::train::memory_line(&m.memory) {
            println!("{line}");
        }
    }
}
