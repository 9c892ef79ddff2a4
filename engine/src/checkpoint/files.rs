//! The file operations that make a checkpoint atomic and verifiable: write to a temporary
//! name, fsync, rename, fsync the directory; CRC32C over every shard file.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::{EngineError, Result};

/// Writes `bytes` to `path` so that `path` either keeps its old content or has all of the new
/// one, durably: a temporary sibling, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(|e| EngineError::file(&tmp, e))?;
    f.write_all(bytes).map_err(|e| EngineError::file(&tmp, e))?;
    f.sync_all().map_err(|e| EngineError::file(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| EngineError::file(path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Makes a rename or a new file in `dir` durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| EngineError::file(dir, e))
}

/// fp32 tensors as safetensors bytes, in the order given.
pub fn encode(tensors: &[(&str, &[f32])], metadata: HashMap<String, String>) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, v), b)| {
            let view = TensorView::new(Dtype::F32, vec![v.len()], b)
                .expect("invariant: a 1-D f32 view of its own bytes");
            (name.to_string(), view)
        })
        .collect();
    safetensors::serialize(views, Some(metadata))
        .map_err(|e| EngineError::Invalid(format!("encoding a checkpoint shard: {e}")))
}

/// A shard file read whole and checked against its recorded size and checksum.
pub struct ShardFile {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl ShardFile {
    pub fn open(path: &Path, bytes: u64, crc: u32) -> Result<ShardFile> {
        let data = std::fs::read(path).map_err(|e| EngineError::file(path, e))?;
        if data.len() as u64 != bytes {
            return Err(EngineError::file(
                path,
                format!(
                    "{} bytes, the manifest says {bytes}: truncated or replaced",
                    data.len()
                ),
            ));
        }
        let found = crc32c::crc32c(&data);
        if found != crc {
            return Err(EngineError::file(
                path,
                format!("checksum {found:08x}, the manifest says {crc:08x}: the file is corrupted"),
            ));
        }
        Ok(ShardFile {
            path: path.to_path_buf(),
            bytes: data,
        })
    }

    /// Elements `range` (relative to the file's start) of tensor `name`.
    pub fn slice(&self, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let st =
            SafeTensors::deserialize(&self.bytes).map_err(|e| EngineError::file(&self.path, e))?;
        let t = st
            .tensor(name)
            .map_err(|e| EngineError::file(&self.path, format!("tensor {name}: {e}")))?;
        let data = t.data();
        if t.dtype() != Dtype::F32 || range.end * 4 > data.len() {
            return Err(EngineError::file(
                &self.path,
                format!("tensor {name}: expected f32 covering {range:?}"),
            ));
        }
        Ok(data[range.start * 4..range.end * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}
