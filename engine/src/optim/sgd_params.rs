//! The `optimizer.params` of `"type": "SGD"`: DeepSpeed takes SGD from torch.optim and passes
//! the params as keyword arguments, so the keys, defaults and checks are torch.optim.SGD's.

use serde_json::{Map, Value as Json};

use ds_config::error::closest;
use ds_config::ConfigError;

const PATH: &str = "optimizer.params";

/// torch.optim.SGD's hyper-parameters. `lr` is the schedule's base rate: every step gets its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdParams {
    /// The config's lr (torch's default 1e-3); the engine's scheduler starts from it.
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

impl SgdParams {
    /// The `optimizer.params` of `"type": "SGD"`, with torch's defaults and checks. Keys are
    /// passed to torch as keyword arguments, so unknown ones are an error, as in DeepSpeed.
    pub fn parse(params: Option<&Json>) -> Result<SgdParams, ConfigError> {
        let empty = Map::new();
        let map = match params {
            None | Some(Json::Null) => &empty,
            Some(Json::Object(m)) => m,
            Some(other) => return Err(ConfigError::invalid(PATH, other, "an object")),
        };
        check_keys(map)?;
        let p = SgdParams {
            lr: number(map, "lr", 1e-3)?,
            momentum: number(map, "momentum", 0.0)?,
            dampening: number(map, "dampening", 0.0)?,
            weight_decay: number(map, "weight_decay", 0.0)?,
            nesterov: boolean(map, "nesterov", false)?,
        };
        if boolean(map, "maximize", false)? {
            return Err(ConfigError::invalid(
                "optimizer.params.maximize",
                true,
                "false",
            ));
        }
        p.check()?;
        Ok(p)
    }

    /// torch's constructor checks, each naming its key.
    fn check(&self) -> Result<(), ConfigError> {
        for (key, x) in [
            ("lr", self.lr),
            ("momentum", self.momentum),
            ("weight_decay", self.weight_decay),
        ] {
            if x.is_nan() || x < 0.0 {
                return Err(ConfigError::invalid(
                    &format!("{PATH}.{key}"),
                    x,
                    "a number >= 0",
                ));
            }
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            let why = "Nesterov momentum requires a momentum > 0 and zero dampening";
            return Err(ConfigError::conflict(&format!("{PATH}.nesterov"), why));
        }
        Ok(())
    }
}

/// torch.optim.SGD's keyword arguments; foreach / fused / differentiable only pick torch's
/// implementation and do not change the result.
const KEYS: [&str; 9] = [
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "nesterov",
    "maximize",
    "foreach",
    "fused",
    "differentiable",
];

fn check_keys(map: &Map<String, Json>) -> Result<(), ConfigError> {
    match map.keys().find(|k| !KEYS.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(ConfigError::Unknown {
            path: format!("{PATH}.{k}"),
            suggestion: closest(k, KEYS),
        }),
    }
}

fn number(map: &Map<String, Json>, key: &str, default: f64) -> Result<f64, ConfigError> {
    match map.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| ConfigError::invalid(&format!("{PATH}.{key}"), v, "a number")),
    }
}

fn boolean(map: &Map<String, Json>, key: &str, default: bool) -> Result<bool, ConfigError> {
    match map.get(key) {
        None | Some(Json::Null) => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ConfigError::invalid(&format!("{PATH}.{key}"), v, "true or false")),
    }
}
