//! Top-level scalar keys, the data-parallel size DeepSpeed derives, and DeepSpeed's warnings.

use serde::Serialize;
use serde_json::Value as Json;

use crate::batch::PyNum;
use crate::dims::ParallelDims;
use crate::error::{ConfigError, Result};
use crate::monitor::MonitorConfig;
use crate::optim::TypedSection;
use crate::runtime::ActivationCheckpointingConfig;
use crate::value::{Dict, Value};
use crate::zero::ZeroConfig;

/// Every top-level key DeepSpeed 0.19.8 reads. Others are accepted (DeepSpeed ignores them)
/// and reported with the closest known key.
pub const KNOWN_KEYS: [&str; 52] = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "managed_gradient_accumulation",
    "steps_per_print",
    "dump_state",
    "disable_python_gc",
    "disable_allgather",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "gradient_allreduce_op",
    "zero_optimization",
    "allgather_size",
    "activation_checkpointing",
    "comms_logger",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "gradient_clipping",
    "fp16",
    "bf16",
    "bfloat16",
    "torch_autocast",
    "optimizer",
    "scheduler",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "flops_profiler",
    "wall_clock_breakdown",
    "memory_breakdown",
    "autotuning",
    "use_data_before_expert_parallelism",
    "hybrid_engine",
    "pipeline",
    "data_efficiency",
    "checkpoint",
    "data_types",
    "aio",
    "dataloader_drop_last",
    "log_level",
    "datastates_ckpt",
    "weight_quantization",
    "compile",
    "timers",
    "tensor_parallel",
    "expert_parallel",
    "vocabulary_size",
    "sequence_parallel_size",
    "data_parallel_size",
];

/// Top-level values DeepSpeed stores as given (no type check at config time). They are kept as
/// JSON here; `Config` accessors convert what the engine uses.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scalars {
    pub steps_per_print: Json,
    pub gradient_clipping: Json,
    pub prescale_gradients: Json,
    pub gradient_predivide_factor: Json,
    /// "mean" or "sum" (lower-cased).
    pub gradient_allreduce_op: String,
    /// "fp32", "fp16", "bf16", or null (follow the training precision).
    pub communication_data_type: Option<String>,
    pub seq_parallel_communication_data_type: Option<String>,
    pub dump_state: Json,
    pub disable_allgather: Json,
    pub memory_breakdown: Json,
    pub dataloader_drop_last: Json,
    pub zero_allow_untested_optimizer: Json,
    pub zero_force_ds_cpu_optimizer: Json,
}

fn raw(root: &Dict, key: &str, default: Json) -> Json {
    root.get(key).map_or(default, Value::to_json)
}

impl Scalars {
    pub fn read(root: &Dict) -> Result<Scalars> {
        Ok(Scalars {
            steps_per_print: raw(root, "steps_per_print", Json::Null),
            gradient_clipping: raw(root, "gradient_clipping", Json::from(1.0)),
            prescale_gradients: raw(root, "prescale_gradients", Json::Bool(false)),
            gradient_predivide_factor: raw(root, "gradient_predivide_factor", Json::from(1.0)),
            communication_data_type: comm_dtype(root, "communication_data_type", None)?,
            seq_parallel_communication_data_type: comm_dtype(
                root,
                "seq_parallel_communication_data_type",
                Some("fp32"),
            )?,
            gradient_allreduce_op: allreduce_op(root)?,
            dump_state: raw(root, "dump_state", Json::Bool(false)),
            disable_allgather: raw(root, "disable_allgather", Json::Bool(false)),
            memory_breakdown: raw(root, "memory_breakdown", Json::Bool(false)),
            dataloader_drop_last: raw(root, "dataloader_drop_last", Json::Bool(false)),
            zero_allow_untested_optimizer: raw(
                root,
                "zero_allow_untested_optimizer",
                Json::Bool(false),
            ),
            zero_force_ds_cpu_optimizer: raw(root, "zero_force_ds_cpu_optimizer", Json::Bool(true)),
        })
    }
}

