//! The job plan: the one way from (a ds_config, a model, what the command line or a program's
//! TrainingArguments add, the world size) to the resolved config and its layout, checked
//! against each other once. `ds-rs train`, `bench train`, `estimate`, the launcher's preflight,
//! the autotuner's trials and the library's `Job` all plan through `JobPlan::new`, so they
//! accept and refuse the same jobs.
//!
//! The phases, in order: read the document, place `--sp` in it, decide the layout, resolve
//! (filling "auto" from the training arguments, as Hugging Face's Trainer does), apply `--ep`,
//! refuse what is left "auto" or not carried out, check the optimizer and the model against
//! the layout, the pipeline's stages, and the engine's settings.

use std::path::Path;

use ds_comm::Groups;
use ds_config::{Config, FillContext, TrainingArgs, Value};

use crate::parallel::{Parallel, Tp};
use crate::Architecture;
use crate::{Engine, EngineError, EngineOptions, Result};

/// Where a job's ds_config comes from.
#[derive(Debug, Clone, Copy)]
pub enum ConfigSource<'a> {
    /// A file (JSON or hjson, read as DeepSpeed reads it).
    File(&'a Path),
    /// The text itself, and its name in messages ("the built-in default config").
    Text { text: &'a str, name: &'a str },
}

impl ConfigSource<'_> {
    /// The config's name in messages: the file's path, or the text's name.
    pub fn name(&self) -> String {
        match self {
            ConfigSource::File(p) => p.display().to_string(),
            ConfigSource::Text { name, .. } => name.to_string(),
        }
    }

    fn read(&self) -> Result<Value> {
        match self {
            ConfigSource::File(p) => Ok(ds_config::load(p)?),
            ConfigSource::Text { text, name } => ds_config::hjson::parse(text).map_err(|e| {
                EngineError::at(name.to_string(), EngineError::Setting(e.to_string()))
            }),
        }
    }
}

/// The parallel degrees a command line asks for (`--tp`, `--pp`, `--ep`, `--sp`); each left
/// out takes the config's own.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayoutFlags {
    pub tp: Option<usize>,
    pub pp: Option<usize>,
    pub ep: Option<usize>,
    pub sp: Option<usize>,
}

/// What the caller adds to the config.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub layout: LayoutFlags,
    /// Hugging Face's training arguments: they fill "auto" values and build the optimizer and
    /// schedule a config leaves out. None: the config alone, as `deepspeed.initialize` reads it.
    pub training: Option<TrainingArgs>,
    /// The steps the run trains (the schedule's length when the arguments give no max_steps).
    pub run_steps: Option<u64>,
}

/// A job's resolved config, checked against its model and layout.
#[derive(Debug, Clone)]
pub struct JobPlan {
    pub config: Config,
    /// The config's name in messages.
    pub source: String,
}

impl JobPlan {
    /// Plans a job of `world` ranks; with a model, checks the model against the layout too.
    pub fn new(
        source: ConfigSource,
        world: usize,
        overrides: &Overrides,
        model: Option<&dyn Architecture>,
    ) -> Result<JobPlan> {
        let name = source.name();
        let config = resolved(source, world, overrides, model.map(|m| m.hidden_size()))?;
        let named = |e: EngineError| EngineError::at(name.clone(), e);
        config.check_filled().map_err(|e| named(e.into()))?;
        config.check_implemented().map_err(|e| named(e.into()))?;
        // a program's config without an optimizer is refused when its engine is built: its
        // Job may serve only to join the job
        if overrides.training.is_some() || config.optimizer.is_some() {
            crate::check_optimizer(&config).map_err(named)?;
        }
        if let Some(m) = model {
            check_model(&config, m)?;
        }
        // what the engine reads of the config (offload's settings among them)
        crate::Settings::from_config(&config, false).map_err(named)?;
        Ok(JobPlan {
            config,
            source: name,
        })
    }

