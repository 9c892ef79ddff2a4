//! `fp16` and `bf16` (also spelt `bfloat16`): DeepSpeed's precision_config.py of 0.19.8.

use serde::Serialize;

use crate::coerce::{self, Bound};
use crate::error::{ConfigError, Result};
use crate::section::Section;
use crate::value::Value;

/// `fp16`: mixed precision with loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fp16Config {
    pub enabled: bool,
    pub auto_cast: bool,
    /// 0 means dynamic loss scaling; any other value is a static scale.
    pub loss_scale: f64,
    pub initial_scale_power: i64,
    pub loss_scale_window: i64,
    pub hysteresis: i64,
    pub consecutive_hysteresis: bool,
    pub min_loss_scale: i64,
    pub fp16_master_weights_and_grads: bool,
}

impl Fp16Config {
    pub fn read(s: &mut Section) -> Fp16Config {
        Fp16Config {
            enabled: s.bool("enabled", false),
            auto_cast: s.bool("auto_cast", false),
            loss_scale: read_loss_scale(s),
            initial_scale_power: s.int("initial_scale_power", 16, Bound::None),
            loss_scale_window: scale_int(s, "loss_scale_window", 1000),
            hysteresis: s.int("hysteresis", 2, Bound::None),
            consecutive_hysteresis: s.bool("consecutive_hysteresis", false),
            min_loss_scale: scale_int(s, "min_loss_scale", 1),
            fp16_master_weights_and_grads: s.bool("fp16_master_weights_and_grads", false),
        }
    }

    /// The model validator: dynamic scaling needs a positive window and minimum.
    pub fn validate(&self) -> Result<()> {
        if !self.enabled || self.loss_scale != 0.0 {
            return Ok(());
        }
        for (key, v) in [
            ("loss_scale_window", self.loss_scale_window),
            ("min_loss_scale", self.min_loss_scale),
        ] {
            if v <= 0 {
                return Err(ConfigError::invalid(
                    &format!("fp16.{key}"),
                    v,
                    "a value > 0 when dynamic loss scaling is enabled (loss_scale = 0)",
                ));
            }
        }
        Ok(())
    }

    /// The loss scale training starts from: the static scale, or 2^initial_scale_power.
    pub fn initial_loss_scale(&self) -> f64 {
        if self.loss_scale != 0.0 {
            self.loss_scale
        } else {
            2f64.powi(self.initial_scale_power.clamp(-1074, 1023) as i32)
        }
    }
}

/// `loss_scale`: a finite number >= 0, and not a bool.
fn read_loss_scale(s: &mut Section) -> f64 {
    let Some(v) = s.raw("loss_scale").cloned() else {
        return 0.0;
    };
    let parsed = match &v {
        Value::Bool(_) => Err("a number, not a bool"),
        v => coerce::to_float(v).map_err(|_| "a number"),
    }
    .and_then(|x| {
        if x.is_finite() {
            Ok(x)
        } else {
            Err("a finite number")
        }
    })
    .and_then(|x| {
        if x >= 0.0 {
            Ok(x)
        } else {
            Err("a number >= 0 (0 enables dynamic loss scaling)")
        }
    });
    parsed.unwrap_or_else(|expected| {
        let path = s.key_path("loss_scale");
        s.error(ConfigError::invalid(&path, &v, expected));
        0.0
    })
}

/// `loss_scale_window` / `min_loss_scale`: integers, never bools or non-finite floats.
fn scale_int(s: &mut Section, key: &'static str, default: i64) -> i64 {
    if let Some(v @ Value::Bool(_)) = s.raw(key).cloned() {
        let path = s.key_path(key);
        s.error(ConfigError::invalid(&path, v, "an integer, not a bool"));
        return default;
    }
    s.int(key, default, Bound::None)
}

/// `bf16`: bfloat16 mixed precision (no loss scaling).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bf16Config {
    pub enabled: bool,
    pub immediate_grad_update: bool,
    pub check_grad_overflow: bool,
    pub bf16_master_weights_and_grads: bool,
    pub bf16_optimizer_states: bool,
}

impl Bf16Config {
    pub fn read(s: &mut Section) -> Bf16Config {
        Bf16Config {
            enabled: s.bool("enabled", false),
            immediate_grad_update: s.bool("immediate_grad_update", false),
            check_grad_overflow: s.bool("check_grad_overflow", true),
            bf16_master_weights_and_grads: s.bool("bf16_master_weights_and_grads", false),
            bf16_optimizer_states: s.bool("bf16_optimizer_states", false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    fn fp16(text: &str) -> Result<Fp16Config> {
        let mut s = Section::open("fp16", &hjson::parse(text).unwrap())?;
        let c = Fp16Config::read(&mut s);
        s.finish()?;
        c.validate()?;
        Ok(c)
    }

    #[test]
    fn fp16_defaults_and_scale() {
        let c = fp16(r#"{"enabled": true}"#).unwrap();
        assert_eq!(
            (c.loss_scale, c.initial_scale_power, c.loss_scale_window),
            (0.0, 16, 1000)
        );
        assert_eq!(c.initial_loss_scale(), 65536.0);
        assert_eq!(
            fp16(r#"{"loss_scale": 128}"#).unwrap().initial_loss_scale(),
            128.0
        );
    }

    #[test]
    fn fp16_errors_name_the_key() {
        for (text, path) in [
            (r#"{"loss_scale": -1}"#, "fp16.loss_scale"),
            (r#"{"loss_scale": true}"#, "fp16.loss_scale"),
            (r#"{"loss_scale": "dynamic"}"#, "fp16.loss_scale"),
            (
                r#"{"enabled": true, "loss_scale_window": 0}"#,
                "fp16.loss_scale_window",
            ),
            (r#"{"min_loss_scale": false}"#, "fp16.min_loss_scale"),
            (r#"{"enabled": 2}"#, "fp16.enabled"),
            (r#"{"loss_scal": 0}"#, "fp16.loss_scal"),
        ] {
            let err = fp16(text).unwrap_err();
            assert_eq!(err.path(), Some(path), "{text}: {err}");
        }
    }

    #[test]
    fn bf16_rejects_fp16_keys() {
        let mut s = Section::open(
            "bf16",
            &hjson::parse(r#"{"enabled": true, "loss_scale": 0}"#).unwrap(),
        )
        .unwrap();
        let c = Bf16Config::read(&mut s);
        assert!(c.enabled);
        assert_eq!(s.finish().unwrap_err().path(), Some("bf16.loss_scale"));
    }
}
