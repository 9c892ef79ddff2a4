//! Sharded checkpoints: every rank writes the flat range it owns (fp32 master copy and
//! optimizer buffers) as one safetensors file, rank 0 adds a JSON manifest, and the `latest`
//! file names the newest complete tag. Any layout loads any checkpoint (DeepSpeed's universal
//! checkpoint): a rank reads the parts of the saved ranges that overlap the range it owns now.
//! Under tensor parallelism a file holds a range of one tensor-parallel rank's slices; the
//! manifest's logical parameters and their splits map any slice of one layout to the files
//! of another (Note [resharding]).
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
use ds_partition::{runs, runs_within, FlatIndex, ParamId, TpRank};

pub use files::sync_dir;
use files::{write_atomic, ShardFile};
pub use manifest::{FrozenPart, Layout, Manifest, ParamEntry, ShardEntry, MANIFEST};

use crate::loss_scale::LossScaleState;
use crate::{crash_point, EngineError, Result};

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
    /// Elements of this rank's (stage's, tensor-parallel slice's) flat buffer.
    pub numel: usize,
    pub tp_rank: usize,
    pub stage: usize,
    pub counters: Counters,
    pub client_state: serde_json::Value,
    pub config: serde_json::Value,
    pub frozen: Option<manifest::FrozenPart>,
}

