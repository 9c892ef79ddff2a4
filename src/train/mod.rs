//! `ds-rs train`: trains a model (`--model`: the built-in GPT, a Hugging Face directory or a
//! preset) with a ds_config, on one
//! rank or as every rank of a job that `ds-rs launch` (or a scheduler) started. Rank 0 shows
//! progress and writes the metrics contract (metrics.jsonl, summary.json) and a chart.

pub(crate) mod chart;
mod data;
pub mod eval;
mod fit;
mod flops;
mod hf_args;
pub(crate) mod hf_out;
mod metrics;
mod progress;
mod report;
mod resume;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use ds_comm::{init, options_for, Backend, Communicator, Groups};
use ds_config::Config;
use ds_engine::monitor::Monitor;
use ds_engine::{ConfigSource, Engine, EngineError, EngineOptions, JobPlan, Overrides};
use ds_models::ModelSpec;

pub use metrics::{gather_memory, gpu_peak, memory_line, RankMemory};
use metrics::{EvalRecord, MetricsFile, StepRecord};
use progress::Progress;

/// The config of a run given none: AdamW with warmup and cosine decay, ZeRO-2 (see the file).
const DEFAULT_CONFIG: &str = include_str!("../../configs/examples/zero2.json");

#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// The ds_config (default: configs/examples/zero2.json, built in).
    #[arg(long, env = "DS_RS_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// A preset (GPT: tiny, small, gpt2; llama-tiny, llama-small, qwen2-tiny, mistral-tiny,
    /// llama3-1b, llama3-8b, gpt2-tiny, gpt2-124m), a GPT model JSON {"V","T","d","H","L"}, or
    /// a Hugging Face model directory (config.json of a gpt2, llama, mistral or qwen2 model;
    /// its model.safetensors or sharded index, when present, are the starting weights).
    #[arg(long, default_value = "tiny")]
    pub(crate) model: String,
    /// Tokens per sample (default: the model's: a config.json's max_position_embeddings up to
    /// 2048, a preset's own, the GPT's T).
    #[arg(long)]
    pub(crate) seq_len: Option<usize>,
    /// markov (learnable, with a known loss floor), uniform (the peer benchmark's tokens), a
    /// Megatron indexed dataset PREFIX (.bin/.idx), a token file *.bin (nanoGPT's raw ids,
    /// llm.c's headered files), a text or JSON-lines file (tokenized once by --tokenizer and
    /// cached beside it; without a tokenizer, text is read as bytes), or a blend as Megatron's
    /// --data-path spells it: "0.3 P1 0.7 P2".
    #[arg(long, default_value = "markov")]
    data: String,
    /// Validation data (any --data form, e.g. nanoGPT's val.bin), instead of a part of --data.
    #[arg(long)]
    eval_data: Option<String>,
    /// Train / validation / test proportions of each --data source, as Megatron's --split
    /// (by documents for indexed datasets); without it the last 5% is validation.
    #[arg(long)]
    split: Option<String>,
    /// The tokenizer.json for text --data (default: the --model directory's).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Read the training windows in file order every epoch (as a PyTorch loop without a
    /// shuffling sampler, the peer benchmark's) instead of a new order per epoch.
    #[arg(long)]
    no_shuffle: bool,
    /// Instruction data (JSON lines of prompt/completion): pack examples back to back into
    /// windows of seq + 1 tokens, instead of one example a sample padded (TRL's `packing`).
    #[arg(long)]
    packing: bool,
    /// Token width of a .bin file: u16 or u32.
    #[arg(long, default_value = "u16")]
    token_width: String,
    /// Optimizer steps to train (default 300, or --epochs' count); Hugging Face's --max_steps
    /// says the same.
    #[arg(long)]
    steps: Option<u64>,
    /// Passes over the training data; --steps or --max_steps, when given, override it (as the
    /// Trainer's --max_steps overrides --num_train_epochs).
    #[arg(long)]
    epochs: Option<f64>,
    /// Seed of the initial weights and of the Markov data.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Start from these weights (a safetensors file or a model directory, under the model's
    /// parameter names); instead of the --model directory's own.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Where metrics.jsonl, summary.json and the chart go (default: a new folder under runs/).
    #[arg(long)]
    metrics_dir: Option<PathBuf>,
    /// Evaluate on held-out data every N steps (0: only at the end).
    #[arg(long, default_value_t = 100)]
    eval_interval: u64,
    /// Global batches of held-out data in each evaluation.
    #[arg(long, default_value_t = 4)]
    eval_batches: u64,
    /// Write checkpoints here (tags global_stepN, `latest` names the newest).
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Save every N steps (0: only after the last step); needs --save-dir.
    #[arg(long, default_value_t = 0)]
    save_interval: u64,
    /// Keep only the newest K checkpoints (0: keep all).
    #[arg(long, default_value_t = 0)]
    keep_checkpoints: usize,
    /// After the last step, write the whole trained model here (safetensors, fp32, the
    /// model's parameter names).
    #[arg(long)]
    save_weights: Option<PathBuf>,
    /// After the last step, write a Hugging Face model directory here (config.json and
    /// safetensors that transformers' from_pretrained loads; Llama-family models). At ZeRO-3
    /// the config must set zero_optimization.stage3_gather_16bit_weights_on_model_save, as
    /// DeepSpeed's save_16bit_model asks.
    #[arg(long)]
    pub(crate) save_hf: Option<PathBuf>,
    /// The dtype of --save-hf's tensors: fp32, bf16 or fp16 (default: the run's precision).
    #[arg(long)]
    save_hf_dtype: Option<String>,
    /// --save-hf writes shard files of at most this many bytes (with an index when there are
    /// several); transformers' default is 5 GB.
    #[arg(long, default_value_t = ds_models::hf_export::DEFAULT_MAX_SHARD_BYTES)]
    save_hf_shard_bytes: u64,
    /// Resume from the newest checkpoint of --save-dir, if any (also done on every restart
    /// by `ds-rs launch --max_restarts`), in whatever layout it was saved.
    #[arg(long)]
    resume: bool,
    /// Start from a DeepSpeed ZeRO checkpoint (engine.save_checkpoint's directory, with
    /// `latest`): imported into --save-dir first, as `ds-rs checkpoint import-deepspeed`
    /// does, then resumed in this run's layout. A --save-dir that already holds checkpoints
    /// resumes from its own newest instead (a restart after the import).
    #[arg(long, requires = "save_dir")]
    resume_from_deepspeed: Option<PathBuf>,
    /// Start even when the memory check predicts that this host's ranks need more memory
    /// than the job may use (the cgroup's limit, the host's available memory).
    #[arg(long)]
    pub(crate) skip_memory_check: bool,
    #[command(flatten)]
    pub(crate) layout: crate::flags::LayoutArgs,
    /// Compute the MLPs and the logits and loss this many positions at a time, their
    /// activations computed again in backward (DeepSpeed's TiledMLP and
    /// TiledFusedLogitsLoss): their memory then no longer grows with the sequence. Off by
    /// default; with tensor parallelism the vocabulary-parallel loss is not tiled (an error).
    #[arg(long)]
    pub(crate) tile: Option<usize>,
    #[command(flatten)]
    pub(crate) training: crate::flags::TrainingArgsCli,
    #[command(flatten)]
    pub(crate) trainer: crate::flags::TrainerRunArgs,
    /// What the Trainer's arguments ask beyond the flags above (set by `resolved`).
    #[arg(skip)]
    pub(crate) trainer_plan: hf_args::TrainerPlan,
    #[command(flatten)]
    pub(crate) backend: crate::flags::BackendArg,
    #[command(flatten)]
    pub(crate) device: crate::flags::DeviceArg,
}

