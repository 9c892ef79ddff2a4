//! Whole-model weights as safetensors under the logical parameter names (the peer
//! benchmark's `--save-init` / `--init` files, readable by candle and Python).

use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
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

/// A weights file opened for reading parts of parameters: memory-mapped, so a rank that reads
/// only the ranges it owns touches only their pages (ZeRO-3's sharded initialisation).
pub struct WeightsFile {
    path: PathBuf,
    map: Mmap,
    /// Per spec, in the specs' order: its dtype and its data's first byte in the file.
    params: Vec<(Dtype, usize)>,
}

impl WeightsFile {
    /// Opens `path` for the parameters `specs` (a pipeline stage's, or all) and checks it holds
    /// them (names and shapes) in a float dtype; a name the whole `model` does not declare is
    /// an error too (a different model).
    pub fn open(path: &Path, specs: &[ParamSpec], model: &[ParamSpec]) -> Result<WeightsFile> {
        let file = File::open(path).map_err(|e| EngineError::file(path, e))?;
        // Safety: the file is only read; a writer changing it meanwhile is the user's race,
        // as with any reader of a file being rewritten.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::file(path, e))?;
        let (header_len, meta) =
            SafeTensors::read_metadata(&map).map_err(|e| EngineError::file(path, e))?;
        let tensors = meta.tensors();
        if let Some(extra) = tensors
            .keys()
            .find(|k| !model.iter().any(|s| &s.name == *k))
        {
            return Err(EngineError::file(
                path,
                format!("tensor '{extra}' is not a parameter of this model"),
            ));
        }
        let data_start = 8 + header_len;
        let params = specs
            .iter()
            .map(|s| {
                let t = tensors.get(&s.name).ok_or_else(|| {
                    EngineError::file(path, format!("parameter '{}' is missing", s.name))
                })?;
                if t.shape != s.shape {
                    return Err(EngineError::file(
                        path,
                        format!(
                            "'{}' has shape {:?}, the model expects {:?}",
                            s.name, t.shape, s.shape
                        ),
                    ));
                }
                float_width(t.dtype)
                    .map_err(|e| EngineError::file(path, format!("'{}': {e}", s.name)))?;
                Ok((t.dtype, data_start + t.data_offsets.0))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(WeightsFile {
            path: path.to_path_buf(),
            map,
            params,
        })
    }

    /// Elements `start..start + dst.len()` of the `i`-th spec's values, as f32.
    pub fn read(&self, i: usize, start: usize, dst: &mut [f32]) -> Result<()> {
        let (dtype, at) = self.params[i];
        let width = float_width(dtype).map_err(|e| EngineError::file(&self.path, e))?;
        let bytes = &self.map[at + start * width..at + (start + dst.len()) * width];
        match dtype {
            Dtype::F32 => dst
                .iter_mut()
                .zip(bytes.chunks_exact(4))
                .for_each(|(d, c)| *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            Dtype::BF16 => dst
                .iter_mut()
                .zip(bytes.chunks_exact(2))
                .for_each(|(d, c)| *d = bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            _ => dst
                .iter_mut()
                .zip(bytes.chunks_exact(2))
                .for_each(|(d, c)| *d = f16::from_le_bytes([c[0], c[1]]).to_f32()),
        }
        Ok(())
    }
}

/// Bytes per element of the float dtypes ds-rs reads.
fn float_width(dtype: Dtype) -> std::result::Result<usize, String> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::BF16 | Dtype::F16 => Ok(2),
        other => Err(format!(
            "dtype {other:?} is not a float type ds-rs reads (F32, BF16, F16)"
        )),
    }
}
