//! `optimizer` and `scheduler`: the type names and params DeepSpeed 0.19.8 accepts.
//!
//! DeepSpeedConfig only records the type and the raw params; the engine builds the optimizer
//! and checks the params when it starts. ds-rs does the same: `resolve` keeps the raw form (so
//! the verdict on a file matches DeepSpeed's), and `OptimizerParams::parse` /
//! `SchedulerParams::parse` give the typed values, with DeepSpeed's defaults, that `train` uses.

use serde::Serialize;
use serde_json::Value as Json;

use crate::error::{ConfigError, Result};
use crate::value::{Dict, Value};

/// The optimizer type names DeepSpeed implements itself (matched case-insensitively).
pub const DEEPSPEED_OPTIMIZERS: [&str; 9] = [
    "adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon",
];

/// The LR schedules of deepspeed/runtime/lr_schedules.py (matched exactly).
pub const SCHEDULERS: [&str; 5] = [
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
];

/// A `{"type": ..., "params": {...}}` section as DeepSpeed records it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TypedSection {
    /// DeepSpeed lower-cases its own optimizer names; other names are kept as written.
    #[serde(rename = "type")]
    pub type_name: String,
    pub params: Option<Json>,
}

/// Reads `optimizer` or `scheduler`: `None` when absent or without a `type`.
pub fn read_typed(root: &Dict, key: &str) -> Result<Option<TypedSection>> {
    let d = match root.get(key) {
        None => return Ok(None),
        Some(Value::Dict(d)) => d,
        Some(other) => {
            return Err(ConfigError::invalid(
                key,
                other,
                "an object with \"type\" and \"params\"",
            ))
        }
    };
    let type_name = match d.get("type") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Str(s)) => s.clone(),
        Some(other) => {
            return Err(ConfigError::invalid(
                &format!("{key}.type"),
                other,
                "a type name",
            ))
        }
    };
    let type_name = match key {
        "optimizer" if DEEPSPEED_OPTIMIZERS.contains(&type_name.to_lowercase().as_str()) => {
            type_name.to_lowercase()
        }
        _ => type_name,
    };
    Ok(Some(TypedSection {
        type_name,
        params: d
            .get("params")
            .filter(|p| **p != Value::Null)
            .map(Value::to_json),
    }))
}

/// Reads params one key at a time with a default, remembering unknown keys.
struct Params<'a> {
    path: String,
    map: Option<&'a serde_json::Map<String, Json>>,
    used: Vec<&'static str>,
}

impl<'a> Params<'a> {
    fn new(path: &str, params: Option<&'a Json>) -> Result<Params<'a>> {
        let map = match params {
            None | Some(Json::Null) => None,
            Some(Json::Object(m)) => Some(m),
            Some(other) => return Err(ConfigError::invalid(path, other, "an object")),
        };
        Ok(Params {
            path: path.to_string(),
            map,
            used: Vec::new(),
        })
    }

    fn get(&mut self, key: &'static str) -> Option<&'a Json> {
        self.used.push(key);
        self.map.and_then(|m| m.get(key))
    }

    fn f64(&mut self, key: &'static str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(key, v, "a number")),
        }
    }

    fn opt_f64(&mut self, key: &'static str) -> Result<Option<f64>> {
        match self.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.bad(key, v, "a number")),
        }
    }

    fn u64(&mut self, key: &'static str, default: u64) -> Result<u64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.bad(key, v, "a non-negative integer")),
        }
    }

    fn bool(&mut self, key: &'static str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, v, "true or false")),
        }
    }

    fn betas(&mut self, default: (f64, f64)) -> Result<(f64, f64)> {
        match self.get("betas") {
            None => Ok(default),
            Some(Json::Array(b)) if b.len() == 2 && b.iter().all(Json::is_number) => Ok((
                b[0].as_f64().unwrap_or(default.0),
                b[1].as_f64().unwrap_or(default.1),
            )),
            Some(v) => Err(self.bad("betas", v, "a list of two numbers")),
        }
    }

    fn bad(&self, key: &str, v: &Json, expected: impl ToString) -> ConfigError {
        ConfigError::invalid(&format!("{}.{key}", self.path), v, expected)
    }

    /// Unknown params are an error: DeepSpeed passes them as keyword arguments.
    fn finish(self) -> Result<()> {
        let Some(m) = self.map else { return Ok(()) };
        match m.keys().find(|k| !self.used.contains(&k.as_str())) {
            None => Ok(()),
            Some(k) => Err(ConfigError::Unknown {
                path: format!("{}.{k}", self.path),
                suggestion: crate::error::closest(k, self.used.iter().copied()),
            }),
        }
    }
}

