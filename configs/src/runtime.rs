//! Runtime sections DeepSpeed reads with `dict.get`: `activation_checkpointing`, `checkpoint`,
//! `autotuning`, `aio`, `pipeline`, `data_types`.

use serde::Serialize;
use serde_json::Value as Json;

use crate::error::{ConfigError, Result};
use crate::lenient::{dict_at, Lenient};
use crate::value::{Dict, Value};

/// `activation_checkpointing`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActivationCheckpointingConfig {
    /// The section is in the file: ds-rs then recomputes layer internals in backward (a
    /// DeepSpeed model opts in by calling `checkpoint()`; a ds-rs model is its layer list).
    #[serde(skip)]
    pub in_config: bool,
    pub partition_activations: bool,
    pub contiguous_memory_optimization: bool,
    pub cpu_checkpointing: bool,
    pub number_checkpoints: Option<i64>,
    pub synchronize_checkpoint_boundary: bool,
    pub profile: bool,
}

impl ActivationCheckpointingConfig {
    pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<Self> {
        let mut r = Lenient::open(root, "activation_checkpointing", warnings)?;
        let number_checkpoints = match r.get("number_checkpoints") {
            None | Some(Value::Null) => None,
            Some(_) => Some(r.integer("number_checkpoints", 0)),
        };
        Ok(ActivationCheckpointingConfig {
            in_config: matches!(root.get("activation_checkpointing"), Some(Value::Dict(_))),
            partition_activations: r.flag("partition_activations", false),
            contiguous_memory_optimization: r.flag("contiguous_memory_optimization", false),
            cpu_checkpointing: r.flag("cpu_checkpointing", false),
            number_checkpoints,
            synchronize_checkpoint_boundary: r.flag("synchronize_checkpoint_boundary", false),
            profile: r.flag("profile", false),
        })
    }
}

/// `checkpoint`: tag validation and loading options.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointConfig {
    /// "WARN", "IGNORE" or "FAIL".
    pub tag_validation: String,
    pub load_universal: bool,
    pub use_node_local_storage: bool,
    pub parallel_write_pipeline_stage: bool,
}

const TAG_MODES: [&str; 3] = ["WARN", "IGNORE", "FAIL"];
const WRITER_TYPES: [&str; 3] = ["MOCK", "PYTHON", "FAST"];
const DP_UNITS: [&str; 3] = ["REPLICA", "SOCKET", "MACHINE"];

impl CheckpointConfig {
    pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<Self> {
        let d = dict_at(root, "checkpoint")?;
        let tag_validation = upper_choice(
            d.and_then(|d| d.get("tag_validation")),
            "Warn",
            &TAG_MODES,
            "checkpoint.tag_validation",
        )?;
        let pipeline_stage = read_parallel_write(d)?;
        if let Some(writer) = d.and_then(|d| d.get("writer")) {
            check_writer(writer)?;
        }
        let mut r = Lenient::over("checkpoint", d, warnings);
        Ok(CheckpointConfig {
            tag_validation,
            load_universal: r.flag("load_universal", false),
            use_node_local_storage: r.flag("use_node_local_storage", false),
            parallel_write_pipeline_stage: pipeline_stage,
        })
    }
}

/// A string compared case-insensitively against `choices` (DeepSpeed calls `.upper()`).
fn upper_choice(v: Option<&Value>, default: &str, choices: &[&str], path: &str) -> Result<String> {
    let s = match v {
        None => default.to_uppercase(),
        Some(Value::Str(s)) => s.to_uppercase(),
        Some(other) => {
            return Err(ConfigError::invalid(
                path,
                other,
                format!("one of {}", choices.join(", ")),
            ))
        }
    };
    if choices.contains(&s.as_str()) {
        Ok(s)
    } else {
        Err(ConfigError::invalid(
            path,
            format!("'{s}'"),
            format!("one of {}", choices.join(", ")),
        ))
    }
}

/// `checkpoint.parallel_write.pipeline_stage`: Python's `value in [True, False]`, which also
/// admits 0, 1, 0.0 and 1.0.
fn read_parallel_write(d: Option<&Dict>) -> Result<bool> {
    let path = "checkpoint.parallel_write.pipeline_stage";
    let pw = match d.and_then(|d| d.get("parallel_write")) {
        None => return Ok(false),
        Some(Value::Dict(pw)) => pw,
        Some(other) => {
            return Err(ConfigError::invalid(
                "checkpoint.parallel_write",
                other,
                "an object",
            ))
        }
    };
    match pw.get("pipeline_stage") {
        None => Ok(false),
        Some(v @ (Value::Bool(_) | Value::Int(0 | 1))) => Ok(v.truthy()),
        Some(Value::Float(f)) if *f == 0.0 || *f == 1.0 => Ok(*f == 1.0),
        Some(other) => Err(ConfigError::invalid(path, other, "true or false")),
    }
}

