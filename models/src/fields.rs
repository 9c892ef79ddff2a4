//! Typed reads of a Hugging Face config.json, each error naming the field.

use serde_json::{Map, Value};

/// A problem in config.json, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigProblem(pub String);

pub(crate) fn problem(msg: impl Into<String>) -> ConfigProblem {
    ConfigProblem(msg.into())
}

/// Typed reads of config.json's fields, each error naming the field.
pub(crate) struct Fields<'a>(pub(crate) &'a Map<String, Value>);

impl Fields<'_> {
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    pub(crate) fn usize(&self, key: &str, default: Option<usize>) -> Result<usize, ConfigProblem> {
        match (self.0.get(key), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(problem(format!("required field `{key}` is missing"))),
            (Some(v), _) => as_usize(key, v),
        }
    }

    /// A size where `null` means the default (transformers' `int | None`).
    pub(crate) fn usize_or_null(&self, key: &str, default: usize) -> Result<usize, ConfigProblem> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => as_usize(key, v),
        }
    }

    /// A size that `null` turns off.
    pub(crate) fn usize_opt(
        &self,
        key: &str,
        default: Option<usize>,
    ) -> Result<Option<usize>, ConfigProblem> {
        match self.0.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => as_usize(key, v).map(Some),
        }
    }

    pub(crate) fn f64(&self, key: &str, default: f64) -> Result<f64, ConfigProblem> {
        match self.0.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| problem(format!("`{key}` must be a number, got {v}"))),
        }
    }

    pub(crate) fn bool(&self, key: &str, default: bool) -> Result<bool, ConfigProblem> {
        match self.0.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| problem(format!("`{key}` must be true or false, got {v}"))),
        }
    }

    pub(crate) fn str(&self, key: &str, default: &str) -> Result<String, ConfigProblem> {
        match self.0.get(key) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| problem(format!("`{key}` must be a string, got {v}"))),
        }
    }
}

fn as_usize(key: &str, v: &Value) -> Result<usize, ConfigProblem> {
    v.as_u64()
        .map(|n| n as usize)
        .ok_or_else(|| problem(format!("`{key}` must be a non-negative integer, got {v}")))
}