pub(crate) const DEFAULT_STEPS: u64 = 300;

/// What a run of `world` ranks trains, decided before any rank joins the job (the launcher
/// calls it too, so a bad combination is one error line before anything starts): the model,
/// and the job plan (the resolved config and its layout, checked against the model).
pub fn plan(args: &TrainArgs, world: usize) -> anyhow::Result<(ModelSpec, JobPlan)> {
    let args = &args.resolved()?;
    check_flags(args)?;
    let model = ModelSpec::resolve(&args.model, args.seq_len)?.with_tile(args.tile);
    // with --epochs alone the step count needs the data: planned with the default here, and
    // again with the count once the data is open (`run_joined`)
    let plan = plan_steps(
        args,
        world,
        &model,
        args.run_steps()?.unwrap_or(DEFAULT_STEPS),
    )?;
    if args.save_hf.is_some() {
        hf_out::check(args, &model, &plan.config)?;
    }
    Ok((model, plan))
}

/// Refuses, before any rank starts, a run whose ranks `local` (this host's) are predicted to
/// need more memory than the job may use here (src/train/fit.rs).
pub fn check_fits(
    args: &TrainArgs,
    model: &ModelSpec,
    plan: &JobPlan,
    local: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    if args.skip_memory_check {
        return Ok(());
    }
    match fit::host_limit() {
        Some(limit) => fit::check(&args.resolved()?, model, plan, local, &limit),
        None => Ok(()),
    }
}