/// Typed optimizer params, with DeepSpeed's (and torch's) defaults.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum OptimizerParams {
    /// Adam and AdamW; `adam_w_mode` selects decoupled weight decay (DeepSpeed's default).
    Adam {
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        adam_w_mode: bool,
        /// FusedAdam's and DeepSpeedCPUAdam's `bias_correction` (default true).
        bias_correction: bool,
    },
    Lamb {
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        max_coeff: f64,
        min_coeff: f64,
        bias_correction: bool,
    },
    Adagrad {
        lr: f64,
        eps: f64,
        weight_decay: f64,
    },
    Lion {
        lr: f64,
        betas: (f64, f64),
        weight_decay: f64,
    },
}

impl OptimizerParams {
    /// The typed params of an optimizer section; an error names the param and its path.
    pub fn parse(section: &TypedSection) -> Result<OptimizerParams> {
        let mut p = Params::new("optimizer.params", section.params.as_ref())?;
        if p.get("max_grad_norm").is_some() {
            // DeepSpeed's _configure_basic_optimizer raises this before it looks at the type
            return Err(ConfigError::invalid(
                "optimizer.params.max_grad_norm",
                "an optimizer parameter",
                "the top-level `gradient_clipping` (DeepSpeed 0.19.8 refuses max_grad_norm here)",
            ));
        }
        let parsed = match section.type_name.as_str() {
            "adam" | "adamw" => adam(&mut p, section.type_name == "adamw")?,
            "lamb" => OptimizerParams::Lamb {
                bias_correction: p.bool("bias_correction", true)?,
                lr: p.f64("lr", 1e-3)?,
                betas: p.betas((0.9, 0.999))?,
                eps: p.f64("eps", 1e-8)?,
                weight_decay: p.f64("weight_decay", 0.0)?,
                max_coeff: p.f64("max_coeff", 10.0)?,
                min_coeff: p.f64("min_coeff", 0.01)?,
            },
            "adagrad" => OptimizerParams::Adagrad {
                lr: p.f64("lr", 1e-2)?,
                eps: p.f64("eps", 1e-10)?,
                weight_decay: p.f64("weight_decay", 0.0)?,
            },
            "lion" => OptimizerParams::Lion {
                lr: p.f64("lr", 1e-4)?,
                betas: p.betas((0.9, 0.99))?,
                weight_decay: p.f64("weight_decay", 0.0)?,
            },
            other => return Err(unknown_optimizer(other)),
        };
        p.finish()?;
        Ok(parsed)
    }
}

/// Adam and AdamW: FusedAdam's (GPU) and DeepSpeedCPUAdam's parameters, and those DeepSpeed's
/// engine pops first (`adam_w_mode`, `torch_adam`, `fp32_optimizer_states`). The type name
/// AdamW forces decoupled decay, as DeepSpeed does.
fn adam(p: &mut Params, is_adamw: bool) -> Result<OptimizerParams> {
    let torch_adam = p.bool("torch_adam", false)?;
    // performance switches of torch's and FusedAdam's kernels: the same update
    for key in ["fused", "foreach", "set_grad_none"] {
        p.get(key);
    }
    if p.bool("amsgrad", false)? {
        let why = match torch_adam {
            true => "torch's AMSGrad, which ds-rs does not implement",
            false => "AMSGrad, which DeepSpeed's FusedAdam and CPU Adam refuse too",
        };
        return Err(p.bad("amsgrad", &Json::Bool(true), format!("false ({why})")));
    }
    if !p.bool("fp32_optimizer_states", true)? {
        return Err(p.bad(
            "fp32_optimizer_states",
            &Json::Bool(false),
            "true (ds-rs keeps Adam's moments in fp32; bf16 moments are not implemented)",
        ));
    }
    Ok(OptimizerParams::Adam {
        lr: p.f64("lr", 1e-3)?,
        betas: p.betas((0.9, 0.999))?,
        eps: p.f64("eps", 1e-8)?,
        // FusedAdam and DeepSpeedCPUAdam default to 0; torch's AdamW to 0.01
        weight_decay: p.f64(
            "weight_decay",
            if torch_adam && is_adamw { 1e-2 } else { 0.0 },
        )?,
        adam_w_mode: p.bool("adam_w_mode", true)? || is_adamw,
        bias_correction: p.bool("bias_correction", true)?,
    })
}

