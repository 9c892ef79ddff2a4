//! Whole-model weights as safetensors under the logical parameter names (the peer
//! benchmark's `--save-init` / `--init` files, readable by candle and Python).

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::{tensor::TensorView, Dtype, SafeTensors};

use super::ParamSpec;
use crate::{EngineError, Result};

/// Writes `values[i]` (f32, row-major) under `specs[i]`'s name and shape.
pub fn save(path: &Path, specs: &[ParamSpec], values: &[Vec<f32>]) -> Result<()> {
    let tensors: Vec<(&str, &[usize], &[f32])> = specs
        .iter()
        .zip(values)
        .map(|(s, v)| (s.name.as_str(), s.shape.as_slice(), v.as_slice()))
        .collect();
    save_as(path, &tensors, false)
}

/// Writes (name, shape, values) tensors, as bf16 when `bf16` (round to nearest even) else f32.
pub fn save_as(path: &Path, tensors: &[(&str, &[usize], &[f32])], bf16: bool) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| match bf16 {
            true => v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
            false => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        })
        .collect();
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view = TensorView::new(dtype, shape.to_vec(), b)
                .map_err(|e| EngineError::file(path, format!("{name}: {e}")))?;
            Ok((name.to_string(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| EngineError::file(path, e))
}

/// Reads one f32 vector per spec, in the specs' order. Every spec must be in the file with
/// its shape; names the file does not declare are an error too (a different model).
pub fn load(path: &Path, specs: &[ParamSpec]) -> Result<Vec<Vec<f32>>> {
    let data = std::fs::read(path).map_err(|e| EngineError::file(path, e))?;
    let st = SafeTensors::deserialize(&data).map_err(|e| EngineError::file(path, e))?;
    let tensors: HashMap<String, TensorView> = st.tensors().into_iter().collect();
    if let Some(extra) = tensors
        .keys()
        .find(|k| !specs.iter().any(|s| &s.name == *k))
    {
        return Err(EngineError::file(
            path,
            format!("tensor '{extra}' is not a parameter of this model"),
        ));
    }
    specs
        .iter()
        .map(|s| {
            let t = tensors.get(&s.name).ok_or_else(|| {
                EngineError::file(path, format!("parameter '{}' is missing", s.name))
            })?;
            if t.shape() != s.shape.as_slice() {
                return Err(EngineError::file(
                    path,
                    format!(
                        "'{}' has shape {:?}, the model expects {:?}",
                        s.name,
                        t.shape(),
                        s.shape
                    ),
                ));
            }
            to_f32(t).map_err(|e| EngineError::file(path, format!("'{}': {e}", s.name)))
        })
        .collect()
}

fn to_f32(t: &TensorView) -> std::result::Result<Vec<f32>, String> {
    let b = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "dtype {other:?} is not a float type ds-rs reads (F32, BF16, F16)"
            ))
        }
    })
}
