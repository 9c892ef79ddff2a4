//! `ds-rs launch --autotuning tune|run ... --config ds.json train ...` (and `ds-rs autotune`,
//! the same as `--autotuning tune`): DeepSpeed's autotuner in fast mode over ZeRO stage and
//! micro-batch for ds-rs's own `train`. The memory model (`ds-rs estimate --config`) prunes
//! what cannot fit the memory per rank; every other candidate runs as a real trial through
//! the launcher for `autotuning.end_profile_step` steps. Outputs in DeepSpeed's layout:
//! `exps_dir/<name>.json`, `results_dir/<name>/{ds_config.json, cmd.txt, metrics.json,
//! stdout.log, stderr.log}`, `results_dir/summary.txt`, `ds_config_optimal.json`,
//! `cmd_optimal.txt`, and `records.json` (every trial, pruned and failed ones included).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ds_autotune::memory::{estimate, Run};
use ds_autotune::tuning::{best, tune, Experiment, Outcome, Record, Space, Trials};
use ds_engine::gpt::GptConfig;
use serde_json::{json, Value as Json};

use crate::launch::LaunchArgs;

/// `--autotuning`: tune only, or tune and then run the best configuration.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Tune,
    Run,
}

const METRICS: [&str; 3] = ["throughput", "latency", "flops"];
const TUNERS: [&str; 3] = ["gridsearch", "random", "model_based"];
/// Options of the tuner itself, not passed to the trials' launcher.
const OWN_FLAGS: [&str; 4] = [
    "--autotuning",
    "--memory_per_rank",
    "--trial_timeout",
    "--config",
];
/// `train` options each trial sets itself.
const TRIAL_FLAGS: [&str; 6] = [
    "--steps",
    "--epochs",
    "--metrics-dir",
    "--eval-interval",
    "--eval-batches",
    "--config",
];

pub fn run(args: &LaunchArgs, mode: Mode) -> anyhow::Result<ExitCode> {
    let tuner = Tuner::new(args)?;
    let stop = crate::launch::StopFlag::on_signals()?;
    let mut trials = Runner {
        tuner: &tuner,
        stop: &stop,
        count: 0,
    };
    let started = Instant::now();
    let records = tune(&tuner.space, &mut trials)?;
    tuner.report(&records, started.elapsed())?;
    if stop.get().is_some() {
        eprintln!(
            "autotuning: stopped; the results so far are in {}",
            tuner.results.display()
        );
        return Ok(ExitCode::from(130));
    }
    let Some(winner) = best(&records) else {
        bail!(
            "autotuning: no trial ran successfully; see {}",
            tuner.results.join("summary.txt").display()
        );
    };
    println!(
        "autotuning: best {} ({}); optimal config in {}",
        winner.experiment.name,
        tuner.metric_text(&winner.outcome),
        tuner.results.join("ds_config_optimal.json").display()
    );
    if mode == Mode::Run {
        let status = tuner
            .launch(
                &tuner.results.join("ds_config_optimal.json"),
                &tuner.user_program,
            )
            .status()
            .context("starting the best configuration")?;
        return Ok(ExitCode::from(status.code().unwrap_or(1) as u8));
    }
    Ok(ExitCode::SUCCESS)
}

/// Everything fixed for the whole search.
struct Tuner {
    /// The user's ds_config, as JSON.
    user: Json,
    space: Space,
    model: GptConfig,
    memory_per_rank: u64,
    metric: String,
    start_profile_step: u64,
    end_profile_step: u64,
    results: PathBuf,
    exps: PathBuf,
    trial_timeout: Duration,
    /// The launcher options the trials share (without the tuner's own).
    launcher_flags: Vec<String>,
    /// The user's `train ...`, and the same without the options each trial sets.
    user_program: Vec<String>,
    trial_program: Vec<String>,
    nproc: usize,
    tp: Option<usize>,
    pp: Option<usize>,
}

