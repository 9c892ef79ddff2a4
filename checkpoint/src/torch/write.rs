//! Writing PyTorch checkpoint files that `torch.load` reads: plain values and fp32 tensors
//! pickled with protocol 2 (the one `torch.save` uses) and stored, uncompressed, in its zip
//! layout (`ARCHIVE/data.pkl`, a record per storage `ARCHIVE/data/KEY`, `ARCHIVE/version`,
//! `ARCHIVE/byteorder`). The only globals written are the ones `torch.load(weights_only=True)`
//! allows: the tensor rebuilder, the float storage and OrderedDict.

use std::io::Write;
use std::path::Path;

use crate::{CheckpointError, Result};

/// A value to pickle. Tensors are fp32 and refer to the `tensors` passed to `save` by index.
#[derive(Debug, Clone, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    Dict(Vec<(Py, Py)>),
    /// `collections.OrderedDict` (a module's state_dict).
    OrderedDict(Vec<(Py, Py)>),
    /// The i-th tensor given to `save`.
    Tensor(usize),
}

impl Py {
    pub fn str(s: &str) -> Py {
        Py::Str(s.to_string())
    }

    /// A dict of string keys.
    pub fn dict<'a>(items: impl IntoIterator<Item = (&'a str, Py)>) -> Py {
        Py::Dict(items.into_iter().map(|(k, v)| (Py::str(k), v)).collect())
    }
}

/// A tensor to write: its shape and values.
pub struct Tensor<'a> {
    pub shape: Vec<usize>,
    pub values: &'a [f32],
}

/// Writes `value` (its tensors from `tensors`) to `path` as `torch.save` would, atomically
/// (a temporary sibling renamed into place).
pub fn save(path: &Path, value: &Py, tensors: &[Tensor]) -> Result<()> {
    let archive = path
        .file_stem()
        .map_or("archive".to_string(), |s| s.to_string_lossy().into_owned());
    let tmp = path.with_extension("partial");
    let err = |e: String| CheckpointError::file(&tmp, e);
    let mut pickle = vec![0x80, 2];
    encode(value, tensors, &mut pickle).map_err(err)?;
    pickle.push(b'.');
    let file = std::fs::File::create(&tmp).map_err(|e| err(e.to_string()))?;
    let mut zip = zip::ZipWriter::new(file);
    let big = tensors
        .iter()
        .any(|t| t.values.len() as u64 * 4 >= u32::MAX as u64);
    let stored = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(big);
    let mut record =
        |name: String, bytes: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>| {
            zip.start_file(name, stored)
                .map_err(|e| err(e.to_string()))?;
            bytes(&mut zip).map_err(|e| err(e.to_string()))
        };
    record(format!("{archive}/data.pkl"), &mut |w| w.write_all(&pickle))?;
    record(format!("{archive}/byteorder"), &mut |w| {
        w.write_all(b"little")
    })?;
    for (i, t) in tensors.iter().enumerate() {
        record(format!("{archive}/data/{i}"), &mut |w| {
            for chunk in t.values.chunks(1 << 14) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
                w.write_all(&bytes)?;
            }
            Ok(())
        })?;
    }
    record(format!("{archive}/version"), &mut |w| w.write_all(b"3\n"))?;
    let file = zip.finish().map_err(|e| err(e.to_string()))?;
    file.sync_all().map_err(|e| err(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| CheckpointError::file(path, e))
}

fn encode(v: &Py, tensors: &[Tensor], out: &mut Vec<u8>) -> std::result::Result<(), String> {
    match v {
        Py::None => out.push(b'N'),
        Py::Bool(b) => out.push(if *b { 0x88 } else { 0x89 }),
        Py::Int(i) => int(*i, out),
        Py::Float(f) => {
            out.push(b'G');
            out.extend_from_slice(&f.to_be_bytes());
        }
        Py::Str(s) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Py::List(items) => {
            out.push(b']');
            if !items.is_empty() {
                out.push(b'(');
                for i in items {
                    encode(i, tensors, out)?;
                }
                out.push(b'e');
            }
        }
        Py::Tuple(items) => {
            out.push(b'(');
            for i in items {
                encode(i, tensors, out)?;
            }
            out.push(b't');
        }
        Py::Dict(items) => {
            out.push(b'}');
            set_items(items, tensors, out)?;
        }
        Py::OrderedDict(items) => {
            global("collections", "OrderedDict", out);
            out.extend_from_slice(b")R");
            set_items(items, tensors, out)?;
        }
        Py::Tensor(i) => {
            let t = tensors
                .get(*i)
                .ok_or_else(|| format!("tensor {i} of {}", tensors.len()))?;
            tensor(*i, t, out);
        }
    }
    Ok(())
}

