//! PyTorch checkpoint files as `torch.save` writes them (a zip of `ARCHIVE/data.pkl` and a
//! record per storage, `ARCHIVE/data/KEY`), read without running anything: the restricted
//! unpickler (Note [restricted unpickling]) gives the object graph, and a tensor's elements
//! are read from its storage record when asked for, a range at a time.

pub mod pickle;
pub mod write;

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use pickle::{Id, Node, Pickle};

use crate::{CheckpointError, Result};

/// An open checkpoint file: its object graph and where each storage's bytes lie.
pub struct TorchFile {
    path: PathBuf,
    file: File,
    pickle: Pickle,
    /// Storage key -> (offset of its bytes in the file, their length).
    records: HashMap<String, (u64, u64)>,
}

/// The element type of a storage (`torch.FloatStorage`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageType {
    F32,
    Bf16,
    F16,
    F64,
    I64,
    I32,
    U8,
    Bool,
}

impl StorageType {
    fn of(global: &str) -> Option<StorageType> {
        Some(match global {
            "torch.FloatStorage" => StorageType::F32,
            "torch.BFloat16Storage" => StorageType::Bf16,
            "torch.HalfStorage" => StorageType::F16,
            "torch.DoubleStorage" => StorageType::F64,
            "torch.LongStorage" => StorageType::I64,
            "torch.IntStorage" => StorageType::I32,
            "torch.ByteStorage" => StorageType::U8,
            "torch.BoolStorage" => StorageType::Bool,
            _ => return None,
        })
    }

    pub fn bytes(self) -> usize {
        match self {
            StorageType::F64 | StorageType::I64 => 8,
            StorageType::F32 | StorageType::I32 => 4,
            StorageType::Bf16 | StorageType::F16 => 2,
            StorageType::U8 | StorageType::Bool => 1,
        }
    }
}

/// A tensor of the file: which storage, from which element, what shape (contiguous).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRef {
    /// Where it sits in the object graph ("optimizer_state_dict.fp32_flat_groups.0").
    pub at: String,
    pub key: String,
    pub dtype: StorageType,
    /// First element in the storage.
    pub offset: usize,
    pub shape: Vec<usize>,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