/// Writes this rank's part of checkpoint `dir/tag` (a collective over `group`, every rank of
/// the job). `writes`: whether this rank's range must be saved (false for data-parallel
/// replicas of stage 0's whole range).
pub fn save(
    group: &Group,
    dir: &Path,
    tag: &str,
    state: &RankState,
    writes: bool,
    desc: Description,
) -> Result<PathBuf> {
    check_tag(tag)?;
    crash_point::point("save.start");
    let (final_dir, partial) = (dir.join(tag), dir.join(format!(".{tag}.partial")));
    if group.rank() == 0 {
        if final_dir.exists() {
            if let Err(e) = remove_unpublished(dir, tag) {
                return fail_all(group, e);
            }
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
    crash_point::point("save.partial");
    let saved = write_and_commit(group, dir, tag, (&partial, &final_dir), state, writes, desc);
    if saved.is_err() && group.rank() == 0 {
        // Give back the space of a save that failed (a full disk): the directory is gone if
        // the failure came after the rename, and a failure before it leaves nothing to keep.
        let _ = std::fs::remove_dir_all(&partial);
    }
    saved?;
    crash_point::point("save.end");
    Ok(final_dir)
}

/// The shards, then rank 0's commit; every rank learns whether each part succeeded.
fn write_and_commit(
    group: &Group,
    dir: &Path,
    tag: &str,
    (partial, final_dir): (&Path, &Path),
    state: &RankState,
    writes: bool,
    desc: Description,
) -> Result<()> {
    let written = if writes {
        write_shard(partial, group.rank(), state, &desc).map(Some)
    } else {
        Ok(None)
    };
    let entry = agree(group, written)?;
    crash_point::point("save.shards");
    let entries = gather_entries(group, entry, state, (desc.stage, desc.tp_rank))?;
    let committed = match group.rank() {
        0 => commit(dir, tag, partial, final_dir, desc, state, entries),
        _ => Ok(()),
    };
    agree(group, committed)
}

/// Note [unpublished tags]: a save killed between renaming its directory into place and
/// replacing `latest` leaves a complete tag that `latest` never named, one step past it. A
/// run resumed from `latest` reaches that step again and saves the same tag: that leftover
/// (newer than every published checkpoint) is removed and written afresh. A tag `latest` names,
/// or one older than it, is never overwritten.
fn remove_unpublished(dir: &Path, tag: &str) -> Result<()> {
    let existing = &dir.join(tag);
    let refuse = || {
        Err(EngineError::file(
            existing,
            "this checkpoint tag exists already; nothing was overwritten",
        ))
    };
    let published = match latest(dir)? {
        Some(tag) => Manifest::read(&dir.join(tag))?.global_steps,
        None => 0,
    };
    match Manifest::read(existing) {
        Ok(m)
            if m.tag == tag
                && m.global_steps > published
                && latest(dir)?.as_deref() != Some(tag) =>
        {
            remove_leftovers(dir)?;
            remove_tag(dir, tag)
        }
        _ => refuse(),
    }
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
    let meta = [
        ("start", s.owned.start.to_string()),
        ("end", s.owned.end.to_string()),
        ("global_steps", d.counters.global_steps.to_string()),
    ];
    files::write_tensors_atomic(&dir.join(shard_name(rank)), &tensors, &meta)
}

/// Every rank's (range, size, checksum), in rank order; ranks that wrote nothing are left out.
fn gather_entries(
    group: &Group,
    entry: Option<(u64, u32)>,
    s: &RankState,
    (stage, tp_rank): Buffer,
) -> Result<Vec<ShardEntry>> {
    let (bytes, crc) = entry.map_or((0, 0), |(b, c)| (b, c as u64));
    let mine = [
        entry.is_some() as u64,
        s.owned.start as u64,
        s.owned.end as u64,
        bytes,
        crc,
        tp_rank as u64,
        stage as u64,
    ];
    let all = group.all_gather_u64(&mine)?;
    Ok(all
        .chunks(mine.len())
        .enumerate()
        .filter(|(_, v)| v[0] == 1)
        .map(|(rank, v)| ShardEntry {
            file: shard_name(rank),
            rank,
            tp_rank: v[5] as usize,
            stage: v[6] as usize,
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
        frozen: d.frozen,
    };
    let text = serde_json::to_string_pretty(&manifest).expect("invariant: plain JSON");
    write_atomic(&partial.join(MANIFEST), text.as_bytes())?;
    std::fs::rename(partial, final_dir).map_err(|e| EngineError::file(final_dir, e))?;
    crash_point::point("commit.renamed");
    sync_dir(dir)?;
    write_atomic(&dir.join(LATEST), tag.as_bytes())?;
    crash_point::point("commit.published");
    Ok(())
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
    /// The whole model's parameters, each tagged with the stage that holds it now.
    pub params: &'a [ParamEntry],
    /// The optimizer buffers to read (None: the master copy only, as consolidation needs).
    pub buffers: Option<&'a [String]>,
    /// The flat range this rank owns now (padded coordinates of its buffer).
    pub owned: Range<usize>,
    /// Whose slices the loading rank holds, of which stage's layers.
    pub tp: TpRank,
    pub stage: usize,
}

/// The master copy and the optimizer buffers being read for a range.
struct Target {
    master: Vec<f32>,
    buffers: Vec<(String, Vec<f32>)>,
}

/// Reads the parts of checkpoint `dir` (a tag's directory) that cover `expect.owned`.
pub fn load(dir: &Path, expect: &Expect) -> Result<(Manifest, RankState)> {
    let m = Manifest::read(dir)?;
    check_model(dir, &m, expect)?;
    let len = expect.owned.len();
    let mut out = Target {
        master: vec![0f32; len],
        buffers: expect
            .buffers
            .unwrap_or_default()
            .iter()
            .map(|n| (n.clone(), vec![0f32; len]))
            .collect(),
    };
    let mut files = Files::new(dir, &m);
    read_range(&mut files, &m, expect, &mut out)?;
    let state = RankState {
        owned: expect.owned.clone(),
        master: out.master,
        optimizer_step: m.optimizer_step,
        buffers: out.buffers,
    };
    Ok((m, state))
}

/// Reads the parts of an open checkpoint that cover `expect.owned` into `out`.
fn read_range(files: &mut Files, m: &Manifest, expect: &Expect, out: &mut Target) -> Result<()> {
    let same_place = m
        .params
        .iter()
        .zip(expect.params)
        .all(|(a, b)| a.split == b.split && a.stage == b.stage);
    if m.layout.tp == expect.tp.size && same_place {
        // the same buffers: the range is the same range of the same stage's same slices
        let numel = local_index(&m.params, expect.stage, expect.tp)?.numel();
        let want = expect.owned.start..expect.owned.end.min(numel);
        let buffer = (expect.stage, expect.tp.rank);
        files.copy(buffer, want, 0, out)
    } else {
        reshard(files, m, expect, out)
    }
}

/// Note [resharding]: a checkpoint saved at tensor-parallel degree tp' and with its layers on
/// other pipeline stages is read through logical coordinates. For each parameter overlapping
/// the loading rank's range, its slice is a list of runs of logical elements (`runs`); each
/// run is found in the buffers of the stage that saved the parameter (every tensor-parallel
/// rank's for a split parameter, rank 0's for a replicated one), whose runs say where those
/// elements sit in that buffer, and so in which file.
fn reshard(files: &mut Files, m: &Manifest, expect: &Expect, out: &mut Target) -> Result<()> {
    let saved_tp = m.layout.tp.max(1);
    let mut saved: HashMap<Buffer, FlatIndex> = HashMap::new();
    for stage in stages_of(&m.params) {
        for rank in 0..saved_tp {
            let tp = TpRank {
                rank,
                size: saved_tp,
            };
            saved.insert((stage, rank), local_index(&m.params, stage, tp)?);
        }
    }
    let stage_of: HashMap<&str, usize> = m
        .params
        .iter()
        .map(|p| (p.name.as_str(), p.stage))
        .collect();
    let mine = local_index(expect.params, expect.stage, expect.tp)?;
    for (i, e) in mine.entries().iter().enumerate() {
        let p = e.range();
        let (a, b) = (p.start.max(expect.owned.start), p.end.min(expect.owned.end));
        if a >= b {
            continue;
        }
        let pieces = saved_pieces(&saved, stage_of[e.name.as_str()], saved_tp, &e.name);
        let mut result = Ok(());
        runs_within(&mine.runs(ParamId(i)), a - p.start..b - p.start, |r| {
            if result.is_err() {
                return;
            }
            let dst = a - expect.owned.start + r.local;
            result = copy_logical(files, &pieces, r.logical..r.logical + r.len, dst, out);
        });
        result?;
    }
    Ok(())
}

/// A saved flat buffer: (pipeline stage, tensor-parallel rank).
type Buffer = (usize, usize);

/// A run of a saved parameter: `len` logical elements from `logical`, held in `buffer` at
/// `flat`.
struct Piece {
    logical: usize,
    len: usize,
    buffer: Buffer,
    flat: usize,
}

/// Where parameter `name`'s logical elements were saved (by stage `stage`'s `tp` ranks),
/// sorted by logical position.
fn saved_pieces(
    saved: &HashMap<Buffer, FlatIndex>,
    stage: usize,
    tp: usize,
    name: &str,
) -> Vec<Piece> {
    let index = |rank: usize| &saved[&(stage, rank)];
    let id = index(0)
        .find(name)
        .expect("invariant: the stage's index holds its parameters");
    let ranks = match index(0).entry(id).split.is_replicated() {
        true => 1,
        false => tp,
    };
    let mut pieces: Vec<Piece> = (0..ranks)
        .flat_map(|rank| {
            let e = index(rank).entry(id);
            runs(&e.logical_shape, e.split, index(rank).tp())
                .into_iter()
                .map(move |r| Piece {
                    logical: r.logical,
                    len: r.len,
                    buffer: (stage, rank),
                    flat: e.offset + r.local,
                })
        })
        .collect();
    pieces.sort_by_key(|p| p.logical);
    pieces
}

/// Copies logical elements `want` of one parameter into `out` at `dst`, from the saved
/// pieces holding them.
fn copy_logical(
    files: &mut Files,
    pieces: &[Piece],
    want: Range<usize>,
    mut dst: usize,
    out: &mut Target,
) -> Result<()> {
    let first = pieces.partition_point(|p| p.logical + p.len <= want.start);
    let mut at = want.start;
    for p in &pieces[first..] {
        if at >= want.end {
            break;
        }
        let (lo, hi) = (at.max(p.logical), want.end.min(p.logical + p.len));
        let from = p.flat + (lo - p.logical);
        files.copy(p.buffer, from..from + (hi - lo), dst, out)?;
        dst += hi - lo;
        at = hi;
    }
    Ok(())
}

/// The stages that hold parameters, in order.
fn stages_of(params: &[ParamEntry]) -> Vec<usize> {
    let mut stages: Vec<usize> = params.iter().map(|p| p.stage).collect();
    stages.sort_unstable();
    stages.dedup();
    stages
}

/// The flat index of the slices `tp` holds of stage `stage`'s logical parameters.
fn local_index(params: &[ParamEntry], stage: usize, tp: TpRank) -> Result<FlatIndex> {
    let mut index = FlatIndex::sliced(tp);
    for p in params.iter().filter(|p| p.stage == stage) {
        index.push_split(&p.name, &p.shape, p.split.into())?;
    }
    Ok(index)
}

/// A checkpoint's shard files, each opened (and its checksum verified) on first use.
struct Files<'a> {
    dir: &'a Path,
    m: &'a Manifest,
    open: HashMap<usize, ShardFile>,
}

impl<'a> Files<'a> {
    fn new(dir: &'a Path, m: &'a Manifest) -> Files<'a> {
        Files {
            dir,
            m,
            open: HashMap::new(),
        }
    }

    /// Copies elements `src` of `buffer` (from whichever shards hold them) into `out` at
    /// `dst`; an element no shard holds is an error.
    fn copy(
        &mut self,
        buffer: Buffer,
        src: Range<usize>,
        dst: usize,
        out: &mut Target,
    ) -> Result<()> {
        let mut covered = 0;
        for (k, shard) in self.m.shards.iter().enumerate() {
            let (lo, hi) = (src.start.max(shard.start), src.end.min(shard.end));
            if (shard.stage, shard.tp_rank) != buffer || lo >= hi {
                continue;
            }
            let file = match self.open.entry(k) {
                std::collections::hash_map::Entry::Occupied(f) => f.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => v.insert(ShardFile::open(
                    &self.m.shard_path(self.dir, shard),
                    shard.bytes,
                    shard.crc32c,
                )?),
            };
            let (from, to) = (
                lo - shard.start..hi - shard.start,
                dst + lo - src.start..dst + hi - src.start,
            );
            out.master[to.clone()].copy_from_slice(&file.slice("master", from.clone())?);
            for (name, buf) in &mut out.buffers {
                buf[to.clone()].copy_from_slice(&file.slice(name, from.clone())?);
            }
            covered += hi - lo;
        }
        match covered >= src.len() {
            true => Ok(()),
            false => Err(EngineError::file(
                self.dir.join(MANIFEST),
                format!(
                    "no shard covers elements {src:?} of stage {}'s tensor-parallel rank {}'s buffer",
                    buffer.0, buffer.1
                ),
            )),
        }
    }
}

fn check_model(dir: &Path, m: &Manifest, e: &Expect) -> Result<()> {
    let path = dir.join(MANIFEST);
    let same = |a: &ParamEntry, b: &ParamEntry| a.name == b.name && a.shape == b.shape;
    if let Some((saved, now)) = m.params.iter().zip(e.params).find(|(a, b)| !same(a, b)) {
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

    Ok(())
}

/// Every element of every tensor-parallel rank's buffer must come from some shard (a
/// missing rank file is an error).
fn check_covered(dir: &Path, m: &Manifest) -> Result<()> {
    let tp = m.layout.tp.max(1);
    for (stage, tp_rank) in stages_of(&m.params)
        .into_iter()
        .flat_map(|s| (0..tp).map(move |r| (s, r)))
    {
        let numel = local_index(
            &m.params,
            stage,
            TpRank {
                rank: tp_rank,
                size: tp,
            },
        )?
        .numel();
        let mut ranges: Vec<Range<usize>> = m
            .shards
            .iter()
            .filter(|s| (s.stage, s.tp_rank) == (stage, tp_rank))
            .map(|s| s.start..s.end)
            .collect();
        ranges.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in ranges {
            if r.start <= at {
                at = at.max(r.end);
            }
        }
        if at < numel {
            return Err(EngineError::file(
                dir.join(MANIFEST),
                format!(
                    "no shard covers elements {at}..{numel} of stage {stage}'s tensor-parallel rank {tp_rank}'s buffer"
                ),
            ));
        }
    }
    Ok(())
}

/// The logical model as one buffer: one stage, no tensor parallelism.
fn whole_model(m: &Manifest) -> Vec<ParamEntry> {
    m.params
        .iter()
        .map(|p| ParamEntry {
            stage: 0,
            ..p.clone()
        })
        .collect()
}

/// Each whole fp32 parameter of checkpoint `dir` (a tag's directory) in flat order, one at a
/// time, every shard verified: what a consolidation or an export writes, with no more than
/// one tensor in memory.
pub fn each_tensor(
    dir: &Path,
    mut f: impl FnMut(&ParamEntry, &[f32]) -> Result<()>,
) -> Result<Manifest> {
    let m = Manifest::read(dir)?;
    on_disk(dir, &m, m.parameters())?;
    let whole = whole_model(&m);
    let mut files = Files::new(dir, &m);
    for p in &whole {
        let n: usize = p.shape.iter().product();
        let expect = Expect {
            params: &whole,
            buffers: None,
            owned: p.offset..p.offset + n,
            tp: TpRank::WHOLE,
            stage: 0,
        };
        let mut out = Target {
            master: vec![0f32; n],
            buffers: Vec::new(),
        };
        read_range(&mut files, &m, &expect, &mut out)?;
        f(p, &out.master)?;
    }
    Ok(m)
}

/// Writes checkpoint `dir`'s (a tag's directory) parameters as one safetensors file under
/// their names, in `dtype`, a tensor at a time: DeepSpeed's zero_to_fp32 without the whole
/// model in memory.
pub fn write_weights(
    dir: &Path,
    out: &Path,
    dtype: crate::model::weights::SaveDtype,
) -> Result<Manifest> {
    write_weights_with(dir, out, dtype, &[])
}

/// As `write_weights`, with `extra` tensors (name, shape, values) after the checkpoint's: a
/// model's frozen parameters, which checkpoints do not hold.
pub fn write_weights_with(
    dir: &Path,
    out: &Path,
    dtype: crate::model::weights::SaveDtype,
    extra: &[(String, Vec<usize>, Vec<f32>)],
) -> Result<Manifest> {
    let m = Manifest::read(dir)?;
    let tensors: Vec<(String, Vec<usize>)> = m
        .params
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone()))
        .chain(extra.iter().map(|(n, s, _)| (n.clone(), s.clone())))
        .collect();
    let mut w =
        crate::model::weights::StreamingWriter::create(out, &tensors, dtype, &[("format", "pt")])?;
    each_tensor(dir, |_, values| w.put(values))?;
    for (_, _, values) in extra {
        w.put(values)?;
    }
    w.finish()?;
    Ok(m)
}

/// The whole fp32 parameters of checkpoint `dir` (a tag's directory), in flat order, every
/// shard verified: DeepSpeed's zero_to_fp32.
pub fn consolidate(dir: &Path) -> Result<(Manifest, Vec<f32>)> {
    let m = Manifest::read(dir)?;
    let numel = m.parameters();
    on_disk(dir, &m, numel)?;
    let whole = whole_model(&m);
    let expect = Expect {
        params: &whole,
        buffers: None,
        owned: 0..numel,
        tp: TpRank::WHOLE,
        stage: 0,
    };
    let (_, state) = load(dir, &expect)?;
    Ok((m, state.master))
}

/// Checks that the shard files hold at least `numel` f32 elements before a buffer of that
/// size is made: the manifest's shapes are only numbers in a file.
fn on_disk(dir: &Path, m: &Manifest, numel: usize) -> Result<()> {
    let mut bytes = 0u64;
    for s in &m.shards {
        let path = m.shard_path(dir, s);
        let len = std::fs::metadata(&path)
            .map_err(|e| EngineError::file(&path, e))?
            .len();
        bytes = bytes.saturating_add(len);
    }
    if (numel as u64).saturating_mul(4) > bytes {
        return Err(EngineError::file(
            dir.join(MANIFEST),
            format!("{numel} parameters, but the shard files hold {bytes} bytes"),
        ));
    }
    Ok(())
}

/// Every shard of checkpoint `dir` checked against its size and checksum.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let m = Manifest::read(dir)?;
    for s in &m.shards {
        ShardFile::open(&m.shard_path(dir, s), s.bytes, s.crc32c)?;
    }
    check_covered(dir, &m)?;
    Ok(m)
}

