//! What the engine takes from a resolved ds_config, read once at initialisation.

use std::path::PathBuf;

use ds_config::precision::Fp16Config;
use ds_config::{Config, OffloadDevice, ZeroStage};
use ds_partition::{ReduceConfig, Stage3Config, ZeroOptions};
use serde_json::Value as Json;

use crate::{CpuOffload, EngineError, Result};

/// The dtype parameters, gradients and activations are computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    BF16,
    F16,
}

/// The training settings of one run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub precision: Precision,
    pub micro_batch: usize,
    pub grad_accum: usize,
    /// Global gradient-norm clipping threshold (0: off).
    pub clip: f64,
    pub zero: ZeroOptions,
    /// Recompute layer internals in backward (ds_config `activation_checkpointing`, or a
    /// `pipeline.activation_checkpoint_interval`).
    pub recompute: bool,
    /// With `recompute`: forward keeps the input of every `checkpoint_interval`-th layer only,
    /// and backward recomputes each such segment from it (DeepSpeed's
    /// `pipeline.activation_checkpoint_interval`; 1 keeps every layer's input).
    pub checkpoint_interval: usize,
    /// ZeRO-3: a layer whose parameters are reused by backward within this many parameter
    /// elements keeps them, with its graph, from forward to backward
    /// (`stage3_max_reuse_distance`).
    pub max_reuse_distance: usize,
    pub fp16: Fp16Config,
    pub wall_clock_breakdown: bool,
    /// `offload_optimizer: {"device": "nvme"}`: the master copy and optimizer states in
    /// files under this path, streamed through this many chunk buffers.
    pub nvme_optimizer: Option<(PathBuf, usize)>,
    /// `offload_param: {"device": "nvme"}` (ZeRO-3): the parameter shard in a file under this
    /// path.
    pub nvme_params: Option<PathBuf>,
    /// ZeRO-Offload: `offload_optimizer.device = "cpu"` (the master copy and the moments in
    /// host memory, stepped by the CPU Adam) and, at stage 3, `offload_param.device = "cpu"`
    /// (the parameter shard in host memory); they move something only on a GPU.
    pub cpu_offload: CpuOffload,
}

/// Which states ZeRO-Offload keeps in host memory, as the config's offload sections say.
fn cpu_offload(cfg: &Config) -> CpuOffload {
    let z = &cfg.zero_optimization;
    let cpu = |d: Option<OffloadDevice>| d == Some(OffloadDevice::Cpu);
    CpuOffload {
        optimizer: cpu(z.offload_optimizer.as_ref().map(|o| o.device)),
        // stages 0-2 keep parameters whole on every rank and offload none (DeepSpeed)
        params: z.stage == ZeroStage::Weights && cpu(z.offload_param.as_ref().map(|o| o.device)),
    }
}

impl Settings {
    pub fn from_config(cfg: &Config, recompute: bool) -> Result<Settings> {
        let interval = cfg.pipeline.activation_checkpoint_interval()?;
        let recompute = recompute || cfg.activation_checkpointing.in_config || interval > 0;
        let precision = match (cfg.fp16.enabled, cfg.bf16.enabled) {
            (true, _) => Precision::F16,
            (_, true) => Precision::BF16,
            _ => Precision::F32,
        };
        Ok(Settings {
            precision,
            micro_batch: positive(
                cfg.train_micro_batch_size_per_gpu.as_i64(),
                "train_micro_batch_size_per_gpu",
            )?,
            grad_accum: positive(
                cfg.gradient_accumulation_steps.as_i64(),
                "gradient_accumulation_steps",
            )?,
            clip: number(&cfg.scalars.gradient_clipping, "gradient_clipping", 0.0)?,
            zero: zero_options(cfg)?,
            recompute,
            checkpoint_interval: interval.max(1),
            max_reuse_distance: elements(
                cfg.zero_optimization.stage3_max_reuse_distance,
                "zero_optimization.stage3_max_reuse_distance",
            )?,
            fp16: cfg.fp16.clone(),
            wall_clock_breakdown: cfg.wall_clock_breakdown,
            nvme_optimizer: nvme_optimizer(cfg)?,
            nvme_params: nvme_params(cfg)?,
            cpu_offload: cpu_offload(cfg),
        })
    }
}

/// `offload_param` to NVMe: its `nvme_path`; ZeRO-3 is required (DeepSpeed offloads the
/// parameters of stage 3's partitioned store only).
fn nvme_params(cfg: &Config) -> Result<Option<PathBuf>> {
    let z = &cfg.zero_optimization;
    let o = z.offload_param.as_ref();
    let stage = match z.stage {
        ZeroStage::Weights => Ok(()),
        s => Err(format!(
            "zero_optimization.stage 3 (stage {} keeps every parameter whole on every rank)",
            u8::from(s)
        )),
    };
    nvme_dir(
        "zero_optimization.offload_param",
        o.map(|o| (o.device, o.nvme_path.as_deref())),
        stage,
    )
}

/// `offload_optimizer` to NVMe: its `nvme_path` and `buffer_count`; a ZeRO stage that
/// partitions the optimizer is required (DeepSpeed's offload works on the partitioned
/// optimizer).
fn nvme_optimizer(cfg: &Config) -> Result<Option<(PathBuf, usize)>> {
    let z = &cfg.zero_optimization;
    let o = z.offload_optimizer.as_ref();
    let stage = match z.stage.partitions_optimizer() {
        true => Ok(()),
        false => Err(format!(
            "zero_optimization.stage 1, 2 or 3 (stage {} keeps no partitioned optimizer to offload)",
            u8::from(z.stage)
        )),
    };
    let dir = nvme_dir(
        "zero_optimization.offload_optimizer",
        o.map(|o| (o.device, o.nvme_path.as_deref())),
        stage,
    )?;
    Ok(dir.zip(o.map(|o| o.buffer_count.max(1) as usize)))
}

