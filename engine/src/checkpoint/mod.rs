//! Sharded checkpoints: every rank writes the flat range it owns (fp32 master copy and
//! optimizer buffers) as one safetensors file, rank 0 adds a JSON manifest, and the `latest`
//! file names the newest complete tag. Any layout loads any checkpoint: a rank reads the parts
//! of the saved ranges that overlap the range it owns now (DeepSpeed's universal checkpoint).
//!
//! Atomicity: files go to `.<tag>.partial/`, each fsynced; after a barrier rank 0 writes the
//! manifest, renames the directory to `<tag>` and only then replaces `latest` (write, fsync,
//! rename). A crash at any moment leaves `latest` naming a complete checkpoint.

mod files;
pub mod manifest;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ds_comm::Group;

pub use files::sync_dir;
use files::{write_atomic, ShardFile};
pub use manifest::{Layout, Manifest, ParamEntry, ShardEntry, MANIFEST};

use crate::loss_scale::LossScaleState;
use crate::{EngineError, Result};

/// The file that names the newest complete tag, as DeepSpeed's.
pub const LATEST: &str = "latest";

/// One rank's share of the training state.
#[derive(Debug, Clone, PartialEq)]
pub struct RankState {
    /// Flat range (padded coordinates) of `master` and every buffer.
    pub owned: Range<usize>,
    pub master: Vec<f32>,
    pub optimizer_step: u64,
    pub buffers: Vec<(String, Vec<f32>)>,
}

/// The replicated counters of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counters {
    pub global_steps: u64,
    pub skipped_steps: u64,
    pub loss_scaler: LossScaleState,
}

/// What rank 0 records beside the shards.
pub struct Description {
    pub layout: Layout,
    pub params: Vec<ParamEntry>,
    pub numel: usize,
    pub counters: Counters,
    pub client_state: serde_json::Value,
    pub config: serde_json::Value,
}

/// Writes this rank's part of checkpoint `dir/tag` (a collective over `group`). `writes`:
/// whether this rank's range must be saved (false for replicas of stage 0's whole range).
pub fn save(
    group: &Group,
    dir: &Path,
    tag: &str,
    state: &RankState,
    writes: bool,
    desc: Description,
) -> Result<PathBuf> {
    check_tag(tag)?;
    let (final_dir, partial) = (dir.join(tag), dir.join(format!(".{tag}.partial")));
    if group.rank() == 0 {
        if final_dir.exists() {
            return fail_all(
                group,
                EngineError::file(
                    &final_dir,
                    "this checkpoint tag exists already; nothing was overwritten",
                ),
            );
        }
        let made = std::fs::create_dir_all(dir)
            .and_then(|_| match partial.exists() {
                true => std::fs::remove_dir_all(&partial),
                false => Ok(()),
            })
            .and_then(|_| std::fs::create_dir(&partial));
        if let Err(e) = made {
            return fail_all(group, EngineError::file(&partial, e));
        }
    }
    agree(group, Ok(()))?;
    let written = if writes {
        write_shard(&partial, group.rank(), state, &desc).map(Some)
    } else {
        Ok(None)
    };
    let entry = agree(group, written)?;
    let entries = gather_entries(group, entry, state)?;
    let committed = match group.rank() {
        0 => commit(dir, tag, &partial, &final_dir, desc, state, entries),
        _ => Ok(()),
    };
    agree(group, committed)?;
    Ok(final_dir)
}

/// Every rank learns whether every rank succeeded; a failure anywhere fails everywhere, so
/// no rank goes on (or changes its state) while another has stopped.
pub(crate) fn agree<T>(group: &Group, mine: Result<T>) -> Result<T> {
    let all = group.all_gather_u64(&[mine.is_err() as u64])?;
    match (mine, all.iter().position(|&f| f != 0)) {
        (Err(e), _) => Err(e),
        (Ok(_), Some(r)) => Err(EngineError::Invalid(format!(
            "checkpoint: rank {r} failed; see its error"
        ))),
        (Ok(v), None) => Ok(v),
    }
}

fn fail_all<T>(group: &Group, e: EngineError) -> Result<T> {
    agree::<()>(group, Err(e)).map(|_| unreachable!("an error was agreed"))
}

fn check_tag(tag: &str) -> Result<()> {
    let ok = !tag.is_empty()
        && !tag.starts_with('.')
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    match ok {
        true => Ok(()),
        false => Err(EngineError::Invalid(format!(
            "checkpoint tag {tag:?}: use letters, digits, '_', '-', '.'"
        ))),
    }
}

