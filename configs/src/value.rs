//! The parsed document, with Python's value model.
//!
//! DeepSpeed reads a config into Python objects and then inspects them with Python's rules
//! (`int` vs `float`, truthiness, `==`), so ds-rs keeps the same distinctions: an integer and a
//! float are different values, and an object keeps its key order (pydantic reports errors in
//! that order).

use std::fmt;

/// One value of a ds_config document.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Value>),
    Dict(Dict),
}

/// A JSON object: keys in file order, each key at most once (the reader rejects duplicates).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Dict(pub Vec<(String, Value)>);

impl Dict {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sets `key`, replacing an existing value in place or appending.
    pub fn insert(&mut self, key: &str, value: Value) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.0.push((key.to_string(), value)),
        }
    }

    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let at = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.remove(at).1)
    }
}

impl Value {
    /// Python's type name, as DeepSpeed's error messages print it.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "NoneType",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
        }
    }

    pub fn as_dict(&self) -> Option<&Dict> {
        match self {
            Value::Dict(d) => Some(d),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// `value == "auto"`: the HF Trainer placeholder.
    pub fn is_auto(&self) -> bool {
        self.as_str() == Some("auto")
    }

    /// Python truthiness (`bool(value)`).
    pub fn truthy(&self) -> bool {
        match self {
            Value::Null => false,
            Value::Bool(b) => *b,
            Value::Int(i) => *i != 0,
            Value::Float(f) => *f != 0.0,
            Value::Str(s) => !s.is_empty(),
            Value::List(l) => !l.is_empty(),
            Value::Dict(d) => !d.is_empty(),
        }
    }

    /// The value as a number (bool counts, as in Python arithmetic), if it is one.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Bool(b) => Some(f64::from(u8::from(*b))),
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The JSON form used in `config check --json` (ints stay ints, floats stay floats).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Null => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            Value::Float(f) => serde_json::Number::from_f64(*f)
                .map(J::Number)
                .unwrap_or_else(|| J::String(py_float_repr(*f))),
            Value::Str(s) => J::String(s.clone()),
            Value::List(l) => J::Array(l.iter().map(Value::to_json).collect()),
            Value::Dict(d) => J::Object(
                d.iter()
                    .map(|(k, v)| (k.to_string(), v.to_json()))
                    .collect(),
            ),
        }
    }
}

/// Python's `repr` of a float (`1.0`, `5e-05`, `inf`, `nan`).
pub fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Python switches to exponent form outside [1e-4, 1e16); mantissa as short as possible.
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').expect("invariant: {:e} has an exponent");
        let exp: i32 = exp.parse().expect("invariant: exponent is an integer");
        return format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        );
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// Python's `repr` of a value, as it appears in DeepSpeed's and pydantic's messages.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => write!(f, "None"),
            Value::Bool(b) => write!(f, "{}", if *b { "True" } else { "False" }),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{}", py_float_repr(*x)),
            Value::Str(s) => write!(f, "'{s}'"),
            Value::List(items) => {
                write!(f, "[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{item}")?;
                }
                write!(f, "]")
            }
            Value::Dict(d) => {
                write!(f, "{{")?;
                for (i, (k, v)) in d.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "'{k}': {v}")?;
                }
                write!(f, "}}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        // Expected strings are Python 3.11's repr() of the same floats.
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (5e-5, "5e-05"),
            (3e-4, "0.0003"),
            (1e16, "1e+16"),
            (123456789.0, "123456789.0"),
            (-2.5, "-2.5"),
            (f64::INFINITY, "inf"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "repr({x})");
        }
    }

    #[test]
    fn dict_insert_replaces_in_place() {
        let mut d = Dict::default();
        d.insert("a", Value::Int(1));
        d.insert("b", Value::Int(2));
        d.insert("a", Value::Int(3));
        assert_eq!(d.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(d.get("a"), Some(&Value::Int(3)));
    }
}
