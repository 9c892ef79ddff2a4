//! What DeepSpeed's engine reports while it trains, for any program that drives an `Engine`:
//! rank 0's progress line every `steps_per_print` steps (`step=N, skipped=K, lr=[...],
//! mom=[...]` and the throughput timer's samples/s), the `wall_clock_breakdown` line, and the
//! `tensorboard` / `csv_monitor` events of its ds_config (`Train/Samples/train_loss`, `lr`,
//! `loss_scale`, with the samples seen as x). `ds-rs train` draws its own progress line and
//! writes the same events and breakdown through the functions here.

use std::time::{Duration, Instant};

use candle_core::Tensor;
use ds_config::Config;

use super::{StepOutcome, Timings};
use crate::monitor::Monitor;
use crate::{EngineError, Result};

/// The engine's reporting for one rank (inert but for the step's throughput figures when
/// the program turned it off or the rank is not 0).
pub(crate) struct Reporter {
    monitor: Monitor,
    /// Print the progress lines (rank 0, and the program left them on).
    print: bool,
    steps_per_print: u64,
    wall_clock: bool,
    /// Samples in one optimizer step over all replicas (train_batch_size).
    samples_per_step: u64,
    /// The config's betas, printed as DeepSpeed's `mom`.
    betas: Option<(f64, f64)>,
    /// This step's micro-batch losses, kept only for the monitors.
    losses: Vec<Tensor>,
    window: Timings,
    last_step: Instant,
    started: Instant,
    steps_timed: u64,
}

impl Reporter {
    pub(crate) fn new(
        cfg: &Config,
        rank: usize,
        print: bool,
        samples_per_step: u64,
    ) -> Result<Reporter> {
        let m = &cfg.monitor;
        let monitor = Monitor::new(&m.tensorboard, &m.csv_monitor, rank)
            .map_err(|e| EngineError::Setting(format!("the config's monitor: {e}")))?;
        Ok(Reporter {
            monitor,
            print: print && rank == 0,
            steps_per_print: steps_per_print(cfg),
            wall_clock: cfg.wall_clock_breakdown,
            samples_per_step,
            betas: betas(cfg),
            losses: Vec::new(),
            window: Timings::default(),
            last_step: Instant::now(),
            started: Instant::now(),
            steps_timed: 0,
        })
    }

    /// Whether the monitors want the loss (reading it waits for the device).
    pub(crate) fn wants_loss(&self) -> bool {
        self.monitor.enabled()
    }

    pub(crate) fn record_loss(&mut self, loss: &Tensor) {
        if self.wants_loss() {
            self.losses.push(loss.detach());
        }
    }

    pub(crate) fn write_events(&mut self, events: &[(&str, f64, u64)]) -> Result<()> {
        self.monitor
            .write_events(events)
            .map_err(|e| EngineError::Setting(format!("the config's monitor: {e}")))
    }

    /// Whether `after_step` will print the wall-clock breakdown, which needs the timings.
    pub(crate) fn wants_timings(&self) -> bool {
        self.print && self.wall_clock
    }

    /// After optimizer step `global_steps`: the step's throughput into `outcome`, the
    /// monitors' events, and rank 0's lines when due. `loss`: the step's loss when the
    /// caller knows it (a pipeline step), else the mean of the recorded micro-batch losses.
    pub(crate) fn after_step(
        &mut self,
        global_steps: u64,
        outcome: &mut StepOutcome,
        loss: Option<f64>,
        timings: Option<Timings>,
    ) -> Result<()> {
        let now = Instant::now();
        let took = now - self.last_step;
        self.last_step = now;
        self.steps_timed += 1;
        outcome.step_seconds = took.as_secs_f64();
        outcome.samples_per_s = self.samples_per_step as f64 / took.as_secs_f64().max(1e-9);
        let losses = std::mem::take(&mut self.losses);
        if self.monitor.enabled() {
            let loss = match loss {
                Some(l) => l,
                None => mean(&losses)?,
            };
            let seen = global_steps * self.samples_per_step;
            self.write_events(&monitor_events(loss, outcome.lr, outcome.loss_scale, seen))?;
        }
        if let Some(t) = timings {
            self.window.add(&t);
        }
        if !self.print || !global_steps.is_multiple_of(self.steps_per_print) {
            return Ok(());
        }
        println!(
            "[Rank 0] {}",
            progress_line(global_steps, outcome, self.betas)
        );
        let running = self.samples_per_step as f64 * self.steps_timed as f64
            / self.started.elapsed().as_secs_f64().max(1e-9);
        println!(
            "[Rank 0] global_step={global_steps}, RunningAvgSamplesPerSec={running:.3}, CurrSamplesPerSec={:.3}",
            outcome.samples_per_s
        );
        if self.wall_clock {
            let t = std::mem::take(&mut self.window);
            println!("[Rank 0] {}", wall_clock_line(&t, self.steps_per_print));
        }
        Ok(())
    }
}