/// This rank's host's ranks, as the rank environment gives them (this rank alone without one).
fn ranks_of_this_host() -> std::ops::Range<usize> {
    match ds_comm::env::RankEnv::from_env() {
        Ok(Some(e)) => {
            let first = e.rank.saturating_sub(e.local_rank);
            first..first + e.local_world_size.max(1)
        }
        _ => 0..1,
    }
}

/// The job plan of a run of `steps` steps (the schedule's length where "auto" or built by
/// the program).
fn plan_steps(
    args: &TrainArgs,
    world: usize,
    model: &ModelSpec,
    steps: u64,
) -> anyhow::Result<JobPlan> {
    let overrides = Overrides {
        layout: args.layout.flags(),
        training: Some(args.training.to_args()?),
        run_steps: Some(steps),
    };
    Ok(JobPlan::new(
        config_source(args.config.as_deref()),
        world,
        &overrides,
        Some(model),
    )?)
}

impl TrainArgs {
    /// The steps the run trains as the command line says them: `--steps`, or Hugging Face's
    /// `--max_steps` (the run's length in transformers too); both, differing, are an error.
    fn run_steps(&self) -> anyhow::Result<Option<u64>> {
        // transformers' default max_steps is -1: not given
        let max = self.training.max_steps.filter(|m| *m > 0).map(|m| m as u64);
        match (self.steps, max) {
            (Some(s), Some(m)) if s != m => anyhow::bail!(
                "--steps {s} and --max_steps {m} disagree: both are the run's length; give one"
            ),
            (s, m) => Ok(s.or(m)),
        }
    }
}

/// Flags that act only beside another are an error without it, naming the one they need:
/// never silence.
fn check_flags(args: &TrainArgs) -> anyhow::Result<()> {
    if args.save_dir.is_none() {
        let needs_dir = [
            (args.resume, "--resume"),
            (args.save_interval > 0, "--save-interval"),
            (args.keep_checkpoints > 0, "--keep-checkpoints"),
        ];
        if let Some((_, flag)) = needs_dir.into_iter().find(|(given, _)| *given) {
            anyhow::bail!(
                "{flag} needs --save-dir: the directory the checkpoints are written to and \
                 resumed from"
            );
        }
    }
    Ok(())
}

/// The config `--config` names, else the built-in default (configs/examples/zero2.json).
pub(crate) fn config_source(path: Option<&Path>) -> ConfigSource<'_> {
    match path {
        Some(p) => ConfigSource::File(p),
        None => ConfigSource::Text {
            text: default_config(),
            name: "the built-in default config",
        },
    }
}

/// The built-in config with its schedule as long as the run (`total_num_steps` "auto", which
/// the run's steps fill): the user chose no config, so `--steps` and `--max_steps` decide.
fn default_config() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let mut doc: serde_json::Value =
            serde_json::from_str(DEFAULT_CONFIG).expect("the built-in config is JSON");
        doc["scheduler"]["params"]["total_num_steps"] = "auto".into();
        doc.to_string()
    })
}

pub fn run(args: &TrainArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let args = &args.resolved()?;
    let mut env = options_for(args.backend.dist_backend).context("reading the rank environment")?;
    env.gpu = args.device.gpu_ordinal();
    ds_engine::crash_point::check()?;
    let (model, plan) = plan(args, env.world_size)?;
    if std::env::var_os(crate::launch::MEMORY_CHECKED).is_none() {
        check_fits(args, &model, &plan, ranks_of_this_host())?;
    }
    // DeepSpeed's comms logger times every collective of rank 0 (its table is printed at
    // the end)
    env.comms_logger = plan.config.comms_logger.clone().filter(|c| c.enabled);
    let comm = init(&env).context("joining the job")?;
    let result = run_joined(args, model, plan, &comm, started);
    if let (Err(e), Backend::Mpi) = (&result, comm.backend()) {
        // MPI would leave the other ranks waiting for this one: end the job, named.
        eprintln!("error: rank {}: {e:#}", comm.rank());
        comm.abort(1);
    }
    result
}

