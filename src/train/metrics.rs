//! The metrics contract of `ds-rs train` that tools parse: DIR/metrics.jsonl, one JSON object
//! per optimizer step, and DIR/summary.json with the run's totals. Only rank 0 writes them.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use ds_comm::Group;
use serde::{Deserialize, Serialize};

/// One optimizer step, as metrics.jsonl holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    /// Mean over the global batch (an f32, written at f64 so that every file agrees).
    pub loss: f64,
    pub lr: f64,
    pub loss_scale: f64,
    pub skipped: bool,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub samples_per_s: f64,
    pub step_ms: f64,
    /// Of it, the time this rank spent reading its micro-batches.
    #[serde(default)]
    pub data_ms: f64,
    /// Model FLOPs achieved per second over all ranks, in TFLOP/s.
    pub tflops: f64,
    /// Wall-clock time the step ended, in milliseconds since the Unix epoch.
    pub unix_ms: u128,
}

/// One evaluation on held-out data.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: u64,
    pub eval_loss: f64,
}

/// Appends one line per record, flushed at once so a crash loses nothing written before it.
pub struct MetricsFile {
    out: BufWriter<File>,
    path: PathBuf,
}

impl MetricsFile {
    pub fn create(dir: &Path) -> anyhow::Result<MetricsFile> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating metrics directory {}", dir.display()))?;
        let path = dir.join("metrics.jsonl");
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(MetricsFile {
            out: BufWriter::new(file),
            path,
        })
    }

    /// A fresh file at step 0; on resume at `start`, the earlier run's records before `start`
    /// (a run that died after its last checkpoint logged steps that will run again): kept in
    /// the file, replaced in one rename so a crash loses nothing, and returned.
    pub fn open(
        dir: &Path,
        start: u64,
    ) -> anyhow::Result<(MetricsFile, Vec<StepRecord>, Vec<EvalRecord>)> {
        if start == 0 {
            return Ok((MetricsFile::create(dir)?, Vec::new(), Vec::new()));
        }
        let path = dir.join("metrics.jsonl");
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        let (mut kept, mut steps, mut evals) = (String::new(), Vec::new(), Vec::new());
        for line in old.lines() {
            if let Ok(r) = serde_json::from_str::<StepRecord>(line) {
                if r.step < start {
                    kept.push_str(line);
                    kept.push('\n');
                    steps.push(r);
                }
            } else if let Ok(e) = serde_json::from_str::<EvalRecord>(line) {
                if e.step < start {
                    kept.push_str(line);
                    kept.push('\n');
                    evals.push(e);
                }
            }
        }
        let partial = dir.join("metrics.jsonl.partial");
        std::fs::write(&partial, kept)
            .and_then(|_| std::fs::rename(&partial, &path))
            .with_context(|| format!("rewriting {}", path.display()))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok((
            MetricsFile {
                out: BufWriter::new(file),
                path,
            },
            steps,
            evals,
        ))
    }

    pub fn write(&mut self, record: &impl Serialize) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// What one rank holds at the end of the run: its peak RSS beside the bytes the engine
/// accounts for (`MemoryReport`: model states, and a step's working memory at its peak).
#[derive(Debug, Clone, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub peak_rss_mib: f64,
    pub params_bytes: u64,
    pub grads_bytes: u64,
    pub optimizer_states_bytes: u64,
    pub activations_bytes: u64,
    pub layer_params_bytes: u64,
    pub layer_grads_bytes: u64,
    pub comm_buffers_bytes: u64,
    /// The sum of the above byte counts.
    pub accounted_bytes: u64,
    /// On disk, not in memory (NVMe offload): not part of the above.
    pub offloaded_bytes: u64,
    /// Of `accounted_bytes`, those in GPU memory (the rest are in host memory).
    pub gpu_bytes: u64,
    /// Of the parameters, gradients and optimizer states, this rank's experts' (expert
    /// parallelism).
    pub expert_params_bytes: u64,
    pub expert_grads_bytes: u64,
    pub expert_optimizer_states_bytes: u64,
}

impl RankMemory {
    fn model_states(&self) -> u64 {
        self.params_bytes + self.grads_bytes + self.optimizer_states_bytes
    }

    /// One line comparing peak RSS with what is accounted in host memory, for the rank's
    /// closing lines.
    pub fn line(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let host = self.accounted_bytes - self.gpu_bytes;
        let rest = self.peak_rss_mib - mib(host);
        let rest = match rest >= 0.0 {
            true => format!(
                "+ {rest:.0} MiB not accounted (the process's fixed cost: code, thread stacks, \
                 the allocator's free lists)"
            ),
            // the step's peaks are summed though they need not coincide
            false => format!("- {:.0} MiB of peaks that did not coincide", -rest),
        };
        let disk = match self.offloaded_bytes {
            0 => String::new(),
            b => format!("; {:.0} MiB offloaded to NVMe", mib(b)),
        };
        let gpu = match self.gpu_bytes {
            0 => String::new(),
            b => format!(
                "; less {:.0} MiB of these in GPU memory, the gpu line's",
                mib(b)
            ),
        };
        format!(
            "memory (rank {}): peak RSS {:.0} MiB = {:.0} MiB accounted (model states {:.0}, \
             activations {:.0}, layer parameters {:.0}, layer gradients {:.0}, communication \
             buffers {:.0}{gpu}) {}{disk}",
            self.rank,
            self.peak_rss_mib,
            mib(host),
            mib(self.model_states()),
            mib(self.activations_bytes),
            mib(self.layer_params_bytes),
            mib(self.layer_grads_bytes),
            mib(self.comm_buffers_bytes),
            rest
        )
    }
}

