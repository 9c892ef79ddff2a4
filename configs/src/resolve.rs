//! `resolve`: from the parsed document to the immutable `Config`, in DeepSpeed's order, so the
//! first problem reported is the one DeepSpeed 0.19.8 would raise.

use serde::Serialize;
use serde_json::Value as Json;

use crate::batch::{self, PyNum};
pub use crate::dims::ParallelDims;
use crate::error::{closest, ConfigError, Result};
use crate::monitor::{CommsLoggerConfig, FlopsProfilerConfig, MonitorConfig};
use crate::optim::{self, OptimizerParams, SchedulerParams, TypedSection};
use crate::precision::{Bf16Config, Fp16Config};
use crate::runtime::{
    ActivationCheckpointingConfig, AioConfig, AutotuningConfig, CheckpointConfig, DataTypesConfig,
    PipelineConfig,
};
use crate::section::Section;
use crate::toplevel::{self, Scalars};
use crate::training_args::TrainingArgs;
use crate::value::{Dict, Value};
use crate::zero::{OffloadDevice, ZeroConfig, ZeroStage};
use crate::{extras, removed};

/// The layout of a job of `world` ranks, decided once from the config and the command line:
/// the tensor-parallel degree is `tp` when given (`--tp`), else the config's
/// `tensor_parallel.autotp_size` (0 and 1: none, as in DeepSpeed); the pipeline degree is
/// `pp` when given (`--pp`), else the config's `pipeline.stages` ("auto", DeepSpeed's default,
/// is 1); data parallelism takes the rest. The error names the numbers
/// that do not divide.
pub fn parallel_dims(
    doc: &Value,
    world: usize,
    tp: Option<usize>,
    pp: Option<usize>,
) -> Result<ParallelDims> {
    let tp = match tp {
        Some(tp) => tp,
        None => match doc {
            Value::Dict(root) => {
                let size = extras::tensor_parallel(root, &mut Vec::new())?.autotp_size;
                usize::try_from(size.max(1)).map_err(|_| {
                    ConfigError::invalid(
                        "tensor_parallel.autotp_size",
                        size,
                        "a degree that fits in memory",
                    )
                })?
            }
            _ => 1,
        },
    };
    let pp = match pp {
        Some(pp) => pp,
        None => pipeline_stages(doc)?,
    };
    let dims = ParallelDims::new(world, tp, pp)?;
    match sequence_parallel_size(doc)? {
        1 => Ok(dims),
        sp => dims
            .with_sp(sp)
            .map_err(|e| ConfigError::conflict("sequence_parallel_size", e)),
    }
}

/// `sequence_parallel_size`: a positive integer (absent: 1).
fn sequence_parallel_size(doc: &Value) -> Result<usize> {
    let Value::Dict(root) = doc else {
        return Ok(1);
    };
    let Some(v) = root.get("sequence_parallel_size") else {
        return Ok(1);
    };
    v.as_f64()
        .filter(|n| *n >= 1.0 && n.fract() == 0.0 && *n <= u32::MAX as f64)
        .map(|n| n as usize)
        .ok_or_else(|| ConfigError::invalid("sequence_parallel_size", v, "a positive integer"))
}

/// `pipeline.stages`: a positive integer, or "auto" (one stage).
fn pipeline_stages(doc: &Value) -> Result<usize> {
    let Value::Dict(root) = doc else {
        return Ok(1);
    };
    PipelineConfig::read(root)?.stages()
}