impl Tuner {
    fn new(args: &LaunchArgs) -> anyhow::Result<Tuner> {
        let path = args
            .config
            .as_deref()
            .context("autotuning needs --config ds.json (with its `autotuning` section)")?;
        let user = ds_config::load(path)?.to_json();
        let name = || path.display().to_string();
        let program = args.program.clone();
        if program.first().map(String::as_str) != Some("train") {
            bail!("autotuning runs ds-rs's own `train` (got `{}`); tuning a program that embeds the engine (autotuning.arg_mappings, metric_path) is not implemented yet in ds-rs (issue 18)", program.join(" "));
        }
        let train = parse_train(&program)?;
        let nproc = args.local_ranks()?;
        let at = &user["autotuning"];
        let text = |k: &str, d: &str| at.get(k).and_then(Json::as_str).unwrap_or(d).to_string();
        let int = |k: &str, d: i64| at.get(k).and_then(Json::as_i64).unwrap_or(d);
        let metric = text("metric", "throughput");
        if !METRICS.contains(&metric.as_str()) {
            bail!(
                "{}: autotuning.metric = {metric:?}: expected one of {METRICS:?}",
                name()
            );
        }
        let tuner_type = text("tuner_type", "gridsearch");
        if !TUNERS.contains(&tuner_type.as_str()) {
            bail!(
                "{}: autotuning.tuner_type = {tuner_type:?}: expected one of {TUNERS:?}",
                name()
            );
        }
        if at.get("fast").and_then(Json::as_bool) == Some(false) {
            bail!("{}: autotuning.fast = false: tuning ZeRO's other settings beyond stage and micro-batch is not implemented yet in ds-rs (issue 18); set it to true", name());
        }
        if at.get("overwrite").and_then(Json::as_bool) == Some(false) {
            bail!("{}: autotuning.overwrite = false: reusing earlier trials' results is not implemented yet in ds-rs (issue 18); remove it or set it to true", name());
        }
        for (key, why) in [
            (
                "model_info",
                "ds-rs computes the model's size from the model itself",
            ),
            (
                "model_info_path",
                "ds-rs computes the model's size from the model itself",
            ),
            (
                "metric_path",
                "each trial's metrics are read from its own metrics directory",
            ),
        ] {
            if at.get(key).is_some() {
                println!("warning: autotuning.{key}: ignored; {why}");
            }
        }
        let space = space_of(&user, at, nproc, &name)?;
        let results = PathBuf::from(text("results_dir", "autotuning_results"));
        let exps = PathBuf::from(text("exps_dir", "autotuning_exps"));
        for dir in [&results, &exps] {
            writable(dir).with_context(|| format!("{}: autotuning: {}", name(), dir.display()))?;
        }
        let memory_per_rank = match &args.memory_per_rank {
            Some(m) => parse_bytes(m).map_err(|e| anyhow::anyhow!("--memory_per_rank {e}"))?,
            None => host_memory()? / nproc as u64,
        };
        let end = int("end_profile_step", 5).max(1) as u64;
        Ok(Tuner {
            model: crate::train::model_config(&train.model)?,
            space,
            memory_per_rank,
            metric,
            start_profile_step: int("start_profile_step", 3).clamp(0, end as i64 - 1) as u64,
            end_profile_step: end,
            results,
            exps,
            trial_timeout: Duration::from_secs(args.trial_timeout),
            launcher_flags: launcher_flags(&program),
            trial_program: without(&program, &TRIAL_FLAGS),
            user_program: without(&program, &["--config"]),
            nproc,
            tp: train.tp,
            pp: train.pp,
            user,
        })
    }

    /// The trial's ds_config: the user's with this stage, micro-batch and accumulation, and no
    /// lists left (DeepSpeed's `get_first_config`) nor an autotuning section.
    fn trial_config(&self, e: &Experiment) -> Json {
        let mut c = self.user.clone();
        let o = c.as_object_mut().expect("a ds_config is an object");
        o.remove("autotuning");
        o.insert(
            "train_micro_batch_size_per_gpu".into(),
            json!(e.micro_batch),
        );
        o.insert("gradient_accumulation_steps".into(), json!(e.gas));
        o.insert("train_batch_size".into(), json!(e.train_batch_size));
        let zero = o.entry("zero_optimization").or_insert_with(|| json!({}));
        zero["stage"] = json!(e.stage);
        first_of_lists(&mut c);
        c
    }

    /// The memory model's peak of the largest rank for this trial.
    fn predicted_peak(&self, e: &Experiment) -> anyhow::Result<u64> {
        let text = serde_json::to_string(&self.trial_config(e))?;
        let doc = ds_config::hjson::parse(&text).map_err(|e| anyhow::anyhow!("{e}"))?;
        let dims = ds_config::parallel_dims(&doc, self.nproc, self.tp, self.pp)?;
        let config = ds_config::resolve(&doc, &dims)?;
        let ranks = estimate(&Run {
            config: &config,
            model: &self.model,
            micro_batch: Some(e.micro_batch),
        })?;
        Ok(ranks
            .iter()
            .map(|r| r.predicted_peak_bytes)
            .max()
            .unwrap_or(0))
    }

