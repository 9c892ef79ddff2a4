//! `zero_optimization`: DeepSpeed's DeepSpeedZeroConfig (deepspeed/runtime/zero/config.py and
//! offload_config.py of 0.19.8), its defaults, aliases, deprecated forms and validators.

use serde::Serialize;

use crate::coerce::{self, Bound};
use crate::error::{ConfigError, Result};
use crate::section::Section;
use crate::value::Value;

/// `ZeroStageEnum`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(into = "u8")]
pub enum ZeroStage {
    Disabled,
    OptimizerStates,
    Gradients,
    Weights,
}

impl From<ZeroStage> for u8 {
    fn from(s: ZeroStage) -> u8 {
        s as u8
    }
}

/// The stage's number, as ds_config spells it.
impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", u8::from(*self))
    }
}

impl ZeroStage {
    /// Stages 1-3: each data-parallel rank keeps the master copy and optimizer states of its
    /// shard only.
    pub fn partitions_optimizer(self) -> bool {
        self >= ZeroStage::OptimizerStates
    }

    /// Stages 2-3: gradients are reduced into the owning shard as backward goes.
    pub fn partitions_gradients(self) -> bool {
        self >= ZeroStage::Gradients
    }

    /// Stage 3: parameters live in shards and are gathered per layer.
    pub fn partitions_parameters(self) -> bool {
        self == ZeroStage::Weights
    }

    fn from_value(v: &Value) -> std::result::Result<ZeroStage, &'static str> {
        const EXPECTED: &str = "0, 1, 2 or 3";
        // An int Enum in pydantic's lax mode: the value is converted like an int first.
        let n = match v {
            Value::Null => return Err(EXPECTED),
            v => coerce::to_int(v).map_err(|_| EXPECTED)?,
        };
        match n {
            0 => Ok(ZeroStage::Disabled),
            1 => Ok(ZeroStage::OptimizerStates),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Weights),
            _ => Err(EXPECTED),
        }
    }
}

/// Where offloaded state lives (`OffloadDeviceEnum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    None,
    Cpu,
    Nvme,
}

impl OffloadDevice {
    fn parse(s: &str) -> OffloadDevice {
        match s {
            "cpu" => OffloadDevice::Cpu,
            "nvme" => OffloadDevice::Nvme,
            _ => OffloadDevice::None,
        }
    }

    /// The device, or `None` when nothing is offloaded.
    pub fn name(self) -> Option<&'static str> {
        match self {
            OffloadDevice::None => None,
            OffloadDevice::Cpu => Some("cpu"),
            OffloadDevice::Nvme => Some("nvme"),
        }
    }
}

const DEVICES: [&str; 3] = ["none", "cpu", "nvme"];

/// `offload_param` (DeepSpeedZeroOffloadParamConfig).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadParamConfig {
    pub device: OffloadDevice,
    pub nvme_path: Option<String>,
    pub buffer_count: i64,
    pub buffer_size: i64,
    pub max_in_cpu: i64,
    pub pin_memory: bool,
}

impl OffloadParamConfig {
    fn read(s: &mut Section) -> Self {
        OffloadParamConfig {
            device: OffloadDevice::parse(&s.choice("device", "none", &DEVICES)),
            nvme_path: read_path(s),
            buffer_count: s.int("buffer_count", 5, Bound::Ge(0.0)),
            buffer_size: s.int("buffer_size", 100_000_000, Bound::Ge(0.0)),
            max_in_cpu: s.int("max_in_cpu", 1_000_000_000, Bound::Ge(0.0)),
            pin_memory: s.bool("pin_memory", true),
        }
    }

    /// DeepSpeed's defaults with the parameters on NVMe under `path`.
    pub fn nvme(path: &str) -> Self {
        let mut s = Section::empty("");
        OffloadParamConfig {
            device: OffloadDevice::Nvme,
            nvme_path: Some(path.to_string()),
            ..Self::read(&mut s)
        }
    }

    fn on_cpu() -> Self {
        let mut s = Section::empty("");
        OffloadParamConfig {
            device: OffloadDevice::Cpu,
            ..Self::read(&mut s)
        }
    }
}

