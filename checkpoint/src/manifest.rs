//! `manifest.json`: what a checkpoint holds and how it was laid out, enough to load it into
//! any layout and to consolidate it without the engine.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use ds_partition::Split;

use crate::{CheckpointError, Result};

/// The mutable part of a scaler: what a checkpoint has to carry. Without dynamic scaling
/// `last_overflow_iter` stays -1 and `cur_hysteresis` 0.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaleState {
    pub cur_scale: f64,
    /// Updates so far (one per optimizer step, skipped or not).
    pub cur_iter: u64,
    pub last_overflow_iter: i64,
    pub cur_hysteresis: i64,
}

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
    /// Elements of the first stage's tensor-parallel rank 0's dense flat buffer, without
    /// padding (the whole model at tp = pp = ep = 1); each buffer's size follows from
    /// `params`.
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
    /// The frozen parameters the checkpoint does not hold (absent without).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen: Option<FrozenPart>,
}

/// The frozen parameters of a run (`Model::freeze`, LoRA's base): checkpoints hold only the
/// trainable ones, so this records what the frozen ones are and where their values came from,
/// and a resume that would start them otherwise is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrozenPart {
    /// Their names and logical shapes, in flat order.
    pub params: Vec<(String, Vec<usize>)>,
    /// `seed N`, or `weights file NAME (BYTES bytes)`.
    pub source: String,
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
    /// The expert-parallel size (1 in manifests written before expert parallelism saved).
    #[serde(default = "one")]
    pub ep: usize,
}

impl Layout {
    /// "dp 2 x tp 1 x pp 1", with " (ep 2)" under expert parallelism (the job's own spelling).
    pub fn parallelism(&self) -> String {
        let dims = format!("dp {} x tp {} x pp {}", self.dp, self.tp, self.pp);
        match self.ep {
            1 => dims,
            ep => format!("{dims} (ep {ep})"),
        }
    }
}

/// A logical parameter: its whole shape, its offset in the logical flat order, and how
/// tensor parallelism split it when saved (a shard holds one tensor-parallel rank's slices).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// Offset in the logical flat buffer (the one of tp = 1).
    pub offset: usize,
    #[serde(default, skip_serializing_if = "SplitEntry::is_replicated")]
    pub split: SplitEntry,
    /// The pipeline stage that held it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stage: usize,
    /// Under expert parallelism, the expert-parallel rank whose experts' store held it;
    /// absent for the dense store, which holds every parameter at ep 1 (Note [resharding]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep_rank: Option<usize>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// `Split` as the manifest spells it: absent for replicated, else `{"dim": d, "blocks": b}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SplitEntry {
    #[serde(default)]
    pub dim: Option<usize>,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub blocks: usize,
}

fn one() -> usize {
    1
}
fn is_one(n: &usize) -> bool {
    *n == 1
}

impl SplitEntry {
    fn is_replicated(&self) -> bool {
        self.dim.is_none()
    }
}

impl From<Split> for SplitEntry {
    fn from(s: Split) -> SplitEntry {
        match s {
            Split::Replicated => SplitEntry {
                dim: None,
                blocks: 1,
            },
            Split::Dim { dim, blocks } => SplitEntry {
                dim: Some(dim),
                blocks,
            },
        }
    }
}

impl From<SplitEntry> for Split {
    fn from(s: SplitEntry) -> Split {
        match s.dim {
            None => Split::Replicated,
            Some(dim) => Split::Dim {
                dim,
                blocks: s.blocks,
            },
        }
    }
}

/// One rank's file: the flat range it covers (padded coordinates) and its checksum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub rank: usize,
    /// The tensor-parallel rank whose slices the file holds (its range is in that rank's
    /// flat buffer).
    #[serde(default)]
    pub tp_rank: usize,
    /// The pipeline stage whose buffer it covers.
    #[serde(default)]
    pub stage: usize,
    /// The expert-parallel rank whose experts' store the file covers; absent for the dense
    /// store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep_rank: Option<usize>,
    pub start: usize,
    pub end: usize,
    pub bytes: u64,
    pub crc32c: u32,
}