impl TorchFile {
    /// Opens `path` and parses its pickle; a file that is no PyTorch zip checkpoint, a
    /// damaged one and a pickle naming a global outside the allowed set are errors naming
    /// the file.
    pub fn open(path: &Path) -> Result<TorchFile> {
        let err = |e: String| CheckpointError::file(path, e);
        let file = File::open(path).map_err(|e| err(e.to_string()))?;
        let len = file.metadata().map_err(|e| err(e.to_string()))?.len();
        let mut zip = zip::ZipArchive::new(&file).map_err(|e| {
            err(format!(
                "not a PyTorch checkpoint (torch.save's zip archive), or a truncated one: {e}"
            ))
        })?;
        let pkl = (0..zip.len())
            .find(|&i| zip.name_for_index(i).is_some_and(is_data_pkl))
            .ok_or_else(|| err("no ARCHIVE/data.pkl in the zip archive".into()))?;
        let prefix = match zip.name_for_index(pkl) {
            Some(Ok(name)) => name.trim_end_matches("data.pkl").to_string(),
            _ => unreachable!("invariant: found by name"),
        };
        let data = {
            let entry = zip
                .by_index(pkl)
                .map_err(|e| err(format!("data.pkl: {e}")))?;
            let mut data = Vec::with_capacity(entry.size().min(len) as usize);
            entry
                .take(len)
                .read_to_end(&mut data)
                .map_err(|e| err(format!("data.pkl: {e}")))?;
            data
        };
        let pickle = pickle::parse(&data).map_err(|e| err(format!("data.pkl: {e}")))?;
        let records = storage_records(&mut zip, &prefix, len).map_err(err)?;
        Ok(TorchFile {
            path: path.to_path_buf(),
            file,
            pickle,
            records,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The object `torch.load` would return.
    pub fn root(&self) -> Obj<'_> {
        Obj {
            file: self,
            id: self.pickle.root,
            at: String::new(),
        }
    }

    /// Tensor `o`, checked to lie inside its storage record (so that its shape may size a
    /// buffer).
    pub fn stored(&self, o: &Obj) -> Result<TensorRef> {
        let t = o.tensor()?;
        let &(_, len) = self
            .records
            .get(&t.key)
            .ok_or_else(|| o.error(format!("its storage {:?} is not in the archive", t.key)))?;
        let need = (t.offset as u64)
            .checked_add(t.numel() as u64)
            .and_then(|n| n.checked_mul(t.dtype.bytes() as u64));
        match need {
            Some(need) if need <= len => Ok(t),
            _ => Err(o.error(format!(
                "storage {:?} holds {len} bytes, shorter than the tensor ({} elements of {} bytes from element {})",
                t.key,
                t.numel(),
                t.dtype.bytes(),
                t.offset
            ))),
        }
    }

    /// Elements `range` of tensor `t` as f32 (from f32, bf16, f16 or f64 storages).
    pub fn read_f32(&self, t: &TensorRef, range: Range<usize>) -> Result<Vec<f32>> {
        let err = |e: String| CheckpointError::file(&self.path, format!("{}: {e}", t.at));
        if range.start > range.end || range.end > t.numel() {
            return Err(err(format!(
                "elements {range:?} of a tensor of {} elements",
                t.numel()
            )));
        }
        let &(start, len) = self
            .records
            .get(&t.key)
            .ok_or_else(|| err(format!("its storage {:?} is not in the archive", t.key)))?;
        let size = t.dtype.bytes() as u64;
        let (first, end) = (
            (t.offset + range.start) as u64,
            (t.offset + range.end) as u64,
        );
        if end.saturating_mul(size) > len {
            return Err(err(format!(
                "storage {:?} holds {len} bytes, shorter than the tensor ({} elements from {} of {} bytes each)",
                t.key,
                t.numel(),
                t.offset,
                size
            )));
        }
        let mut bytes = vec![0u8; ((end - first) * size) as usize];
        self.file
            .read_exact_at(&mut bytes, start + first * size)
            .map_err(|e| err(format!("reading storage {:?}: {e}", t.key)))?;
        decode(t.dtype, &bytes)
            .ok_or_else(|| err(format!("a {:?} tensor, not floating point", t.dtype)))
    }

    /// A whole tensor as f32.
    pub fn tensor_f32(&self, t: &TensorRef) -> Result<Vec<f32>> {
        self.read_f32(t, 0..t.numel())
    }
}

fn is_data_pkl(
    name: std::result::Result<std::borrow::Cow<'_, str>, zip::result::ZipError>,
) -> bool {
    name.is_ok_and(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
}

/// Every `PREFIX/data/KEY` record's place in the file; each must be stored uncompressed (as
/// torch.save writes them) and lie inside the file.
fn storage_records(
    zip: &mut zip::ZipArchive<&File>,
    prefix: &str,
    len: u64,
) -> std::result::Result<HashMap<String, (u64, u64)>, String> {
    let data = format!("{prefix}data/");
    let mut records = HashMap::new();
    for i in 0..zip.len() {
        let entry = zip
            .by_index_raw(i)
            .map_err(|e| format!("zip entry {i}: {e}"))?;
        let name = entry
            .name()
            .map_err(|e| format!("zip entry {i}: {e}"))?
            .to_string();
        let Some(key) = name.strip_prefix(&data) else {
            continue;
        };
        if entry.compression() != zip::CompressionMethod::Stored {
            return Err(format!(
                "{name}: a compressed storage record (torch.save stores them)"
            ));
        }
        let start = entry
            .data_start()
            .ok_or_else(|| format!("{name}: no data offset"))?;
        let size = entry.compressed_size();
        if start.saturating_add(size) > len {
            return Err(format!(
                "{name}: {size} bytes from byte {start} of a {len}-byte file (truncated?)"
            ));
        }
        records.insert(key.to_string(), (start, size));
    }
    Ok(records)
}

fn decode(dtype: StorageType, b: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        StorageType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        StorageType::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StorageType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        StorageType::F64 => b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
            .collect(),
        _ => return None,
    })
}

/// A value of the file's object graph, with its path there for errors
/// ("optimizer_state_dict.loss_scaler").
#[derive(Clone)]
pub struct Obj<'a> {
    file: &'a TorchFile,
    id: Id,
    at: String,
}