/// `offload_optimizer` (DeepSpeedZeroOffloadOptimizerConfig).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OffloadOptimizerConfig {
    pub device: OffloadDevice,
    pub nvme_path: Option<String>,
    pub buffer_count: i64,
    pub pin_memory: bool,
    pub pipeline_read: bool,
    pub pipeline_write: bool,
    pub fast_init: bool,
    pub ratio: f64,
    pub super_offload: bool,
    pub cpuadam_cores_perc: f64,
}

impl OffloadOptimizerConfig {
    /// DeepSpeed's defaults with the optimizer states on NVMe under `path`.
    pub fn nvme(path: &str) -> Self {
        let mut s = Section::empty("");
        OffloadOptimizerConfig {
            device: OffloadDevice::Nvme,
            nvme_path: Some(path.to_string()),
            ..Self::read(&mut s)
        }
    }

    fn read(s: &mut Section) -> Self {
        OffloadOptimizerConfig {
            device: OffloadDevice::parse(&s.choice("device", "none", &DEVICES)),
            nvme_path: read_path(s),
            buffer_count: s.int("buffer_count", 4, Bound::Ge(0.0)),
            pin_memory: s.bool("pin_memory", true),
            pipeline_read: s.bool("pipeline_read", false),
            pipeline_write: s.bool("pipeline_write", false),
            fast_init: s.bool("fast_init", false),
            ratio: s.float("ratio", 1.0, Bound::Range(0.0, 1.0)),
            super_offload: s.bool("super_offload", false),
            cpuadam_cores_perc: s.float("cpuadam_cores_perc", 0.8, Bound::Range(0.0, 1.0)),
        }
    }

    fn on_cpu() -> Self {
        let mut s = Section::empty("");
        OffloadOptimizerConfig {
            device: OffloadDevice::Cpu,
            ..Self::read(&mut s)
        }
    }
}

/// `nvme_path` is an `Optional[Path]`: a string or null.
fn read_path(s: &mut Section) -> Option<String> {
    s.opt_string("nvme_path")
}

/// `zenflow` (ZenFlowConfig): kept as read, checked like DeepSpeed checks it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZenFlowConfig {
    pub topk_ratio: f64,
    pub select_strategy: String,
    pub overlap_step: bool,
    pub offload: bool,
    pub auto_ratio: f64,
    pub full_warm_up_rounds: i64,
    pub pt_reserved_cores_perc: f64,
}

impl ZenFlowConfig {
    fn read(s: &mut Section) -> Self {
        let z = ZenFlowConfig {
            topk_ratio: s.float("topk_ratio", 0.1, Bound::OpenRange(0.0, 1.0)),
            select_strategy: s.string("select_strategy", "auto"),
            overlap_step: s.bool("overlap_step", false),
            offload: s.bool("offload", false),
            auto_ratio: s.float("auto_ratio", 0.99, Bound::Range(0.0, 1.0)),
            full_warm_up_rounds: s.int("full_warm_up_rounds", 0, Bound::None),
            pt_reserved_cores_perc: s.float("pt_reserved_cores_perc", 0.5, Bound::Range(0.0, 1.0)),
        };
        for key in ["select_interval", "update_interval"] {
            check_interval(s, key);
        }
        s.opt_int("steps_per_epoch");
        if !["auto", "step", "epoch"].contains(&z.select_strategy.as_str()) {
            // ZenFlowConfig checks this in a model validator: pydantic reports it at the section.
            let path = s.path().to_string();
            let found = format!("select_strategy '{}'", z.select_strategy);
            s.error(ConfigError::invalid(
                &path,
                found,
                "select_strategy \"auto\", \"step\" or \"epoch\"",
            ));
        }
        z
    }
}

/// `select_interval` / `update_interval`: "auto" or an integer (update_interval >= 1).
fn check_interval(s: &mut Section, key: &'static str) {
    let Some(v) = s.raw(key).cloned() else { return };
    let ok = match &v {
        Value::Str(_) => false, // "auto" was dropped as a default; any other string is wrong
        v => coerce::to_int(v).is_ok_and(|n| key != "update_interval" || n >= 1),
    };
    if !ok {
        // A model-validator check, reported at the section as pydantic does.
        let path = s.path().to_string();
        s.error(ConfigError::invalid(
            &path,
            format!("{key} {v}"),
            format!("{key} \"auto\" or an integer (update_interval >= 1)"),
        ));
    }
}

