//! Rotary position embeddings in Hugging Face's convention: the head's two halves rotate
//! together (`rotate_half`), frequencies from `rope_theta`, optionally rescaled (`linear`,
//! `llama3`); the arithmetic is float32 as in transformers' `_compute_*_parameters`.

use candle_core::{DType, Device, Result, Tensor, D};
use serde_json::{Map, Value};

/// How the inverse frequencies are rescaled for contexts longer than the pre-training one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scaling {
    /// The original RoPE.
    Default,
    /// Every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth blend
    /// between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: Scaling,
}

impl Rope {
    /// transformers' default base.
    pub const DEFAULT_THETA: f64 = 10_000.0;

    /// From config.json in either spelling: transformers 5's `rope_parameters` or transformers
    /// 4's top-level `rope_theta` with `rope_scaling` (whose type key was `type`, then
    /// `rope_type`). `default_theta` is the family's base where neither gives one.
    pub fn from_hf(
        o: &Map<String, Value>,
        max_position_embeddings: usize,
        default_theta: f64,
    ) -> Result2<Rope> {
        let params = ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|k| o.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)));
        let empty = Map::new();
        let (section, p) = match params {
            Some((k, v)) => (
                k,
                v.as_object()
                    .ok_or_else(|| format!("`{k}` must be an object, got {v}"))?,
            ),
            None => ("rope_parameters", &empty),
        };
        let num = |key: &str| -> Result2<Option<f64>> {
            match p
                .get(key)
                .or_else(|| (key == "rope_theta").then(|| o.get(key)).flatten())
            {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| format!("`{section}.{key}` must be a number, got {v}")),
            }
        };
        let need = |key: &str| -> Result2<f64> {
            num(key)?.ok_or_else(|| format!("`{section}.{key}` is required by this rope type"))
        };
        let theta = num("rope_theta")?.unwrap_or(default_theta);
        // transformers reads it beside the RoPE parameters or at the top level
        let partial = match p
            .get("partial_rotary_factor")
            .or_else(|| o.get("partial_rotary_factor"))
        {
            None | Some(Value::Null) => 1.0,
            Some(v) => v.as_f64().unwrap_or(f64::NAN),
        };
        if partial != 1.0 {
            return Err(format!(
                "`partial_rotary_factor` {partial}: ds-rs rotates the whole head (1.0 only)"
            ));
        }
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let scaling = match kind {
            "default" => Scaling::Default,
            "linear" => Scaling::Linear {
                factor: need("factor")?,
            },
            "llama3" => Scaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?
                    .map_or(max_position_embeddings, |v| v as usize),
            },
            other => {
                return Err(format!(
                    "`{section}.rope_type` \"{other}\" is not supported (default, linear, llama3)"
                ))
            }
        };
        if theta.is_nan() || theta <= 0.0 {
            return Err(format!("`rope_theta` must be positive, got {theta}"));
        }
        Ok(Rope { theta, scaling })
    }

    /// transformers 5's `rope_parameters` object.
    pub fn to_hf_json(&self) -> Value {
        let mut v = serde_json::json!({"rope_theta": self.theta});
        match self.scaling {
            Scaling::Default => v["rope_type"] = "default".into(),
            Scaling::Linear { factor } => {
                v["rope_type"] = "linear".into();
                v["factor"] = factor.into();
            }
            Scaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                v["rope_type"] = "llama3".into();
                v["factor"] = factor.into();
                v["low_freq_factor"] = low_freq_factor.into();
                v["high_freq_factor"] = high_freq_factor.into();
                v["original_max_position_embeddings"] = original_max_position_embeddings.into();
            }
        }
        v
    }

    /// The inverse frequencies of a head of `dim` (dim / 2 of them), in f32 as transformers
    /// computes them.
    pub fn inv_freq(&self, dim: usize) -> Vec<f32> {
        let base: Vec<f32> = (0..dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                1.0 / (self.theta.powf(exponent as f64) as f32)
            })
            .collect();
        match self.scaling {
            Scaling::Default => base,
            Scaling::Linear { factor } => base.iter().map(|f| f / factor as f32).collect(),
            Scaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                );
                let old = original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if !medium {
                            return scaled;
                        }
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    })
                    .collect()
            }
        }
    }

    /// cos and sin [len, dim] of positions `start..start + len` (the halves repeated, as
    /// transformers' `cat((freqs, freqs))`), in `dtype` on `device`: made once, then the same
    /// tensors for every layer's forward and backward (Note [rope tables]).
    pub fn tables(
        &self,
        dim: usize,
        start: usize,
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let key = TableKey {
            rope: *self,
            dim,
            start,
            len,
            dtype,
        };
        let same = |(k, d, _): &&KeptTables| *k == key && d.same_device(device);
        let mut kept = TABLES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, t)) = kept.iter().find(same) {
            return Ok(t.clone());
        }
        let t = key.compute(device)?;
        if kept.len() == KEPT_TABLES {
            kept.remove(0);
        }
        kept.push((key, device.clone(), t.clone()));
        Ok(t)
    }
}