/// The swap directory of an offload `section` (its device and nvme_path) when the device is
/// NVMe; `stage`: whether the ZeRO stage can offload it, else what it needs.
fn nvme_dir(
    section: &str,
    offload: Option<(OffloadDevice, Option<&str>)>,
    stage: std::result::Result<(), String>,
) -> Result<Option<PathBuf>> {
    let Some((OffloadDevice::Nvme, path)) = offload else {
        return Ok(None);
    };
    if let Err(needs) = stage {
        return Err(EngineError::Setting(format!(
            "{section}.device = \"nvme\" needs {needs}"
        )));
    }
    match path.filter(|p| !p.is_empty()) {
        Some(p) => Ok(Some(p.into())),
        None => Err(EngineError::Setting(format!(
            "{section}.nvme_path: required with device \"nvme\" (a directory on the disk to swap to)"
        ))),
    }
}

fn zero_options(cfg: &Config) -> Result<ZeroOptions> {
    let z = &cfg.zero_optimization;
    let predivide = number(
        &cfg.scalars.gradient_predivide_factor,
        "gradient_predivide_factor",
        1.0,
    )?;
    let prescale = cfg.scalars.prescale_gradients.as_bool().unwrap_or(false);
    Ok(ZeroOptions {
        stage: z.stage,
        reduce: ReduceConfig {
            bucket_size: elements(z.reduce_bucket_size, "zero_optimization.reduce_bucket_size")?,
            // Stages 0-1 reduce once per step, after backward, so there is nothing to overlap.
            overlap_comm: z.overlap_comm && z.stage.partitions_gradients(),
            // DeepSpeed applies the predivide factor only with prescale_gradients.
            predivide_factor: if prescale { predivide } else { 1.0 },
        },
        allgather_bucket_size: elements(
            z.allgather_bucket_size,
            "zero_optimization.allgather_bucket_size",
        )?,
        stage3: Stage3Config {
            prefetch_bucket_size: elements(
                z.stage3_prefetch_bucket_size,
                "zero_optimization.stage3_prefetch_bucket_size",
            )?,
            max_live_parameters: elements(
                z.stage3_max_live_parameters,
                "zero_optimization.stage3_max_live_parameters",
            )?,
            param_persistence_threshold: elements(
                z.stage3_param_persistence_threshold,
                "zero_optimization.stage3_param_persistence_threshold",
            )?,
        },
    })
}

fn positive(v: Option<i64>, path: &str) -> Result<usize> {
    match v {
        Some(n) if n > 0 => Ok(n as usize),
        _ => Err(EngineError::Setting(format!(
            "{path}: must be a positive integer, got {v:?}"
        ))),
    }
}

fn elements(v: i64, path: &str) -> Result<usize> {
    usize::try_from(v)
        .map_err(|_| EngineError::Setting(format!("{path}: must not be negative, got {v}")))
}

fn number(v: &Json, path: &str, default: f64) -> Result<f64> {
    match v {
        Json::Null => Ok(default),
        Json::Bool(b) => Ok(f64::from(u8::from(*b))),
        v => v
            .as_f64()
            .ok_or_else(|| EngineError::Setting(format!("{path}: expected a number, got {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds_config::{hjson, resolve, ParallelDims};

    fn offload(zero: &str) -> CpuOffload {
        let json = format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "optimizer": {{"type": "AdamW"}},
                "zero_optimization": {{{zero}}}}}"#
        );
        let doc = hjson::parse_bytes(json.as_bytes()).unwrap();
        let cfg = resolve(&doc, &ParallelDims::new(1, 1, 1).unwrap()).unwrap();
        Settings::from_config(&cfg, false).unwrap().cpu_offload
    }

    /// ZeRO-Offload's two settings, as DeepSpeed reads them: the optimizer's at any stage
    /// that has one, the parameters' at stage 3 only (stages 0-2 keep them whole).
    #[test]
    fn cpu_offload_follows_the_sections_and_the_stage() {
        let both = r#""offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}"#;
        let cases = [
            (r#""stage": 2"#.to_string(), (false, false)),
            (format!(r#""stage": 3, {both}"#), (true, true)),
            (format!(r#""stage": 2, {both}"#), (true, false)),
            (
                r#""stage": 1, "cpu_offload": true"#.to_string(),
                (true, false),
            ),
            (
                r#""stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}"#.to_string(),
                (false, false),
            ),
        ];
        for (zero, (optimizer, params)) in cases {
            assert_eq!(offload(&zero), CpuOffload { optimizer, params }, "{zero}");
        }
    }

    /// Training on the CPU, every state is in host memory whatever the offload settings.
    #[test]
    fn on_the_cpu_every_state_is_in_host_memory() {
        let all = CpuOffload {
            optimizer: true,
            params: true,
        };
        for offload in [CpuOffload::default(), all] {
            for dp_on_gpu in [true, false] {
                let p = crate::device::placements(&candle_core::Device::Cpu, offload, dp_on_gpu);
                assert!(p.params.is_host() && p.grads.is_host() && p.optimizer.is_host());
            }
        }
    }
}
