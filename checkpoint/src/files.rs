//! The file operations that make a checkpoint atomic and verifiable: write to a temporary
//! name, fsync, rename, fsync the directory; CRC32C over every shard file.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::{crash_point, CheckpointError, Result};

/// Writes `bytes` to `path` so that `path` either keeps its old content or has all of the new
/// one, durably: a temporary sibling, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(|e| CheckpointError::file(&tmp, e))?;
    f.write_all(bytes)
        .map_err(|e| CheckpointError::file(&tmp, e))?;
    crash_point::point("file.written");
    f.sync_all().map_err(|e| CheckpointError::file(&tmp, e))?;
    crash_point::point("file.synced");
    std::fs::rename(&tmp, path).map_err(|e| CheckpointError::file(path, e))?;
    crash_point::point("file.renamed");
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Makes a rename or a new file in `dir` durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::file(dir, e))
}

/// Writes 1-D fp32 tensors as a safetensors file at `path`, atomically as `write_atomic`
/// (the same crash points), streaming: the header first, then each tensor through a small
/// buffer, the CRC32C computed on the way, so a shard is never held as bytes in memory.
/// Returns the file's size and checksum.
pub fn write_tensors_atomic(
    path: &Path,
    tensors: &[(&str, &[f32])],
    metadata: &[(&str, String)],
) -> Result<(u64, u32)> {
    let sizes: Vec<(&str, usize)> = tensors.iter().map(|(n, v)| (*n, v.len())).collect();
    write_tensors_streaming(path, &sizes, metadata, |i, sink| sink(tensors[i].1))
}

/// As `write_tensors_atomic`, with tensor i's `len` values given by `fill(i, sink)` through
/// `sink`, in as many pieces as it likes: nothing of a tensor need be in memory at once.
pub fn write_tensors_streaming(
    path: &Path,
    tensors: &[(&str, usize)],
    metadata: &[(&str, String)],
    mut fill: impl FnMut(usize, &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()>,
) -> Result<(u64, u32)> {
    let tmp = path.with_extension("partial");
    let err = |e: std::io::Error| CheckpointError::file(&tmp, e);
    let mut header = serde_json::Map::new();
    let meta: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone().into()))
        .collect();
    header.insert("__metadata__".into(), meta.into());
    let mut at = 0usize;
    for (name, n) in tensors {
        let len = n * 4;
        let entry =
            serde_json::json!({"dtype": "F32", "shape": [n], "data_offsets": [at, at + len]});
        header.insert(name.to_string(), entry);
        at += len;
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = CrcWriter {
        inner: std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(err)?),
        crc: 0,
        bytes: 0,
    };
    out.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(err)?;
    out.write_all(&text).map_err(err)?;
    let mut chunk = Vec::with_capacity(1 << 16);
    for (i, (name, n)) in tensors.iter().enumerate() {
        let mut written = 0usize;
        fill(i, &mut |values: &[f32]| {
            for part in values.chunks(1 << 14) {
                chunk.clear();
                chunk.extend(part.iter().flat_map(|x| x.to_le_bytes()));
                out.write_all(&chunk).map_err(err)?;
            }
            written += values.len();
            Ok(())
        })?;
        if written != *n {
            return Err(CheckpointError::file(
                &tmp,
                format!("tensor {name}: {written} values written, its header says {n}"),
            ));
        }
    }
    let (crc, bytes) = (out.crc, out.bytes);
    let f = out.inner.into_inner().map_err(|e| err(e.into_error()))?;
    crash_point::point("file.written");
    f.sync_all().map_err(err)?;
    crash_point::point("file.synced");
    std::fs::rename(&tmp, path).map_err(|e| CheckpointError::file(path, e))?;
    crash_point::point("file.renamed");
    sync_dir(path.parent().unwrap_or(Path::new(".")))?;
    Ok((bytes, crc))
}