/// The resolved configuration: DeepSpeed's defaults applied, the batch triad filled, every
/// section checked. Immutable once built.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    pub dims: ParallelDims,
    /// The data-parallel size the batch rule used (a float only in DeepSpeed's
    /// sequence-parallel corner, see `toplevel::data_parallel_size`).
    pub data_parallel_size: PyNum,
    pub train_batch_size: PyNum,
    pub train_micro_batch_size_per_gpu: PyNum,
    pub gradient_accumulation_steps: PyNum,
    #[serde(flatten)]
    pub scalars: Scalars,
    pub zero_optimization: ZeroConfig,
    pub fp16: Fp16Config,
    pub bf16: Bf16Config,
    pub optimizer: Option<TypedSection>,
    pub scheduler: Option<TypedSection>,
    pub activation_checkpointing: ActivationCheckpointingConfig,
    pub comms_logger: Option<CommsLoggerConfig>,
    pub monitor: MonitorConfig,
    pub flops_profiler: FlopsProfilerConfig,
    pub wall_clock_breakdown: bool,
    pub pipeline: PipelineConfig,
    /// `tensor_parallel.autotp_size`: DeepSpeed's AutoTP degree (0 = off).
    pub autotp_size: i64,
    /// `tensor_parallel.sequence_parallel` (a ds-rs extension): activations between the
    /// tensor-parallel products split along the sequence.
    pub sequence_parallel: bool,
    /// `expert_parallel` (DeepSpeed's AutoEP): the expert-parallel size it asks for and the
    /// model preset it names.
    pub expert_parallel: crate::expert_parallel::ExpertParallel,
    /// `tensor_parallel.partition_config` (AutoTP's layer specs), as written.
    pub tp_partition_config: Option<Json>,
    pub checkpoint: CheckpointConfig,
    pub data_types: DataTypesConfig,
    pub autotuning: AutotuningConfig,
    pub aio: AioConfig,
    pub warnings: Vec<String>,
    /// What each "auto" became: filled by the training command, or DeepSpeed's default.
    pub auto_filled: Vec<(String, Json)>,
    /// The "auto" values left for DeepSpeed outside zero_optimization's tuning knobs and its
    /// own "auto" (pipeline.stages), with the default DeepSpeed takes for each where it has
    /// one: `check_filled` refuses them for training.
    pub auto_left: Vec<(String, Option<Json>)>,
    /// The training arguments that filled the "auto" values (`resolve_with_args`).
    pub training: Option<TrainingArgs>,
    /// The schedule's total steps: `--max_steps`, else the steps the run trains (when known).
    pub schedule_steps: Option<i64>,
    /// The document as resolved: the file with its "auto" values filled.
    pub document: Json,
}

impl Config {
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero_optimization.stage
    }

    /// The typed optimizer params `train` uses (None: no optimizer section).
    pub fn optimizer_params(&self) -> Result<Option<OptimizerParams>> {
        self.optimizer
            .as_ref()
            .map(OptimizerParams::parse)
            .transpose()
    }

    /// Err naming the first "auto" left that Hugging Face's Trainer does not fill and
    /// DeepSpeed would quietly replace (see `auto_left`): a training command refuses it
    /// rather than train with a value the user did not choose.
    pub fn check_filled(&self) -> Result<()> {
        let Some((path, default)) = self.auto_left.first() else {
            return Ok(());
        };
        let deepspeed = match default {
            Some(v) => format!("DeepSpeed would take its default, {v}"),
            None => "DeepSpeed would use the string \"auto\" as the value".to_string(),
        };
        Err(ConfigError::invalid(
            path,
            "\"auto\"",
            format!("a value: Hugging Face's Trainer does not fill this key and {deepspeed}"),
        ))
    }

    /// The document as a ds_config that reproduces this resolution (`train` writes it as
    /// ds_config.resolved.json): every "auto" replaced by what it became (the arguments'
    /// value, else the default DeepSpeed took) and the batch triad written out.
    pub fn resolved_document(&self) -> Json {
        let mut doc = self.document.clone();
        for (path, value) in &self.auto_filled {
            let pointer = format!("/{}", path.replace('~', "~0").replace('.', "/"));
            if let Some(slot) = doc
                .pointer_mut(&pointer)
                .filter(|v| v.as_str() == Some("auto"))
            {
                *slot = value.clone();
            }
        }
        if let Json::Object(top) = &mut doc {
            top.insert("train_batch_size".into(), self.train_batch_size.to_json());
            top.insert(
                "train_micro_batch_size_per_gpu".into(),
                self.train_micro_batch_size_per_gpu.to_json(),
            );
            top.insert(
                "gradient_accumulation_steps".into(),
                self.gradient_accumulation_steps.to_json(),
            );
        }
        doc
    }

    pub fn scheduler_params(&self) -> Result<Option<SchedulerParams>> {
        self.scheduler
            .as_ref()
            .map(SchedulerParams::parse)
            .transpose()
    }
}