/// `communication_data_type`: fp32 / fp16 / bf16 in any case, or null.
fn comm_dtype(root: &Dict, key: &str, default: Option<&str>) -> Result<Option<String>> {
    let v = match root.get(key) {
        None => return Ok(default.map(str::to_string)),
        Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    match v.as_str().map(str::to_lowercase) {
        Some(s) if ["fp32", "fp16", "bf16"].contains(&s.as_str()) => Ok(Some(s)),
        _ => Err(ConfigError::invalid(
            key,
            v,
            "\"fp16\", \"bf16\" or \"fp32\"",
        )),
    }
}

fn allreduce_op(root: &Dict) -> Result<String> {
    let v = root
        .get("gradient_allreduce_op")
        .cloned()
        .unwrap_or(Value::Str("mean".into()));
    match v.as_str().map(str::to_lowercase) {
        Some(s) if s == "mean" || s == "sum" => Ok(s),
        _ => Err(ConfigError::invalid(
            "gradient_allreduce_op",
            &v,
            "\"mean\" or \"sum\"",
        )),
    }
}

/// The data-parallel size the batch rule uses.
///
/// With tp or pp > 1, DeepSpeed gets it from the model-parallel unit: world / (tp * pp), and
/// ds-rs divides that by the sequence-parallel size as the Ulysses rule below does. Without,
/// it is the world size, divided by `sequence_parallel_size` when the config has that key (a
/// true division: it can be a float, and DeepSpeed then does float batch arithmetic), or
/// `data_parallel_size` when both keys are present (DeepSpeed builds a device mesh).
pub fn data_parallel_size(root: &Dict, dims: &ParallelDims) -> Result<PyNum> {
    if dims.tp > 1 || dims.pp > 1 {
        return Ok(PyNum::Int(dims.replicas() as i64));
    }
    let Some(sp) = root.get("sequence_parallel_size") else {
        return Ok(PyNum::Int(dims.world_size as i64));
    };
    let sp_num = sp
        .as_f64()
        .ok_or_else(|| ConfigError::invalid("sequence_parallel_size", sp, "a positive integer"))?;
    if let Some(dp) = root.get("data_parallel_size") {
        let dp_num = dp
            .as_f64()
            .ok_or_else(|| ConfigError::invalid("data_parallel_size", dp, "a positive integer"))?;
        if dp_num * sp_num != dims.world_size as f64 || dp_num.fract() != 0.0 {
            return Err(ConfigError::conflict(
                "data_parallel_size",
                format!("data_parallel_size * sequence_parallel_size = {dp} * {sp} must equal the world size {}", dims.world_size),
            ));
        }
        return Ok(PyNum::Int(dp_num as i64));
    }
    if sp_num == 0.0 {
        return Err(ConfigError::invalid(
            "sequence_parallel_size",
            sp,
            "a positive integer",
        ));
    }
    Ok(PyNum::Float(dims.world_size as f64 / sp_num))
}

/// The legacy `"zero_optimization": true|false` form: stage 1 (with the top-level
/// `allgather_size` as bucket size) or stage 0.
pub fn legacy_zero_bool(on: bool, root: &Dict) -> Value {
    let mut d = Dict::default();
    d.insert("stage", Value::Int(i64::from(on)));
    if on {
        let size = root
            .get("allgather_size")
            .cloned()
            .unwrap_or(Value::Float(5e8));
        d.insert("allgather_bucket_size", size);
    }
    Value::Dict(d)
}

/// `doc` with a legacy `"zero_optimization": true|false` written out as the section it means,
/// for a program that edits the section (the autotuner's trials set its stage).
pub fn expand_legacy_zero(doc: &mut Value) {
    let Value::Dict(root) = doc else { return };
    if let Some(Value::Bool(on)) = root.get("zero_optimization") {
        let section = legacy_zero_bool(*on, root);
        root.insert("zero_optimization", section);
    }
}

/// `wall_clock_breakdown | flops_profiler.enabled`: Python's `|` needs bools or ints.
pub fn wall_clock_breakdown(root: &Dict) -> Result<bool> {
    let wall = root
        .get("wall_clock_breakdown")
        .cloned()
        .unwrap_or(Value::Bool(false));
    let flops = match root.get("flops_profiler") {
        Some(Value::Dict(d)) => d.get("enabled").cloned().unwrap_or(Value::Bool(false)),
        _ => Value::Bool(false),
    };
    for (path, v) in [
        ("wall_clock_breakdown", &wall),
        ("flops_profiler.enabled", &flops),
    ] {
        if !matches!(v, Value::Bool(_) | Value::Int(_)) {
            return Err(ConfigError::invalid(path, v, "true or false"));
        }
    }
    Ok(wall.truthy() || flops.truthy())
}

/// DeepSpeed's `_do_warning_check`, which can also fail on values of the wrong type.
pub fn warning_checks(root: &Dict, optimizer: Option<&TypedSection>) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    if let Some(v) = root.get("vocabulary_size").filter(|v| v.truthy()) {
        let n = match v {
            Value::Int(_) | Value::Bool(_) | Value::Float(_) => v.as_f64().unwrap_or(0.0),
            other => return Err(ConfigError::invalid("vocabulary_size", other, "an integer")),
        };
        if n % 8.0 != 0.0 {
            warnings.push(format!(
                "vocabulary_size: {v} is not aligned to 8, which may hurt tensor-core use"
            ));
        }
    }
    let params = optimizer.and_then(|o| o.params.as_ref());
    if let Some(p) = params {
        let Json::Object(map) = p else {
            return Err(ConfigError::invalid("optimizer.params", p, "an object"));
        };
        if let Some(m) = map.get("max_grad_norm") {
            let x = m.as_f64().ok_or_else(|| {
                ConfigError::invalid("optimizer.params.max_grad_norm", m, "a number")
            })?;
            if x > 0.0 {
                warnings.push(format!(
                    "optimizer.params.max_grad_norm: {m} is not supported as an optimizer parameter; use `gradient_clipping`"
                ));
            }
        }
    }
    Ok(warnings)
}

