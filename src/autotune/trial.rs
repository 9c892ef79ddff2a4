//! Trials as real jobs: each a `ds-rs launch` child on its group of the cluster, with its own
//! results directory and logs, a time limit, and SIGTERM on Ctrl-C; the metric read from the
//! trial's own metrics file. Also the rates the time model needs, measured before the search.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ds_autotune::time::{Rates, StepCost};
use ds_autotune::tuning::{Experiment, Metric, Outcome, Trials};
use serde_json::{json, Value as Json};

use super::cluster::Group;
use super::workload::Workload;
use super::Tuner;
use crate::launch::StopFlag;

/// The trials of one search.
pub struct Runner<'a> {
    tuner: &'a Tuner,
    stop: &'a StopFlag,
    count: usize,
    /// When the search started (trial times in trial.json are relative to it).
    started: Instant,
}

impl<'a> Runner<'a> {
    pub fn new(tuner: &'a Tuner, stop: &'a StopFlag, started: Instant) -> Runner<'a> {
        Runner {
            tuner,
            stop,
            count: 0,
            started,
        }
    }
}

impl Trials for Runner<'_> {
    fn fits(&mut self, e: &Experiment) -> anyhow::Result<(bool, u64)> {
        let peak = self.tuner.predicted_peak(e)?;
        Ok((peak <= self.tuner.memory_per_rank, peak))
    }

    fn cost(&mut self, e: &Experiment) -> anyhow::Result<StepCost> {
        self.tuner.cost(e)
    }

    fn run(&mut self, batch: &[(Experiment, u64)]) -> Vec<Outcome> {
        let mut running: Vec<Result<Running, Outcome>> = batch
            .iter()
            .zip(&self.tuner.groups)
            .map(|((e, _), group)| match self.earlier(e) {
                Some(outcome) => Err(outcome),
                None => self
                    .start(e, group)
                    .map_err(|err| Outcome::Failed(format!("{err:#}"))),
            })
            .collect();
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        for (i, r) in running.iter().enumerate() {
            if let Err(o) = r {
                outcomes[i] = Some(o.clone());
            }
        }
        while outcomes.iter().any(Option::is_none) {
            for (i, r) in running.iter_mut().enumerate() {
                let (Ok(trial), None) = (r, &outcomes[i]) else {
                    continue;
                };
                if let Some(o) = self.poll(trial) {
                    self.count += 1;
                    println!(
                        "[autotune] trial {} {} on {}: {} (predicted peak {} MiB)",
                        self.count,
                        trial.name,
                        trial.place,
                        super::report::outcome_text(self.tuner, &o),
                        batch[i].1 >> 20
                    );
                    outcomes[i] = Some(o);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        outcomes.into_iter().flatten().collect()
    }

    fn side_by_side(&self) -> usize {
        self.tuner.groups.len()
    }

    fn stopped(&self) -> bool {
        self.stop.get().is_some()
    }
}

/// A trial in flight.
struct Running {
    name: String,
    place: String,
    child: Child,
    started: Instant,
    dir: std::path::PathBuf,
    /// Seconds from the search's start.
    start_s: f64,
}

impl Runner<'_> {
    /// With `autotuning.overwrite` false, the outcome of this trial from an earlier search
    /// whose metrics are in results_dir (DeepSpeed's rule: such an experiment is not rerun).
    fn earlier(&self, e: &Experiment) -> Option<Outcome> {
        if self.tuner.overwrite {
            return None;
        }
        let dir = self.tuner.results.join(&e.name);
        let outcome = self.measured(&dir).ok()?;
        println!(
            "[autotune] {} {}: from an earlier search ({})",
            e.name,
            super::report::outcome_text(self.tuner, &outcome),
            dir.display()
        );
        Some(outcome)
    }

    /// Writes the trial's files and starts it on `group`.
    fn start(&self, e: &Experiment, group: &Group) -> anyhow::Result<Running> {
        let t = self.tuner;
        let dir = t.results.join(&e.name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let config = dir.join("ds_config.json");
        let mut ds = t.trial_config(e);
        let metrics_file = dir.join("metrics.json");
        let _ = std::fs::remove_file(&metrics_file);
        let program = match &t.workload {
            Workload::Train { .. } => self.train_program(&dir),
            Workload::Program { .. } => {
                // the engine's trial hook measures the steps and writes the metrics
                ds["autotuning"] = json!({
                    "enabled": true,
                    "metric_path": metrics_file,
                    "start_profile_step": t.start_profile_step,
                    "end_profile_step": t.end_profile_step,
                });
                t.workload.with_mappings(&t.trial_program, &ds)?
            }
        };
        std::fs::write(&config, serde_json::to_string_pretty(&ds)?)?;
        let exp =
            json!({"name": e.name, "ds_config": ds, "num_gpus": t.ranks, "hosts": group.place});
        std::fs::write(
            t.exps.join(format!("{}.json", e.name)),
            serde_json::to_string_pretty(&exp)?,
        )?;
        let mut cmd = t.launch(&config, &program, Some(group));
        std::fs::write(dir.join("cmd.txt"), command_line(&cmd) + "\n")?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.join("stdout.log"))?)
            .stderr(std::fs::File::create(dir.join("stderr.log"))?)
            .spawn()
            .context("starting the trial")?;
        Ok(Running {
            name: e.name.clone(),
            place: group.place.clone(),
            child,
            started: Instant::now(),
            dir,
            start_s: self.started.elapsed().as_secs_f64(),
        })
    }

    /// The trial's outcome once it has ended (stopping it past its time limit or on Ctrl-C).
    fn poll(&self, trial: &mut Running) -> Option<Outcome> {
        let t = self.tuner;
        let status = match trial.child.try_wait() {
            Ok(Some(status)) => status,
            Ok(None) if self.profiled(trial) => {
                // the engine wrote the metrics after the last profiled step: the program,
                // told so by its step's outcome, need not train on (DeepSpeed exits there)
                end(trial);
                let outcome = self.measured(&trial.dir);
                return Some(self.finish(
                    trial,
                    outcome.unwrap_or_else(|e| Outcome::Failed(format!("{e:#}"))),
                ));
            }
            Ok(None) if trial.started.elapsed() <= t.trial_timeout && self.stop.get().is_none() => {
                return None
            }
            Ok(None) => {
                end(trial);
                let why = match self.stop.get() {
                    Some(_) => "stopped".to_string(),
                    None => format!(
                        "exceeded the trial time limit of {} s",
                        t.trial_timeout.as_secs()
                    ),
                };
                return Some(self.finish(trial, Outcome::Failed(why)));
            }
            Err(e) => return Some(Outcome::Failed(format!("waiting for the trial: {e}"))),
        };
        let outcome = match status.success() {
            true => self
                .measured(&trial.dir)
                .unwrap_or_else(|e| Outcome::Failed(format!("{e:#}"))),
            false => {
                let err = std::fs::read_to_string(trial.dir.join("stderr.log")).unwrap_or_default();
                // the first error is the cause (a rank's); the launcher's follows it
                let first = err
                    .lines()
                    .find(|l| l.contains("error:"))
                    .unwrap_or("")
                    .trim();
                Outcome::Failed(format!(
                    "exit status {}: {first}",
                    status.code().unwrap_or(-1)
                ))
            }
        };
        Some(self.finish(trial, outcome))
    }

    /// Whether the engine's trial hook has written the trial's metrics (a program that
    /// embeds the engine; `train`'s trials end by themselves after their steps).
    fn profiled(&self, trial: &Running) -> bool {
        matches!(self.tuner.workload, Workload::Program { .. })
            && trial.dir.join("metrics.json").exists()
    }

    /// `train` with the trial's steps, its metrics directory in `dir`, and no evaluation.
    fn train_program(&self, dir: &Path) -> Vec<String> {
        let t = self.tuner;
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
        program
    }

    /// Records where and when the trial ran (trial.json) and hands its outcome on.
    fn finish(&self, trial: &Running, outcome: Outcome) -> Outcome {
        let placement = json!({
            "hosts": trial.place,
            "started_s": trial.start_s,
            "finished_s": self.started.elapsed().as_secs_f64(),
        });
        let _ = std::fs::write(trial.dir.join("trial.json"), placement.to_string());
        outcome
    }

    /// The trial's metric from its own metrics file (metrics.json written beside).
    fn measured(&self, dir: &Path) -> anyhow::Result<Outcome> {
        let t = self.tuner;
        let path = dir.join("metrics.json");
        let values = match &t.workload {
            Workload::Train { .. } => {
                let values = profile(&dir.join("metrics/metrics.jsonl"), t.start_profile_step)?;
                std::fs::write(&path, serde_json::to_string_pretty(&values)?)?;
                values
            }
            // written by the engine's trial hook
            Workload::Program { .. } => {
                let text = std::fs::read_to_string(&path).with_context(|| {
                    format!("the program ended without the engine writing {} (does it train through ds-rs's engine for end_profile_step steps?)", path.display())
                })?;
                serde_json::from_str(&text)
                    .with_context(|| format!("reading {}", path.display()))?
            }
        };
        let get = |k: &str| values[k].as_f64().unwrap_or(0.0);
        let metric = match t.space.metric {
            Metric::Throughput => get("throughput"),
            Metric::Latency => -get("latency"),
            Metric::Flops => get("flops"),
        };
        Ok(Outcome::Ran {
            metric,
            step_s: get("latency"),
        })
    }
}