/// Adam's parameters that select an implementation, not an update: read and not acted on.
pub fn param_warnings(section: &TypedSection) -> Vec<String> {
    if !matches!(section.type_name.as_str(), "adam" | "adamw") {
        return Vec::new();
    }
    let Some(Json::Object(params)) = &section.params else {
        return Vec::new();
    };
    let notes = [
        (
            "torch_adam",
            "ds-rs computes DeepSpeed's Adam (torch's rounds differently, in the last bits)",
        ),
        ("fused", "a switch of torch's kernels"),
        ("foreach", "a switch of torch's kernels"),
        ("set_grad_none", "ds-rs keeps gradients in flat buffers"),
    ];
    notes
        .iter()
        .filter(|(key, _)| params.contains_key(*key))
        .map(|(key, why)| format!("optimizer.params.{key}: no effect: {why}"))
        .collect()
}

/// A type DeepSpeed would look up in torch.optim and fail on at initialize, or one of the
/// communication-compressed optimizers.
fn unknown_optimizer(name: &str) -> ConfigError {
    let compressed = ["onebitadam", "zerooneadam", "onebitlamb"];
    let expected = match compressed.contains(&name.to_lowercase().as_str()) {
        true => {
            "Adam or AdamW: the 1-bit (communication-compressed) optimizers are not in \
                 DeepSpeed 0.19.8's engine and ds-rs does not implement them"
        }
        false => {
            "Adam, AdamW or SGD (the optimizers ds-rs implements); DeepSpeed looks any \
                  other name up in torch.optim"
        }
    };
    ConfigError::invalid("optimizer.type", format!("'{name}'"), expected)
}

