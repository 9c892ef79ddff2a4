//! `manifest.json`: what a checkpoint holds and how it was laid out, enough to load it into
//! any layout and to consolidate it without the engine.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::loss_scale::LossScaleState;
use crate::{EngineError, Result};

/// The format this build writes and reads.
pub const FORMAT: &str = "ds-rs checkpoint v1";
pub const MANIFEST: &str = "manifest.json";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub tag: String,
    /// Optimizer steps attempted and skipped (DeepSpeed's global_steps, skipped_steps).
    pub global_steps: u64,
    pub skipped_steps: u64,
    pub loss_scaler: LossScaleState,
    pub layout: Layout,
    /// Every parameter in flat order: the logical model.
    pub params: Vec<ParamEntry>,
    /// Parameters in all (the flat length without padding).
    pub numel: usize,
    /// The optimizer's state buffers, each stored beside the master copy in every shard.
    pub optimizer_buffers: Vec<String>,
    /// The optimizer's step count (Adam's bias correction).
    pub optimizer_step: u64,
    pub shards: Vec<ShardEntry>,
    /// Whatever the training program keeps (the train job: its data position and metrics).
    pub client_state: serde_json::Value,
    /// The resolved ds_config the run used.
    pub config: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    pub world_size: usize,
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub zero_stage: u8,
    /// The compute dtype: f32, bf16 or f16.
    pub dtype: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// Offset in the flat buffer.
    pub offset: usize,
}

/// One rank's file: the flat range it covers (padded coordinates) and its checksum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub rank: usize,
    pub start: usize,
    pub end: usize,
    pub bytes: u64,
    pub crc32c: u32,
}

impl Manifest {
    /// Reads `dir/manifest.json`; errors name the file.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::file(&path, e))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| EngineError::file(&path, format!("not a checkpoint manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(EngineError::file(
                &path,
                format!("format {:?}, expected {FORMAT:?}", m.format),
            ));
        }
        Ok(m)
    }

    pub fn shard_path(&self, dir: &Path, shard: &ShardEntry) -> PathBuf {
        dir.join(&shard.file)
    }
}