    fn launch(&self, config: &Path, program: &[String]) -> Command {
        let mut cmd = Command::new(std::env::current_exe().expect("the running binary"));
        cmd.arg("launch").args(&self.launcher_flags);
        cmd.arg("--config").arg(config).args(program);
        cmd
    }

    /// Larger is better for every metric the search compares (latency is negated).
    fn metric_text(&self, o: &Outcome) -> String {
        match (o, self.metric.as_str()) {
            (Outcome::Metric(v), "latency") => format!("latency {:.4} s/step", -v),
            (Outcome::Metric(v), "flops") => format!("{v:.4} TFLOP/s"),
            (Outcome::Metric(v), _) => format!("throughput {v:.2} samples/s"),
            (Outcome::Failed(why), _) => format!("failed: {why}"),
            (Outcome::Pruned(why), _) => format!("pruned: {why}"),
        }
    }

    fn report(&self, records: &[Record], took: Duration) -> anyhow::Result<()> {
        let write = |name: &str, text: String| {
            let p = self.results.join(name);
            std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
        };
        write("records.json", serde_json::to_string_pretty(records)?)?;
        self.chart(records)?;
        let mut summary = format!(
            "ds-rs autotuning ({} mode, metric {}): model {}, {} ranks, {} MiB per rank\n\n| # | experiment | stage | micro-batch | gas | predicted peak MiB | result |\n| --- | --- | --- | --- | --- | --- | --- |\n",
            "fast",
            self.metric,
            self.user_program.iter().skip_while(|a| *a != "--model").nth(1).map_or("tiny", String::as_str),
            self.nproc,
            self.memory_per_rank >> 20
        );
        for (i, r) in records.iter().enumerate() {
            let e = &r.experiment;
            summary.push_str(&format!(
                "| {i} | {} | {} | {} | {} | {} | {} |\n",
                e.name,
                e.stage,
                e.micro_batch,
                e.gas,
                r.predicted_peak_bytes >> 20,
                self.metric_text(&r.outcome)
            ));
        }
        let ran = records
            .iter()
            .filter(|r| !matches!(r.outcome, Outcome::Pruned(_)))
            .count();
        summary.push_str(&format!(
            "\nexperiments: {} ({ran} run, {} pruned by the memory model); total time {:.0} s\n",
            records.len(),
            records.len() - ran,
            took.as_secs_f64()
        ));
        if let Some(b) = best(records) {
            summary.push_str(&format!(
                "best: {} ({})\n",
                b.experiment.name,
                self.metric_text(&b.outcome)
            ));
            let optimal = self.results.join("ds_config_optimal.json");
            write(
                "ds_config_optimal.json",
                serde_json::to_string_pretty(&self.trial_config(&b.experiment))?,
            )?;
            let cmd = self.launch(&optimal, &self.user_program);
            write("cmd_optimal.txt", command_line(&cmd) + "\n")?;
        }
        write("summary.txt", summary)
    }
}

impl Tuner {
    /// `autotune.png`: each trial's metric (gaps where it failed or was pruned) and its
    /// predicted peak beside the memory per rank, by trial number (summary.txt's `#`).
    fn chart(&self, records: &[Record]) -> anyhow::Result<()> {
        let metric: Vec<(f64, f64)> = records
            .iter()
            .enumerate()
            .map(|(i, r)| match r.outcome {
                Outcome::Metric(v) if self.metric == "latency" => (i as f64, -v),
                Outcome::Metric(v) => (i as f64, v),
                _ => (i as f64, f64::NAN),
            })
            .collect();
        let peak: Vec<(f64, f64)> = records
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (
                    i as f64,
                    r.predicted_peak_bytes as f64 / (1u64 << 20) as f64,
                )
            })
            .collect();
        let limit = self.memory_per_rank as f64 / (1u64 << 20) as f64;
        let series = [
            crate::train::chart::Series {
                title: "each trial's metric (gaps: failed or pruned)",
                y_label: &self.metric,
                points: &metric,
                floor: None,
            },
            crate::train::chart::Series {
                title: "predicted peak RSS of the largest rank (MiB)",
                y_label: "MiB",
                points: &peak,
                floor: Some((limit, "memory per rank")),
            },
        ];
        let path = self.results.join("autotune.png");
        crate::train::chart::write_png_over(
            &path,
            "ds-rs autotuning",
            "trial (# in summary.txt)",
            &series,
        )?;
        Ok(())
    }
}

/// The trials, run one after another through the launcher.
struct Runner<'a> {
    tuner: &'a Tuner,
    stop: &'a crate::launch::StopFlag,
    count: usize,
}