/// The resolved `zero_optimization` section.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZeroConfig {
    pub stage: ZeroStage,
    pub contiguous_gradients: bool,
    pub reduce_scatter: bool,
    pub reduce_bucket_size: i64,
    pub use_multi_rank_bucket_allreduce: bool,
    pub allgather_partitions: bool,
    pub allgather_bucket_size: i64,
    pub overlap_comm: bool,
    pub compute_grad_norm: bool,
    pub load_from_fp32_weights: bool,
    pub elastic_checkpoint: bool,
    pub offload_param: Option<OffloadParamConfig>,
    pub offload_optimizer: Option<OffloadOptimizerConfig>,
    pub zenflow: Option<ZenFlowConfig>,
    pub sub_group_size: i64,
    pub stage3_prefetch_bucket_size: i64,
    pub stage3_param_persistence_threshold: i64,
    pub stage3_model_persistence_threshold: i64,
    pub stage3_max_live_parameters: i64,
    pub stage3_max_reuse_distance: i64,
    pub stage3_gather_16bit_weights_on_model_save: bool,
    pub stage3_module_granularity_threshold: i64,
    pub stage3_use_all_reduce_for_fetch_params: bool,
    pub stage3_allgather_sequential: bool,
    pub ignore_unused_parameters: bool,
    pub legacy_stage1: bool,
    pub round_robin_gradients: bool,
    pub parameter_alignment: bool,
    pub zero_hpz_partition_size: i64,
    pub zero_quantized_weights: bool,
    pub zero_quantized_nontrainable_weights: bool,
    pub zero_quantized_gradients: bool,
    pub memory_efficient_linear: bool,
    pub pipeline_loading_checkpoint: bool,
    pub override_module_apply: bool,
    pub log_trace_cache_warnings: bool,
    pub enable_sanity_checks: bool,
    pub save_muon_momentum_buffer_in_memory: bool,
    pub leaf_module: LeafModuleConfig,
}

/// `leaf_module`: module classes/names ZeRO-3 treats as one unit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeafModuleConfig {
    pub classes: Vec<String>,
    pub names: Vec<String>,
    pub name_suffixes: Vec<String>,
}

const DEFAULT_LEAF_CLASSES: [&str; 3] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
];

impl LeafModuleConfig {
    fn read(parent: &mut Section) -> Self {
        let mut out = LeafModuleConfig {
            classes: DEFAULT_LEAF_CLASSES.iter().map(|s| s.to_string()).collect(),
            names: vec![],
            name_suffixes: vec![],
        };
        // A null leaf_module means "defaults" (its before-validator maps None to {}).
        let Some(mut s) = parent.sub("leaf_module", true) else {
            return out;
        };
        for (key, slot) in [
            ("classes", &mut out.classes),
            ("names", &mut out.names),
            ("name_suffixes", &mut out.name_suffixes),
        ] {
            if let Some(list) = string_list(&mut s, key) {
                *slot = dedup(list);
            }
        }
        parent.absorb(s);
        out
    }
}