/// Stops a running trial: the launcher stops its ranks on SIGTERM.
fn end(trial: &mut Running) {
    unsafe { libc::kill(trial.child.id() as i32, libc::SIGTERM) };
    let _ = trial.child.wait();
}

/// The rates of the time model: this host's compute and memory per rank, and an all-reduce
/// among a trial's ranks through the launcher on the first group (`ds-rs bench comm`), as
/// the trials' collectives will run.
pub fn measure_rates(t: &Tuner, stop: &StopFlag) -> anyhow::Result<Rates> {
    let (flops_per_s, memory_bytes_per_s) = t.host_rates()?;
    let (bus_bytes_per_s, collective_s) = match t.ranks {
        1 => (f64::MAX, 0.0),
        _ => all_reduce_rates(t, stop).context("measuring the all-reduce among a trial's ranks")?,
    };
    let rates = Rates {
        flops_per_s,
        bus_bytes_per_s,
        collective_s,
        memory_bytes_per_s,
    };
    println!(
        "[autotune] measured rates per rank: {:.1} GFLOP/s, memory {:.1} GB/s, all-reduce bus {:.2} GB/s and {:.0} us per call",
        rates.flops_per_s / 1e9,
        rates.memory_bytes_per_s / 1e9,
        rates.bus_bytes_per_s.min(1e12) / 1e9,
        rates.collective_s * 1e6
    );
    Ok(rates)
}

