//! The optimizer and LR schedule of a run: the config's `optimizer` and `scheduler`
//! sections, else those a program builds from its training arguments, as Hugging Face's
//! Trainer does when a ds_config leaves them out (`create_optimizer`: AdamW with biases and
//! norm weights in a group without weight decay; `create_scheduler`: `lr_scheduler_type`).

use ds_config::optim::TypedSection;
use ds_config::{Config, TrainingArgs};
use serde_json::json;

use super::DecayGroups;
use crate::schedule::LrSchedule;
use crate::{EngineError, Result};

/// What updates the parameters, and where it came from.
#[derive(Debug, Clone)]
pub(super) struct ProgramOptimizer {
    /// The config's section, or the AdamW section the arguments describe.
    pub optimizer: TypedSection,
    pub groups: DecayGroups,
    pub schedule: LrSchedule,
}

pub(super) fn optimizer_and_schedule(config: &Config) -> Result<ProgramOptimizer> {
    let (optimizer, groups) = match (&config.optimizer, &config.training) {
        (Some(section), _) => (section.clone(), DecayGroups::All),
        (None, Some(args)) => (adamw(args), DecayGroups::ExceptBiasesAndNorms),
        (None, None) => {
            return Err(EngineError::Setting(
                "ds_config has no `optimizer` section, and no training arguments to build one \
                 from (resolve the config with ds_config::resolve_with_args)"
                    .into(),
            ))
        }
    };
    let base_lr = base_lr(&optimizer)?;
    let schedule = match (config.scheduler_params()?, program_schedule(config)) {
        (Some(p), _) => LrSchedule::new(&p, base_lr)?,
        (None, Some(args)) => hf_schedule(args, base_lr, config.schedule_steps)?,
        (None, None) => LrSchedule::constant(base_lr),
    };
    Ok(ProgramOptimizer {
        optimizer,
        groups,
        schedule,
    })
}

/// The training arguments when the program builds the schedule (see
/// `TrainingArgs::builds_schedule`).
fn program_schedule(config: &Config) -> Option<&TrainingArgs> {
    let args = config.training.as_ref()?;
    let builds = args.builds_schedule(config.optimizer.is_some(), config.scheduler.is_some());
    builds.then_some(args)
}

/// The AdamW of HF's Trainer: its `adamw_torch` defaults, the arguments' values.
fn adamw(args: &TrainingArgs) -> TypedSection {
    let (b1, b2) = args.betas();
    TypedSection {
        type_name: "adamw".into(),
        params: Some(json!({
            "lr": args.lr(),
            "betas": [b1, b2],
            "eps": args.eps(),
            "weight_decay": args.weight_decay(),
        })),
    }
}

fn hf_schedule(args: &TrainingArgs, base_lr: f64, total: Option<i64>) -> Result<LrSchedule> {
    let kind = args.scheduler_type();
    let missing = || {
        EngineError::Setting(format!(
            "--lr_scheduler_type {}: the schedule needs its total steps; give --max_steps",
            kind.name()
        ))
    };
    let total = total.ok_or_else(missing)?;
    let warmup = args.warmup(Some(total)).ok_or_else(missing)?;
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    Ok(LrSchedule::hugging_face(
        kind,
        base_lr,
        count(warmup),
        count(total),
    )?)
}

/// The run's LR schedule (the config's scheduler, else the one its training arguments
/// describe, else the optimizer's constant lr).
pub fn lr_schedule(config: &Config) -> Result<LrSchedule> {
    Ok(optimizer_and_schedule(config)?.schedule)
}

/// The run's optimizer and schedule checked without building any state, so that a command
/// can refuse a bad section (or a missing one with no arguments) before any rank starts.
pub fn check_optimizer(config: &Config) -> Result<()> {
    let program = optimizer_and_schedule(config)?;
    crate::optim::build_from_section(&program.optimizer, 0, &ds_partition::Placement::Host)?;
    Ok(())
}

/// The optimizer the run builds: the config's section, else the AdamW its training arguments
/// describe (what the memory model counts the states of).
pub fn optimizer_section(config: &Config) -> Result<TypedSection> {
    Ok(optimizer_and_schedule(config)?.optimizer)
}

/// The optimizer's `lr` param (DeepSpeed's optimizers default to 1e-3).
fn base_lr(section: &TypedSection) -> Result<f64> {
    match section.params.as_ref().and_then(|p| p.get("lr")) {
        None => Ok(1e-3),
        Some(v) => v.as_f64().ok_or_else(|| {
            EngineError::Setting(format!("optimizer.params.lr: expected a number, got {v}"))
        }),
    }
}

/// The one line `train` prints when it builds the optimizer or the schedule itself.
pub fn program_optimizer_line(config: &Config) -> Option<String> {
    let args = config.training.as_ref()?;
    let schedule = match program_schedule(config) {
        Some(_) => format!(
            ", schedule {} with {} warmup steps over {} steps",
            args.scheduler_type().name(),
            args.warmup(config.schedule_steps).unwrap_or(0),
            config.schedule_steps.map_or("?".into(), |n| n.to_string())
        ),
        None if config.optimizer.is_some() => return None,
        None => String::new(),
    };
    let (b1, b2) = args.betas();
    let py = ds_config::value::py_float_repr;
    let optimizer = match &config.optimizer {
        Some(o) => format!("the config's {}", o.type_name),
        None => format!(
            "AdamW(lr={}, betas=({}, {}), eps={}, weight_decay={} except biases and norm weights)",
            py(args.lr()),
            py(b1),
            py(b2),
            py(args.eps()),
            py(args.weight_decay())
        ),
    };
    let from = match config.optimizer.is_none() {
        true => "the config has no optimizer section",
        false => "the config has no scheduler section",
    };
    Some(format!(
        "optimizer: {optimizer}{schedule}, from the training arguments ({from})"
    ))
}