/// The run of a rank that has joined the job.
fn run_joined(
    args: &TrainArgs,
    model: ModelSpec,
    plan: JobPlan,
    comm: &Communicator,
    started: Instant,
) -> anyhow::Result<ExitCode> {
    if comm.rank() == 0 && !launcher_warned(args.config.as_deref()) {
        crate::launch::print_config_warnings(&plan.config);
    }
    // a config.json's length capped to ds_models::DEFAULT_MAX_SEQ: said, so it is no surprise
    let capped = model.source_config.is_some() && model.seq_len < model.max_positions();
    if comm.rank() == 0 && args.seq_len.is_none() && capped {
        println!(
            "sequence length {} by default (the model's config allows {}; --seq-len sets another)",
            model.seq_len,
            model.max_positions()
        );
    }
    if comm.rank() == 0 {
        if let Some(line) = ds_engine::program_optimizer_line(&plan.config) {
            println!("{line}");
        }
    }
    let groups = Groups::new(comm, plan.config.dims)?;
    let s = ds_engine::Settings::from_config(&plan.config, false)?;
    let width = data::token_width(&args.token_width)?;
    let data = data::open(
        &data::DataArgs {
            data: &args.data,
            eval_data: args.eval_data.as_deref(),
            split: args.split.as_deref(),
            tokenizer: data::tokenizer_path(args.tokenizer.as_deref(), &args.model),
            shuffle: !args.no_shuffle,
            packing: args.packing,
            width,
        },
        &data::Layout::of(&model, &s, &groups, args.seed),
    )?;
    let (steps, plan) = match (args.run_steps()?, args.epochs) {
        (Some(n), _) => (n, plan),
        (None, Some(e)) => {
            let n = (e / data.train.epochs(1)).ceil().max(1.0) as u64;
            (n, plan_steps(args, comm.world_size(), &model, n)?)
        }
        (None, None) => (DEFAULT_STEPS, plan),
    };
    let cfg = &plan.config;
    let device = args.device.open()?;
    let opts = EngineOptions {
        seed: args.seed,
        init: args.init.clone(),
        device: device.clone(),
        // rank 0 draws its own progress (progress.rs); the monitors are the engine's
        report: false,
        ..EngineOptions::default()
    };
    let mut engine = plan.engine(&model, &groups, opts)?;
    let per_epoch = (1.0 / data.train.epochs(1)).round().max(1.0) as u64;
    let tp = &args.trainer_plan;
    let export = args
        .save_hf
        .clone()
        .or_else(|| hf_out::model_export(args, &model, cfg, comm.rank() == 0));
    let run = Run {
        args,
        model,
        cfg,
        steps,
        eval_every: if tp.eval_each_epoch {
            per_epoch
        } else {
            args.eval_interval
        },
        save_every: if tp.save_each_epoch {
            per_epoch
        } else {
            args.save_interval
        },
        export,
        dir: metrics_dir(args, comm.rank())?,
        device,
    };
    run.train(&mut engine, &data, comm, started)
}

struct Run<'a> {
    args: &'a TrainArgs,
    model: ModelSpec,
    cfg: &'a Config,
    steps: u64,
    /// Evaluate / save every N steps (0: not on a schedule).
    eval_every: u64,
    save_every: u64,
    /// Where the trained model goes as a Hugging Face directory (--save-hf, --output_dir).
    export: Option<PathBuf>,
    dir: PathBuf,
    /// Where the layers compute (a GPU's name and memory go into the summary).
    device: ds_engine::Device,
}