impl Trials for Runner<'_> {
    fn fits(&mut self, stage: u8, micro_batch: usize) -> anyhow::Result<(bool, u64)> {
        let s = &self.tuner.space;
        let e = Experiment {
            name: String::new(),
            stage,
            micro_batch,
            gas: s.gas,
            train_batch_size: micro_batch * s.gas * s.ranks / s.mp.max(1),
        };
        let peak = self.tuner.predicted_peak(&e)?;
        Ok((peak <= self.tuner.memory_per_rank, peak))
    }

    fn run(&mut self, e: &Experiment, predicted: u64) -> Outcome {
        self.count += 1;
        let outcome = self
            .trial(e)
            .unwrap_or_else(|err| Outcome::Failed(format!("{err:#}")));
        println!(
            "[autotune] trial {} {}: {} (predicted peak {} MiB)",
            self.count,
            e.name,
            self.tuner.metric_text(&outcome),
            predicted >> 20
        );
        outcome
    }

    fn stopped(&self) -> bool {
        self.stop.get().is_some()
    }
}

impl Runner<'_> {
    fn trial(&self, e: &Experiment) -> anyhow::Result<Outcome> {
        let t = self.tuner;
        let dir = t.results.join(&e.name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let config = dir.join("ds_config.json");
        let ds = t.trial_config(e);
        std::fs::write(&config, serde_json::to_string_pretty(&ds)?)?;
        let exp = json!({"name": e.name, "ds_config": ds, "num_gpus": t.nproc, "num_nodes": 1});
        std::fs::write(
            t.exps.join(format!("{}.json", e.name)),
            serde_json::to_string_pretty(&exp)?,
        )?;
        let metrics = dir.join("metrics");
        let _ = std::fs::remove_dir_all(&metrics);
        let mut program = t.trial_program.clone();
        program.extend([
            "--steps".into(),
            t.end_profile_step.to_string(),
            "--eval-interval".into(),
            "0".into(),
            "--eval-batches".into(),
            "1".into(),
            "--metrics-dir".into(),
            metrics.display().to_string(),
        ]);
        let mut cmd = t.launch(&config, &program);
        std::fs::write(dir.join("cmd.txt"), command_line(&cmd) + "\n")?;
        let stdout = std::fs::File::create(dir.join("stdout.log"))?;
        let stderr = std::fs::File::create(dir.join("stderr.log"))?;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .context("starting the trial")?;
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if started.elapsed() > t.trial_timeout || self.stop.get().is_some() {
                // the launcher stops its ranks on SIGTERM
                unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                let _ = child.wait();
                let why = match self.stop.get() {
                    Some(_) => "stopped".to_string(),
                    None => format!(
                        "exceeded the trial time limit of {} s",
                        t.trial_timeout.as_secs()
                    ),
                };
                return Ok(Outcome::Failed(why));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if !status.success() {
            let err = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
            // the first error is the cause (a rank's); the launcher's follows it
            let first = err
                .lines()
                .find(|l| l.contains("error:"))
                .unwrap_or("")
                .trim();
            return Ok(Outcome::Failed(format!(
                "exit status {}: {first}",
                status.code().unwrap_or(-1)
            )));
        }
        let values = profile(&metrics.join("metrics.jsonl"), t.start_profile_step)?;
        std::fs::write(
            dir.join("metrics.json"),
            serde_json::to_string_pretty(&values)?,
        )?;
        let v = values[t.metric.as_str()].as_f64().unwrap_or(0.0);
        Ok(Outcome::Metric(if t.metric == "latency" { -v } else { v }))
    }
}

/// `cmd` as one shell line (its words have no spaces: paths of scratch and results dirs).
fn command_line(cmd: &Command) -> String {
    let words = std::iter::once(cmd.get_program()).chain(cmd.get_args());
    words
        .map(|w| w.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// DeepSpeed's trial metrics over the profiled steps (from `start_profile_step`): throughput
/// in samples/s, latency in seconds per step, flops in TFLOP/s.
fn profile(path: &Path, start: u64) -> anyhow::Result<Json> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let steps: Vec<Json> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let profiled: Vec<&Json> = steps
        .iter()
        .filter(|s| {
            s["step"].as_u64().is_some_and(|n| n >= start) && s.get("samples_per_s").is_some()
        })
        .collect();
    if profiled.is_empty() {
        bail!("{}: no step from step {start} on", path.display());
    }
    let mean = |k: &str| {
        profiled
            .iter()
            .map(|s| s[k].as_f64().unwrap_or(0.0))
            .sum::<f64>()
            / profiled.len() as f64
    };
    Ok(json!({
        "throughput": mean("samples_per_s"),
        "latency": mean("step_ms") / 1e3,
        "flops": mean("tflops"),
    }))
}

/// The search space of a user's config (DeepSpeed's: a list is a tuning dimension).
fn space_of(
    user: &Json,
    at: &Json,
    ranks: usize,
    name: &dyn Fn() -> String,
) -> anyhow::Result<Space> {
    let int = |k: &str, d: i64| at.get(k).and_then(Json::as_i64).unwrap_or(d);
    let stages = match user.pointer("/zero_optimization/stage") {
        None => vec![0],
        Some(Json::String(s)) if s == "all" => vec![0, 1, 2, 3],
        Some(Json::Array(v)) => v
            .iter()
            .map(stage_of)
            .collect::<Option<_>>()
            .context("a ZeRO stage 0-3")?,
        Some(v) => vec![stage_of(v).context("a ZeRO stage 0-3")?],
    };
    let micro = user.get("train_micro_batch_size_per_gpu");
    let micro_batches = match micro {
        Some(Json::Array(v)) => {
            let list: Vec<usize> = v
                .iter()
                .filter_map(Json::as_u64)
                .map(|n| n as usize)
                .collect();
            if list.is_empty() || list.len() != v.len() || list.contains(&0) {
                bail!("{}: train_micro_batch_size_per_gpu = {}: a list to tune must hold positive integers", name(), Json::Array(v.clone()));
            }
            Some(list)
        }
        _ => None,
    };
    let min_micro_batch = match micro.and_then(Json::as_u64) {
        Some(m) if m > 0 => m as usize,
        _ => int("min_train_micro_batch_size_per_gpu", 1).max(1) as usize,
    };
    Ok(Space {
        stages,
        micro_batches,
        min_micro_batch,
        max_micro_batch: int("max_train_micro_batch_size_per_gpu", 1024).max(1) as usize,
        num_micro_batches: int("num_tuning_micro_batch_sizes", 3).max(1) as usize,
        gas: user
            .get("gradient_accumulation_steps")
            .and_then(Json::as_u64)
            .unwrap_or(1)
            .max(1) as usize,
        max_train_batch_size: at
            .get("max_train_batch_size")
            .and_then(Json::as_u64)
            .map(|n| n as usize),
        ranks,
        mp: int("mp_size", 1).max(1) as usize,
    })
}

fn stage_of(v: &Json) -> Option<u8> {
    v.as_u64().filter(|&s| s <= 3).map(|s| s as u8)
}

/// Replaces every list inside `c` by its first element.
fn first_of_lists(c: &mut Json) {
    match c {
        Json::Object(o) => o.values_mut().for_each(first_of_lists),
        Json::Array(v) if !v.is_empty() && !v.iter().all(Json::is_string) => {
            *c = v[0].clone();
            first_of_lists(c);
        }
        _ => {}
    }
}

fn parse_train(program: &[String]) -> anyhow::Result<crate::train::TrainArgs> {
    #[derive(clap::Parser)]
    struct Train {
        #[command(flatten)]
        args: crate::train::TrainArgs,
    }
    let t = <Train as clap::Parser>::try_parse_from(program).context("the train arguments")?;
    Ok(t.args)
}

/// The launcher options of this invocation (its arguments before the program), without the
/// tuner's own.
fn launcher_flags(program: &[String]) -> Vec<String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let start = raw
        .iter()
        .position(|a| a == "launch" || a == "autotune")
        .map_or(0, |i| i + 1);
    let end = raw.len() - program.len();
    without(&raw[start..end.max(start)], &OWN_FLAGS)
}

/// `args` without the options `flags` (as `--flag value` or `--flag=value`).
fn without(args: &[String], flags: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        let flag = |f: &&str| a == f || a.strip_prefix(*f).is_some_and(|r| r.starts_with('='));
        match flags.iter().copied().find(|f| flag(f)) {
            Some(f) => skip = a == f,
            None => out.push(a.clone()),
        }
    }
    out
}

/// Memory sizes: bytes, or a number with K, M, G or T (powers of 1024).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (num, scale) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        Some('T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    match num.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok((v * scale as f64) as u64),
        _ => Err(format!("{text:?}: expected a size such as 2G or 1500M")),
    }
}

/// This host's RAM (MemTotal).
fn host_memory() -> anyhow::Result<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kib = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("/proc/meminfo has no MemTotal")?;
    Ok(kib << 10)
}

/// Creates `dir` if needed and checks a file can be written there.
fn writable(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).context("cannot create the directory")?;
    let probe = dir.join(".ds-rs-write-check");
    std::fs::write(&probe, b"").context("cannot write there")?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}
