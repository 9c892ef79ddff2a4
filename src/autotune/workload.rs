//! What the trials train, as the memory and time models see it: ds-rs's own `train` (a GPT
//! both models know exactly), or any program that embeds the engine, known only through
//! `autotuning.model_info` and tuned through its own flags (`autotuning.arg_mappings`).

use anyhow::{bail, Context};
use ds_autotune::memory::{estimate, Run};
use ds_autotune::time::Work;
use ds_autotune::tuning::{Metric, Space, TunerKind};
use ds_config::{Config, ZeroStage};
use ds_engine::{Precision, Settings};
use ds_models::ModelSpec;
use serde_json::Value as Json;

pub enum Workload {
    /// `train --model NAME`: the memory model of `ds-rs estimate --config`, the GPT's FLOPs.
    Train { model: Box<ModelSpec>, name: String },
    /// A program that embeds the engine: the engine's trial hook measures it (DeepSpeed's
    /// `_autotuning_exit`), `arg_mappings` put each trial's values on its command line.
    Program {
        /// `model_info.num_params`: DeepSpeed's model-state estimate, else nothing is pruned.
        num_params: Option<u64>,
        /// `model_info.activation_mem_per_gpu`: activation bytes per sample of a micro-batch.
        activation_per_sample: u64,
        /// `model_info.hidden_size`: the width the compute rate is measured at.
        hidden: usize,
        /// ds_config key (dotted) -> the program's flag.
        arg_mappings: Vec<(String, String)>,
    },
}

impl Workload {
    /// The model, where ds-rs knows it (the job plan checks it against each trial's layout).
    pub fn architecture(&self) -> Option<&dyn ds_engine::Architecture> {
        match self {
            Workload::Train { model, .. } => Some(model.as_ref()),
            Workload::Program { .. } => None,
        }
    }

