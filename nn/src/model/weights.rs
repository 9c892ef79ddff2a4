//! Whole-model weights as safetensors under the logical parameter names (the peer
//! benchmark's `--save-init` / `--init` files, readable by candle and Python).

use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};

use super::ParamSpec;
use crate::{NnError, Result};

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
                .map_err(|e| NnError::file(path, format!("{name}: {e}")))?;
            Ok((name.to_string(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| NnError::file(path, e))
}

/// Weights opened for reading parts of parameters: memory-mapped, so a rank that reads only
/// the ranges it owns touches only their pages (ZeRO-3's sharded initialisation). One
/// safetensors file, or a Hugging Face model directory: `model.safetensors`, or the shards a
/// `model.safetensors.index.json` names.
pub struct WeightsFile {
    /// Each file and its map.
    files: Vec<(PathBuf, Mmap)>,
    /// Per spec, in the specs' order: where its values are.
    /// Per spec: where its values are; None for an adapter the file does not hold.
    params: Vec<Option<Located>>,
}

/// Where a parameter's values are: its file, dtype and data's first byte in the file, and
/// for a matrix stored transposed its (rows, columns) as the model sees it.
#[derive(Clone, Copy)]
struct Located {
    file: usize,
    dtype: Dtype,
    at: usize,
    transposed: Option<(usize, usize)>,
}

/// Hugging Face's single-file and sharded weights names in a model directory.
pub const HF_WEIGHTS: &str = "model.safetensors";
pub const HF_INDEX: &str = "model.safetensors.index.json";

/// Tensors a Hugging Face checkpoint may hold that are buffers, not parameters (old Llama
/// files' rotary frequencies, GPT-2's causal masks): skipped when reading.
const HF_BUFFERS: [&str; 3] = [".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"];

/// GPT2LMHeadModel's module prefix, which older hub files leave out.
const GPT2_PREFIX: &str = "transformer.";

/// The safetensors files of a weights path: the file itself, or a model directory's.
pub fn weight_files(path: &Path) -> Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let index = path.join(HF_INDEX);
    if index.exists() {
        return index_files(&index);
    }
    let single = path.join(HF_WEIGHTS);
    match single.exists() {
        true => Ok(vec![single]),
        false => Err(NnError::file(
            path,
            format!("holds neither {HF_WEIGHTS} nor {HF_INDEX}"),
        )),
    }
}

/// Whether a model directory holds weights.
pub fn has_weights(dir: &Path) -> bool {
    dir.join(HF_INDEX).exists() || dir.join(HF_WEIGHTS).exists()
}

/// The shard files an index names (`weight_map`: tensor -> file), each once, in order.
fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index).map_err(|e| NnError::file(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| NnError::file(index, e))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| NnError::file(index, "`weight_map` is missing or not an object"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, file) in map {
        let name = file.as_str().ok_or_else(|| {
            NnError::file(index, format!("`weight_map.{tensor}` is not a file name"))
        })?;
        let path = dir.join(name);
        if !path.is_file() {
            return Err(NnError::file(
                index,
                format!("shard '{name}' (holding '{tensor}') is missing"),
            ));
        }
        if !files.contains(&path) {
            files.push(path);
        }
    }
    Ok(files)
}

