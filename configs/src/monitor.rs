//! Observability sections: `tensorboard`, `wandb`, `csv_monitor`, `comet` (monitor/config.py),
//! `comms_logger` (comm/config.py) and `flops_profiler` (profiling/config.py).

use serde::Serialize;

use crate::coerce::Bound;
use crate::error::{ConfigError, Result};
use crate::lenient::Lenient;
use crate::section::Section;
use crate::value::Dict;

/// `tensorboard` / `csv_monitor`: event or CSV files under `output_path/job_name`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FileMonitorConfig {
    pub enabled: bool,
    pub output_path: String,
    pub job_name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WandbConfig {
    pub enabled: bool,
    pub group: Option<String>,
    pub team: Option<String>,
    pub project: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CometConfig {
    pub enabled: bool,
    pub samples_log_interval: i64,
    pub project: Option<String>,
    pub workspace: Option<String>,
    pub experiment_name: Option<String>,
    pub experiment_key: Option<String>,
    pub online: Option<bool>,
    pub mode: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MonitorConfig {
    pub tensorboard: FileMonitorConfig,
    pub wandb: WandbConfig,
    pub csv_monitor: FileMonitorConfig,
    pub comet: CometConfig,
}

impl MonitorConfig {
    /// Each monitor section must be an object when present ("auto" means the defaults).
    pub fn read(
        root: &Dict,
        autos: &mut Vec<(String, serde_json::Value)>,
    ) -> Result<MonitorConfig> {
        let mut errors = Vec::new();
        let mut open = |key: &'static str| -> Section {
            match root.get(key) {
                None => Section::empty(key),
                Some(v) if v.is_auto() => Section::empty(key),
                Some(v) => Section::open(key, v).unwrap_or_else(|e| {
                    errors.push(e);
                    Section::empty(key)
                }),
            }
        };
        let mut sections = [
            open("tensorboard"),
            open("wandb"),
            open("csv_monitor"),
            open("comet"),
        ];
        let [tb, wb, csv, comet] = &mut sections;
        let config = MonitorConfig {
            tensorboard: read_file_monitor(tb),
            wandb: read_wandb(wb),
            csv_monitor: read_file_monitor(csv),
            comet: read_comet(comet),
        };
        for s in sections {
            match s.finish() {
                Ok(a) => autos.extend(a),
                Err(e) => errors.push(e),
            }
        }
        ConfigError::from_list(errors).map_or(Ok(config), Err)
    }

    pub fn enabled(&self) -> bool {
        self.tensorboard.enabled
            || self.wandb.enabled
            || self.csv_monitor.enabled
            || self.comet.enabled
    }
}

fn read_file_monitor(s: &mut Section) -> FileMonitorConfig {
    FileMonitorConfig {
        enabled: s.bool("enabled", false),
        output_path: s.string("output_path", ""),
        job_name: s.string("job_name", "DeepSpeedJobName"),
    }
}

fn read_wandb(s: &mut Section) -> WandbConfig {
    WandbConfig {
        enabled: s.bool("enabled", false),
        group: s.opt_string("group"),
        team: s.opt_string("team"),
        project: s.string("project", "deepspeed"),
    }
}

fn read_comet(s: &mut Section) -> CometConfig {
    let c = CometConfig {
        enabled: s.bool("enabled", false),
        samples_log_interval: s.int("samples_log_interval", 100, Bound::None),
        project: s.opt_string("project"),
        workspace: s.opt_string("workspace"),
        experiment_name: s.opt_string("experiment_name"),
        experiment_key: s.opt_string("experiment_key"),
        online: s.opt_bool("online"),
        mode: s.opt_string("mode"),
    };
    s.opt_string("api_key"); // accepted, never stored: a secret has no place in a printed config
    c
}

/// `comms_logger`: per-collective size, latency and bandwidth.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CommsLoggerConfig {
    pub enabled: bool,
    pub prof_all: bool,
    pub prof_ops: Vec<String>,
    pub verbose: bool,
    pub debug: bool,
}

impl CommsLoggerConfig {
    pub fn read(s: &mut Section) -> CommsLoggerConfig {
        let prof_ops = s.list("prof_ops").unwrap_or_default();
        CommsLoggerConfig {
            enabled: s.bool("enabled", false),
            prof_all: s.bool("prof_all", true),
            prof_ops: prof_ops
                .iter()
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                .collect(),
            verbose: s.bool("verbose", false),
            debug: s.bool("debug", false),
        }
    }
}

/// `flops_profiler`. DeepSpeed reads it with plain `dict.get` (no type checks, unknown keys
/// ignored); ds-rs converts what it uses and rejects values it cannot use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlopsProfilerConfig {
    pub enabled: bool,
    pub recompute_fwd_factor: f64,
    pub profile_step: i64,
    pub module_depth: i64,
    pub top_modules: i64,
    pub detailed: bool,
    pub output_file: Option<String>,
}

impl FlopsProfilerConfig {
    pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<FlopsProfilerConfig> {
        let mut r = Lenient::open(root, "flops_profiler", warnings)?;
        Ok(FlopsProfilerConfig {
            enabled: r.flag("enabled", false),
            recompute_fwd_factor: r.number("recompute_fwd_factor", 0.0),
            profile_step: r.integer("profile_step", 1),
            module_depth: r.integer("module_depth", -1),
            top_modules: r.integer("top_modules", 1),
            detailed: r.flag("detailed", true),
            output_file: r.text("output_file"),
        })
    }
}