/// What resolution collects besides the typed sections.
#[derive(Default)]
struct Notes {
    warnings: Vec<String>,
    autos: Vec<(String, Json)>,
}

/// Resolves a parsed document for a layout. `filled` lists the "auto" values the caller
/// already replaced (see `auto::fill`).
pub fn resolve(doc: &Value, dims: &ParallelDims, filled: Vec<(String, Json)>) -> Result<Config> {
    let Value::Dict(root) = doc else {
        return Err(ConfigError::invalid(
            "(top level)",
            doc.type_name(),
            "an object ({...})",
        ));
    };
    removed::reject(root)?;
    let dp = toplevel::data_parallel_size(root, dims)?;
    let mut notes = Notes {
        autos: filled,
        ..Notes::default()
    };
    let scalars = toplevel::Scalars::read(root)?;
    let zero_optimization = read_zero(root, &mut notes)?;
    let activation_checkpointing = ActivationCheckpointingConfig::read(root, &mut notes.warnings)?;
    let comms_logger = read_comms_logger(root, &mut notes)?;
    let monitor = MonitorConfig::read(root, &mut notes.autos)?;
    let (fp16, bf16) = read_precision(root, &mut notes)?;
    extras::torch_autocast(root)?;
    let optimizer = optim::read_typed(root, "optimizer")?;
    let scheduler = optim::read_typed(root, "scheduler")?;
    let flops_profiler = FlopsProfilerConfig::read(root, &mut notes.warnings)?;
    let wall_clock_breakdown = toplevel::wall_clock_breakdown(root)?;
    let autotuning = AutotuningConfig::read(root, &mut notes.warnings)?;
    let (pipeline, checkpoint, data_types, aio) = read_runtime(root, &mut notes)?;
    let (deepcompile, tensor_parallel) = read_extras(root, &mut notes)?;
    let expert_parallel = crate::expert_parallel::read(root, &mut notes.warnings)?;
    let triad = batch::resolve(root, dp)?;
    let config = Config {
        dims: *dims,
        data_parallel_size: dp,
        train_batch_size: triad.train_batch_size,
        train_micro_batch_size_per_gpu: triad.micro_batch,
        gradient_accumulation_steps: triad.grad_accum,
        scalars,
        zero_optimization,
        fp16,
        bf16,
        optimizer,
        scheduler,
        activation_checkpointing,
        comms_logger,
        monitor,
        wall_clock_breakdown: wall_clock_breakdown || flops_profiler.enabled,
        flops_profiler,
        pipeline,
        autotp_size: tensor_parallel.autotp_size,
        sequence_parallel: tensor_parallel.sequence_parallel,
        tp_partition_config: tensor_parallel.partition_config,
        expert_parallel,
        checkpoint,
        data_types,
        autotuning,
        aio,
        warnings: Vec::new(),
        auto_filled: Vec::new(),
        auto_left: Vec::new(),
        training: None,
        schedule_steps: None,
        document: Json::Null,
    };
    sanity_check(&config, deepcompile)?;
    notes
        .warnings
        .extend(toplevel::warning_checks(root, config.optimizer.as_ref())?);
    finish(config, root, notes)
}

fn read_zero(root: &Dict, notes: &mut Notes) -> Result<ZeroConfig> {
    let zero = match root.get("zero_optimization") {
        None => return Ok(ZeroConfig::defaults()),
        Some(Value::Bool(on)) => toplevel::legacy_zero_bool(*on, root),
        Some(v) => v.clone(),
    };
    let mut s = Section::open("zero_optimization", &zero)?;
    let z = ZeroConfig::read(&mut s);
    notes.autos.extend(s.finish()?);
    let z = z?;
    z.validate("zero_optimization")?;
    notes.warnings.extend(cpu_offload_warnings(&z));
    Ok(z)
}

