//! `ds-rs launch --autotuning tune|run ... --config ds.json train ...` (and `ds-rs autotune`,
//! the same as `--autotuning tune`): DeepSpeed's autotuner for ds-rs's own `train`, over ZeRO
//! stage, micro-batch, ZeRO's other settings and the tensor- and pipeline-parallel degrees
//! (ds-autotune's search). The memory model (`ds-rs estimate --config`) prunes what cannot fit
//! the memory per rank; the time model, at rates measured here first, predicts each trial's
//! step time; every other candidate runs as a real trial through the launcher for
//! `autotuning.end_profile_step` steps, side by side where the cluster has room (cluster.rs).
//! Outputs in DeepSpeed's layout (report.rs).

mod cluster;
mod report;
mod space;
mod trial;
mod workload;

#[cfg(test)]
mod corpus_tests;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ds_autotune::time::{measure_host, step_cost, Rates, StepCost};
use ds_autotune::tuning::{best, tune, Experiment, Space};
use ds_engine::{ConfigSource, JobPlan, LayoutFlags, Overrides};
use serde_json::{json, Value as Json};

use crate::flags::AutotuneMode;
use crate::launch::LaunchArgs;
use cluster::{Group, GROUP_FLAGS};
use workload::Workload;

/// Options of the tuner itself, not passed to the trials' launcher.
const OWN_FLAGS: [&str; 4] = [
    "--autotuning",
    "--memory_per_rank",
    "--trial_timeout",
    "--config",
];
/// The launcher options among those removed that take no value.
const SWITCHES: [&str; 1] = ["--force_multi"];
/// `train` options the best configuration's run sets itself (the batch through its config).
const BATCH_AND_CONFIG_FLAGS: [&str; 5] = [
    "--config",
    "--per_device_train_batch_size",
    "--micro-batch",
    "--gradient_accumulation_steps",
    "--grad-accum",
];
/// `train` options each trial sets itself (the batch through its config).
const TRIAL_FLAGS: [&str; 10] = [
    "--steps",
    "--epochs",
    "--metrics-dir",
    "--eval-interval",
    "--eval-batches",
    "--config",
    "--per_device_train_batch_size",
    "--micro-batch",
    "--gradient_accumulation_steps",
    "--grad-accum",
];