impl Run<'_> {
    fn train(
        &self,
        engine: &mut Engine,
        data: &data::Data,
        comm: &Communicator,
        started: Instant,
    ) -> anyhow::Result<ExitCode> {
        let rank0 = comm.rank() == 0;
        let s = engine.settings().clone();
        let samples = (s.micro_batch * s.grad_accum * self.cfg.dims.replicas()) as f64;
        let tokens = samples * self.model.seq_len as f64;
        let flops_per_token = self.model.flops_per_token();
        let start = self.resume(engine, data, rank0)?;
        let (mut file, mut records, mut evals) = match rank0 {
            true => {
                let (f, r, e) = MetricsFile::open(&self.dir, start)?;
                (Some(f), r, e)
            }
            false => (None, Vec::new(), Vec::new()),
        };
        let mut trainer_tb = self.trainer_monitor(comm.rank())?;
        let every = self.args.trainer.logging_steps;
        let mut progress = Progress::new(
            start,
            self.steps,
            every.unwrap_or(ds_engine::steps_per_print(self.cfg)),
        );
        if rank0 {
            self.announce(data, comm, &s);
            write_resolved(&self.dir, self.cfg)?;
        }
        let mut first_step_s = None;
        let mut wall = ds_engine::Timings::default();
        let mut gpu_peak: Option<ds_engine::device::GpuInfo> = None;
        for step in start..self.steps {
            let t0 = Instant::now();
            let mut reading = std::time::Duration::ZERO;
            let (loss, out) = engine.train_batch(|k| {
                let t = Instant::now();
                let batch = data.train.micro_batch(step, k);
                reading += t.elapsed();
                batch.map_err(EngineError::input)
            })?;
            let dt = t0.elapsed().as_secs_f64();
            first_step_s.get_or_insert(started.elapsed().as_secs_f64());
            let r = StepRecord {
                step,
                loss: loss as f64,
                lr: out.lr,
                loss_scale: out.loss_scale,
                skipped: out.skipped,
                grad_norm: out.grad_norm,
                tokens_per_s: tokens / dt,
                samples_per_s: samples / dt,
                step_ms: 1e3 * dt,
                data_ms: 1e3 * reading.as_secs_f64(),
                tflops: tokens * flops_per_token / dt / 1e12,
                unix_ms: unix_ms(),
            };
            trainer_tb.write_events(&trainer_events(&r))?;
            if let Some(f) = &mut file {
                f.write(&r)?;
                progress.step(&r);
                for m in &out.messages {
                    progress.note(m);
                }
            }
            let timings = engine.take_timings();
            if rank0 {
                gpu_peak = metrics::gpu_peak(gpu_peak, &self.device);
                self.profile(engine, step, &timings)?;
                wall.add(&timings);
                self.wall_clock(&mut wall, step, &progress);
            }
            records.push(r);
            let last = step + 1 == self.steps && self.args.trainer_plan.final_eval;
            if last || (self.eval_every > 0 && (step + 1).is_multiple_of(self.eval_every)) {
                let e = self.evaluate(engine, data, step)?;
                if let Some(f) = &mut file {
                    f.write(&e)?;
                    let seen = (step + 1) * samples as u64;
                    engine.write_events(&[("Train/Samples/eval_loss", e.eval_loss, seen)])?;
                    trainer_tb.write_events(&[("eval/loss", e.eval_loss, step + 1)])?;
                    progress.note(&format!("step {} | eval loss {:.4}", step + 1, e.eval_loss));
                }
                evals.push(e);
                if rank0 {
                    // redrawn at each evaluation, so a long run's chart is never stale
                    self.write_chart(data, &records, &evals)?;
                }
            }
            self.checkpoint(engine, data, step)?;
            if out.trial_complete {
                // an autotuning trial's profile is measured: the run ends, as DeepSpeed's
                break;
            }
        }
        if rank0 {
            progress.finish();
        }
        if let Some(path) = &self.args.save_weights {
            engine.save_weights(path)?;
        }
        if let Some(dir) = &self.export {
            hf_out::save(self, engine, data, comm, dir)?;
        }
        let memory = metrics::gather_memory(&comm.world(), &engine.memory_report())?;
        if rank0 {
            let mut summary = self.summary(data, comm, &records, &evals, &memory, first_step_s);
            summary["gpu"] = metrics::gpu_summary(
                gpu_peak.as_ref(),
                &memory[0],
                &records,
                &s,
                comm.world_size(),
            );
            metrics::write_summary(&self.dir, &summary)?;
            self.write_chart(data, &records, &evals)?;
            self.print_summary(&summary, &memory);
            if let Some(table) = comm.comms_summary() {
                println!("{table}");
            }
        }
        Ok(ExitCode::SUCCESS)
    }

    /// The held-out loss over `--eval-batches` global batches: the same windows at every
    /// evaluation and in every layout (each rank evaluates its share of each).
    fn evaluate(
        &self,
        engine: &mut Engine,
        data: &data::Data,
        step: u64,
    ) -> anyhow::Result<EvalRecord> {
        let (batches, ga) = (self.args.eval_batches.max(1), engine.settings().grad_accum);
        let mut sum = 0.0f64;
        for b in 0..batches {
            let micro = |k| data.eval.micro_batch(b, k).map_err(EngineError::input);
            sum += engine.eval_batch(micro)? as f64 * ga as f64;
        }
        Ok(EvalRecord {
            step,
            eval_loss: sum / (batches * ga as u64) as f64,
        })
    }

    /// DeepSpeed's wall_clock_breakdown line, every steps_per_print steps: the mean forward,
    /// backward and step time of those steps.
    fn wall_clock(&self, wall: &mut ds_engine::Timings, step: u64, progress: &Progress) {
        let every = ds_engine::steps_per_print(self.cfg);
        if !self.cfg.wall_clock_breakdown || !(step + 1).is_multiple_of(every) {
            return;
        }
        progress.note(&ds_engine::wall_clock_line(&std::mem::take(wall), every));
    }

    /// The flops profiler's report of the step that starts with `profile_step` steps done
    /// (DeepSpeed's rule: the default 1 skips the first, warm-up step).
    fn profile(
        &self,
        engine: &Engine,
        step: u64,
        timings: &ds_engine::Timings,
    ) -> anyhow::Result<()> {
        let fp = &self.cfg.flops_profiler;
        if !fp.enabled || step as i64 != fp.profile_step {
            return Ok(());
        }
        let s = engine.settings();
        let layers = engine.layer_profile(self.model.seq_len);
        flops::emit(
            fp,
            &flops::ProfileInput {
                step,
                world: self.cfg.dims.world_size,
                dp: self.cfg.dims.replicas(),
                micro_batch: s.micro_batch,
                grad_accum: s.grad_accum,
                layers: &layers,
                timings,
            },
        )
    }
}