impl Manifest {
    /// Reads `dir/manifest.json`; errors name the file.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| CheckpointError::file(&path, e))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| CheckpointError::file(&path, format!("not a checkpoint manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(CheckpointError::file(
                &path,
                format!("format {:?}, expected {FORMAT:?}", m.format),
            ));
        }
        m.check()
            .map_err(|reason| CheckpointError::file(&path, reason))?;
        Ok(m)
    }

    /// What the readers rely on, checked before any number here sizes a loop or a buffer:
    /// shapes whose sizes fit in memory's address space and lie inside the model, shard files
    /// named inside the checkpoint's directory, a tensor-parallel degree no larger than the
    /// number of shard files (each tensor-parallel rank writes at least one), experts' stores
    /// of the expert-parallel ranks there are.
    fn check(&self) -> std::result::Result<(), String> {
        let mut total = 0usize;
        for p in &self.params {
            let n = p.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            total = n
                .and_then(|n| total.checked_add(n))
                .filter(|t| t.checked_mul(4).is_some())
                .ok_or_else(|| format!("parameter {}: shape {:?} is too large", p.name, p.shape))?;
        }
        for p in &self.params {
            let n: usize = p.shape.iter().product();
            if p.offset.checked_add(n).is_none_or(|end| end > total) {
                return Err(format!(
                    "parameter {}: offset {} and shape {:?} lie outside the model's {total} elements",
                    p.name, p.offset, p.shape
                ));
            }
        }
        if self.layout.tp > self.shards.len().max(1) {
            return Err(format!(
                "tensor-parallel degree {} with {} shard files",
                self.layout.tp,
                self.shards.len()
            ));
        }
        self.check_ep_ranks()?;
        for s in &self.shards {
            let plain = Path::new(&s.file)
                .file_name()
                .is_some_and(|f| f == s.file.as_str());
            if !plain || s.file == ".." {
                return Err(format!(
                    "shard file {:?} is not a file name in the checkpoint",
                    s.file
                ));
            }
            if s.start > s.end {
                return Err(format!(
                    "shard {}: range {}..{} is reversed",
                    s.file, s.start, s.end
                ));
            }
        }
        Ok(())
    }

    /// Every store's expert-parallel rank below the saved ep, so that one's buffers exist.
    fn check_ep_ranks(&self) -> std::result::Result<(), String> {
        let ep = self.layout.ep;
        let params = self.params.iter().map(|p| (&p.name, p.ep_rank));
        let shards = self.shards.iter().map(|s| (&s.file, s.ep_rank));
        match params
            .chain(shards)
            .find(|(_, r)| r.is_some_and(|r| r >= ep))
        {
            Some((name, r)) => Err(format!(
                "{name}: expert-parallel rank {} at expert-parallel size {ep}",
                r.unwrap_or_default()
            )),
            None => Ok(()),
        }
    }

    /// The logical model's parameter count (at tp > 1 more than `numel`, one rank's slices);
    /// `read` checked that it fits in a usize.
    pub fn parameters(&self) -> usize {
        self.params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    pub fn shard_path(&self, dir: &Path, shard: &ShardEntry) -> PathBuf {
        dir.join(&shard.file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        let entry = |name: &str, offset, ep_rank| ParamEntry {
            name: name.into(),
            shape: vec![2, 3],
            offset,
            split: SplitEntry::default(),
            stage: 0,
            ep_rank,
        };
        let shard = |file: &str, ep_rank| ShardEntry {
            file: file.into(),
            rank: 0,
            tp_rank: 0,
            stage: 0,
            ep_rank,
            start: 0,
            end: 6,
            bytes: 100,
            crc32c: 7,
        };
        Manifest {
            format: FORMAT.into(),
            tag: "t".into(),
            global_steps: 1,
            skipped_steps: 0,
            loss_scaler: LossScaleState {
                cur_scale: 1.0,
                cur_iter: 1,
                last_overflow_iter: -1,
                cur_hysteresis: 0,
            },
            layout: Layout {
                world_size: 2,
                dp: 2,
                tp: 1,
                pp: 1,
                zero_stage: 0,
                dtype: "f32".into(),
                ep: 2,
            },
            params: vec![entry("router", 0, None), entry("expert", 6, Some(1))],
            numel: 6,
            optimizer_buffers: vec![],
            optimizer_step: 1,
            shards: vec![
                shard("zero_rank00000.safetensors", None),
                shard("expert_rank00001.safetensors", Some(1)),
            ],
            client_state: serde_json::Value::Null,
            config: serde_json::Value::Null,
            frozen: None,
        }
    }

    #[test]
    fn a_manifest_written_before_expert_parallelism_reads_as_ep_1() {
        let mut m = manifest();
        m.params[1].ep_rank = None;
        m.shards.pop();
        let mut json = serde_json::to_value(&m).unwrap();
        json["layout"].as_object_mut().unwrap().remove("ep");
        let text = json.to_string();
        assert!(
            !text.contains("ep_rank") && !text.contains("\"ep\""),
            "{text}"
        );
        let read: Manifest = serde_json::from_str(&text).unwrap();
        assert_eq!(read.layout.ep, 1);
        assert_eq!(
            read,
            Manifest {
                layout: Layout {
                    ep: 1,
                    ..m.layout.clone()
                },
                ..m
            }
        );
        assert_eq!(read.check(), Ok(()));
    }

    #[test]
    fn an_expert_store_beyond_the_saved_ep_is_refused() {
        let m = manifest();
        let round: Manifest = serde_json::from_value(serde_json::to_value(&m).unwrap()).unwrap();
        assert_eq!(round, m);
        assert_eq!(m.check(), Ok(()));
        for shard in [false, true] {
            let mut bad = manifest();
            bad.layout.ep = 1;
            if shard {
                bad.params[1].ep_rank = None;
            }
            let why = bad.check().unwrap_err();
            assert!(
                why.contains("expert-parallel rank 1 at expert-parallel size 1"),
                "{why}"
            );
        }
    }
}