/// Bus bandwidth (16 MiB messages) and the time of one small all-reduce (4 KiB).
fn all_reduce_rates(t: &Tuner, stop: &StopFlag) -> anyhow::Result<(f64, f64)> {
    let bench: Vec<String> =
        "bench comm --op all-reduce --min-bytes 4K --max-bytes 16M --iters 5 --json"
            .split(' ')
            .map(String::from)
            .collect();
    let mut cmd = Command::new(std::env::current_exe().expect("the running binary"));
    cmd.arg("launch")
        .args(&t.group_flags)
        .args(t.groups.first().map_or(&[][..], |g| &g.flags[..]))
        .args(&bench);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting ds-rs bench comm")?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > Duration::from_secs(120) || stop.get().is_some() {
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
            bail!("ds-rs bench comm did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    // rank 0's rows, one JSON object a line (after the launcher's `[rank0] ` prefix)
    let rows: Vec<Json> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(&l[l.find('{')?..]).ok())
        .collect();
    let measured = || rows.iter().filter(|r| r["busbw_gbs"].is_number());
    let bytes = |r: &&Json| r["bytes"].as_u64().unwrap_or(0);
    let (Some(large), Some(small)) = (measured().max_by_key(bytes), measured().min_by_key(bytes))
    else {
        bail!("ds-rs bench comm printed no measurement");
    };
    let bus = large["busbw_gbs"].as_f64().unwrap_or(0.0) * 1e9;
    let call = small["time_us"].as_f64().unwrap_or(0.0) / 1e6;
    if bus <= 0.0 {
        bail!("ds-rs bench comm measured no bandwidth");
    }
    Ok((bus, call))
}

/// `cmd` as one shell line (its words have no spaces: paths of scratch and results dirs).
pub fn command_line(cmd: &Command) -> String {
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