/// Complete checkpoints in `dir` (directories with a manifest of their own name), oldest
/// first. A save killed after its manifest but before its rename leaves `.<tag>.partial/`
/// with a manifest naming `<tag>`: not a checkpoint, and not listed.
pub fn tags(dir: &Path) -> Result<Vec<(u64, String)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, e))?;
    let mut tags: Vec<(u64, String)> = entries
        .flatten()
        .filter(|e| e.path().join(MANIFEST).is_file())
        .filter_map(|e| {
            Manifest::read(&e.path())
                .ok()
                .filter(|m| e.file_name() == m.tag.as_str())
                .map(|m| (m.global_steps, m.tag))
        })
        .collect();
    tags.sort();
    Ok(tags)
}

/// Removes all but the newest `keep` complete checkpoints (never the one `latest` names); a
/// checkpoint another process removed first (pruning the same directory) is no error.
pub fn prune(dir: &Path, keep: usize) -> Result<()> {
    remove_leftovers(dir)?;
    let all = tags(dir)?;
    let latest = latest(dir)?;
    for (_, tag) in all.iter().take(all.len().saturating_sub(keep)) {
        if Some(tag) != latest.as_ref() {
            remove_tag(dir, tag)?;
        }
    }
    Ok(())
}

/// Renames the tag away first, one atomic step, then deletes it: a process killed while
/// deleting leaves `.<tag>.removed/` (deleted by the next prune or save), never a half-deleted
/// tag that `tags()` would list and `inspect` call corrupt.
fn remove_tag(dir: &Path, tag: &str) -> Result<()> {
    let (path, doomed) = (dir.join(tag), dir.join(format!(".{tag}.removed")));
    match std::fs::rename(&path, &doomed) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(EngineError::file(&path, e)),
        Ok(()) => {}
    }
    crash_point::point("remove.renamed");
    remove_dir(&doomed)
}

/// Deletes what a removal killed midway left (`.<tag>.removed/`).
pub fn remove_leftovers(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| EngineError::file(dir, e))?;
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(".removed") {
            remove_dir(&e.path())?;
        }
    }
    Ok(())
}

/// `remove_dir_all`, where a directory already gone is no error.
fn remove_dir(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EngineError::file(path, e)),
        _ => Ok(()),
    }
}
