//! DeepSpeed's file monitors, `tensorboard` and `csv_monitor` (deepspeed/monitor/).
//!
//! The engine hands over `(tag, value, step)` events, DeepSpeed's `write_events` triples:
//! `Train/Samples/train_loss`, `Train/Samples/lr`, `Train/Samples/loss_scale`, ... with the
//! number of samples seen as the step. [`Monitor`] fans them out to the enabled writers.
//!
//! As in DeepSpeed (`MonitorMaster`), only global rank 0 creates directories or files; on other
//! ranks a `Monitor` is inert. Both monitors write under `output_path/job_name`, joined as
//! Python's `os.path.join` does: an empty `output_path` (the default) means `job_name` relative
//! to the working directory, and an absolute `job_name` stands alone.

mod csv;
mod error;
mod event;
mod pyfloat;
mod record;
mod tensorboard;

use std::path::{Path, PathBuf};

use ds_config::monitor::FileMonitorConfig;

pub use error::MonitorError;

use self::csv::CsvWriter;
use self::tensorboard::TensorBoardWriter;

/// The enabled file monitors of this rank.
#[derive(Debug)]
pub struct Monitor {
    tensorboard: Option<TensorBoardWriter>,
    csv: Option<CsvWriter>,
}

impl Monitor {
    /// Opens the enabled monitors; on rank 0 this creates their directories and the event
    /// file, so a bad `output_path` fails at start-up rather than at the first step.
    pub fn new(
        tensorboard: &FileMonitorConfig,
        csv: &FileMonitorConfig,
        rank: usize,
    ) -> Result<Monitor, MonitorError> {
        if rank != 0 {
            return Ok(Monitor {
                tensorboard: None,
                csv: None,
            });
        }
        let tensorboard = if tensorboard.enabled {
            Some(TensorBoardWriter::create(&log_dir(tensorboard))?)
        } else {
            None
        };
        let csv = if csv.enabled {
            Some(CsvWriter::create(&log_dir(csv))?)
        } else {
            None
        };
        Ok(Monitor { tensorboard, csv })
    }

    /// Whether events given to this monitor go anywhere (false on ranks other than 0), so the
    /// caller can skip computing them, as DeepSpeed's engine checks `global_rank == 0`.
    pub fn enabled(&self) -> bool {
        self.tensorboard.is_some() || self.csv.is_some()
    }

    /// Writes `(tag, value, step)` events to every enabled monitor. TensorBoard's file is
    /// flushed after each call, as DeepSpeed's `TensorBoardMonitor.write_events` does; CSV rows
    /// are appended (and the file closed) per event, as `csvMonitor` does.
    pub fn write_events(&mut self, events: &[(&str, f64, u64)]) -> Result<(), MonitorError> {
        if let Some(tb) = &mut self.tensorboard {
            for &(tag, value, step) in events {
                tb.write_scalar(tag, value, step)?;
            }
            tb.flush()?;
        }
        if let Some(csv) = &mut self.csv {
            for &(tag, value, step) in events {
                csv.write_event(tag, value, step)?;
            }
        }
        Ok(())
    }

    /// Pushes buffered TensorBoard records to the file (CSV rows are never buffered).
    pub fn flush(&mut self) -> Result<(), MonitorError> {
        match &mut self.tensorboard {
            Some(tb) => tb.flush(),
            None => Ok(()),
        }
    }

    /// The TensorBoard event file being written, if any (for logs and tests).
    pub fn tensorboard_file(&self) -> Option<&Path> {
        self.tensorboard.as_ref().map(TensorBoardWriter::path)
    }

    /// The directory receiving the CSV files, if any.
    pub fn csv_dir(&self) -> Option<&Path> {
        self.csv.as_ref().map(CsvWriter::dir)
    }
}

/// `os.path.join(output_path, job_name)`, the directory DeepSpeed gives both monitors.
/// DeepSpeed's other branch (`~/tensorboard/<DLWS_JOB_ID>/logs`) runs only when output_path is
/// None, which its config never produces (the default is ""), so it has no counterpart here.
pub fn log_dir(config: &FileMonitorConfig) -> PathBuf {
    Path::new(&config.output_path).join(&config.job_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(output_path: &str, job_name: &str) -> FileMonitorConfig {
        FileMonitorConfig {
            enabled: true,
            output_path: output_path.to_string(),
            job_name: job_name.to_string(),
        }
    }

    #[test]
    fn log_dir_joins_like_os_path_join() {
        // Expected values are Python's os.path.join results for the same arguments.
        let cases = [
            ("", "DeepSpeedJobName", "DeepSpeedJobName"),
            ("output/ds_logs/", "train_bert", "output/ds_logs/train_bert"),
            ("output/ds_logs", "train_bert", "output/ds_logs/train_bert"),
            ("/abs/out", "job", "/abs/out/job"),
            ("out", "/elsewhere/job", "/elsewhere/job"),
        ];
        for (output_path, job_name, expected) in cases {
            let got = log_dir(&config(output_path, job_name));
            assert_eq!(got, Path::new(expected), "{output_path:?} + {job_name:?}");
        }
    }

    #[test]
    fn other_ranks_write_nothing() {
        let dir = std::env::temp_dir().join(format!("ds_monitor_rank1_{}", std::process::id()));
        let cfg = config(&dir.to_string_lossy(), "job");
        let mut m = Monitor::new(&cfg, &cfg, 1).expect("rank 1 monitor");
        assert!(!m.enabled());
        m.write_events(&[("Train/Samples/lr", 0.1, 8)])
            .expect("no-op write");
        m.flush().expect("no-op flush");
        assert!(!dir.exists(), "rank 1 created {}", dir.display());
    }
}