fn check_writer(writer: &Value) -> Result<()> {
    let w = match writer {
        Value::Null => return Ok(()),
        Value::Dict(w) => w,
        other => {
            return Err(ConfigError::invalid(
                "checkpoint.writer",
                other,
                "an object",
            ))
        }
    };
    upper_choice(
        w.get("type"),
        "FAST",
        &WRITER_TYPES,
        "checkpoint.writer.type",
    )?;
    match w.get("data_parallel") {
        None | Some(Value::Null) => Ok(()),
        v => upper_choice(v, "", &DP_UNITS, "checkpoint.writer.data_parallel").map(|_| ()),
    }
}

/// `autotuning`: what `ds-rs autotune` searches and how it measures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AutotuningConfig {
    pub enabled: bool,
    pub fast: bool,
    pub results_dir: String,
    pub exps_dir: String,
    pub overwrite: bool,
    pub start_profile_step: i64,
    pub end_profile_step: i64,
    pub metric: String,
    pub metric_path: Option<String>,
    pub tuner_type: String,
    pub tuner_early_stopping: i64,
    pub tuner_num_trials: i64,
    pub arg_mappings: Option<Json>,
    pub model_info: Option<Json>,
    pub model_info_path: Option<String>,
    pub mp_size: i64,
    pub max_train_batch_size: Option<i64>,
    pub min_train_batch_size: i64,
    pub max_train_micro_batch_size_per_gpu: i64,
    pub min_train_micro_batch_size_per_gpu: i64,
    pub num_tuning_micro_batch_sizes: i64,
}

impl AutotuningConfig {
    pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<Self> {
        let d = dict_at(root, "autotuning")?;
        for key in ["results_dir", "exps_dir"] {
            if let Some(v) = d.and_then(|d| d.get(key)).filter(|v| !v.truthy()) {
                return Err(ConfigError::invalid(
                    &format!("autotuning.{key}"),
                    v,
                    "a non-empty directory name",
                ));
            }
        }
        let model_info = match d.and_then(|d| d.get("model_info")) {
            None | Some(Value::Null) => None,
            Some(Value::Dict(m)) => Some(Value::Dict(m.clone()).to_json()),
            Some(other) => {
                return Err(ConfigError::invalid(
                    "autotuning.model_info",
                    other,
                    "an object",
                ))
            }
        };
        let mut r = Lenient::over("autotuning", d, warnings);
        Ok(AutotuningConfig {
            enabled: r.flag("enabled", false),
            fast: r.flag("fast", true),
            results_dir: r.text_or("results_dir", "autotuning_results"),
            exps_dir: r.text_or("exps_dir", "autotuning_exps"),
            overwrite: r.flag("overwrite", true),
            start_profile_step: r.integer("start_profile_step", 3),
            end_profile_step: r.integer("end_profile_step", 5),
            metric: r.text_or("metric", "throughput"),
            metric_path: r.text("metric_path"),
            tuner_type: r.text_or("tuner_type", "gridsearch"),
            tuner_early_stopping: r.integer("tuner_early_stopping", 5),
            tuner_num_trials: r.integer("tuner_num_trials", 50),
            arg_mappings: r.get("arg_mappings").map(Value::to_json),
            model_info,
            model_info_path: r.text("model_info_path"),
            mp_size: r.integer("mp_size", 1),
            max_train_batch_size: r
                .get("max_train_batch_size")
                .map(|_| r.integer("max_train_batch_size", 0)),
            min_train_batch_size: r.integer("min_train_batch_size", 1),
            max_train_micro_batch_size_per_gpu: r
                .integer("max_train_micro_batch_size_per_gpu", 1024),
            min_train_micro_batch_size_per_gpu: r.integer("min_train_micro_batch_size_per_gpu", 1),
            num_tuning_micro_batch_sizes: r.integer("num_tuning_micro_batch_sizes", 3),
        })
    }
}

/// `aio`: asynchronous I/O for NVMe offload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AioConfig {
    pub block_size: i64,
    pub queue_depth: i64,
    pub intra_op_parallelism: i64,
    pub single_submit: bool,
    pub overlap_events: bool,
    pub use_gds: bool,
}