/// A `List[str]` field that also takes a single string.
fn string_list(s: &mut Section, key: &'static str) -> Option<Vec<String>> {
    let v = s.raw(key)?.clone();
    let items = match &v {
        Value::Str(one) => return Some(vec![one.clone()]),
        Value::List(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>(),
        _ => None,
    };
    if items.is_none() {
        let path = s.key_path(key);
        s.error(ConfigError::invalid(
            &path,
            &v,
            "a string or a list of strings",
        ));
    }
    items
}

fn dedup(list: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(list.len());
    for item in list {
        if !out.contains(&item) {
            out.push(item);
        }
    }
    out
}

/// Reads a field that has an alias: the alias wins; the plain name is accepted only alone
/// (pydantic `populate_by_name`: with both present, the plain name is an unknown key).
fn aliased<T>(
    s: &mut Section,
    alias: &'static str,
    name: &'static str,
    read: impl Fn(&mut Section, &'static str) -> T,
) -> T {
    if s.has(alias) || !s.has(name) {
        read(s, alias)
    } else {
        read(s, name)
    }
}

impl ZeroConfig {
    /// Reads the section from its JSON object (`path` is "zero_optimization").
    pub fn read(section: &mut Section) -> Result<ZeroConfig> {
        let mut z = Self::read_fields(section);
        Self::apply_deprecated(section, &mut z)?;
        Ok(z)
    }

    /// The defaults: what an absent `zero_optimization` means.
    pub fn defaults() -> ZeroConfig {
        let mut s = Section::empty("zero_optimization");
        Self::read(&mut s).expect("invariant: the defaults are valid")
    }

    fn read_fields(s: &mut Section) -> ZeroConfig {
        let stage = read_stage(s);
        let ge0 = Bound::Ge(0.0);
        let (offload_param, offload_optimizer, zenflow) = read_subsections(s);
        let overlap_comm = s.opt_bool("overlap_comm");
        ZeroConfig {
            stage,
            contiguous_gradients: s.bool("contiguous_gradients", true),
            reduce_scatter: s.bool("reduce_scatter", true),
            reduce_bucket_size: s.int("reduce_bucket_size", 500_000_000, Bound::Gt(0.0)),
            use_multi_rank_bucket_allreduce: s.bool("use_multi_rank_bucket_allreduce", true),
            allgather_partitions: s.bool("allgather_partitions", true),
            allgather_bucket_size: s.int("allgather_bucket_size", 500_000_000, ge0),
            // DeepSpeed's dynamic default: overlap is on for stage 3 only.
            overlap_comm: overlap_comm.unwrap_or(stage == ZeroStage::Weights),
            compute_grad_norm: s.bool("compute_grad_norm", true),
            load_from_fp32_weights: s.bool("load_from_fp32_weights", true),
            elastic_checkpoint: s.bool("elastic_checkpoint", false),
            offload_param,
            offload_optimizer,
            zenflow,
            sub_group_size: s.int("sub_group_size", 1_000_000_000, ge0),
            stage3_prefetch_bucket_size: aliased(
                s,
                "stage3_prefetch_bucket_size",
                "prefetch_bucket_size",
                |s, k| s.int(k, 50_000_000, ge0),
            ),
            stage3_param_persistence_threshold: aliased(
                s,
                "stage3_param_persistence_threshold",
                "param_persistence_threshold",
                |s, k| s.int(k, 100_000, ge0),
            ),
            stage3_model_persistence_threshold: aliased(
                s,
                "stage3_model_persistence_threshold",
                "model_persistence_threshold",
                |s, k| s.int(k, i64::MAX, ge0),
            ),
            stage3_max_live_parameters: aliased(
                s,
                "stage3_max_live_parameters",
                "max_live_parameters",
                |s, k| s.int(k, 1_000_000_000, ge0),
            ),
            stage3_max_reuse_distance: aliased(
                s,
                "stage3_max_reuse_distance",
                "max_reuse_distance",
                |s, k| s.int(k, 1_000_000_000, ge0),
            ),
            stage3_gather_16bit_weights_on_model_save: aliased(
                s,
                "stage3_gather_16bit_weights_on_model_save",
                "gather_16bit_weights_on_model_save",
                |s, k| s.bool(k, false),
            ),
            stage3_module_granularity_threshold: aliased(
                s,
                "stage3_module_granularity_threshold",
                "module_granularity_threshold",
                |s, k| s.int(k, 0, Bound::None),
            ),
            stage3_use_all_reduce_for_fetch_params: aliased(
                s,
                "stage3_use_all_reduce_for_fetch_params",
                "use_all_reduce_for_fetch_params",
                |s, k| s.bool(k, false),
            ),
            stage3_allgather_sequential: aliased(
                s,
                "stage3_allgather_sequential",
                "allgather_sequential",
                |s, k| s.bool(k, false),
            ),
            ignore_unused_parameters: s.bool("ignore_unused_parameters", true),
            legacy_stage1: s.bool("legacy_stage1", false),
            round_robin_gradients: s.bool("round_robin_gradients", false),
            parameter_alignment: s.bool("parameter_alignment", false),
            zero_hpz_partition_size: s.int("zero_hpz_partition_size", 1, ge0),
            zero_quantized_weights: s.bool("zero_quantized_weights", false),
            zero_quantized_nontrainable_weights: s
                .bool("zero_quantized_nontrainable_weights", false),
            zero_quantized_gradients: s.bool("zero_quantized_gradients", false),
            memory_efficient_linear: s.bool("memory_efficient_linear", true),
            pipeline_loading_checkpoint: s.bool("pipeline_loading_checkpoint", false),
            override_module_apply: s.bool("override_module_apply", true),
            log_trace_cache_warnings: s.bool("log_trace_cache_warnings", false),
            enable_sanity_checks: s.bool("enable_sanity_checks", false),
            save_muon_momentum_buffer_in_memory: s
                .bool("save_muon_momentum_buffer_in_memory", false),
            leaf_module: LeafModuleConfig::read(s),
        }
    }

    /// The model validators of DeepSpeedZeroConfig, run once every field is valid.
    pub fn validate(&self, path: &str) -> Result<()> {
        if self
            .offload_optimizer
            .as_ref()
            .is_some_and(|o| o.ratio < 1.0)
            && self.stage != ZeroStage::Weights
        {
            return Err(ConfigError::conflict(
                &format!("{path}.offload_optimizer.ratio"),
                "partial offloading (ratio < 1) is only supported with ZeRO stage 3",
            ));
        }
        let stage_1_or_2 = matches!(
            self.stage,
            ZeroStage::OptimizerStates | ZeroStage::Gradients
        );
        if !self.compute_grad_norm && !stage_1_or_2 {
            return Err(ConfigError::conflict(
                &format!("{path}.compute_grad_norm"),
                "compute_grad_norm=false is supported only with ZeRO stage 1 or 2",
            ));
        }
        Ok(())
    }

    /// The deprecated keys (`cpu_offload`, `cpu_offload_param`, `cpu_offload_use_pin_memory`,
    /// `stage3_gather_fp16_weights_on_model_save`): each sets its replacement, which must not be
    /// given as well.
    fn apply_deprecated(s: &mut Section, z: &mut ZeroConfig) -> Result<()> {
        s.opt_bool("cpu_offload_use_pin_memory"); // deprecated without effect
        if let Some(on) = deprecated_flag(s, "cpu_offload_param", "offload_param")? {
            z.offload_param = on.then(OffloadParamConfig::on_cpu);
        }
        if let Some(on) = deprecated_flag(s, "cpu_offload", "offload_optimizer")? {
            z.offload_optimizer = on.then(OffloadOptimizerConfig::on_cpu);
        }
        let new_given = s.has("stage3_gather_16bit_weights_on_model_save")
            || s.has("gather_16bit_weights_on_model_save");
        if s.has("stage3_gather_fp16_weights_on_model_save") {
            let on = s.bool("stage3_gather_fp16_weights_on_model_save", false);
            if new_given {
                return Err(both_given(
                    s,
                    "stage3_gather_fp16_weights_on_model_save",
                    "gather_16bit_weights_on_model_save",
                ));
            }
            z.stage3_gather_16bit_weights_on_model_save = on;
        }
        Ok(())
    }
}

fn read_stage(s: &mut Section) -> ZeroStage {
    let Some(v) = s.raw("stage").cloned() else {
        return ZeroStage::Disabled;
    };
    ZeroStage::from_value(&v).unwrap_or_else(|expected| {
        let path = s.key_path("stage");
        s.error(ConfigError::invalid(&path, &v, expected));
        ZeroStage::Disabled
    })
}

type Subsections = (
    Option<OffloadParamConfig>,
    Option<OffloadOptimizerConfig>,
    Option<ZenFlowConfig>,
);

fn read_subsections(s: &mut Section) -> Subsections {
    let offload_param = s.nested("offload_param", OffloadParamConfig::read);
    let offload_optimizer = s.nested("offload_optimizer", OffloadOptimizerConfig::read);
    let zenflow = s.nested("zenflow", ZenFlowConfig::read);
    (offload_param, offload_optimizer, zenflow)
}

/// A deprecated `Optional[bool]` flag; `Some(value)` when it was given.
fn deprecated_flag(s: &mut Section, old: &'static str, new: &'static str) -> Result<Option<bool>> {
    if !s.has(old) {
        s.opt_bool(old);
        return Ok(None);
    }
    let on = s.opt_bool(old).unwrap_or(false);
    if s.has(new) {
        return Err(both_given(s, old, new));
    }
    Ok(Some(on))
}

fn both_given(s: &Section, old: &str, new: &str) -> ConfigError {
    ConfigError::conflict(
        &s.key_path(old),
        format!("the deprecated `{old}` and its replacement `{new}` cannot both be given; keep only `{new}`"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    fn read(text: &str) -> Result<ZeroConfig> {
        let mut s = Section::open("zero_optimization", &hjson::parse(text).unwrap())?;
        let z = ZeroConfig::read(&mut s);
        s.finish()?;
        let z = z?;
        z.validate("zero_optimization")?;
        Ok(z)
    }

    fn err_paths(text: &str) -> Vec<String> {
        read(text)
            .unwrap_err()
            .paths()
            .into_iter()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn defaults_follow_deepspeed() {
        let z = read("{}").unwrap();
        assert_eq!(z.stage, ZeroStage::Disabled);
        assert_eq!(z.reduce_bucket_size, 500_000_000);
        assert_eq!(z.allgather_bucket_size, 500_000_000);
        assert_eq!(z.stage3_prefetch_bucket_size, 50_000_000);
        assert_eq!(z.stage3_param_persistence_threshold, 100_000);
        assert!(!z.overlap_comm);
        assert!(z.contiguous_gradients);
        assert!(
            read(r#"{"stage": 3}"#).unwrap().overlap_comm,
            "stage 3 overlaps by default"
        );
    }

    #[test]
    fn stage_out_of_range_names_the_path() {
        assert_eq!(err_paths(r#"{"stage": 4}"#), ["zero_optimization.stage"]);
        assert_eq!(err_paths(r#"{"stage": 2.5}"#), ["zero_optimization.stage"]);
        assert_eq!(
            read(r#"{"stage": "2"}"#).unwrap().stage,
            ZeroStage::Gradients
        );
    }

    #[test]
    fn bucket_sizes_are_bounded() {
        assert_eq!(
            err_paths(r#"{"reduce_bucket_size": -1}"#),
            ["zero_optimization.reduce_bucket_size"]
        );
        assert_eq!(
            err_paths(r#"{"reduce_bucket_size": 0}"#),
            ["zero_optimization.reduce_bucket_size"]
        );
        assert_eq!(
            err_paths(r#"{"allgather_bucket_size": 5.5}"#),
            ["zero_optimization.allgather_bucket_size"]
        );
        assert_eq!(
            read(r#"{"allgather_bucket_size": 0}"#)
                .unwrap()
                .allgather_bucket_size,
            0
        );
    }

    #[test]
    fn offload_sections() {
        let z = read(r#"{"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}"#)
            .unwrap();
        assert_eq!(z.offload_param.unwrap().device, OffloadDevice::Nvme);
        assert_eq!(
            err_paths(r#"{"offload_param": {"device": "gpu"}}"#),
            ["zero_optimization.offload_param.device"]
        );
        assert_eq!(
            err_paths(r#"{"offload_optimizer": {"foo": 1}}"#),
            ["zero_optimization.offload_optimizer.foo"]
        );
        assert_eq!(
            err_paths(r#"{"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}"#),
            ["zero_optimization.offload_optimizer.ratio"]
        );
    }

    #[test]
    fn legacy_cpu_offload_forms() {
        let z = read(r#"{"stage": 2, "cpu_offload": true}"#).unwrap();
        assert_eq!(z.offload_optimizer.unwrap().device, OffloadDevice::Cpu);
        assert_eq!(
            err_paths(r#"{"cpu_offload": true, "offload_optimizer": {"device": "cpu"}}"#),
            ["zero_optimization.cpu_offload"]
        );
        assert_eq!(
            err_paths(r#"{"cpu_offload_params": true}"#),
            ["zero_optimization.cpu_offload_params"]
        );
    }

    #[test]
    fn aliases_and_typos() {
        assert_eq!(
            read(r#"{"prefetch_bucket_size": 7}"#)
                .unwrap()
                .stage3_prefetch_bucket_size,
            7
        );
        assert_eq!(
            err_paths(r#"{"stage3_prefetch_bucket_size": 5, "prefetch_bucket_size": 7}"#),
            ["zero_optimization.prefetch_bucket_size"]
        );
        let err = read(r#"{"stage3_param_persitance_threshold": 1}"#).unwrap_err();
        assert!(
            err.to_string()
                .contains("did you mean `stage3_param_persistence_threshold`"),
            "{err}"
        );
    }
}
