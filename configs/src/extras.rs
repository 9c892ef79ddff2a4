//! Typed sections ds-rs checks exactly as DeepSpeed does but does not act on yet:
//! `hybrid_engine`, `compile`, `tensor_parallel`, `weight_quantization`, `timers`,
//! `torch_autocast`, `data_efficiency`.
//!
//! Checking them keeps the verdict on a file identical to DeepSpeed's; `resolve` adds a
//! warning when one of them asks for a feature ds-rs does not have.

use crate::coerce::Bound;
use crate::error::{ConfigError, Result};
use crate::lenient::dict_at;
use crate::section::Section;
use crate::value::{Dict, Value};

pub type Autos = Vec<(String, serde_json::Value)>;

/// Opens `root[key]` as a typed section (absent: all defaults), reads it and closes it.
fn typed<T>(
    root: &Dict,
    key: &'static str,
    autos: &mut Autos,
    read: impl FnOnce(&mut Section) -> T,
) -> Result<T> {
    let mut s = match root.get(key) {
        None => Section::empty(key),
        Some(v) => Section::open(key, v)?,
    };
    let out = read(&mut s);
    autos.extend(s.finish()?);
    Ok(out)
}

/// `hybrid_engine.enabled`.
pub fn hybrid_engine(root: &Dict, autos: &mut Autos) -> Result<bool> {
    typed(root, "hybrid_engine", autos, |s| {
        s.int("max_out_tokens", 512, Bound::Gt(0.0));
        s.int("inference_tp_size", 1, Bound::None);
        s.bool("release_inference_cache", false);
        s.bool("pin_parameters", true);
        s.int("tp_gather_partition_size", 8, Bound::None);
        s.bool("enable_cuda_graph", false);
        s.bool("enabled", false)
    })
}

/// The bool fields of CompileConfig besides `deepcompile`, with their defaults.
const COMPILE_FLAGS: [(&str, bool); 15] = [
    ("autoep_non_moe", false),
    ("free_activation", false),
    ("offload_activation", false),
    ("offload_activation_pin_memory", true),
    ("offload_opt_states", false),
    ("double_buffer", true),
    ("symmetric_memory", false),
    ("debug_log", false),
    ("offload_parameters", false),
    ("sync_before_reduce", false),
    ("sync_after_reduce", false),
    ("sync_before_allgather", false),
    ("sync_after_allgather", false),
    ("keep_int_input_tensors", true),
    ("keep_all_input_tensors", false),
];

/// `compile.deepcompile`.
pub fn compile(root: &Dict, autos: &mut Autos) -> Result<bool> {
    typed(root, "compile", autos, |s| {
        let deepcompile = s.bool("deepcompile", false);
        for (key, default) in COMPILE_FLAGS {
            s.bool(key, default);
        }
        s.int("free_activation_threshold", 10 * 1024 * 1024, Bound::None);
        check_passes(s);
        deepcompile
    })
}

fn check_passes(s: &mut Section) {
    const PASSES: [&str; 4] = ["z1", "z3", "autosp", "autotp"];
    let Some(v) = s.raw("passes").cloned() else {
        return;
    };
    let expected = "null or a list of \"z1\", \"z3\", \"autosp\", \"autotp\"";
    match &v {
        Value::Null => {}
        Value::List(items) => {
            // pydantic names each bad item by its index.
            for (i, item) in items.iter().enumerate() {
                if !item.as_str().is_some_and(|p| PASSES.contains(&p)) {
                    let path = format!("{}.{i}", s.key_path("passes"));
                    s.error(ConfigError::invalid(&path, item, expected));
                }
            }
        }
        other => {
            let path = s.key_path("passes");
            s.error(ConfigError::invalid(&path, other, expected));
        }
    }
}

/// What ds-rs takes from the `tensor_parallel` section.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TensorParallel {
    /// DeepSpeed's AutoTP degree (0 = off).
    pub autotp_size: i64,
    /// `partition_config` as written (DeepSpeed checks it only when it builds the AutoTP
    /// layers; the engine reads it against the model's parameter names).
    pub partition_config: Option<serde_json::Value>,
    /// `sequence_parallel`: a ds-rs extension (Megatron-LM's sequence parallelism), which
    /// DeepSpeed 0.19.8 would reject as an unknown key.
    pub sequence_parallel: bool,
}

/// The key ds-rs adds to DeepSpeed's `tensor_parallel` section.
pub const SEQUENCE_PARALLEL: &str = "sequence_parallel";