/// Typed LR-schedule params, with the defaults of deepspeed/runtime/lr_schedules.py.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum SchedulerParams {
    LrRangeTest {
        min_lr: f64,
        step_size: u64,
        step_rate: f64,
        staircase: bool,
    },
    OneCycle(OneCycleParams),
    /// `max_lr: None` means the optimizer's lr.
    WarmupLr {
        min_lr: f64,
        max_lr: Option<f64>,
        num_steps: u64,
        log_warmup: bool,
    },
    WarmupDecayLr {
        total_steps: u64,
        min_lr: f64,
        max_lr: f64,
        num_steps: u64,
        log_warmup: bool,
    },
    WarmupCosineLr {
        total_steps: u64,
        min_ratio: f64,
        num_steps: u64,
        cos_min_ratio: f64,
        log_warmup: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneCycleParams {
    pub min_lr: f64,
    pub max_lr: f64,
    pub decay_lr_rate: f64,
    pub first_step_size: u64,
    pub second_step_size: Option<u64>,
    pub decay_step_size: u64,
    pub cycle_momentum: bool,
    pub min_mom: f64,
    pub max_mom: f64,
    pub decay_mom_rate: f64,
}

impl SchedulerParams {
    pub fn parse(section: &TypedSection) -> Result<SchedulerParams> {
        let mut p = Params::new("scheduler.params", section.params.as_ref())?;
        p.get("last_batch_iteration");
        let parsed = match section.type_name.as_str() {
            "LRRangeTest" => SchedulerParams::LrRangeTest {
                min_lr: p.f64("lr_range_test_min_lr", 1e-3)?,
                step_size: p.u64("lr_range_test_step_size", 2000)?,
                step_rate: p.f64("lr_range_test_step_rate", 1.0)?,
                staircase: p.bool("lr_range_test_staircase", false)?,
            },
            "OneCycle" => SchedulerParams::OneCycle(one_cycle(&mut p)?),
            "WarmupLR" => SchedulerParams::WarmupLr {
                min_lr: p.f64("warmup_min_lr", 0.0)?,
                max_lr: p.opt_f64("warmup_max_lr")?,
                num_steps: positive_steps(&mut p, "warmup_num_steps")?,
                log_warmup: warmup_type(&mut p)?,
            },
            "WarmupDecayLR" => SchedulerParams::WarmupDecayLr {
                total_steps: required_steps(&mut p)?,
                min_lr: p.f64("warmup_min_lr", 0.0)?,
                max_lr: p.f64("warmup_max_lr", 1e-3)?,
                num_steps: positive_steps(&mut p, "warmup_num_steps")?,
                log_warmup: warmup_type(&mut p)?,
            },
            "WarmupCosineLR" => SchedulerParams::WarmupCosineLr {
                total_steps: required_steps(&mut p)?,
                min_ratio: p.f64("warmup_min_ratio", 0.0)?,
                num_steps: positive_steps(&mut p, "warmup_num_steps")?,
                cos_min_ratio: p.f64("cos_min_ratio", 1e-4)?,
                log_warmup: warmup_type(&mut p)?,
            },
            other => {
                return Err(ConfigError::invalid(
                    "scheduler.type",
                    format!("'{other}'"),
                    SCHEDULERS.join(", "),
                ))
            }
        };
        p.finish()?;
        Ok(parsed)
    }
}

fn one_cycle(p: &mut Params) -> Result<OneCycleParams> {
    let min_lr = p.opt_f64("cycle_min_lr")?;
    let max_lr = p.opt_f64("cycle_max_lr")?;
    let (Some(min_lr), Some(max_lr)) = (min_lr, max_lr) else {
        return Err(ConfigError::invalid(
            "scheduler.params",
            "missing keys",
            "cycle_min_lr and cycle_max_lr",
        ));
    };
    p.u64("cycle_first_stair_count", 0)?;
    p.get("cycle_second_stair_count");
    Ok(OneCycleParams {
        min_lr,
        max_lr,
        decay_lr_rate: p.f64("decay_lr_rate", 0.0)?,
        first_step_size: p.u64("cycle_first_step_size", 2000)?,
        second_step_size: p.opt_f64("cycle_second_step_size")?.map(|x| x as u64),
        decay_step_size: p.u64("decay_step_size", 0)?,
        cycle_momentum: p.bool("cycle_momentum", true)?,
        min_mom: p.f64("cycle_min_mom", 0.8)?,
        max_mom: p.f64("cycle_max_mom", 0.9)?,
        decay_mom_rate: p.f64("decay_mom_rate", 0.0)?,
    })
}

/// `warmup_num_steps`: DeepSpeed requires a positive int.
fn positive_steps(p: &mut Params, key: &'static str) -> Result<u64> {
    let n = p.u64(key, 1000)?;
    if n == 0 {
        return Err(ConfigError::invalid(
            &format!("scheduler.params.{key}"),
            0,
            "a positive integer",
        ));
    }
    Ok(n)
}

fn required_steps(p: &mut Params) -> Result<u64> {
    match p.get("total_num_steps") {
        Some(v) => v
            .as_u64()
            .ok_or_else(|| p.bad("total_num_steps", v, "a non-negative integer")),
        None => Err(ConfigError::invalid(
            "scheduler.params.total_num_steps",
            "nothing",
            "the total number of steps",
        )),
    }
}

/// `warmup_type`: "log" (default) or "linear"; true for log.
fn warmup_type(p: &mut Params) -> Result<bool> {
    match p.get("warmup_type") {
        None => Ok(true),
        Some(Json::String(s)) if s == "log" => Ok(true),
        Some(Json::String(s)) if s == "linear" => Ok(false),
        Some(v) => Err(p.bad("warmup_type", v, "\"log\" or \"linear\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    fn section(key: &str, text: &str) -> TypedSection {
        let root = hjson::parse(text).unwrap();
        read_typed(root.as_dict().unwrap(), key).unwrap().unwrap()
    }

    #[test]
    fn optimizer_names_are_lowercased_like_deepspeed() {
        assert_eq!(
            section("optimizer", r#"{"optimizer": {"type": "AdamW"}}"#).type_name,
            "adamw"
        );
        assert_eq!(
            section("optimizer", r#"{"optimizer": {"type": "OneBitAdam"}}"#).type_name,
            "OneBitAdam"
        );
    }

    #[test]
    fn adam_defaults_and_unknown_param() {
        let s = section(
            "optimizer",
            r#"{"optimizer": {"type": "Adam", "params": {"lr": 0.01}}}"#,
        );
        let OptimizerParams::Adam {
            lr,
            betas,
            eps,
            adam_w_mode,
            ..
        } = OptimizerParams::parse(&s).unwrap()
        else {
            panic!("adam expected")
        };
        assert_eq!(
            (lr, betas, eps, adam_w_mode),
            (0.01, (0.9, 0.999), 1e-8, true)
        );
        let s = section(
            "optimizer",
            r#"{"optimizer": {"type": "Adam", "params": {"lrr": 0.01}}}"#,
        );
        let err = OptimizerParams::parse(&s).unwrap_err();
        assert_eq!(err.path(), Some("optimizer.params.lrr"));
        assert!(err.to_string().contains("did you mean `lr`"), "{err}");
    }

    /// DeepSpeed's Adam parameters: acted on, refused as DeepSpeed refuses them, or refused
    /// because ds-rs lacks the variant.
    #[test]
    fn deepspeed_adam_parameters() {
        let parse = |params: &str| {
            let s = section(
                "optimizer",
                &format!(r#"{{"optimizer": {{"type": "AdamW", "params": {params}}}}}"#),
            );
            OptimizerParams::parse(&s)
        };
        let p = parse(r#"{"bias_correction": false, "adam_w_mode": false, "torch_adam": false}"#);
        let Ok(OptimizerParams::Adam {
            bias_correction,
            adam_w_mode,
            weight_decay,
            ..
        }) = p
        else {
            panic!("{p:?}")
        };
        // AdamW forces decoupled decay; FusedAdam's default weight decay is 0
        assert_eq!(
            (bias_correction, adam_w_mode, weight_decay),
            (false, true, 0.0)
        );
        for (params, path) in [
            (
                r#"{"max_grad_norm": 1.0}"#,
                "optimizer.params.max_grad_norm",
            ),
            (r#"{"amsgrad": true}"#, "optimizer.params.amsgrad"),
            (
                r#"{"fp32_optimizer_states": false}"#,
                "optimizer.params.fp32_optimizer_states",
            ),
        ] {
            assert_eq!(parse(params).unwrap_err().path(), Some(path), "{params}");
        }
        let s = section("optimizer", r#"{"optimizer": {"type": "OneBitAdam"}}"#);
        let err = OptimizerParams::parse(&s).unwrap_err().to_string();
        assert!(err.contains("1-bit"), "{err}");
        let warned = param_warnings(&section(
            "optimizer",
            r#"{"optimizer": {"type": "Adam", "params": {"torch_adam": true, "lr": 1}}}"#,
        ));
        assert_eq!(warned.len(), 1, "{warned:?}");
    }

    #[test]
    fn schedulers_need_their_required_params() {
        let s = section(
            "scheduler",
            r#"{"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}"#,
        );
        assert_eq!(
            SchedulerParams::parse(&s).unwrap_err().path(),
            Some("scheduler.params.total_num_steps")
        );
        let s = section(
            "scheduler",
            r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}"#,
        );
        assert_eq!(
            SchedulerParams::parse(&s).unwrap_err().path(),
            Some("scheduler.params.warmup_num_steps")
        );
        let s = section("scheduler", r#"{"scheduler": {"type": "WarmupLR"}}"#);
        assert!(matches!(
            SchedulerParams::parse(&s).unwrap(),
            SchedulerParams::WarmupLr {
                num_steps: 1000,
                ..
            }
        ));
    }
}
