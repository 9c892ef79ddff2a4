//! Sections DeepSpeed reads with plain `dict.get` instead of a typed model.
//!
//! DeepSpeed accepts any value there at config time (a wrong type fails later, or never), so
//! ds-rs must accept the same files. A `Lenient` reader converts what ds-rs uses, and when a
//! value cannot be used it keeps the default and records a warning naming the key, instead of
//! rejecting a file DeepSpeed accepts. Only a section that is not an object is an error, as it
//! is in DeepSpeed (`.get` on a non-dict raises).

use crate::error::{ConfigError, Result};
use crate::value::{Dict, Value};

/// The object at `key` of `root`: `None` when absent, an error when it is not an object.
pub fn dict_at<'a>(root: &'a Dict, key: &str) -> Result<Option<&'a Dict>> {
    match root.get(key) {
        None => Ok(None),
        Some(Value::Dict(d)) => Ok(Some(d)),
        Some(other) => Err(ConfigError::invalid(key, other, "an object ({...})")),
    }
}

pub struct Lenient<'a> {
    path: String,
    dict: Option<&'a Dict>,
    warnings: &'a mut Vec<String>,
}

impl<'a> Lenient<'a> {
    /// Reads `root[key]`, which must be an object when present.
    pub fn open(root: &'a Dict, key: &str, warnings: &'a mut Vec<String>) -> Result<Lenient<'a>> {
        Ok(Lenient {
            path: key.to_string(),
            dict: dict_at(root, key)?,
            warnings,
        })
    }

    /// Reads an object already in hand (`None` for "absent").
    pub fn over(path: &str, dict: Option<&'a Dict>, warnings: &'a mut Vec<String>) -> Lenient<'a> {
        Lenient {
            path: path.to_string(),
            dict,
            warnings,
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.dict.and_then(|d| d.get(key))
    }

    fn unusable(&mut self, key: &str, v: &Value, expected: &str) {
        let path = format!("{}.{key}", self.path);
        self.warnings.push(format!(
            "{path}: {v} is not {expected}; ds-rs uses the default"
        ));
    }

    /// A flag, read with Python truthiness as DeepSpeed's `if value:` does.
    pub fn flag(&mut self, key: &str, default: bool) -> bool {
        self.get(key).map_or(default, Value::truthy)
    }

    pub fn number(&mut self, key: &str, default: f64) -> f64 {
        match self.get(key) {
            None => default,
            Some(v) => v.as_f64().unwrap_or_else(|| {
                self.unusable(key, v, "a number");
                default
            }),
        }
    }

    pub fn integer(&mut self, key: &str, default: i64) -> i64 {
        match self.get(key) {
            None => default,
            Some(Value::Int(i)) => *i,
            Some(Value::Bool(b)) => i64::from(*b),
            Some(v) => {
                self.unusable(key, v, "an integer");
                default
            }
        }
    }

    pub fn text(&mut self, key: &str) -> Option<String> {
        match self.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Str(s)) => Some(s.clone()),
            Some(v) => {
                self.unusable(key, v, "a string");
                None
            }
        }
    }

    pub fn text_or(&mut self, key: &str, default: &str) -> String {
        self.text(key).unwrap_or_else(|| default.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    #[test]
    fn unusable_values_warn_and_default() {
        let root = hjson::parse(r#"{"s": {"n": "x", "f": 1, "i": 3}}"#).unwrap();
        let mut warnings = Vec::new();
        let mut r = Lenient::open(root.as_dict().unwrap(), "s", &mut warnings).unwrap();
        assert_eq!(r.number("n", 2.0), 2.0);
        assert!(r.flag("f", false));
        assert_eq!(r.integer("i", 0), 3);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with("s.n:"), "{warnings:?}");
    }

    #[test]
    fn non_object_section_is_an_error() {
        let root = hjson::parse(r#"{"s": [1]}"#).unwrap();
        let mut warnings = Vec::new();
        let err = Lenient::open(root.as_dict().unwrap(), "s", &mut warnings)
            .err()
            .unwrap();
        assert_eq!(err.path(), Some("s"));
    }
}