impl AioConfig {
    pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<Self> {
        let d = match root.get("aio") {
            None | Some(Value::Null) => None,
            Some(_) => dict_at(root, "aio")?,
        };
        let mut r = Lenient::over("aio", d, warnings);
        let c = AioConfig {
            block_size: r.integer("block_size", 1_048_576),
            queue_depth: r.integer("queue_depth", 8),
            intra_op_parallelism: r.integer("intra_op_parallelism", 1),
            single_submit: r.flag("single_submit", false),
            overlap_events: r.flag("overlap_events", true),
            use_gds: r.flag("use_gds", false),
        };
        if c.use_gds {
            // DeepSpeed asserts a CUDA accelerator here; GPUDirect Storage is CUDA-only.
            return Err(ConfigError::conflict(
                "aio.use_gds",
                "GPUDirect Storage needs a CUDA accelerator",
            ));
        }
        Ok(c)
    }
}

/// `pipeline`: DeepSpeed's pipeline-engine section, its defaults with the user's keys laid
/// over them. DeepSpeed reads it with `dict.get`, so any value resolves (the verdict stays
/// DeepSpeed's, and the resolved document keeps every key as written); each key a run reads
/// is typed and checked by its accessor.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct PipelineConfig(Json);

impl PipelineConfig {
    pub fn read(root: &Dict) -> Result<PipelineConfig> {
        let mut out = serde_json::json!({
            "stages": "auto",
            "partition": "best",
            "seed_layers": false,
            "activation_checkpoint_interval": 0,
            "pipe_partitioned": true,
            "grad_partitioned": true,
        });
        if let Some(d) = dict_at(root, "pipeline")? {
            for (k, v) in d.iter() {
                out[k] = v.to_json();
            }
        }
        Ok(PipelineConfig(out))
    }

    /// `stages`: a positive integer, or "auto" (one stage).
    pub fn stages(&self) -> Result<usize> {
        match &self.0["stages"] {
            Json::String(s) if s == "auto" => Ok(1),
            v => positive(v).ok_or_else(|| {
                ConfigError::invalid("pipeline.stages", v, "a positive integer or \"auto\"")
            }),
        }
    }

    /// `partition`: how the layers are cut into stages (DeepSpeed's `partition_method`:
    /// parameters, uniform, type:REGEX); "parameters" when it is not a string.
    pub fn partition(&self) -> &str {
        self.0["partition"].as_str().unwrap_or("parameters")
    }

    /// `activation_checkpoint_interval`: layers per recomputed chunk (0: none).
    pub fn activation_checkpoint_interval(&self) -> Result<usize> {
        const PATH: &str = "pipeline.activation_checkpoint_interval";
        match &self.0["activation_checkpoint_interval"] {
            Json::Null => Ok(0),
            v => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| ConfigError::invalid(PATH, v, "a whole number of layers")),
        }
    }

    /// `virtual_stages` (a ds-rs extension, Megatron-LM's interleaved schedule): model
    /// chunks per stage, 1 by default.
    pub fn virtual_stages(&self) -> Result<usize> {
        match &self.0["virtual_stages"] {
            Json::Null => Ok(1),
            v => positive(v).ok_or_else(|| {
                ConfigError::invalid("pipeline.virtual_stages", v, "a positive integer")
            }),
        }
    }
}

fn positive(v: &Json) -> Option<usize> {
    v.as_u64().filter(|&n| n > 0).map(|n| n as usize)
}

/// `data_types`: the dtypes of gradient accumulation, parameters and buffers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataTypesConfig {
    pub grad_accum_dtype: Option<String>,
    pub param_dtype: Option<String>,
    pub buffer_dtype: Option<String>,
}

impl DataTypesConfig {
    pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<Self> {
        let mut r = Lenient::open(root, "data_types", warnings)?;
        if let Some(v) = r.get("keep_in_fp32_modules") {
            let names =
                matches!(v, Value::List(items) if items.iter().all(|i| i.as_str().is_some()));
            if !v.is_auto() && !names {
                let expected = "\"auto\" or a list of module name patterns";
                return Err(ConfigError::invalid(
                    "data_types.keep_in_fp32_modules",
                    v,
                    expected,
                ));
            }
        }
        Ok(DataTypesConfig {
            grad_accum_dtype: r.text("grad_accum_dtype"),
            param_dtype: r.text("param_dtype"),
            buffer_dtype: r.text("buffer_dtype"),
        })
    }
}