pub fn run(args: &LaunchArgs, mode: AutotuneMode) -> anyhow::Result<ExitCode> {
    let mut tuner = Tuner::new(args)?;
    let stop = crate::launch::StopFlag::on_signals()?;
    tuner.rates = trial::measure_rates(&tuner, &stop)?;
    let started = Instant::now();
    let mut trials = trial::Runner::new(&tuner, &stop, started);
    let records = tune(&tuner.space, &mut trials)?;
    report::write(&tuner, &records, started.elapsed())?;
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
        report::outcome_text(&tuner, &winner.outcome),
        tuner.results.join("ds_config_optimal.json").display()
    );
    if mode == AutotuneMode::Run {
        let status = tuner
            .launch(
                &tuner.results.join("ds_config_optimal.json"),
                &tuner.user_program,
                None,
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
    workload: Workload,
    memory_per_rank: u64,
    start_profile_step: u64,
    end_profile_step: u64,
    results: PathBuf,
    exps: PathBuf,
    trial_timeout: Duration,
    /// `autotuning.overwrite`: false reuses the metrics of a trial already in results_dir.
    overwrite: bool,
    /// The user's launcher options (without the tuner's own), and those each group's trials
    /// share (without the options a group sets).
    launcher_flags: Vec<String>,
    group_flags: Vec<String>,
    /// The user's `train ...`, and the same without the options each trial sets.
    user_program: Vec<String>,
    trial_program: Vec<String>,
    /// Where trials run, and the ranks of one.
    groups: Vec<Group>,
    ranks: usize,
    /// The degrees the train command fixes (`--tp`, `--pp`, `--ep`, `--sp`).
    fixed: space::Fixed,
    rates: Rates,
    /// The training arguments of the user's `train` (None for another program: its `Job`
    /// reads the config alone).
    training: Option<ds_config::TrainingArgs>,
    /// The user's config, for messages.
    config_name: String,
}

impl Tuner {
    /// The tuner of this invocation, its trials' rendezvous set and its directories
    /// writable.
    fn new(args: &LaunchArgs) -> anyhow::Result<Tuner> {
        let mut tuner = Tuner::plan(args)?;
        let mut groups = std::mem::take(&mut tuner.groups);
        cluster::rendezvous(&mut groups, args)?;
        for dir in [&tuner.results, &tuner.exps] {
            writable(dir)
                .with_context(|| format!("{}: autotuning: {}", tuner.config_name, dir.display()))?;
        }
        Ok(Tuner { groups, ..tuner })
    }

    /// Everything the search needs, read and checked, nothing written or contacted: the
    /// space, the workload, and one layout at least that the job plan accepts.
    fn plan(args: &LaunchArgs) -> anyhow::Result<Tuner> {
        let path = args
            .config
            .as_deref()
            .context("autotuning needs --config ds.json (with its `autotuning` section)")?;
        let mut doc = ds_config::load(path)?;
        // the trials set the section's stage: a legacy `true` is the section it stands for
        ds_config::expand_legacy_zero(&mut doc);
        let user = doc.to_json();
        let name = || path.display().to_string();
        let program = args.program.clone();
        let train = match program.first().map(String::as_str) {
            Some("train") => Some(parse_train(&program)?),
            _ => None,
        };
        let fixed = train
            .as_ref()
            .map_or(space::Fixed::default(), |t| t.layout.flags());
        let (groups, ranks) = cluster::groups(args)?;
        let at = &user["autotuning"];
        let text = |k: &str, d: &str| at.get(k).and_then(Json::as_str).unwrap_or(d).to_string();
        let int = |k: &str, d: i64| at.get(k).and_then(Json::as_i64).unwrap_or(d);
        let space = space::space_of(&user, ranks, fixed, &name)?;
        let model = train.as_ref().map(|t| (t.model.as_str(), t.seq_len));
        let workload = Workload::new(&program, model, at, &space, &name)?;
        let mut ignored = vec![
            (
                "model_info_path",
                "ds-rs runs no model-info profile; give autotuning.model_info",
            ),
            (
                "metric_path",
                "each trial's metrics file is in its own results directory",
            ),
            (
                "mp_size",
                "ds-rs takes the model-parallel degree from each candidate's tp x pp",
            ),
        ];
        if train.is_some() {
            ignored.push((
                "model_info",
                "ds-rs computes the model's size from the model itself",
            ));
            ignored.push(("arg_mappings", "the tuner sets train's options itself"));
        }
        for (key, why) in ignored {
            if at.get(key).is_some() {
                println!("warning: autotuning.{key}: ignored; {why}");
            }
        }
        let results = PathBuf::from(text("results_dir", "autotuning_results"));
        let exps = PathBuf::from(text("exps_dir", "autotuning_exps"));
        let per_host = groups.first().map_or(1, |g| g.per_host);
        let memory_per_rank = match &args.memory_per_rank {
            Some(m) => parse_bytes(m).map_err(|e| anyhow::anyhow!("--memory_per_rank {e}"))?,
            None => host_memory()? / per_host.max(1) as u64,
        };
        let end = int("end_profile_step", 5).max(1) as u64;
        let launcher_flags = launcher_flags(&program);
        let group_flags = match groups.iter().any(|g| !g.flags.is_empty()) {
            true => without(&launcher_flags, &GROUP_FLAGS),
            false => launcher_flags.clone(),
        };
        let tuner = Tuner {
            workload,
            space,
            memory_per_rank,
            start_profile_step: int("start_profile_step", 3).clamp(0, end as i64 - 1) as u64,
            end_profile_step: end,
            results,
            exps,
            trial_timeout: Duration::from_secs(args.trial_timeout),
            overwrite: at.get("overwrite").and_then(Json::as_bool).unwrap_or(true),
            launcher_flags,
            group_flags,
            trial_program: match &train {
                Some(_) => without(&program, &TRIAL_FLAGS),
                None => program.clone(),
            },
            // the best run takes its batch from ds_config_optimal.json, as the trials did
            user_program: match &train {
                Some(_) => without(&program, &BATCH_AND_CONFIG_FLAGS),
                None => program.clone(),
            },
            groups,
            ranks,
            fixed,
            training: trial_training_args(&program, train.is_some())?,
            config_name: name(),
            rates: Rates {
                flops_per_s: 1.0,
                bus_bytes_per_s: 1.0,
                collective_s: 0.0,
                memory_bytes_per_s: 1.0,
            },
            user,
        };
        tuner.check_layouts(&name)?;
        Ok(tuner)
    }

    /// One layout of the space at least must suit the model and the ranks at one stage:
    /// else the search is refused before anything runs, naming the layout. The others (tp x
    /// pp over more ranks than a trial has, ZeRO-2 with a pipeline) are pruned with the reason.
    fn check_layouts(&self, name: &dyn Fn() -> String) -> anyhow::Result<()> {
        let s = &self.space;
        let check = |layout, stage| {
            let e = Experiment::new(stage, layout, s.min_micro_batch, s.gas, Vec::new(), s);
            self.resolved(&e)
                .and_then(|c| self.workload.peak(&c, e.micro_batch).map(drop))
        };
        let mut first = None;
        for &layout in &s.layouts {
            for &stage in &s.stages {
                match check(layout, stage) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        first.get_or_insert((layout, e));
                    }
                }
            }
        }
        match first {
            Some((layout, e)) => Err(e.context(format!(
                "{}: autotuning a layout of tp {} x pp {} (ep {}, sp {}) over {} ranks",
                name(),
                layout.tp,
                layout.pp,
                layout.ep,
                layout.sp,
                self.ranks
            ))),
            None => Ok(()),
        }
    }

    /// The trial's ds_config: the user's with this experiment's values, no lists left outside
    /// the optimizer section (DeepSpeed's `get_first_config`, whose search ignores the
    /// optimizer: its `betas` is a value, not a dimension) and no autotuning section. Other
    /// "auto" values stay for the trial's `train` to fill with the trial's micro-batch.
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
        if self.space.layouts.len() > 1 {
            let tp = o.entry("tensor_parallel").or_insert_with(|| json!({}));
            tp["autotp_size"] = json!(e.layout.tp);
            let pp = o.entry("pipeline").or_insert_with(|| json!({}));
            pp["stages"] = json!(e.layout.pp);
            if let Some(ep) = o
                .get_mut("expert_parallel")
                .filter(|s| s["enabled"] == true)
            {
                ep["autoep_size"] = json!(e.layout.ep);
            }
            if e.layout.sp > 1 || o.contains_key("sequence_parallel_size") {
                o.insert("sequence_parallel_size".into(), json!(e.layout.sp));
            }
        }
        let zero = o.entry("zero_optimization").or_insert_with(|| json!({}));
        zero["stage"] = json!(e.stage);
        for (key, value) in &e.settings {
            zero[key.as_str()] = value.clone();
        }
        for (key, value) in c.as_object_mut().expect("a ds_config is an object") {
            if key != "optimizer" {
                space::first_of_lists(value);
            }
        }
        c
    }

    /// The trial's config as its ranks will plan it: the job plan of `train` (or of the
    /// program's `Job`), with the trial's layout and the user's training arguments.
    fn resolved(&self, e: &Experiment) -> anyhow::Result<ds_config::Config> {
        let text = serde_json::to_string(&self.trial_config(e))?;
        let overrides = Overrides {
            layout: LayoutFlags {
                tp: self.fixed.tp.or(Some(e.layout.tp)),
                pp: self.fixed.pp.or(Some(e.layout.pp)),
                ep: self.fixed.ep,
                sp: self.fixed.sp,
            },
            training: self.training.clone(),
            run_steps: Some(self.end_profile_step),
        };
        let source = ConfigSource::Text {
            text: &text,
            name: &self.config_name,
        };
        let model = self.workload.architecture();
        Ok(JobPlan::new(source, self.ranks, &overrides, model)?.config)
    }

    /// The memory model's peak of the largest rank for this trial.
    fn predicted_peak(&self, e: &Experiment) -> anyhow::Result<u64> {
        self.workload.peak(&self.resolved(e)?, e.micro_batch)
    }

    /// The time model's cost of a step of this trial.
    fn cost(&self, e: &Experiment) -> anyhow::Result<StepCost> {
        let config = self.resolved(e)?;
        step_cost(&config, &self.workload.work(), e.micro_batch, &self.rates)
    }

    /// `ds-rs launch` of `program` with `config`, on `group` (a trial) or as the user's
    /// options say (None).
    fn launch(&self, config: &Path, program: &[String], group: Option<&Group>) -> Command {
        let mut cmd = Command::new(std::env::current_exe().expect("the running binary"));
        cmd.arg("launch");
        match group {
            Some(g) => cmd.args(&self.group_flags).args(&g.flags),
            None => cmd.args(&self.launcher_flags),
        };
        cmd.arg("--config").arg(config).args(program);
        cmd
    }

    /// This host's compute and memory rates per rank.
    fn host_rates(&self) -> anyhow::Result<(f64, f64)> {
        let (d, rows) = self.workload.matmul_shape();
        let per_host = self.groups.first().map_or(1, |g| g.per_host);
        measure_host(d, rows * self.space.min_micro_batch, per_host)
    }
}