impl WeightsFile {
    /// Opens `path` (a file or a model directory) for the parameters `specs` (a pipeline
    /// stage's, or all) and checks it holds them (names and shapes) in a float dtype; a
    /// tensor the whole `model` does not declare is an error too (a different model). A
    /// tied parameter missing from the files reads its owner's tensor.
    pub fn open(path: &Path, specs: &[ParamSpec], model: &[ParamSpec]) -> Result<WeightsFile> {
        let mut files = Vec::new();
        // every tensor: (file, its metadata)
        let mut found: std::collections::HashMap<String, (usize, TensorInfo)> = Default::default();
        for (f, file_path) in weight_files(path)?.into_iter().enumerate() {
            let (map, tensors) = map_file(&file_path)?;
            for (name, info) in tensors {
                // GPT-2 hub files name the transformer's tensors without its prefix
                let prefixed = format!("{GPT2_PREFIX}{name}");
                let known = model.iter().any(|s| s.name == name || s.name == prefixed);
                if !known && !HF_BUFFERS.iter().any(|b| name.ends_with(b)) {
                    return Err(NnError::file(
                        &file_path,
                        format!("tensor '{name}' is not a parameter of this model"),
                    ));
                }
                found.insert(name, (f, info));
            }
            files.push((file_path, map));
        }
        let params = specs
            .iter()
            .map(|s| {
                let held = found.contains_key(&s.name) || found.contains_key(s.value_name());
                if s.adapter && !held {
                    return Ok(None);
                }
                let (f, t) = found
                    .get(&s.name)
                    .or_else(|| found.get(s.value_name()))
                    .or_else(|| {
                        // a hub file's bare name, of the parameter or of its tie's owner
                        let bare = |n: &str| n.strip_prefix(GPT2_PREFIX).and_then(|b| found.get(b));
                        bare(&s.name).or_else(|| bare(s.value_name()))
                    })
                    .ok_or_else(|| {
                        NnError::file(path, format!("parameter '{}' is missing", s.name))
                    })?;
                let file = &files[*f].0;
                if t.shape != s.stored_shape() {
                    return Err(NnError::file(
                        file,
                        format!(
                            "'{}' has shape {:?}, the model expects {:?}",
                            s.name,
                            t.shape,
                            s.stored_shape()
                        ),
                    ));
                }
                float_width(t.dtype)
                    .map_err(|e| NnError::file(file, format!("'{}': {e}", s.name)))?;
                let transposed =
                    (s.stored_transposed && s.shape.len() == 2).then(|| (s.shape[0], s.shape[1]));
                Ok(Some(Located {
                    file: *f,
                    dtype: t.dtype,
                    at: t.at,
                    transposed,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(WeightsFile { files, params })
    }

    /// Whether the file holds the `i`-th spec (an adapter may be missing).
    pub fn holds(&self, i: usize) -> bool {
        self.params[i].is_some()
    }

    /// Elements `start..start + dst.len()` of the `i`-th spec's values, as f32.
    pub fn read(&self, i: usize, start: usize, dst: &mut [f32]) -> Result<()> {
        let Some(Located {
            file,
            dtype,
            at,
            transposed,
        }) = self.params[i]
        else {
            return Err(NnError::Invalid(format!(
                "parameter {i} is not in the weights file (an adapter): start it from its initialiser"
            )));
        };
        let (path, map) = &self.files[file];
        let width = float_width(dtype).map_err(|e| NnError::file(path, e))?;
        if let Some((rows, cols)) = transposed {
            // element (r, c) of the model's matrix is the file's (c, r)
            for (k, d) in dst.iter_mut().enumerate() {
                let (r, c) = ((start + k) / cols, (start + k) % cols);
                let b = at + (c * rows + r) * width;
                *d = decode(dtype, &map[b..b + width]);
            }
            return Ok(());
        }
        let bytes = &map[at + start * width..at + (start + dst.len()) * width];
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

/// One element of a float dtype ds-rs reads, as f32.
fn decode(dtype: Dtype, b: &[u8]) -> f32 {
    match dtype {
        Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        Dtype::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => f16::from_le_bytes([b[0], b[1]]).to_f32(),
    }
}

/// A tensor's shape, dtype and first byte in its file.
struct TensorInfo {
    shape: Vec<usize>,
    dtype: Dtype,
    at: usize,
}

/// Maps a safetensors file and lists its tensors.
fn map_file(path: &Path) -> Result<(Mmap, Vec<(String, TensorInfo)>)> {
    let file = File::open(path).map_err(|e| NnError::file(path, e))?;
    // Safety: the file is only read; a writer changing it meanwhile is the user's race, as
    // with any reader of a file being rewritten.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| NnError::file(path, e))?;
    let (header_len, meta) =
        SafeTensors::read_metadata(&map).map_err(|e| NnError::file(path, e))?;
    let data_start = 8 + header_len;
    let tensors = meta
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let info = TensorInfo {
                shape: t.shape.clone(),
                dtype: t.dtype,
                at: data_start + t.data_offsets.0,
            };
            (name, info)
        })
        .collect();
    Ok((map, tensors))
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

/// The element type a weights file is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveDtype {
    F32,
    Bf16,
    F16,
}

impl SaveDtype {
    /// fp32, bf16 or fp16 (also float32, bfloat16, float16).
    pub fn parse(s: &str) -> std::result::Result<SaveDtype, String> {
        match s {
            "fp32" | "float32" => Ok(SaveDtype::F32),
            "bf16" | "bfloat16" => Ok(SaveDtype::Bf16),
            "fp16" | "float16" => Ok(SaveDtype::F16),
            other => Err(format!("dtype {other}: expected fp32, bf16 or fp16")),
        }
    }

    pub fn width(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            _ => 2,
        }
    }

    /// torch's name, as config.json's `dtype` spells it.
    pub fn torch_name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "float32",
            SaveDtype::Bf16 => "bfloat16",
            SaveDtype::F16 => "float16",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            SaveDtype::F32 => "F32",
            SaveDtype::Bf16 => "BF16",
            SaveDtype::F16 => "F16",
        }
    }

    /// `values` in this type's little-endian bytes (round to nearest even).
    fn bytes(self, values: &[f32], out: &mut Vec<u8>) {
        out.clear();
        match self {
            SaveDtype::F32 => out.extend(values.iter().flat_map(|x| x.to_le_bytes())),
            SaveDtype::Bf16 => {
                out.extend(values.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()))
            }
            SaveDtype::F16 => {
                out.extend(values.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()))
            }
        }
    }
}