/// A writer that keeps the CRC32C and the count of what passes through it.
struct CrcWriter<W: Write> {
    inner: W,
    crc: u32,
    bytes: u64,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A shard file checked against its recorded size and checksum, from which a rank then reads
/// only the ranges it owns: the checksum streams through a small buffer and each slice is one
/// positioned read, so loading never holds a whole shard (a stage-0 checkpoint's one shard is
/// the whole model).
pub struct ShardFile {
    path: PathBuf,
    file: File,
    /// Tensor name -> (dtype, byte range of its data, from the file's start).
    tensors: HashMap<String, (String, Range<u64>)>,
}

/// Bytes read at a time while checksumming.
const CRC_CHUNK: usize = 1 << 20;

impl ShardFile {
    pub fn open(path: &Path, bytes: u64, crc: u32) -> Result<ShardFile> {
        let err = |e: std::io::Error| CheckpointError::file(path, e);
        let mut file = File::open(path).map_err(err)?;
        let len = file.metadata().map_err(err)?.len();
        if len != bytes {
            return Err(CheckpointError::file(
                path,
                format!("{len} bytes, the manifest says {bytes}: truncated or replaced"),
            ));
        }
        let found = checksum(&mut file).map_err(err)?;
        if found != crc {
            return Err(CheckpointError::file(
                path,
                format!("checksum {found:08x}, the manifest says {crc:08x}: the file is corrupted"),
            ));
        }
        let tensors = header(&file, len).map_err(|e| CheckpointError::file(path, e))?;
        Ok(ShardFile {
            path: path.to_path_buf(),
            file,
            tensors,
        })
    }

    /// Elements `range` (relative to the file's start) of tensor `name`.
    pub fn slice(&self, name: &str, range: Range<usize>) -> Result<Vec<f32>> {
        let found = self.tensors.get(name);
        let (at, fits) = match found {
            Some((dtype, data)) if dtype == "F32" => (
                data.start + range.start as u64 * 4,
                data.start + range.end as u64 * 4 <= data.end,
            ),
            _ => (0, false),
        };
        if !fits {
            return Err(CheckpointError::file(
                &self.path,
                format!("tensor {name}: expected f32 covering {range:?}"),
            ));
        }
        let mut raw = vec![0u8; range.len() * 4];
        self.file
            .read_exact_at(&mut raw, at)
            .map_err(|e| CheckpointError::file(&self.path, e))?;
        Ok(raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// CRC32C of the whole file, read in chunks.
fn checksum(file: &mut File) -> std::io::Result<u32> {
    let mut buf = vec![0u8; CRC_CHUNK];
    let mut crc = 0u32;
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(crc),
            n => crc = crc32c::crc32c_append(crc, &buf[..n]),
        }
    }
}

/// The safetensors header: each tensor's dtype and data bytes (checked to lie in the file).
fn header(
    file: &File,
    len: u64,
) -> std::result::Result<HashMap<String, (String, Range<u64>)>, String> {
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0).map_err(|e| e.to_string())?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > 100 << 20 {
        return Err(format!("a header of {n} bytes in a file of {len}"));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact_at(&mut text, 8)
        .map_err(|e| e.to_string())?;
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("header: {e}"))?;
    let obj = json.as_object().ok_or("header: not an object")?;
    let data_start = 8 + n;
    let mut out = HashMap::new();
    for (name, t) in obj.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype = t["dtype"].as_str().unwrap_or_default().to_string();
        let offsets = t["data_offsets"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect::<Vec<u64>>());
        let Some([a, b]) = offsets
            .as_deref()
            .and_then(|o| <[u64; 2]>::try_from(o).ok())
        else {
            return Err(format!("header: tensor {name} has no data_offsets"));
        };
        if a > b || data_start.checked_add(b).is_none_or(|end| end > len) {
            return Err(format!("header: tensor {name} lies outside the file"));
        }
        out.insert(name.clone(), (dtype, data_start + a..data_start + b));
    }
    Ok(out)
}