/// Every rank's peak RSS and memory report, in rank order (a collective).
pub fn gather_memory(
    g: &Group,
    report: &ds_engine::MemoryReport,
) -> anyhow::Result<Vec<RankMemory>> {
    let mine = [
        peak_rss_kib(),
        report.params as u64,
        report.grads as u64,
        report.optimizer_states as u64,
        report.activations as u64,
        report.layer_params as u64,
        report.layer_grads as u64,
        report.comm_buffers as u64,
        report.total() as u64,
        report.offloaded as u64,
        report.gpu as u64,
        report.experts.params as u64,
        report.experts.grads as u64,
        report.experts.optimizer_states as u64,
    ];
    let all = g.all_gather_u64(&mine)?;
    Ok(all
        .chunks(mine.len())
        .enumerate()
        .map(|(rank, v)| RankMemory {
            rank,
            peak_rss_mib: v[0] as f64 / 1024.0,
            params_bytes: v[1],
            grads_bytes: v[2],
            optimizer_states_bytes: v[3],
            activations_bytes: v[4],
            layer_params_bytes: v[5],
            layer_grads_bytes: v[6],
            comm_buffers_bytes: v[7],
            accounted_bytes: v[8],
            offloaded_bytes: v[9],
            gpu_bytes: v[10],
            expert_params_bytes: v[11],
            expert_grads_bytes: v[12],
            expert_optimizer_states_bytes: v[13],
        })
        .collect())
}

/// The closing `memory` line: the rank with the highest peak RSS.
pub fn memory_line(ranks: &[RankMemory]) -> Option<String> {
    ranks
        .iter()
        .max_by(|a, b| a.peak_rss_mib.total_cmp(&b.peak_rss_mib))
        .map(RankMemory::line)
}

/// This process's peak resident set (VmHWM) in KiB; 0 where /proc does not tell.
pub fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Writes `summary` as DIR/summary.json.
pub fn write_summary(dir: &Path, summary: &serde_json::Value) -> anyhow::Result<()> {
    let path = dir.join("summary.json");
    let text = serde_json::to_string_pretty(summary)?;
    std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// The median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The GPU's memory in use after this step, kept if it is the most so far (the driver's count:
/// every process on the GPU, the CUDA context included), with the process's allocation peak so
/// far. None on the CPU.
pub fn gpu_peak(
    peak: Option<ds_engine::device::GpuInfo>,
    dev: &ds_engine::Device,
) -> Option<ds_engine::device::GpuInfo> {
    let now = ds_engine::device::gpu_info(dev)?;
    Some(match peak {
        Some(p) => ds_engine::device::GpuInfo {
            used_bytes: p.used_bytes.max(now.used_bytes),
            allocated_peak_bytes: p.allocated_peak_bytes.max(now.allocated_peak_bytes),
            ..now
        },
        None => now,
    })
}

/// The summary's `gpu` section (null on the CPU): the device, its peak memory in use beside
/// what rank 0 accounts in GPU memory (`memory`), and the MFU: the median step's model
/// TFLOP/s over the job's GPUs against the GPU's dense peak for the precision of the matrix
/// products.
pub fn gpu_summary(
    gpu: Option<&ds_engine::device::GpuInfo>,
    memory: &RankMemory,
    records: &[StepRecord],
    s: &ds_engine::Settings,
    gpus: usize,
) -> serde_json::Value {
    let Some(g) = gpu else {
        return serde_json::Value::Null;
    };
    let half = s.precision != ds_engine::Precision::F32;
    let peak = ds_engine::device::peak_tflops(&g.name, half);
    let tflops = median(&records.iter().skip(1).map(|r| r.tflops).collect::<Vec<_>>());
    let mfu = peak
        .filter(|_| tflops.is_finite())
        .map(|p| tflops / (p * gpus as f64));
    serde_json::json!({
        "name": g.name,
        "memory_used_peak_mib": g.used_bytes as f64 / (1 << 20) as f64,
        "memory_allocated_peak_mib": g.allocated_peak_bytes.map(|b| b as f64 / (1 << 20) as f64),
        "memory_total_mib": g.total_bytes as f64 / (1 << 20) as f64,
        "accounted_mib": memory.gpu_bytes as f64 / (1 << 20) as f64,
        "peak_tflops": peak,
        "median_tflops": tflops.is_finite().then_some(tflops),
        "mfu": mfu,
    })
}

#[cfg(test)]
mod tests {
    use super::RankMemory;

    fn rank(gpu_bytes: u64) -> RankMemory {
        const MIB: u64 = 1 << 20;
        RankMemory {
            rank: 0,
            peak_rss_mib: 100.0,
            params_bytes: 40 * MIB,
            grads_bytes: 20 * MIB,
            optimizer_states_bytes: 30 * MIB,
            activations_bytes: 0,
            layer_params_bytes: 0,
            layer_grads_bytes: 0,
            comm_buffers_bytes: 0,
            accounted_bytes: 90 * MIB,
            offloaded_bytes: 0,
            gpu_bytes,
            expert_params_bytes: 0,
            expert_grads_bytes: 0,
            expert_optimizer_states_bytes: 0,
        }
    }

    /// Peak RSS is set against what is in host memory: the bytes on a GPU are named apart.
    #[test]
    fn the_rss_line_counts_only_host_memory() {
        let cpu = rank(0).line();
        assert!(
            cpu.contains("= 90 MiB accounted") && cpu.contains("+ 10 MiB not"),
            "{cpu}"
        );
        assert!(!cpu.contains("GPU"), "{cpu}");
        let gpu = rank(60 << 20).line();
        assert!(
            gpu.contains("= 30 MiB accounted") && gpu.contains("+ 70 MiB not"),
            "{gpu}"
        );
        assert!(gpu.contains("less 60 MiB of these in GPU memory"), "{gpu}");
    }
}