// Note [rope tables]: every layer's forward and backward takes cos and sin of the same
// positions. Computed on the host each time, they were 131k f64 cos and sin a call at T 1024
// and head size 64 (3 ms on this project's 2-core machine, 50 ms at T 8192 and head size 128),
// then a copy to the device: for Llama 3.2 1B's 16 layers about 100 ms of host time a
// micro-step, more than the GPU's whole micro-step at micro-batch 4. Kept, they are made once
// per shape, dtype and device; the newest few are kept (one in a run of fixed length).
const KEPT_TABLES: usize = 8;

/// What a pair of tables is made for (and the device beside it in `TABLES`).
#[derive(Clone, Copy, PartialEq)]
struct TableKey {
    rope: Rope,
    dim: usize,
    start: usize,
    len: usize,
    dtype: DType,
}

impl TableKey {
    /// The tables on `device`: the angles in f32 as transformers has them, cos and sin in f64.
    fn compute(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let TableKey {
            dim,
            start,
            len,
            dtype,
            ..
        } = *self;
        let inv = self.rope.inv_freq(dim);
        let (mut cos, mut sin) = (Vec::with_capacity(len * dim), Vec::with_capacity(len * dim));
        for p in start..start + len {
            let angles: Vec<f32> = inv.iter().map(|f| p as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| (*a as f64).cos() as f32));
                sin.extend(angles.iter().map(|a| (*a as f64).sin() as f32));
            }
        }
        let t = |v| Tensor::from_vec(v, (len, dim), device)?.to_dtype(dtype);
        Ok((t(cos)?, t(sin)?))
    }
}

/// A pair of tables kept: what it was made for, its device, cos and sin.
type KeptTables = (TableKey, Device, (Tensor, Tensor));

/// The tables made so far, oldest first.
static TABLES: std::sync::Mutex<Vec<KeptTables>> = std::sync::Mutex::new(Vec::new());

type Result2<T> = std::result::Result<T, String>;

/// `[-x2, x1]` of the halves of the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// The transpose of `rotate_half`: `[g2, -g1]`.
fn rotate_half_t(g: &Tensor) -> Result<Tensor> {
    let half = g.dim(D::Minus1)? / 2;
    let g1 = g.narrow(D::Minus1, 0, half)?;
    let g2 = g.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&g2, &g1.neg()?], D::Minus1)
}

/// `x cos + rotate_half(x) sin` for x [B, H, T, hd] and tables [T, hd].
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if let Some(fused) = ds_nn::kernels::rotary::apply(x, cos, sin)? {
        return Ok(fused);
    }
    x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?
}

/// The gradient of `apply`'s input from its output's `dy`.
pub fn apply_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if let Some(fused) = ds_nn::kernels::rotary::apply_backward(dy, cos, sin)? {
        return Ok(fused);
    }
    dy.broadcast_mul(cos)? + rotate_half_t(&dy.broadcast_mul(sin)?)?
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROPE: Rope = Rope {
        theta: 500_000.0,
        scaling: Scaling::Default,
    };

    #[test]
    fn tables_are_made_once_per_shape_and_hold_the_angles() {
        let cpu = Device::Cpu;
        let (cos, sin) = ROPE.tables(8, 3, 5, DType::F32, &cpu).unwrap();
        let (again, _) = ROPE.tables(8, 3, 5, DType::F32, &cpu).unwrap();
        assert_eq!(
            cos.id(),
            again.id(),
            "the second call made the tables again"
        );
        // any other shape, start or dtype is a table of its own
        for (dim, start, len, dtype) in [
            (8, 0, 5, DType::F32),
            (8, 3, 6, DType::F32),
            (4, 3, 5, DType::F32),
            (8, 3, 5, DType::F64),
        ] {
            let (other, _) = ROPE.tables(dim, start, len, dtype, &cpu).unwrap();
            assert_ne!(other.id(), cos.id());
            assert_eq!(other.dims(), [len, dim]);
            assert_eq!(other.dtype(), dtype);
        }
        // position 3 + p, frequency i: theta^(-2i/8), both halves alike
        let (cos, sin) = (cos.to_vec2::<f32>().unwrap(), sin.to_vec2::<f32>().unwrap());
        for (p, (c, s)) in cos.iter().zip(&sin).enumerate() {
            for i in 0..4 {
                let angle = (3 + p) as f64 * ROPE.theta.powf(-((2 * i) as f64) / 8.0);
                for half in [i, i + 4] {
                    assert!(
                        (c[half] as f64 - angle.cos()).abs() < 1e-6,
                        "cos p {p} i {i}"
                    );
                    assert!(
                        (s[half] as f64 - angle.sin()).abs() < 1e-6,
                        "sin p {p} i {i}"
                    );
                }
            }
        }
    }
}