/// `tensor_parallel.autotp_size` and the ds-rs extension `sequence_parallel`.
pub fn tensor_parallel(root: &Dict, autos: &mut Autos) -> Result<TensorParallel> {
    typed(root, "tensor_parallel", autos, |s| {
        if let Some(v) = s.raw("dtype").cloned() {
            // A torch.dtype object: JSON cannot express one, so any JSON value is rejected.
            let path = s.key_path("dtype");
            s.error(ConfigError::invalid(
                &path,
                &v,
                "a torch.dtype (not expressible in JSON; leave it out)",
            ));
        }
        s.bool("tp_overlap_comm", false);
        s.opt_bool("vocab_parallel_lm_head");
        s.choice("vocab_parallel_ce_backend", "torch", &["torch", "liger"]);
        tp_subsection(s);
        s.raw("injection_policy_tuple");
        let partition_config = s.raw("partition_config").map(|v| v.to_json());
        s.opt_string("preset_model");
        s.bool("keep_module_on_host", false);
        s.bool("kernel_inject", false);
        TensorParallel {
            partition_config,
            autotp_size: s.int("autotp_size", 0, Bound::None),
            sequence_parallel: s.bool(SEQUENCE_PARALLEL, false),
        }
    })
}

/// `tensor_parallel.tp` (alias of `tensor_parallel`).
fn tp_subsection(s: &mut Section) {
    let key = if s.has("tp") || !s.has("tensor_parallel") {
        "tp"
    } else {
        "tensor_parallel"
    };
    if let Some(mut sub) = s.sub(key, false) {
        sub.int("tp_size", 1, Bound::None);
        sub.int("tp_grain_size", 1, Bound::None);
        sub.raw("mpu");
        sub.raw("tp_group");
        s.absorb(sub);
    }
}

/// `weight_quantization` (inference weight quantization).
pub fn weight_quantization(root: &Dict, autos: &mut Autos) -> Result<bool> {
    if !root.contains_key("weight_quantization") {
        return Ok(false);
    }
    typed(root, "weight_quantization", autos, |s| {
        s.int("num_bits", 8, Bound::None);
        s.choice("q_type", "symmetric", &["asymmetric", "symmetric"]);
        s.int("q_groups", 1, Bound::None);
        s.raw("quantized_initialization");
        s.raw("post_init_quant");
        s.bool("enabled", true)
    })
}

/// `timers.throughput` (read only when present, as DeepSpeed does).
pub fn timers(root: &Dict, autos: &mut Autos) -> Result<()> {
    let Some(t) = root.get("timers") else {
        return Ok(());
    };
    let inner = match t {
        Value::Dict(d) => d.get("throughput"),
        Value::Str(s) => return check_membership_string(s),
        Value::List(_) => None,
        other => return Err(ConfigError::invalid("timers", other, "an object")),
    };
    let Some(inner) = inner else { return Ok(()) };
    let mut s = Section::open("timers.throughput", inner)?;
    s.bool("enabled", true);
    s.bool("synchronized", true);
    autos.extend(s.finish()?);
    Ok(())
}

/// `"throughput" in "some string"` is a substring test in Python; a string that contains it is
/// then indexed like a dict and fails.
fn check_membership_string(s: &str) -> Result<()> {
    if s.contains("throughput") {
        Err(ConfigError::invalid(
            "timers",
            format!("'{s}'"),
            "an object",
        ))
    } else {
        Ok(())
    }
}

/// `torch_autocast`: enabled flag, dtype and the modules kept in lower precision.
pub fn torch_autocast(root: &Dict) -> Result<bool> {
    const DTYPES: [&str; 13] = [
        "torch.float16",
        "fp16",
        "float16",
        "half",
        "torch.float32",
        "fp32",
        "float32",
        "float",
        "torch.int8",
        "int8",
        "torch.bfloat16",
        "bf16",
        "bfloat16",
    ];
    let Some(d) = dict_at(root, "torch_autocast")? else {
        return Ok(false);
    };
    if let Some(v) = d.get("dtype") {
        if !v.as_str().is_some_and(|s| DTYPES.contains(&s)) {
            return Err(ConfigError::invalid(
                "torch_autocast.dtype",
                v,
                "a dtype name such as \"bf16\" or \"fp16\"",
            ));
        }
    }
    if let Some(v) = d.get("lower_precision_safe_modules") {
        let ok = matches!(v, Value::List(items) if items.iter().all(|i| i.as_str().is_some()));
        if !ok {
            return Err(ConfigError::invalid(
                "torch_autocast.lower_precision_safe_modules",
                v,
                "a list of module names",
            ));
        }
    }
    Ok(d.get("enabled").is_some_and(Value::truthy))
}

/// `data_efficiency`: curriculum learning and data routing (not implemented by ds-rs).
pub fn data_efficiency(root: &Dict) -> Result<bool> {
    let Some(d) = dict_at(root, "data_efficiency")? else {
        return Ok(false);
    };
    for key in ["data_sampling", "data_routing"] {
        if let Some(v) = d.get(key) {
            if v.as_dict().is_none() {
                return Err(ConfigError::invalid(
                    &format!("data_efficiency.{key}"),
                    v,
                    "an object",
                ));
            }
        }
    }
    Ok(d.get("enabled").is_some_and(Value::truthy))
}