fn mean(losses: &[Tensor]) -> Result<f64> {
    let mut sum = 0.0f64;
    for l in losses {
        sum += l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()? as f64;
    }
    Ok(sum / losses.len().max(1) as f64)
}

/// ds_config `steps_per_print` (DeepSpeed's default 10).
pub fn steps_per_print(cfg: &Config) -> u64 {
    cfg.scalars
        .steps_per_print
        .as_f64()
        .map_or(10, |n| n.max(1.0) as u64)
}

/// The optimizer's `betas`, as DeepSpeed's progress line prints them (`mom`).
fn betas(cfg: &Config) -> Option<(f64, f64)> {
    let b = cfg.optimizer.as_ref()?.params.as_ref()?.get("betas")?;
    let b = b.as_array()?;
    Some((b.first()?.as_f64()?, b.get(1)?.as_f64()?))
}

/// DeepSpeed's `_report_progress` line: `step=N, skipped=K, lr=[...], mom=[(b1, b2)]`.
pub fn progress_line(
    global_steps: u64,
    outcome: &StepOutcome,
    betas: Option<(f64, f64)>,
) -> String {
    let mom = match betas {
        Some((b1, b2)) => format!("[({b1}, {b2})]"),
        None => "[]".into(),
    };
    format!(
        "step={global_steps}, skipped={}, lr=[{}], mom={mom}",
        outcome.skipped_steps, outcome.lr
    )
}

/// DeepSpeed's per-step monitor events, with the samples seen so far as x.
pub fn monitor_events(
    loss: f64,
    lr: f64,
    loss_scale: f64,
    samples_seen: u64,
) -> [(&'static str, f64, u64); 3] {
    [
        ("Train/Samples/train_loss", loss, samples_seen),
        ("Train/Samples/lr", lr, samples_seen),
        ("Train/Samples/loss_scale", loss_scale, samples_seen),
    ]
}

/// DeepSpeed's wall_clock_breakdown line: the mean forward, backward and step time of `steps`
/// steps, with NVMe offload's I/O when there was any.
pub fn wall_clock_line(t: &Timings, steps: u64) -> String {
    let ms = |d: Duration| 1e3 * d.as_secs_f64() / steps.max(1) as f64;
    format!(
        "time (ms) | fwd: {:.2} | bwd: {:.2} | step: {:.2}{}",
        ms(t.forward),
        ms(t.backward),
        ms(t.step),
        swap_note(&t.swap, steps)
    )
}

/// ` | swap: read R MiB, written W MiB in T ms (B MiB/s)` per step over `steps` steps of
/// NVMe offload's I/O (its time: inside the reads and writes, mostly overlapped with the
/// update), empty without offload.
pub fn swap_note(io: &ds_partition::swap::IoTotals, steps: u64) -> String {
    if io.read_bytes + io.written_bytes == 0 {
        return String::new();
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64 / steps.max(1) as f64;
    format!(
        " | swap: read {:.0} MiB, written {:.0} MiB in {:.0} ms ({:.0} MiB/s)",
        mib(io.read_bytes),
        mib(io.written_bytes),
        1e3 * io.busy.as_secs_f64() / steps.max(1) as f64,
        io.mib_per_s()
    )
}