fn set_items(
    items: &[(Py, Py)],
    tensors: &[Tensor],
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    if !items.is_empty() {
        out.push(b'(');
        for (k, v) in items {
            encode(k, tensors, out)?;
            encode(v, tensors, out)?;
        }
        out.push(b'u');
    }
    Ok(())
}

fn int(i: i64, out: &mut Vec<u8>) {
    match i {
        0..=0xff => out.extend_from_slice(&[b'K', i as u8]),
        0x100..=0xffff => {
            out.push(b'M');
            out.extend_from_slice(&(i as u16).to_le_bytes());
        }
        _ if i32::try_from(i).is_ok() => {
            out.push(b'J');
            out.extend_from_slice(&(i as i32).to_le_bytes());
        }
        _ => {
            out.extend_from_slice(&[0x8a, 8]);
            out.extend_from_slice(&i.to_le_bytes());
        }
    }
}

fn global(module: &str, name: &str, out: &mut Vec<u8>) {
    out.push(b'c');
    out.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
}

/// `_rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`, the storage the
/// persistent id `("storage", FloatStorage, "i", "cpu", numel)`.
fn tensor(i: usize, t: &Tensor, out: &mut Vec<u8>) {
    global("torch._utils", "_rebuild_tensor_v2", out);
    out.push(b'(');
    out.push(b'(');
    encode_plain(&Py::str("storage"), out);
    global("torch", "FloatStorage", out);
    encode_plain(&Py::Str(i.to_string()), out);
    encode_plain(&Py::str("cpu"), out);
    int(t.values.len() as i64, out);
    out.push(b't');
    out.push(b'Q');
    int(0, out);
    let mut stride = vec![1usize; t.shape.len()];
    for d in (0..t.shape.len().saturating_sub(1)).rev() {
        stride[d] = stride[d + 1] * t.shape[d + 1];
    }
    let dims = |v: &[usize]| Py::Tuple(v.iter().map(|&d| Py::Int(d as i64)).collect());
    encode_plain(&dims(&t.shape), out);
    encode_plain(&dims(&stride), out);
    out.push(0x89);
    global("collections", "OrderedDict", out);
    out.extend_from_slice(b")R");
    out.push(b't');
    out.push(b'R');
}

/// A value without tensors.
fn encode_plain(v: &Py, out: &mut Vec<u8>) {
    encode(v, &[], out).expect("invariant: no tensors");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch::TorchFile;

    #[test]
    fn what_is_written_reads_back() {
        let dir = std::env::temp_dir().join(format!("ds-torch-write-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.pt");
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
        let value = Py::dict([
            ("w", Py::Tensor(0)),
            ("n", Py::Int(-3)),
            ("big", Py::Int(1 << 40)),
            ("lr", Py::Float(3e-4)),
            (
                "names",
                Py::List(vec![Py::str("a"), Py::None, Py::Bool(true)]),
            ),
            ("sd", Py::OrderedDict(vec![(Py::str("x"), Py::Int(70000))])),
        ]);
        save(
            &path,
            &value,
            &[Tensor {
                shape: vec![2, 3],
                values: &values,
            }],
        )
        .unwrap();
        let f = TorchFile::open(&path).unwrap();
        let r = f.root();
        let t = f.stored(&r.get("w").unwrap()).unwrap();
        assert_eq!(t.shape, [2, 3]);
        assert_eq!(f.tensor_f32(&t).unwrap(), values);
        assert_eq!(r.get("n").unwrap().int().unwrap(), -3);
        assert_eq!(r.get("big").unwrap().int().unwrap(), 1 << 40);
        assert_eq!(r.get("lr").unwrap().float().unwrap(), 3e-4);
        let names = r.get("names").unwrap().seq().unwrap();
        assert!(names[1].is_none() && names[2].bool().unwrap());
        assert_eq!(r.get("sd").unwrap().get("x").unwrap().int().unwrap(), 70000);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