fn shard_name(rank: usize) -> String {
    format!("zero_rank{rank:05}.safetensors")
}

fn write_shard(dir: &Path, rank: usize, s: &RankState, d: &Description) -> Result<(u64, u32)> {
    let mut tensors: Vec<(&str, &[f32])> = vec![("master", &s.master)];
    tensors.extend(s.buffers.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    let meta = HashMap::from([
        ("start".to_string(), s.owned.start.to_string()),
        ("end".to_string(), s.owned.end.to_string()),
        (
            "global_steps".to_string(),
            d.counters.global_steps.to_string(),
        ),
    ]);
    let bytes = files::encode(&tensors, meta)?;
    let path = dir.join(shard_name(rank));
    write_atomic(&path, &bytes)?;
    Ok((bytes.len() as u64, crc32c::crc32c(&bytes)))
}

/// Every rank's (range, size, checksum), in rank order; ranks that wrote nothing are left out.
fn gather_entries(
    group: &Group,
    entry: Option<(u64, u32)>,
    s: &RankState,
) -> Result<Vec<ShardEntry>> {
    let (bytes, crc) = entry.map_or((0, 0), |(b, c)| (b, c as u64));
    let mine = [
        entry.is_some() as u64,
        s.owned.start as u64,
        s.owned.end as u64,
        bytes,
        crc,
    ];
    let all = group.all_gather_u64(&mine)?;
    Ok(all
        .chunks(mine.len())
        .enumerate()
        .filter(|(_, v)| v[0] == 1)
        .map(|(rank, v)| ShardEntry {
            file: shard_name(rank),
            rank,
            start: v[1] as usize,
            end: v[2] as usize,
            bytes: v[3],
            crc32c: v[4] as u32,
        })
        .collect())
}

/// Rank 0: the manifest, the rename that makes the tag visible, then `latest`.
fn commit(
    dir: &Path,
    tag: &str,
    partial: &Path,
    final_dir: &Path,
    d: Description,
    s: &RankState,
    shards: Vec<ShardEntry>,
) -> Result<()> {
    let manifest = Manifest {
        format: manifest::FORMAT.into(),
        tag: tag.into(),
        global_steps: d.counters.global_steps,
        skipped_steps: d.counters.skipped_steps,
        loss_scaler: d.counters.loss_scaler,
        layout: d.layout,
        params: d.params,
        numel: d.numel,
        optimizer_buffers: s.buffers.iter().map(|(n, _)| n.clone()).collect(),
        optimizer_step: s.optimizer_step,
        shards,
        client_state: d.client_state,
        config: d.config,
    };
    let text = serde_json::to_string_pretty(&manifest).expect("invariant: plain JSON");
    write_atomic(&partial.join(MANIFEST), text.as_bytes())?;
    std::fs::rename(partial, final_dir).map_err(|e| EngineError::file(final_dir, e))?;
    sync_dir(dir)?;
    write_atomic(&dir.join(LATEST), tag.as_bytes())
}

/// The tag `latest` names in `dir`, if any.
pub fn latest(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(LATEST);
    match std::fs::read_to_string(&path) {
        Ok(t) => Ok(Some(t.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(EngineError::file(&path, e)),
    }
}

/// What a loading rank expects of a checkpoint.
pub struct Expect<'a> {
    pub params: &'a [ParamEntry],
    /// The optimizer buffers to read (None: the master copy only, as consolidation needs).
    pub buffers: Option<&'a [String]>,
    /// The flat range this rank owns now (padded coordinates).
    pub owned: Range<usize>,
}

/// Reads the parts of checkpoint `dir` (a tag's directory) that cover `expect.owned`.
pub fn load(dir: &Path, expect: &Expect) -> Result<(Manifest, RankState)> {
    let m = Manifest::read(dir)?;
    check_model(dir, &m, expect)?;
    let len = expect.owned.len();
    let mut master = vec![0f32; len];
    let mut buffers: Vec<(String, Vec<f32>)> = expect
        .buffers
        .unwrap_or_default()
        .iter()
        .map(|n| (n.clone(), vec![0f32; len]))
        .collect();
    let want = expect.owned.start..expect.owned.end.min(m.numel);
    for shard in &m.shards {
        let (lo, hi) = (want.start.max(shard.start), want.end.min(shard.end));
        if lo >= hi {
            continue;
        }
        let file = ShardFile::open(&m.shard_path(dir, shard), shard.bytes, shard.crc32c)?;
        let (src, dst) = (
            lo - shard.start..hi - shard.start,
            lo - expect.owned.start..hi - expect.owned.start,
        );
        master[dst.clone()].copy_from_slice(&file.slice("master", src.clone())?);
        for (name, buf) in &mut buffers {
            buf[dst.clone()].copy_from_slice(&file.slice(name, src.clone())?);
        }
    }
    check_covered(dir, &m, &want)?;
    let state = RankState {
        owned: expect.owned.clone(),
        master,
        optimizer_step: m.optimizer_step,
        buffers,
    };
    Ok((m, state))
}

fn check_model(dir: &Path, m: &Manifest, e: &Expect) -> Result<()> {
    let path = dir.join(MANIFEST);
    if let Some((saved, now)) = m.params.iter().zip(e.params).find(|(a, b)| a != b) {
        return Err(EngineError::file(
            &path,
            format!(
            "parameter {} {:?} does not match this model's {} {:?}: a checkpoint of another model",
            saved.name, saved.shape, now.name, now.shape
        ),
        ));
    }
    if m.params.len() != e.params.len() {
        return Err(EngineError::file(
            &path,
            format!(
                "{} parameters, this model has {}",
                m.params.len(),
                e.params.len()
            ),
        ));
    }
    if e.buffers.is_some_and(|b| m.optimizer_buffers != b) {
        return Err(EngineError::file(
            &path,
            format!(
                "optimizer state {:?}, this run's optimizer keeps {:?}",
                m.optimizer_buffers, e.buffers
            ),
        ));
    }
    if m.layout.tp != 1 || m.layout.pp != 1 {
        return Err(EngineError::file(
            &path,
            format!(
                "tp={} pp={}: this build maps only tp=1 pp=1",
                m.layout.tp, m.layout.pp
            ),
        ));
    }
    Ok(())
}

/// Every element of `want` must come from some shard (a missing rank file is an error).
fn check_covered(dir: &Path, m: &Manifest, want: &Range<usize>) -> Result<()> {
    let mut ranges: Vec<Range<usize>> = m.shards.iter().map(|s| s.start..s.end).collect();
    ranges.sort_by_key(|r| r.start);
    let mut at = want.start;
    for r in ranges {
        if r.start <= at {
            at = at.max(r.end);
        }
    }
    match at >= want.end {
        true => Ok(()),
        false => Err(EngineError::file(
            dir.join(MANIFEST),
            format!("no shard covers elements {at}..{}", want.end),
        )),
    }
}

/// The whole fp32 parameters of checkpoint `dir` (a tag's directory), in flat order, every
/// shard verified: DeepSpeed's zero_to_fp32.
pub fn consolidate(dir: &Path) -> Result<(Manifest, Vec<f32>)> {
    let m = Manifest::read(dir)?;
    let expect = Expect {
        params: &m.params,
        buffers: None,
        owned: 0..m.numel,
    };
    let (_, state) = load(dir, &expect)?;
    Ok((m, state.master))
}

/// Every shard of checkpoint `dir` checked against its size and checksum.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let m = Manifest::read(dir)?;
    for s in &m.shards {
        ShardFile::open(&m.shard_path(dir, s), s.bytes, s.crc32c)?;
    }
    check_covered(dir, &m, &(0..m.numel))?;
    Ok(m)
}

/// Complete checkpoints in `dir` (directories with a manifest), oldest first.
pub fn tags(dir: &Path) -> Result<Vec<(u64, String)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, e))?;
    let mut tags: Vec<(u64, String)> = entries
        .flatten()
        .filter(|e| e.path().join(MANIFEST).is_file())
        .filter_map(|e| {
            Manifest::read(&e.path())
                .ok()
                .map(|m| (m.global_steps, m.tag))
        })
        .collect();
    tags.sort();
    Ok(tags)
}

/// Removes all but the newest `keep` complete checkpoints (never the one `latest` names).
pub fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = tags(dir)?;
    let latest = latest(dir)?;
    for (_, tag) in all.iter().take(all.len().saturating_sub(keep)) {
        if Some(tag) != latest.as_ref() {
            let path = dir.join(tag);
            std::fs::remove_dir_all(&path).map_err(|e| EngineError::file(&path, e))?;
        }
    }
    Ok(())
}