/// The resolved sections `unsupported_feature_warnings` reads.
pub struct Sections<'a> {
    pub zero: &'a ZeroConfig,
    pub checkpointing: &'a ActivationCheckpointingConfig,
    pub monitor: &'a MonitorConfig,
    /// The tensor-parallel degree.
    pub tp: usize,
}

/// Settings DeepSpeed accepts that ask for something ds-rs does not do (yet).
pub fn unsupported_feature_warnings(root: &Dict, s: &Sections) -> Vec<String> {
    let (z, ac) = (s.zero, s.checkpointing);
    let checks = [
        // ds-rs checkpoints by recomputation (in_config, pipeline.activation_checkpoint_interval);
        // these tune where DeepSpeed's CUDA implementation keeps the checkpoints
        (
            ac.cpu_checkpointing,
            "activation_checkpointing.cpu_checkpointing",
        ),
        (
            ac.contiguous_memory_optimization,
            "activation_checkpointing.contiguous_memory_optimization",
        ),
        (
            ac.number_checkpoints.is_some(),
            "activation_checkpointing.number_checkpoints",
        ),
        (
            ac.synchronize_checkpoint_boundary,
            "activation_checkpointing.synchronize_checkpoint_boundary",
        ),
        (ac.profile, "activation_checkpointing.profile"),
        (
            ac.partition_activations && s.tp == 1,
            "activation_checkpointing.partition_activations at tensor-parallel size 1 (nothing to partition)",
        ),
        (root.contains_key("data_efficiency"), "data_efficiency"),
        (root.contains_key("hybrid_engine"), "hybrid_engine"),
        (root.contains_key("torch_autocast"), "torch_autocast"),
        (
            root.contains_key("weight_quantization"),
            "weight_quantization",
        ),
        (z.zenflow.is_some(), "zero_optimization.zenflow"),
        (
            z.zero_quantized_weights || z.zero_quantized_gradients,
            "zero_optimization.zero_quantized_* (ZeRO++)",
        ),
        (
            z.zero_hpz_partition_size > 1,
            "zero_optimization.zero_hpz_partition_size (ZeRO++)",
        ),
        (s.monitor.wandb.enabled, "wandb (needs a network service)"),
        (s.monitor.comet.enabled, "comet (needs a network service)"),
    ];
    checks
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, what)| format!("{what}: accepted as DeepSpeed does, but ds-rs does not implement it; it has no effect"))
        .collect()
}