/// `offload_optimizer` / `offload_param` to `"cpu"` (also the deprecated `cpu_offload` flags):
/// training on the CPU, the states live in host memory and the optimizer steps on the CPU
/// already, so the setting moves nothing; on a GPU the engine acts on it (ZeRO-Offload). The
/// config alone does not say which device will train, so the warning says both.
fn cpu_offload_warnings(z: &ZeroConfig) -> Vec<String> {
    let on_cpu = |d: Option<OffloadDevice>| d == Some(OffloadDevice::Cpu);
    [
        (
            "offload_optimizer",
            on_cpu(z.offload_optimizer.as_ref().map(|o| o.device)),
            "the master copy and optimizer states",
        ),
        (
            "offload_param",
            on_cpu(z.offload_param.as_ref().map(|o| o.device)),
            "the parameters",
        ),
    ]
    .into_iter()
    .filter(|(_, on, _)| *on)
    .map(|(key, _, what)| {
        format!(
            "zero_optimization.{key}.device = \"cpu\": no effect when training on the CPU ({what} are in host memory already); on a GPU (--device cuda) it keeps them in host memory (ZeRO-Offload)"
        )
    })
    .collect()
}

fn read_comms_logger(root: &Dict, notes: &mut Notes) -> Result<Option<CommsLoggerConfig>> {
    let Some(v) = root.get("comms_logger") else {
        return Ok(None);
    };
    let mut s = Section::open("comms_logger", v)?;
    let c = CommsLoggerConfig::read(&mut s);
    notes.autos.extend(s.finish()?);
    Ok(Some(c))
}

/// `fp16`, then `bf16` (or the old spelling `bfloat16` when `bf16` is absent or null).
fn read_precision(root: &Dict, notes: &mut Notes) -> Result<(Fp16Config, Bf16Config)> {
    let mut s = match root.get("fp16") {
        None => Section::empty("fp16"),
        Some(v) => Section::open("fp16", v)?,
    };
    let fp16 = Fp16Config::read(&mut s);
    notes.autos.extend(s.finish()?);
    fp16.validate()?;
    let (key, bf) = match root.get("bf16") {
        None | Some(Value::Null) => ("bfloat16", root.get("bfloat16")),
        some => ("bf16", some),
    };
    let mut s = match bf {
        None => Section::empty(key),
        Some(v) => Section::open(key, v)?,
    };
    let bf16 = Bf16Config::read(&mut s);
    notes.autos.extend(s.finish()?);
    if fp16.enabled && bf16.enabled {
        return Err(ConfigError::conflict(
            &format!("{key}.enabled"),
            "fp16 and bf16 cannot both be enabled",
        ));
    }
    Ok((fp16, bf16))
}

type Runtime = (PipelineConfig, CheckpointConfig, DataTypesConfig, AioConfig);

fn read_runtime(root: &Dict, notes: &mut Notes) -> Result<Runtime> {
    extras::hybrid_engine(root, &mut notes.autos)?;
    let pipeline = PipelineConfig::read(root)?;
    notes.warnings.extend(pipeline_warnings(root)?);
    notes.warnings.extend(aio_warnings(root));
    extras::data_efficiency(root)?;
    let checkpoint = CheckpointConfig::read(root, &mut notes.warnings)?;
    let data_types = DataTypesConfig::read(root, &mut notes.warnings)?;
    let aio = AioConfig::read(root, &mut notes.warnings)?;
    Ok((pipeline, checkpoint, data_types, aio))
}

