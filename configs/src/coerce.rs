//! pydantic v2's lax-mode conversions, which DeepSpeed's typed sections apply to JSON values.
//!
//! Each function takes a value and returns the converted value or a description of what was
//! expected. The accepted forms were measured on pydantic 2.14 (the version DeepSpeed 0.19.8 was
//! run with): e.g. a bool field takes `1`, `0.0`, `"yes"` and `"off"` but not `2` or `" true"`;
//! an int field takes `5.0`, `"5"`, `" 5 "`, `"5.0"` and `true` but not `5.5` or `"5e8"`.

use crate::value::Value;

const TRUE_STRINGS: [&str; 6] = ["1", "on", "t", "true", "y", "yes"];
const FALSE_STRINGS: [&str; 6] = ["0", "off", "f", "false", "n", "no"];

pub fn to_bool(v: &Value) -> Result<bool, &'static str> {
    const EXPECTED: &str = "a boolean (true/false, 0/1, \"yes\"/\"no\", \"on\"/\"off\")";
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        Value::Float(f) if *f == 0.0 => Ok(false),
        Value::Float(f) if *f == 1.0 => Ok(true),
        Value::Str(s) => {
            let l = s.to_lowercase();
            if TRUE_STRINGS.contains(&l.as_str()) {
                Ok(true)
            } else if FALSE_STRINGS.contains(&l.as_str()) {
                Ok(false)
            } else {
                Err(EXPECTED)
            }
        }
        _ => Err(EXPECTED),
    }
}

pub fn to_int(v: &Value) -> Result<i64, &'static str> {
    const EXPECTED: &str = "an integer";
    match v {
        Value::Bool(b) => Ok(i64::from(*b)),
        Value::Int(i) => Ok(*i),
        Value::Float(f) => float_to_int(*f),
        Value::Str(s) => str_to_int(s).ok_or(EXPECTED),
        _ => Err(EXPECTED),
    }
}

fn float_to_int(f: f64) -> Result<i64, &'static str> {
    if !f.is_finite() || f.fract() != 0.0 {
        return Err("an integer (a number without fractional part)");
    }
    // i64::MAX as f64 rounds up to 2^63, so the bound is exclusive.
    if f.abs() >= 9.223_372_036_854_776e18 {
        return Err("an integer that fits in 64 bits");
    }
    Ok(f as i64)
}

/// Python's `int(str)` as pydantic applies it: surrounding whitespace, single underscores
/// between digits, and a fractional part of zeros (`"5.0"`) are accepted.
fn str_to_int(s: &str) -> Option<i64> {
    let t = s.trim();
    let (int_part, frac) = match t.split_once('.') {
        Some((i, f)) if !f.is_empty() && f.bytes().all(|b| b == b'0') => (i, true),
        Some(_) => return None,
        None => (t, false),
    };
    let digits = int_part.strip_prefix(['+', '-']).unwrap_or(int_part);
    let valid = !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    if !valid || (frac && digits.contains('_')) {
        return None;
    }
    int_part.replace('_', "").parse().ok()
}

pub fn to_float(v: &Value) -> Result<f64, &'static str> {
    const EXPECTED: &str = "a number";
    match v {
        Value::Bool(b) => Ok(f64::from(u8::from(*b))),
        Value::Int(i) => Ok(*i as f64),
        Value::Float(f) => Ok(*f),
        Value::Str(s) => s.trim().replace('_', "").parse().map_err(|_| EXPECTED),
        _ => Err(EXPECTED),
    }
}

pub fn to_str(v: &Value) -> Result<String, &'static str> {
    match v {
        Value::Str(s) => Ok(s.clone()),
        _ => Err("a string"),
    }
}

/// A bound on a number, checked after conversion (pydantic's `ge`, `gt`, `le`).
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    None,
    Ge(f64),
    Gt(f64),
    Range(f64, f64),
    OpenRange(f64, f64),
}

impl Bound {
    pub fn check(self, x: f64) -> Result<(), String> {
        let ok = match self {
            Bound::None => true,
            Bound::Ge(lo) => x >= lo,
            Bound::Gt(lo) => x > lo,
            Bound::Range(lo, hi) => x >= lo && x <= hi,
            Bound::OpenRange(lo, hi) => x > lo && x < hi,
        };
        if ok {
            Ok(())
        } else {
            Err(self.describe())
        }
    }

    fn describe(self) -> String {
        match self {
            Bound::None => "any number".into(),
            Bound::Ge(lo) => format!("a number >= {lo}"),
            Bound::Gt(lo) => format!("a number > {lo}"),
            Bound::Range(lo, hi) => format!("a number in [{lo}, {hi}]"),
            Bound::OpenRange(lo, hi) => format!("a number in ({lo}, {hi})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Value::*;

    // The expectations below are what pydantic 2.14 answered for a `bool` / `int` / `float`
    // field given the same inputs (see the module comment).
    #[test]
    fn bool_accepts_pydantic_forms() {
        for (v, want) in [
            (Bool(true), true),
            (Int(0), false),
            (Int(1), true),
            (Float(1.0), true),
            (Str("TRUE".into()), true),
            (Str("off".into()), false),
            (Str("y".into()), true),
            (Str("0".into()), false),
        ] {
            assert_eq!(to_bool(&v), Ok(want), "{v}");
        }
        for v in [
            Int(2),
            Float(1.5),
            Str("maybe".into()),
            Str(" true".into()),
            Str(String::new()),
            Null,
        ] {
            assert!(to_bool(&v).is_err(), "{v} should be rejected");
        }
    }

    #[test]
    fn int_accepts_pydantic_forms() {
        for (v, want) in [
            (Int(5), 5),
            (Float(5.0), 5),
            (Str("5".into()), 5),
            (Str(" 5 ".into()), 5),
            (Str("5.0".into()), 5),
            (Str("1_000".into()), 1000),
            (Str("-3".into()), -3),
            (Bool(true), 1),
        ] {
            assert_eq!(to_int(&v), Ok(want), "{v}");
        }
        for v in [
            Float(5.5),
            Str("5e8".into()),
            Str("abc".into()),
            Str("0x10".into()),
            Float(1e20),
            Null,
        ] {
            assert!(to_int(&v).is_err(), "{v} should be rejected");
        }
    }

    #[test]
    fn float_and_bounds() {
        assert_eq!(to_float(&Str("1e-1".into())), Ok(0.1));
        assert_eq!(to_float(&Bool(true)), Ok(1.0));
        assert!(to_float(&Null).is_err());
        assert!(Bound::Range(0.0, 1.0).check(2.0).is_err());
        assert!(Bound::Gt(0.0).check(0.0).is_err());
        assert!(Bound::Ge(0.0).check(0.0).is_ok());
        assert!(Bound::Range(0.0, 1.0).check(f64::NAN).is_err());
    }
}
