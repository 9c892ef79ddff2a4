//! What rank 0 shows while training: a bar redrawn in place on a terminal, plain lines every
//! `steps_per_print` steps otherwise (CI, log files), as DeepSpeed prints them.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use super::metrics::StepRecord;

const BAR_WIDTH: usize = 24;

pub struct Progress {
    /// The step this run started at (a resumed run's ETA counts only the steps it trains).
    first: u64,
    total: u64,
    every: u64,
    bar: bool,
    start: Instant,
}

impl Progress {
    /// A bar when stdout is a terminal, or when the launcher relays to one (DS_RS_TTY).
    pub fn new(first: u64, total: u64, steps_per_print: u64) -> Progress {
        let bar = std::io::stdout().is_terminal() || std::env::var_os("DS_RS_TTY").is_some();
        Progress {
            first,
            total,
            every: steps_per_print.max(1),
            bar,
            start: Instant::now(),
        }
    }

    pub fn step(&mut self, r: &StepRecord) {
        let done = r.step + 1;
        if self.bar {
            print!("\r\x1b[K{}", self.bar_line(r, done));
            let _ = std::io::stdout().flush();
        } else if done.is_multiple_of(self.every) || done == self.total {
            println!("{}", self.line(r, done));
        }
    }

    /// Ends the bar's line so that what follows starts on a fresh one.
    pub fn finish(&self) {
        if self.bar {
            println!();
        }
    }

    /// A message between steps (evaluation, loss-scale changes).
    pub fn note(&self, text: &str) {
        if self.bar {
            print!("\r\x1b[K");
        }
        println!("{text}");
    }

    fn bar_line(&self, r: &StepRecord, done: u64) -> String {
        let filled = (done as usize * BAR_WIDTH) / self.total.max(1) as usize;
        let bar: String = (0..BAR_WIDTH)
            .map(|i| if i < filled { '#' } else { '-' })
            .collect();
        format!("[{bar}] {}", self.line(r, done))
    }

    fn line(&self, r: &StepRecord, done: u64) -> String {
        format!(
            "step {done}/{} | loss {:.4} | lr {:.3e} | loss scale {} | {:.0} tokens/s | {:.1} samples/s | {:.3} TFLOP/s | ETA {}",
            self.total,
            r.loss,
            r.lr,
            r.loss_scale,
            r.tokens_per_s,
            r.samples_per_s,
            r.tflops,
            eta(self.start.elapsed(), done - self.first.min(done), self.total - self.first.min(done))
        )
    }
}

/// The time left for `total` steps at the pace of the `done` this run has trained.
fn eta(elapsed: Duration, done: u64, total: u64) -> String {
    let left = elapsed.as_secs_f64() / done.max(1) as f64 * total.saturating_sub(done) as f64;
    let s = left.round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run resumed at step 100 of 200 that trained 10 steps in 10 s has 90 s left: the
    /// resumed steps were not trained by this run and say nothing of its pace.
    #[test]
    fn the_eta_counts_only_the_steps_this_run_trains() {
        let mut p = Progress::new(100, 200, 10);
        p.start = Instant::now() - Duration::from_secs(10);
        let r: StepRecord = serde_json::from_value(serde_json::json!({
            "step": 109, "loss": 2.0, "lr": 1e-3, "loss_scale": 1.0, "skipped": false,
            "grad_norm": 1.0, "tokens_per_s": 1.0, "samples_per_s": 1.0, "step_ms": 1.0,
            "tflops": 0.0, "unix_ms": 0
        }))
        .unwrap();
        let line = p.line(&r, 110);
        assert!(line.ends_with("ETA 0:01:30"), "{line}");
    }
}