/// The `pipeline` keys the user wrote that ds-rs reads differently from DeepSpeed.
fn pipeline_warnings(root: &Dict) -> Result<Vec<String>> {
    let Some(user) = crate::lenient::dict_at(root, "pipeline")? else {
        return Ok(Vec::new());
    };
    let notes = [
        ("virtual_stages", "a ds-rs extension (Megatron-LM's interleaved schedule); DeepSpeed 0.19.8 ignores this key"),
        ("seed_layers", "no effect: ds-rs draws every parameter from (seed, name), the same values in every layout"),
        ("pipe_partitioned", "no effect: each tensor-parallel rank sends its whole activation to its counterpart on the next stage (the same values, more bytes)"),
        ("grad_partitioned", "no effect: each tensor-parallel rank sends its whole gradient to its counterpart on the previous stage (the same values, more bytes)"),
    ];
    Ok(notes
        .iter()
        .filter(|(key, _)| user.contains_key(key))
        .map(|(key, why)| format!("pipeline.{key}: {why}"))
        .collect())
}

/// The `aio` keys the user wrote: ds-rs's NVMe tier does its own I/O.
fn aio_warnings(root: &Dict) -> Vec<String> {
    // DeepSpeed reads the section with `dict.get`: null or another value is no section
    let Some(Value::Dict(user)) = root.get("aio") else {
        return Vec::new();
    };
    let keys: Vec<&str> = user.0.iter().map(|(k, _)| k.as_str()).collect();
    match keys.is_empty() {
        true => Vec::new(),
        false => vec![format!(
            "aio ({}): no effect: ds-rs's NVMe tier reads and writes with pread/pwrite on one I/O thread per rank",
            keys.join(", ")
        )],
    }
}

/// The sections ds-rs checks but does not act on; returns `compile.deepcompile` and
/// the `tensor_parallel` section.
fn read_extras(root: &Dict, notes: &mut Notes) -> Result<(bool, extras::TensorParallel)> {
    extras::weight_quantization(root, &mut notes.autos)?;
    let deepcompile = extras::compile(root, &mut notes.autos)?;
    extras::timers(root, &mut notes.autos)?;
    let tensor_parallel = extras::tensor_parallel(root, &mut notes.autos)?;
    if tensor_parallel.sequence_parallel {
        notes.warnings.push(format!(
            "tensor_parallel.{}: a ds-rs extension (Megatron-LM's sequence parallelism); DeepSpeed 0.19.8 rejects this key",
            extras::SEQUENCE_PARALLEL
        ));
    }
    Ok((deepcompile, tensor_parallel))
}

/// DeepSpeed's `_do_error_check`: rules across sections.
fn sanity_check(c: &Config, deepcompile: bool) -> Result<()> {
    let stage = c.zero_optimization.stage;
    let sum = c.scalars.gradient_allreduce_op == "sum";
    if sum && stage == ZeroStage::Weights {
        return Err(ConfigError::conflict(
            "gradient_allreduce_op",
            "'sum' is not supported with ZeRO stage 3",
        ));
    }
    if sum && c.zero_optimization.zenflow.is_some() {
        return Err(ConfigError::conflict(
            "gradient_allreduce_op",
            "'sum' is not supported with ZenFlow",
        ));
    }
    if sum && deepcompile {
        return Err(ConfigError::conflict(
            "gradient_allreduce_op",
            "'sum' is not supported with DeepCompile",
        ));
    }
    let zero_on = stage != ZeroStage::Disabled;
    for (on, path) in [
        (
            c.fp16.fp16_master_weights_and_grads,
            "fp16.fp16_master_weights_and_grads",
        ),
        (
            c.bf16.bf16_master_weights_and_grads,
            "bf16.bf16_master_weights_and_grads",
        ),
        (c.bf16.bf16_optimizer_states, "bf16.bf16_optimizer_states"),
    ] {
        if on && !zero_on {
            return Err(ConfigError::conflict(
                path,
                "only supported with ZeRO stage 1, 2 or 3",
            ));
        }
    }
    if c.bf16.bf16_optimizer_states && !c.bf16.bf16_master_weights_and_grads {
        return Err(ConfigError::conflict(
            "bf16.bf16_optimizer_states",
            "requires bf16_master_weights_and_grads",
        ));
    }
    Ok(())
}

