//! The batch-size rule: train_batch_size = micro_batch * gradient_accumulation * dp, filled and
//! checked exactly as DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion` do,
//! including Python's arithmetic (floor division; a float stays a float).

use std::fmt;

use crate::error::{ConfigError, Result};
use crate::value::{py_float_repr, Dict, Value};

pub const TRAIN_BATCH_SIZE: &str = "train_batch_size";
pub const MICRO_BATCH: &str = "train_micro_batch_size_per_gpu";
pub const GRAD_ACCUM: &str = "gradient_accumulation_steps";

/// A Python number: DeepSpeed does its batch arithmetic on whatever the JSON held.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PyNum {
    /// A JSON bool: an int in arithmetic, but reported as given when left untouched.
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl PyNum {
    fn f(self) -> f64 {
        match self {
            PyNum::Bool(b) => f64::from(u8::from(b)),
            PyNum::Int(i) => i as f64,
            PyNum::Float(x) => x,
        }
    }

    fn int(self) -> PyNum {
        match self {
            PyNum::Bool(b) => PyNum::Int(i64::from(b)),
            other => other,
        }
    }

    fn floordiv(self, rhs: PyNum, what: &str) -> Result<PyNum> {
        let (lhs, rhs) = (self.int(), rhs.int());
        if rhs.f() == 0.0 {
            return Err(ConfigError::conflict(
                what,
                "division by zero while deriving the batch triad",
            ));
        }
        Ok(match (lhs, rhs) {
            (PyNum::Int(a), PyNum::Int(b)) => {
                let q = a / b;
                PyNum::Int(if a % b != 0 && ((a < 0) != (b < 0)) {
                    q - 1
                } else {
                    q
                })
            }
            (a, b) => PyNum::Float((a.f() / b.f()).floor()),
        })
    }

    fn mul(self, rhs: PyNum) -> PyNum {
        match (self.int(), rhs.int()) {
            (PyNum::Int(a), PyNum::Int(b)) => a
                .checked_mul(b)
                .map_or(PyNum::Float(a as f64 * b as f64), PyNum::Int),
            (a, b) => PyNum::Float(a.f() * b.f()),
        }
    }

    pub fn as_i64(self) -> Option<i64> {
        match self {
            PyNum::Bool(b) => Some(i64::from(b)),
            PyNum::Int(i) => Some(i),
            PyNum::Float(x) if x.fract() == 0.0 && x.abs() < 9.0e18 => Some(x as i64),
            PyNum::Float(_) => None,
        }
    }

    pub fn to_json(self) -> serde_json::Value {
        match self {
            PyNum::Bool(b) => b.into(),
            PyNum::Int(i) => i.into(),
            PyNum::Float(x) => {
                serde_json::Number::from_f64(x).map_or(serde_json::Value::Null, Into::into)
            }
        }
    }
}

impl serde::Serialize for PyNum {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl fmt::Display for PyNum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PyNum::Bool(b) => write!(f, "{}", if *b { "True" } else { "False" }),
            PyNum::Int(i) => write!(f, "{i}"),
            PyNum::Float(x) => write!(f, "{}", py_float_repr(*x)),
        }
    }
}

/// The three batch values after filling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchTriad {
    pub train_batch_size: PyNum,
    pub micro_batch: PyNum,
    pub grad_accum: PyNum,
}

/// One batch key as given: absent/null, or a value that must be a number.
fn read_key(root: &Dict, key: &str) -> Option<Value> {
    root.get(key).filter(|v| **v != Value::Null).cloned()
}

fn as_num(key: &str, v: &Value) -> Result<PyNum> {
    match v {
        Value::Bool(b) => Ok(PyNum::Bool(*b)),
        Value::Int(i) => Ok(PyNum::Int(*i)),
        Value::Float(x) => Ok(PyNum::Float(*x)),
        v if v.is_auto() => Err(ConfigError::invalid(
            key,
            v,
            "a number: \"auto\" is filled only by a training command that knows the batch \
             (`ds-rs train --micro-batch ... --grad-accum ...`); `config check` cannot derive it",
        )),
        other => Err(ConfigError::invalid(key, other, "a positive integer")),
    }
}

/// Fills the missing members of the triad and checks the rule, for data-parallel size `dp`.
pub fn resolve(root: &Dict, dp: PyNum) -> Result<BatchTriad> {
    let tbs = read_key(root, TRAIN_BATCH_SIZE);
    let mbs = read_key(root, MICRO_BATCH);
    let gas = read_key(root, GRAD_ACCUM);
    if tbs.is_none() && mbs.is_none() {
        return Err(ConfigError::conflict(
            TRAIN_BATCH_SIZE,
            format!("either {TRAIN_BATCH_SIZE} or {MICRO_BATCH} needs to be provided"),
        ));
    }
    let num = |key: &str, v: &Option<Value>| v.as_ref().map(|v| as_num(key, v)).transpose();
    let (tbs, mbs, gas) = (
        num(TRAIN_BATCH_SIZE, &tbs)?,
        num(MICRO_BATCH, &mbs)?,
        num(GRAD_ACCUM, &gas)?,
    );
    let triad = fill(tbs, mbs, gas, dp)?;
    check(&triad, dp)?;
    Ok(triad)
}