    pub fn new(
        program: &[String],
        model: Option<(&str, Option<usize>)>,
        at: &Json,
        space: &Space,
        name: &dyn Fn() -> String,
    ) -> anyhow::Result<Workload> {
        if let Some((model, seq_len)) = model {
            return Ok(Workload::Train {
                model: Box::new(ModelSpec::resolve(model, seq_len)?),
                name: model.to_string(),
            });
        }
        let info = &at["model_info"];
        let num_params = info.get("num_params").and_then(Json::as_u64);
        if space.metric == Metric::Flops {
            bail!("{}: autotuning.metric = \"flops\": ds-rs knows the FLOPs of its own `train` only; use throughput or latency for `{}`", name(), program[0]);
        }
        if space.tuner == TunerKind::ModelBased && num_params.is_none() {
            bail!("{}: autotuning.tuner_type = \"model_based\" needs autotuning.model_info.num_params for a program other than `train` (`{}`)", name(), program[0]);
        }
        if num_params.is_none() {
            println!("warning: autotuning.model_info.num_params is not given: the memory model cannot judge `{}`, so no candidate is ruled out before it runs", program[0]);
        }
        let arg_mappings = match at.get("arg_mappings") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Object(m)) => m
                .iter()
                .map(|(k, v)| match v.as_str() {
                    Some(flag) if !flag.trim().is_empty() => {
                        Ok((k.trim().to_string(), flag.trim().to_string()))
                    }
                    _ => bail!("{}: autotuning.arg_mappings.{k} = {v}: expected the program's flag, e.g. \"--micro-batch\"", name()),
                })
                .collect::<anyhow::Result<_>>()?,
            Some(other) => {
                bail!("{}: autotuning.arg_mappings = {other}: expected an object of ds_config keys to the program's flags", name())
            }
        };
        let size = |k: &str| info.get(k).and_then(Json::as_u64);
        Ok(Workload::Program {
            num_params,
            activation_per_sample: size("activation_mem_per_gpu").unwrap_or(0),
            hidden: size("hidden_size").unwrap_or(1024) as usize,
            arg_mappings,
        })
    }

    /// The predicted peak bytes of the trial's largest rank.
    pub fn peak(&self, config: &Config, micro_batch: usize) -> anyhow::Result<u64> {
        match self {
            Workload::Train { model, .. } => {
                let ranks = estimate(&Run {
                    config,
                    model,
                    micro_batch: Some(micro_batch),
                })?;
                Ok(ranks
                    .iter()
                    .map(|r| r.predicted_peak_bytes)
                    .max()
                    .unwrap_or(0))
            }
            Workload::Program {
                num_params: None, ..
            } => Ok(0),
            Workload::Program {
                num_params: Some(n),
                activation_per_sample,
                ..
            } => {
                let states = deepspeed_instantiation_bytes(config, *n)?;
                Ok(states + micro_batch as u64 * activation_per_sample)
            }
        }
    }

    /// What a step asks of the time model.
    pub fn work(&self) -> Work {
        match self {
            Workload::Train { model, .. } => Work::of_model(model),
            Workload::Program { num_params, .. } => Work::of_params(num_params.unwrap_or(1)),
        }
    }

    /// The matrix width and rows per sample the compute rate is measured at.
    pub fn matmul_shape(&self) -> (usize, usize) {
        match self {
            Workload::Train { model, .. } => (model.hidden_size(), model.seq_len),
            Workload::Program { hidden, .. } => (*hidden, 64),
        }
    }

    pub fn describe(&self, program: &[String]) -> String {
        match self {
            Workload::Train { name, .. } => format!("train --model {name}"),
            Workload::Program { num_params, .. } => format!(
                "{} (model_info.num_params {})",
                program.join(" "),
                num_params.map_or("not given".into(), |n| n.to_string())
            ),
        }
    }

    /// The program's arguments for a trial with ds_config `trial`: DeepSpeed's
    /// `arg_mappings` (a flag already present takes the value, else it is appended).
    pub fn with_mappings(&self, program: &[String], trial: &Json) -> anyhow::Result<Vec<String>> {
        let Workload::Program { arg_mappings, .. } = self else {
            return Ok(program.to_vec());
        };
        let mut args = program.to_vec();
        for (key, flag) in arg_mappings {
            let pointer = format!("/{}", key.replace('.', "/"));
            let value = trial.pointer(&pointer).with_context(|| {
                format!("autotuning.arg_mappings: the trial's ds_config has no {key}")
            })?;
            let text = match value {
                Json::String(s) if s == "auto" => continue,
                Json::String(s) => s.clone(),
                other => other.to_string(),
            };
            match args.iter().position(|a| a == flag) {
                Some(i) if i + 1 < args.len() => args[i + 1] = text,
                _ => args.extend([flag.clone(), text]),
            }
        }
        Ok(args)
    }
}

/// DeepSpeed's `Autotuner.get_instantiation_memory_required_per_gpu` (Adam's model states
/// by ZeRO stage), with ds-rs's shards: over the data-parallel ranks, the model split over
/// tp x pp.
fn deepspeed_instantiation_bytes(config: &Config, num_params: u64) -> anyhow::Result<u64> {
    let s = Settings::from_config(config, false)?;
    let half = s.precision != Precision::F32;
    let n = num_params as f64;
    let dp = config.dims.dp() as f64;
    let (mut params, mut grads, mut optimizer) = match half {
        true => (2.0 * n, 2.0 * n, 16.0 * n),
        false => (4.0 * n, 4.0 * n, 8.0 * n),
    };
    let stage = config.zero_stage();
    if stage != ZeroStage::Disabled {
        optimizer /= dp;
    }
    if matches!(stage, ZeroStage::Gradients | ZeroStage::Weights) {
        grads /= dp;
    }
    if stage == ZeroStage::Weights {
        params /= dp;
    }
    Ok(((params + grads + optimizer) / (config.dims.tp * config.dims.pp) as f64) as u64)
}
