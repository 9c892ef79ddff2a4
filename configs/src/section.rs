//! Reading one typed section, the way DeepSpeed's pydantic models read theirs.
//!
//! A `Section` wraps one JSON object. Each typed accessor names a key, converts its value with
//! pydantic's lax rules and returns the default when the key is absent; `finish` then rejects the
//! keys nobody asked for (pydantic's `extra="forbid"`), with a "did you mean". Like pydantic,
//! all problems of a section are collected and reported together.
//!
//! See Note ["auto" inside sections]: DeepSpeedConfigModel drops every key whose value is the
//! string "auto" before validation, so such a key takes the field's default.

use serde_json::Value as Json;

use crate::coerce::{self, Bound};
use crate::error::{closest, ConfigError, Result};
use crate::value::{Dict, Value};

pub struct Section {
    path: String,
    dict: Dict,
    known: Vec<&'static str>,
    errors: Vec<ConfigError>,
    /// Keys whose "auto" value was dropped, and the default each one took.
    dropped_auto: Vec<String>,
    pub auto_defaults: Vec<(String, Json)>,
}

// Note ["auto" inside sections]
// DeepSpeedConfigModel.__init__ filters `v != "auto"` out of its keyword arguments, and pydantic
// calls that __init__ for nested models too, so "auto" means "default" at any depth of a typed
// section. The HF Trainer fills the keys it knows before DeepSpeed sees them (see auto.rs);
// what is left is reported in `auto_defaults` so `config check` can say what each became.

impl Section {
    /// Opens the object at `path`; anything but an object is an error (DeepSpeed: `**value`).
    pub fn open(path: &str, value: &Value) -> Result<Section> {
        let Value::Dict(dict) = value else {
            return Err(ConfigError::invalid(path, value, "an object ({...})"));
        };
        let (dropped, kept): (Vec<_>, Vec<_>) =
            dict.0.iter().cloned().partition(|(_, v)| v.is_auto());
        Ok(Section {
            path: path.to_string(),
            dict: Dict(kept),
            known: Vec::new(),
            errors: Vec::new(),
            dropped_auto: dropped.into_iter().map(|(k, _)| k).collect(),
            auto_defaults: Vec::new(),
        })
    }