impl Run<'_> {
    /// `--report_to tensorboard`: the Trainer's scalars, under its tags and with the global
    /// step as x (DeepSpeed's own monitor, from the config, counts samples instead).
    fn trainer_monitor(&self, rank: usize) -> anyhow::Result<Monitor> {
        use ds_config::monitor::FileMonitorConfig;
        let off = FileMonitorConfig {
            enabled: false,
            output_path: String::new(),
            job_name: String::new(),
        };
        let Some(dir) = &self.args.trainer_plan.tensorboard else {
            return Ok(Monitor::new(&off, &off, rank)?);
        };
        let dir = match dir.as_os_str().is_empty() {
            true => self.dir.join("runs"),
            false => dir.clone(),
        };
        let tb = FileMonitorConfig {
            enabled: true,
            output_path: dir.display().to_string(),
            job_name: String::new(),
        };
        Ok(Monitor::new(&tb, &off, rank)?)
    }
}

/// The Trainer's per-step TensorBoard scalars, with throughput beside them.
fn trainer_events(r: &StepRecord) -> [(&'static str, f64, u64); 5] {
    let step = r.step + 1;
    [
        ("train/loss", r.loss, step),
        ("train/learning_rate", r.lr, step),
        ("train/grad_norm", r.grad_norm, step),
        ("train/tokens_per_second", r.tokens_per_s, step),
        ("train/tflops", r.tflops, step),
    ]
}

/// Whether the launcher that started this rank printed the warnings of this config already.
fn launcher_warned(path: Option<&Path>) -> bool {
    let warned = std::env::var_os(crate::launch::CONFIG_WARNED);
    matches!((warned, path), (Some(w), Some(p)) if Path::new(&w) == p)
}

/// ds_config.resolved.json beside the metrics: the config as this run resolved it, itself a
/// config that trains the same run (with the same training arguments).
fn write_resolved(dir: &Path, cfg: &Config) -> anyhow::Result<()> {
    let path = dir.join("ds_config.resolved.json");
    let text = serde_json::to_string_pretty(&cfg.resolved_document())?;
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// --metrics-dir, else runs/train-<unix seconds> (rank 0 alone writes there).
fn metrics_dir(args: &TrainArgs, rank: usize) -> anyhow::Result<PathBuf> {
    let dir = match &args.metrics_dir {
        Some(d) => d.clone(),
        None => PathBuf::from("runs").join(format!("train-{}", unix_ms() / 1000)),
    };
    if rank == 0 {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating metrics directory {}", dir.display()))?;
    }
    Ok(dir)
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}