/// A safetensors file written one tensor at a time, so that writing a model never holds
/// more than one tensor: the header (names, shapes, offsets) first, from the shapes alone,
/// then each tensor's values in order. Written to `<path>.partial` and renamed into place
/// once complete and synced.
pub struct StreamingWriter {
    path: PathBuf,
    partial: PathBuf,
    out: std::io::BufWriter<File>,
    dtype: SaveDtype,
    /// Elements of each tensor, and how many tensors were written.
    sizes: Vec<usize>,
    written: usize,
    bytes: Vec<u8>,
}

impl StreamingWriter {
    /// Starts `path` for `tensors` (name, shape) in this order, in `dtype`; `metadata` goes
    /// into the header's `__metadata__` (Hugging Face's loaders want `{"format": "pt"}`).
    pub fn create(
        path: &Path,
        tensors: &[(String, Vec<usize>)],
        dtype: SaveDtype,
        metadata: &[(&str, &str)],
    ) -> Result<StreamingWriter> {
        let mut header = serde_json::Map::new();
        let meta: serde_json::Map<String, serde_json::Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        header.insert("__metadata__".into(), meta.into());
        let mut at = 0usize;
        for (name, shape) in tensors {
            let len = shape.iter().product::<usize>() * dtype.width();
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype.tag(), "shape": shape, "data_offsets": [at, at + len]}),
            );
            at += len;
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        // the data starts 8-byte aligned, as safetensors' own writer pads it
        text.resize(text.len().div_ceil(8) * 8, b' ');
        let partial = path.with_extension("safetensors.partial");
        let file = File::create(&partial).map_err(|e| NnError::file(&partial, e))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        use std::io::Write;
        out.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&text))
            .map_err(|e| NnError::file(&partial, e))?;
        Ok(StreamingWriter {
            path: path.to_path_buf(),
            partial,
            out,
            dtype,
            sizes: tensors.iter().map(|(_, s)| s.iter().product()).collect(),
            written: 0,
            bytes: Vec::new(),
        })
    }

    /// The next tensor's values.
    pub fn put(&mut self, values: &[f32]) -> Result<()> {
        use std::io::Write;
        let want = self.sizes.get(self.written).copied();
        if want != Some(values.len()) {
            return Err(NnError::file(
                &self.path,
                format!(
                    "tensor {} of {} has {} values, the header says {want:?}",
                    self.written,
                    self.sizes.len(),
                    values.len()
                ),
            ));
        }
        self.dtype.bytes(values, &mut self.bytes);
        self.out
            .write_all(&self.bytes)
            .map_err(|e| NnError::file(&self.partial, e))?;
        self.written += 1;
        Ok(())
    }

    /// Every tensor written: synced and renamed into place.
    pub fn finish(self) -> Result<()> {
        if self.written != self.sizes.len() {
            return Err(NnError::file(
                &self.path,
                format!("{} of {} tensors written", self.written, self.sizes.len()),
            ));
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| NnError::file(&self.partial, e.error().to_string()))?;
        file.sync_all()
            .map_err(|e| NnError::file(&self.partial, e))?;
        std::fs::rename(&self.partial, &self.path).map_err(|e| NnError::file(&self.path, e))
    }
}