    /// This rank's engine over `model`, its layers split over the rank's groups, starting
    /// from `opts.init`, else the model's own weights.
    pub fn engine(
        &self,
        model: &dyn Architecture,
        groups: &Groups,
        mut opts: EngineOptions,
    ) -> Result<Engine> {
        opts.init = opts.init.or_else(|| model.weights());
        let parallel = Parallel::of(groups, self.config.sequence_parallel);
        let layers = model
            .build(&parallel)
            .map_err(|e| EngineError::at(model.describe(), EngineError::Model(e)))?;
        Engine::initialize(layers, &self.config, groups, &opts)
    }
}

/// The document resolved for its layout, "auto" filled, `--ep` applied.
fn resolved(
    source: ConfigSource,
    world: usize,
    o: &Overrides,
    hidden_size: Option<usize>,
) -> Result<Config> {
    let name = source.name();
    let named = |e: ds_config::ConfigError| EngineError::at(name.clone(), e.into());
    let mut doc = source.read()?;
    if let Some(sp) = o.layout.sp {
        with_sp(&mut doc, sp, &name)?;
    }
    let (tp, pp) = (o.layout.tp, o.layout.pp);
    let dims = ds_config::parallel_dims(&doc, world, tp, pp).map_err(|e| {
        // a size --sp wrote into the document is the flag's
        match (o.layout.sp, e.path()) {
            (Some(n), Some("sequence_parallel_size")) => {
                EngineError::at(format!("--sp {n}"), e.into())
            }
            _ => named(e),
        }
    })?;
    let config = match &o.training {
        Some(args) => {
            let ctx = FillContext {
                data_parallel: dims.replicas() as i64,
                hidden_size: hidden_size.map(|h| h as i64),
                run_steps: o.run_steps.map(|n| n as i64),
            };
            ds_config::resolve_with_args(&doc, &dims, args, &ctx)
        }
        None => ds_config::resolve(&doc, &dims),
    };
    let config = config
        .and_then(Config::with_expert_parallel)
        .map_err(named)?;
    with_ep(config, o.layout.ep, &name)
}

/// The model checked against the config's layout; with a pipeline, the stages it splits into.
fn check_model(config: &Config, model: &dyn Architecture) -> Result<()> {
    let named = |e: String| EngineError::at(model.describe(), EngineError::Model(e));
    model.check_layout(config).map_err(named)?;
    if config.dims.pp > 1 {
        let layers = model.build(&Parallel::tensor(Tp::none())).map_err(named)?;
        crate::pipeline_layout(config, &layers)?;
    }
    Ok(())
}

/// `doc` with `sequence_parallel_size` `sp` (`--sp`), which a size the config names must
/// agree with; `name` names the config.
fn with_sp(doc: &mut Value, sp: usize, name: &str) -> Result<()> {
    let Value::Dict(root) = doc else {
        return Ok(());
    };
    let said = root.get("sequence_parallel_size").and_then(|v| v.as_f64());
    if let Some(n) = said.filter(|&n| n != sp as f64) {
        return Err(EngineError::Setting(format!(
            "--sp {sp} and {name}'s sequence_parallel_size {n} disagree"
        )));
    }
    root.insert("sequence_parallel_size", Value::Int(sp as i64));
    Ok(())
}

/// `config` at expert-parallel size `ep` (`--ep`) when given, else the config's AutoEP size
/// (which `Config::with_expert_parallel` put in the layout); `name` names the config.
pub fn with_ep(mut config: Config, ep: Option<usize>, name: &str) -> Result<Config> {
    let Some(ep) = ep else {
        return Ok(config);
    };
    let from_config = config.expert_parallel.size();
    if from_config > 1 && ep != from_config {
        return Err(EngineError::Setting(format!(
            "--ep {ep} and {name}'s expert_parallel.autoep_size {from_config} disagree"
        )));
    }
    config.dims = config
        .dims
        .with_ep(ep)
        .map_err(|e| EngineError::at(format!("--ep {ep}"), EngineError::Setting(e)))?;
    Ok(config)
}