    /// An empty section: every field takes its default.
    pub fn empty(path: &str) -> Section {
        Section::open(path, &Value::Dict(Dict::default()))
            .expect("invariant: an empty object opens")
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn key_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The raw value of `key`, marking the key as known.
    pub fn raw(&mut self, key: &'static str) -> Option<&Value> {
        self.known.push(key);
        self.dict.get(key)
    }

    pub fn has(&self, key: &str) -> bool {
        self.dict.contains_key(key)
    }

    pub fn error(&mut self, e: ConfigError) {
        self.errors.push(e);
    }

    fn note_default(&mut self, key: &str, default: Json) {
        if self.dropped_auto.iter().any(|k| k == key) {
            let path = self.key_path(key);
            self.auto_defaults.push((path, default));
        }
    }

    /// Converts `key` with `convert`, or returns `default`; a failed conversion is recorded.
    fn field<T: Clone + Into<Json>>(
        &mut self,
        key: &'static str,
        default: T,
        convert: impl Fn(&Value) -> std::result::Result<T, String>,
    ) -> T {
        let Some(v) = self.raw(key).cloned() else {
            self.note_default(key, default.clone().into());
            return default;
        };
        convert(&v).unwrap_or_else(|expected| {
            let path = self.key_path(key);
            self.errors.push(ConfigError::invalid(&path, &v, expected));
            default
        })
    }

    pub fn bool(&mut self, key: &'static str, default: bool) -> bool {
        self.field(key, default, |v| coerce::to_bool(v).map_err(String::from))
    }

    pub fn int(&mut self, key: &'static str, default: i64, bound: Bound) -> i64 {
        self.field(key, default, |v| {
            let i = coerce::to_int(v).map_err(String::from)?;
            bound
                .check(i as f64)
                .map(|_| i)
                .map_err(|e| e.replacen("a number", "an integer", 1))
        })
    }

    pub fn float(&mut self, key: &'static str, default: f64, bound: Bound) -> f64 {
        self.field(key, default, |v| {
            let x = coerce::to_float(v).map_err(String::from)?;
            bound.check(x).map(|_| x)
        })
    }

    pub fn string(&mut self, key: &'static str, default: &str) -> String {
        self.field(key, default.to_string(), |v| {
            coerce::to_str(v).map_err(String::from)
        })
    }

    /// An `Optional[str]` field: null is allowed.
    pub fn opt_string(&mut self, key: &'static str) -> Option<String> {
        self.opt(key, |v| coerce::to_str(v).map_err(String::from))
    }

    pub fn opt_bool(&mut self, key: &'static str) -> Option<bool> {
        self.opt(key, |v| coerce::to_bool(v).map_err(String::from))
    }

    pub fn opt_int(&mut self, key: &'static str) -> Option<i64> {
        self.opt(key, |v| coerce::to_int(v).map_err(String::from))
    }

    fn opt<T: Clone + Into<Json>>(
        &mut self,
        key: &'static str,
        convert: impl Fn(&Value) -> std::result::Result<T, String>,
    ) -> Option<T> {
        self.field(key, None, |v| match v {
            Value::Null => Ok(None),
            v => convert(v).map(Some),
        })
    }

    /// A field restricted to a set of strings (a str Enum): exact, case-sensitive match.
    pub fn choice(
        &mut self,
        key: &'static str,
        default: &'static str,
        choices: &[&'static str],
    ) -> String {
        self.field(key, default.to_string(), |v| match v.as_str() {
            Some(s) if choices.contains(&s) => Ok(s.to_string()),
            _ => Err(format!("one of {}", quoted_list(choices))),
        })
    }

    /// A `list` field (any items).
    pub fn list(&mut self, key: &'static str) -> Option<Vec<Value>> {
        match self.raw(key).cloned() {
            None => None,
            Some(Value::List(items)) => Some(items),
            Some(other) => {
                let path = self.key_path(key);
                self.errors
                    .push(ConfigError::invalid(&path, &other, "a list"));
                None
            }
        }
    }

    /// A nested typed section; `None` when absent. `nullable` allows an explicit null.
    pub fn sub(&mut self, key: &'static str, nullable: bool) -> Option<Section> {
        let value = self.raw(key)?.clone();
        if nullable && value == Value::Null {
            return None;
        }
        let path = self.key_path(key);
        match Section::open(&path, &value) {
            Ok(s) => Some(s),
            Err(e) => {
                self.errors.push(e);
                None
            }
        }
    }

    /// Reads the nested section `key` (null or absent: `None`) with `read`, keeping its problems.
    pub fn nested<T>(
        &mut self,
        key: &'static str,
        read: impl FnOnce(&mut Section) -> T,
    ) -> Option<T> {
        let mut sub = self.sub(key, true)?;
        let out = read(&mut sub);
        self.absorb(sub);
        Some(out)
    }

    /// Takes over the problems and auto defaults of a nested section.
    pub fn absorb(&mut self, child: Section) {
        let (errors, autos) = child.into_parts();
        self.errors.extend(errors);
        self.auto_defaults.extend(autos);
    }

    fn into_parts(mut self) -> (Vec<ConfigError>, Vec<(String, Json)>) {
        let unknown: Vec<String> = self
            .dict
            .keys()
            .filter(|k| !self.known.contains(k))
            .map(str::to_string)
            .collect();
        for key in unknown {
            let suggestion = closest(&key, self.known.iter().copied());
            self.errors.push(ConfigError::Unknown {
                path: self.key_path(&key),
                suggestion,
            });
        }
        (self.errors, self.auto_defaults)
    }

    /// Ends the section: unknown keys become errors; returns the auto defaults taken.
    pub fn finish(self) -> Result<Vec<(String, Json)>> {
        let (errors, autos) = self.into_parts();
        match ConfigError::from_list(errors) {
            Some(e) => Err(e),
            None => Ok(autos),
        }
    }
}

pub fn quoted_list(items: &[&str]) -> String {
    items
        .iter()
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    fn open(text: &str) -> Section {
        Section::open("sec", &hjson::parse(text).unwrap()).unwrap()
    }

    #[test]
    fn defaults_conversions_and_unknown_keys() {
        let mut s = open(r#"{"a": "yes", "b": 5.0, "typo_bb": 1}"#);
        assert!(s.bool("a", false));
        assert_eq!(s.int("b", 0, Bound::Ge(0.0)), 5);
        assert_eq!(s.int("bb", 7, Bound::Ge(0.0)), 7);
        let err = s.finish().unwrap_err();
        assert_eq!(err.paths(), ["sec.typo_bb"]);
    }

    #[test]
    fn auto_takes_the_default_and_is_reported() {
        let mut s = open(r#"{"n": "auto"}"#);
        assert_eq!(s.int("n", 42, Bound::None), 42);
        let autos = s.finish().unwrap();
        assert_eq!(autos, vec![("sec.n".to_string(), Json::from(42))]);
    }

    #[test]
    fn all_problems_are_collected_with_paths() {
        let mut s = open(r#"{"n": -1, "b": 2}"#);
        s.int("n", 0, Bound::Gt(0.0));
        s.bool("b", false);
        let err = s.finish().unwrap_err();
        assert_eq!(err.paths(), ["sec.n", "sec.b"]);
    }

    #[test]
    fn non_object_section_is_rejected() {
        let err = Section::open("fp16", &Value::Bool(true)).err().unwrap();
        assert_eq!(err.path(), Some("fp16"));
    }
}