/// The training arguments each trial's `train` runs with: the user's, without the options
/// each trial sets itself (its batch comes through its config). None for another program.
fn trial_training_args(
    program: &[String],
    is_train: bool,
) -> anyhow::Result<Option<ds_config::TrainingArgs>> {
    if !is_train {
        return Ok(None);
    }
    let trial = parse_train(&without(program, &TRIAL_FLAGS))?;
    Ok(Some(trial.training.to_args()?))
}

fn parse_train(program: &[String]) -> anyhow::Result<crate::train::TrainArgs> {
    let (t, _) = crate::flags::parse_args::<crate::train::TrainArgs>("train", program)
        .context("the train arguments")?;
    Ok(t)
}

/// The launcher options of this invocation (its arguments before the program), without the
/// tuner's own.
fn launcher_flags(program: &[String]) -> Vec<String> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let start = raw
        .iter()
        .position(|a| a == "launch" || a == "autotune")
        .map_or(0, |i| i + 1);
    let end = raw.len().saturating_sub(program.len());
    without(&raw[start..end.max(start)], &OWN_FLAGS)
}

/// `args` without the options `flags` (as `--flag value` or `--flag=value`; the switches
/// among them, `SWITCHES`, take no value).
fn without(args: &[String], flags: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        let flag = |f: &&str| a == f || a.strip_prefix(*f).is_some_and(|r| r.starts_with('='));
        match flags.iter().copied().find(|f| flag(f)) {
            Some(f) => skip = a == f && !SWITCHES.contains(&f),
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