/// Containers nest at most this deep in what `to_json` converts (a pickle may even contain
/// itself).
const MAX_DEPTH: usize = 32;

impl<'a> Obj<'a> {
    fn node(&self) -> &'a Node {
        &self.file.pickle.nodes[self.id]
    }

    fn child(&self, id: Id, name: impl std::fmt::Display) -> Obj<'a> {
        let at = match self.at.is_empty() {
            true => name.to_string(),
            false => format!("{}.{name}", self.at),
        };
        Obj {
            file: self.file,
            id,
            at,
        }
    }

    /// An error about this value, naming the file and where the value sits.
    pub fn error(&self, what: impl std::fmt::Display) -> CheckpointError {
        let at = if self.at.is_empty() {
            "the top object"
        } else {
            &self.at
        };
        CheckpointError::file(&self.file.path, format!("{at}: {what}"))
    }

    fn kind(&self) -> &'static str {
        match self.node() {
            Node::None => "None",
            Node::Bool(_) => "a bool",
            Node::Int(_) => "an int",
            Node::Float(_) => "a float",
            Node::Str(_) => "a string",
            Node::Tuple(_) => "a tuple",
            Node::List(_) => "a list",
            Node::Dict(_) => "a dict",
            Node::Global(_) => "a global",
            Node::Call { .. } => "a call",
            Node::Build { .. } => "an object",
            Node::Persistent(_) => "a storage reference",
        }
    }

    fn expected(&self, what: &str) -> CheckpointError {
        self.error(format!("expected {what}, found {}", self.kind()))
    }

    /// The value under string key `key` of a dict.
    pub fn get(&self, key: &str) -> Result<Obj<'a>> {
        self.opt(key)?
            .ok_or_else(|| self.error(format!("no key {key:?}")))
    }

    /// The value under string key `key` of a dict, if there is one.
    pub fn opt(&self, key: &str) -> Result<Option<Obj<'a>>> {
        Ok(self
            .items()?
            .into_iter()
            .find(|(k, _)| matches!(k.node(), Node::Str(s) if s == key))
            .map(|(_, v)| v))
    }

    /// The value under integer key `key` of a dict (a torch optimizer's `state`).
    pub fn get_int(&self, key: i64) -> Result<Obj<'a>> {
        self.items()?
            .into_iter()
            .find(|(k, _)| matches!(k.node(), Node::Int(i) if *i == key))
            .map(|(_, v)| v)
            .ok_or_else(|| self.error(format!("no key {key}")))
    }

    /// A dict's entries in order.
    pub fn items(&self) -> Result<Vec<(Obj<'a>, Obj<'a>)>> {
        let Node::Dict(d) = self.node() else {
            return Err(self.expected("a dict"));
        };
        let name = |k: Id| match &self.file.pickle.nodes[k] {
            Node::Str(s) => s.clone(),
            Node::Int(i) => i.to_string(),
            _ => "?".into(),
        };
        Ok(d.iter()
            .map(|&(k, v)| (self.child(k, "<key>"), self.child(v, name(k))))
            .collect())
    }

    /// A list's, a tuple's or a torch.Size's elements.
    pub fn seq(&self) -> Result<Vec<Obj<'a>>> {
        let ids = match self.node() {
            Node::List(l) | Node::Tuple(l) => l,
            // torch.Size((d0, d1, ...)): its one argument is a tuple (or list) of the dims
            Node::Call { callable, args } if self.global_is(*callable, "torch.Size") => {
                let dims = match &self.file.pickle.nodes[*args] {
                    Node::Tuple(a) | Node::List(a) if a.len() == 1 => &self.file.pickle.nodes[a[0]],
                    _ => return Err(self.expected("torch.Size((dims,))")),
                };
                match dims {
                    Node::Tuple(d) | Node::List(d) => d,
                    _ => return Err(self.expected("torch.Size((dims,))")),
                }
            }
            _ => return Err(self.expected("a list or a tuple")),
        };
        Ok(ids
            .iter()
            .enumerate()
            .map(|(i, &id)| self.child(id, i))
            .collect())
    }

    fn rename(&self, o: Obj<'a>) -> Obj<'a> {
        Obj {
            at: format!("{}[]", self.at),
            ..o
        }
    }

    fn global_is(&self, id: Id, name: &str) -> bool {
        matches!(self.file.pickle.nodes[id], Node::Global(g) if g == name)
    }

    pub fn is_none(&self) -> bool {
        matches!(self.node(), Node::None)
    }

    pub fn int(&self) -> Result<i64> {
        match self.node() {
            Node::Int(i) => Ok(*i),
            Node::Bool(b) => Ok(*b as i64),
            _ => Err(self.expected("an int")),
        }
    }

    /// A count or an index: an int that is not negative.
    pub fn usize(&self) -> Result<usize> {
        let i = self.int()?;
        usize::try_from(i).map_err(|_| self.error(format!("{i} is negative")))
    }

    pub fn float(&self) -> Result<f64> {
        match self.node() {
            Node::Float(f) => Ok(*f),
            Node::Int(i) => Ok(*i as f64),
            _ => Err(self.expected("a number")),
        }
    }

    pub fn bool(&self) -> Result<bool> {
        match self.node() {
            Node::Bool(b) => Ok(*b),
            _ => Err(self.expected("a bool")),
        }
    }

    pub fn str(&self) -> Result<&'a str> {
        match self.node() {
            Node::Str(s) => Ok(s),
            _ => Err(self.expected("a string")),
        }
    }

    /// A shape: a torch.Size, list or tuple of counts.
    pub fn shape(&self) -> Result<Vec<usize>> {
        self.seq()?.iter().map(|d| d.usize()).collect()
    }

    /// An object `Class()` whose state BUILD set: its class ("module.Name") and its state.
    pub fn object(&self) -> Result<(&'static str, Obj<'a>)> {
        let Node::Build { object, state } = self.node() else {
            return Err(self.expected("an object"));
        };
        match &self.file.pickle.nodes[*object] {
            Node::Call { callable, .. } => match self.file.pickle.nodes[*callable] {
                Node::Global(g) => Ok((g, self.child(*state, "__dict__"))),
                _ => Err(self.expected("an object of a class")),
            },
            _ => Err(self.expected("an object of a class")),
        }
    }

    /// An enum member `Class(value)` (DeepSpeed's ZeroStageEnum): its class and value.
    pub fn enum_member(&self) -> Result<(&'static str, i64)> {
        if let Node::Call { callable, args } = self.node() {
            if let (Node::Global(g), Ok(args)) = (
                &self.file.pickle.nodes[*callable],
                self.child(*args, "").seq(),
            ) {
                if let [v] = &args[..] {
                    return Ok((g, v.int()?));
                }
            }
        }
        Err(self.expected("an enum member"))
    }

    /// A tensor: `_rebuild_tensor_v2(storage, offset, size, stride, ...)`, possibly inside
    /// `_rebuild_from_type_v2` or `_rebuild_parameter`; it must be contiguous.
    pub fn tensor(&self) -> Result<TensorRef> {
        self.tensor_within(true)
    }

    /// `wrapped`: whether `_rebuild_parameter` may still wrap the tensor (once: a pickle may
    /// make a parameter of itself).
    fn tensor_within(&self, wrapped: bool) -> Result<TensorRef> {
        let Node::Call { callable, args } = self.node() else {
            return Err(self.expected("a tensor"));
        };
        let args = self.child(*args, "").seq()?;
        match self.file.pickle.nodes[*callable] {
            Node::Global("torch._utils._rebuild_tensor_v2") => self.rebuild(&args),
            // (function, type, args, state): the tensor is function(*args)
            Node::Global("torch._tensor._rebuild_from_type_v2") if args.len() >= 3 => {
                self.rebuild(&args[2].seq()?)
            }
            // (tensor, requires_grad, hooks)
            Node::Global("torch._utils._rebuild_parameter") if wrapped && !args.is_empty() => {
                self.rename(args[0].clone()).tensor_within(false)
            }
            _ => Err(self.expected("a tensor")),
        }
    }

    fn rebuild(&self, args: &[Obj<'a>]) -> Result<TensorRef> {
        let [storage, offset, size, stride, ..] = args else {
            return Err(self.expected("a tensor's (storage, offset, size, stride)"));
        };
        let Node::Persistent(record) = storage.node() else {
            return Err(self.expected("a tensor whose storage is a record of the archive"));
        };
        // ("storage", torch.XStorage, key, location, numel)
        let record = self.child(*record, "storage").seq()?;
        let [_, class, key, _, _] = &record[..] else {
            return Err(self.expected("a storage record (\"storage\", type, key, location, size)"));
        };
        let dtype = match class.node() {
            Node::Global(g) => StorageType::of(g),
            _ => None,
        }
        .ok_or_else(|| self.expected("a storage type"))?;
        let shape = size.shape()?;
        let stride = stride.shape()?;
        let numel = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| self.error(format!("shape {shape:?} is too large")))?;
        let mut contiguous = vec![1usize; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            contiguous[i] = contiguous[i + 1] * shape[i + 1];
        }
        let same = shape
            .iter()
            .zip(stride.iter().zip(&contiguous))
            .all(|(&d, (s, c))| d <= 1 || s == c);
        if numel > 0 && (stride.len() != shape.len() || !same) {
            return Err(self.error(format!(
                "a tensor of shape {shape:?} with strides {stride:?} (only contiguous tensors are read)"
            )));
        }
        Ok(TensorRef {
            at: self.at.clone(),
            key: key.str()?.to_string(),
            dtype,
            offset: offset.usize()?,
            shape,
        })
    }

    /// Plain values as JSON (a ds_config, a scheduler's state); tensors and objects are
    /// errors.
    pub fn to_json(&self) -> Result<serde_json::Value> {
        self.json(0)
    }

    fn json(&self, depth: usize) -> Result<serde_json::Value> {
        use serde_json::Value;
        if depth > MAX_DEPTH {
            return Err(self.error(format!("nested deeper than {MAX_DEPTH}")));
        }
        Ok(match self.node() {
            Node::None => Value::Null,
            Node::Bool(b) => Value::Bool(*b),
            Node::Int(i) => Value::from(*i),
            Node::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
            Node::Str(s) => Value::String(s.clone()),
            Node::List(_) | Node::Tuple(_) => Value::Array(
                self.seq()?
                    .iter()
                    .map(|v| v.json(depth + 1))
                    .collect::<Result<_>>()?,
            ),
            Node::Dict(_) => {
                let mut m = serde_json::Map::new();
                for (k, v) in self.items()? {
                    let key = match k.node() {
                        Node::Str(s) => s.clone(),
                        Node::Int(i) => i.to_string(),
                        _ => return Err(k.expected("a string or int key")),
                    };
                    m.insert(key, v.json(depth + 1)?);
                }
                Value::Object(m)
            }
            _ => return Err(self.expected("a plain value")),
        })
    }
}