/// Adds the warnings (unknown top-level keys, "auto" left, features ds-rs lacks).
fn finish(mut c: Config, root: &Dict, notes: Notes) -> Result<Config> {
    let mut warnings = notes.warnings;
    for key in root.keys().filter(|k| !toplevel::KNOWN_KEYS.contains(k)) {
        let hint = closest(key, toplevel::KNOWN_KEYS.iter().copied())
            .map_or(String::new(), |s| format!(" (did you mean `{s}`?)"));
        warnings.push(format!("{key}: not a DeepSpeed key; ignored{hint}"));
    }
    let sections = toplevel::Sections {
        zero: &c.zero_optimization,
        checkpointing: &c.activation_checkpointing,
        monitor: &c.monitor,
        tp: c.dims.tp,
    };
    warnings.extend(toplevel::unsupported_feature_warnings(root, &sections));
    warnings.extend(
        c.optimizer
            .as_ref()
            .map_or_else(Vec::new, optim::param_warnings),
    );
    for path in crate::auto::remaining(root) {
        let defaulted = notes.autos.iter().any(|(p, _)| *p == path);
        if !defaulted && !path.starts_with("zero_optimization") {
            warnings.push(format!(
                "{path}: \"auto\" is left for the training command to fill"
            ));
        }
    }
    c.auto_left = crate::auto::remaining(root)
        .into_iter()
        .filter(|p| !p.starts_with("zero_optimization.") && p != "pipeline.stages")
        .map(|p| {
            let default = notes
                .autos
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, v)| v.clone());
            (p, default)
        })
        .collect();
    c.warnings = warnings;
    c.auto_filled = notes.autos;
    c.document = Value::Dict(root.clone()).to_json();
    Ok(c)
}

#[cfg(test)]
mod sequence_parallel_tests {
    use super::*;
    use crate::hjson;

    fn dims(json: &str, world: usize, tp: usize) -> Result<ParallelDims> {
        parallel_dims(&hjson::parse(json).unwrap(), world, Some(tp), None)
    }

    /// `sequence_parallel_size` groups the data-parallel ranks; the batch counts the
    /// replicas that read different samples (DeepSpeed's world / sp).
    #[test]
    fn the_sequence_parallel_size_divides_the_data_parallel_ranks() {
        let d = dims(r#"{"sequence_parallel_size": 2}"#, 8, 2).unwrap();
        assert_eq!((d.dp(), d.sp, d.replicas()), (4, 2, 2));
        let cfg = crate::resolve(
            &hjson::parse(r#"{"train_micro_batch_size_per_gpu": 3, "sequence_parallel_size": 2}"#)
                .unwrap(),
            &d,
        )
        .unwrap();
        assert_eq!(cfg.train_batch_size, crate::batch::PyNum::Int(6));
        assert_eq!(dims("{}", 8, 2).unwrap().sp, 1);
    }

    #[test]
    fn a_sequence_parallel_size_that_does_not_fit_is_named() {
        for (json, world, tp, says) in [
            (
                r#"{"sequence_parallel_size": 3}"#,
                4,
                1,
                "does not divide the data-parallel size 4",
            ),
            (
                r#"{"sequence_parallel_size": 4}"#,
                4,
                2,
                "does not divide the data-parallel size 2",
            ),
            (
                r#"{"sequence_parallel_size": 0}"#,
                4,
                1,
                "a positive integer",
            ),
            (
                r#"{"sequence_parallel_size": 1.5}"#,
                4,
                1,
                "a positive integer",
            ),
            (
                r#"{"sequence_parallel_size": "2"}"#,
                4,
                1,
                "a positive integer",
            ),
        ] {
            let e = dims(json, world, tp).unwrap_err().to_string();
            assert!(
                e.contains("sequence_parallel_size") && e.contains(says),
                "{json}: {e}"
            );
        }
        let piped = parallel_dims(
            &hjson::parse(r#"{"sequence_parallel_size": 2}"#).unwrap(),
            4,
            None,
            Some(2),
        );
        assert!(piped.unwrap_err().to_string().contains("pipeline stages"));
        let d = dims(r#"{"sequence_parallel_size": 2}"#, 4, 1).unwrap();
        assert!(d
            .with_ep(2)
            .unwrap_err()
            .contains("sequence-parallel size 2"));
    }
}