fn fill(
    tbs: Option<PyNum>,
    mbs: Option<PyNum>,
    gas: Option<PyNum>,
    dp: PyNum,
) -> Result<BatchTriad> {
    let one = PyNum::Int(1);
    let (t, m, g) = match (tbs, mbs, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => (t, m, t.floordiv(m, MICRO_BATCH)?.floordiv(dp, GRAD_ACCUM)?),
        (Some(t), None, Some(g)) => (t, t.floordiv(dp, MICRO_BATCH)?.floordiv(g, GRAD_ACCUM)?, g),
        (None, Some(m), Some(g)) => (m.mul(g).mul(dp), m, g),
        (Some(t), None, None) => (t, t.floordiv(dp, MICRO_BATCH)?, one),
        (None, Some(m), None) => (m.mul(dp), m, one),
        (None, None, _) => unreachable!("invariant: checked by resolve"),
    };
    Ok(BatchTriad {
        train_batch_size: t,
        micro_batch: m,
        grad_accum: g,
    })
}

fn check(b: &BatchTriad, dp: PyNum) -> Result<()> {
    for (key, v) in [
        (TRAIN_BATCH_SIZE, b.train_batch_size),
        (MICRO_BATCH, b.micro_batch),
        (GRAD_ACCUM, b.grad_accum),
    ] {
        if v.f() <= 0.0 {
            return Err(ConfigError::invalid(
                key,
                v,
                "a value greater than 0 (after filling the batch triad)",
            ));
        }
    }
    let product = b.micro_batch.mul(b.grad_accum).mul(dp);
    if b.train_batch_size.f() != product.f() {
        return Err(ConfigError::conflict(
            TRAIN_BATCH_SIZE,
            format!(
                "train_batch_size must equal micro_batch_per_gpu * gradient_accumulation_steps * \
                 data_parallel_size: {} != {} * {} * {}",
                b.train_batch_size, b.micro_batch, b.grad_accum, dp
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    fn triad(text: &str, dp: i64) -> Result<(PyNum, PyNum, PyNum)> {
        let root = hjson::parse(text).unwrap();
        let b = resolve(root.as_dict().unwrap(), PyNum::Int(dp))?;
        Ok((b.train_batch_size, b.micro_batch, b.grad_accum))
    }

    use PyNum::{Float as F, Int as I};

    // Expected values follow DeepSpeed's _set_batch_related_parameters (config.py), worked by hand.
    #[test]
    fn fills_missing_values_like_deepspeed() {
        assert_eq!(
            triad(
                r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}"#,
                2
            )
            .unwrap(),
            (I(32), I(4), I(4))
        );
        assert_eq!(
            triad(
                r#"{"train_batch_size": 32, "gradient_accumulation_steps": 2}"#,
                4
            )
            .unwrap(),
            (I(32), I(4), I(2))
        );
        assert_eq!(
            triad(
                r#"{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}"#,
                2
            )
            .unwrap(),
            (I(30), I(3), I(5))
        );
        assert_eq!(
            triad(r#"{"train_batch_size": 16}"#, 8).unwrap(),
            (I(16), I(2), I(1))
        );
        assert_eq!(
            triad(r#"{"train_micro_batch_size_per_gpu": 2}"#, 8).unwrap(),
            (I(16), I(2), I(1))
        );
        // hjson reads 16.0 as the int 16 but keeps 2e10 a float; Python's // then keeps floats.
        let t = r#"{"train_batch_size": 16.0, "train_micro_batch_size_per_gpu": 2}"#;
        assert_eq!(triad(t, 1).unwrap(), (I(16), I(2), I(8)));
        let t = r#"{"train_batch_size": 2e10, "train_micro_batch_size_per_gpu": 2}"#;
        assert_eq!(triad(t, 1).unwrap(), (F(2e10), I(2), F(1e10)));
    }

    #[test]
    fn deepspeed_error_cases_name_the_key() {
        for (text, dp, path) in [
            (r#"{}"#, 1, TRAIN_BATCH_SIZE),
            (r#"{"gradient_accumulation_steps": 4}"#, 1, TRAIN_BATCH_SIZE),
            (
                r#"{"train_batch_size": 24, "train_micro_batch_size_per_gpu": 24}"#,
                2,
                GRAD_ACCUM,
            ),
            (r#"{"train_batch_size": 1}"#, 2, MICRO_BATCH),
            (
                r#"{"train_batch_size": 128, "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1}"#,
                1,
                TRAIN_BATCH_SIZE,
            ),
            (r#"{"train_batch_size": -8}"#, 1, TRAIN_BATCH_SIZE),
            (
                r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}"#,
                1,
                TRAIN_BATCH_SIZE,
            ),
            (
                r#"{"train_micro_batch_size_per_gpu": 0, "train_batch_size": 8}"#,
                1,
                MICRO_BATCH,
            ),
            (r#"{"train_micro_batch_size_per_gpu": [2]}"#, 1, MICRO_BATCH),
        ] {
            let err = triad(text, dp).unwrap_err();
            assert_eq!(err.path(), Some(path), "{text} at dp={dp}: {err}");
        }
    }

    #[test]
    fn python_floor_division() {
        assert_eq!(
            PyNum::Int(-7).floordiv(PyNum::Int(2), "x").unwrap(),
            PyNum::Int(-4)
        );
        assert_eq!(
            PyNum::Int(7).floordiv(PyNum::Int(-2), "x").unwrap(),
            PyNum::Int(-4)
        );
        assert_eq!(
            PyNum::Float(7.0).floordiv(PyNum::Int(2), "x").unwrap(),
            PyNum::Float(3.0)
        );
    }
}
