//! Sharded checkpoints: every rank writes the flat range it owns (fp32 master copy and
//! optimizer buffers) as one safetensors file, rank 0 adds a JSON manifest, and the `latest`
//! file names the newest complete tag. Any layout loads any checkpoint (DeepSpeed's universal
//! checkpoint): a rank reads the parts of the saved ranges that overlap the range it owns now.
//! Under tensor parallelism a file holds a range of one tensor-parallel rank's slices, and
//! under expert parallelism a rank writes a second file for its experts' store; the
//! manifest's logical parameters, their splits and stores map any slice of one layout to the
//! files of another (Note [resharding]).
//!
//! Why one long file: the save protocol, the load by range overlap and the consolidation share
//! the shard arithmetic and the atomicity rules above, and read best beside them; the formats
//! of other tools are modules of their own (deepspeed, universal, torch).
//!
//! Atomicity: files go to `.<tag>.partial/`, each fsynced; after a barrier rank 0 writes the
//! manifest, renames the directory to `<tag>` and only then replaces `latest` (write, fsync,
//! rename). A crash at any moment leaves `latest` naming a complete checkpoint.

pub mod crash_point;
pub mod deepspeed;
mod error;
mod files;
pub mod manifest;
pub mod torch;
pub mod universal;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ds_comm::Group;
use ds_partition::{runs, runs_within, FlatIndex, ParamId, TpRank};

pub use error::{CheckpointError, Result};
pub use files::sync_dir;
use files::{write_atomic, ShardFile};
pub use manifest::{
    FrozenPart, Layout, LossScaleState, Manifest, ParamEntry, ShardEntry, MANIFEST,
};

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
    /// The whole model (every expert-parallel rank's experts too), each parameter with the
    /// store that holds it.
    pub params: Vec<ParamEntry>,
    /// Elements of this rank's (stage's, tensor-parallel slice's) dense flat buffer.
    pub numel: usize,
    pub tp_rank: usize,
    pub stage: usize,
    /// This rank's expert-parallel rank (0 without expert parallelism).
    pub ep_rank: usize,
    pub counters: Counters,
    pub client_state: serde_json::Value,
    pub config: serde_json::Value,
    pub frozen: Option<manifest::FrozenPart>,
}

/// One of a rank's stores to save: its share of the state, and whether this rank writes it
/// (false for data-parallel replicas of stage 0's whole range).
pub struct Share<'a> {
    pub state: &'a RankState,
    pub writes: bool,
}

/// What one rank saves: its dense store's share and, under expert parallelism, its experts'
/// store's (a file of its own).
pub struct Shares<'a> {
    pub dense: Share<'a>,
    pub experts: Option<Share<'a>>,
}

/// Writes this rank's part of checkpoint `dir/tag` (a collective over `group`, every rank of
/// the job).
pub fn save(
    group: &Group,
    dir: &Path,
    tag: &str,
    shares: &Shares,
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
            return fail_all(group, CheckpointError::file(&partial, e));
        }
    }
    agree::<(), CheckpointError>(group, Ok(()))?;
    crash_point::point("save.partial");
    let saved = write_and_commit(group, dir, tag, (&partial, &final_dir), shares, desc);
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
    shares: &Shares,
    desc: Description,
) -> Result<()> {
    let rank = group.rank();
    let stores = [
        Some((&shares.dense, None)),
        shares.experts.as_ref().map(|s| (s, Some(desc.ep_rank))),
    ];
    // both stores' files, then one agreement: a failure in either fails the save everywhere
    let written: Result<Vec<Option<Written>>> = stores
        .into_iter()
        .map(|store| match store {
            Some((share, ep_rank)) if share.writes => {
                write_store(partial, rank, share, ep_rank, &desc).map(Some)
            }
            _ => Ok(None),
        })
        .collect();
    let written = agree(group, written)?;
    crash_point::point("save.shards");
    let entries = gather_entries(group, &written)?;
    let committed = match rank {
        0 => commit(
            dir,
            tag,
            (partial, final_dir),
            desc,
            Optimizer::of(shares.dense.state),
            entries,
        ),
        _ => Ok(()),
    };
    agree(group, committed)
}

/// A shard file this rank wrote (its name follows from the rank and the store).
struct Written {
    buffer: Buffer,
    range: Range<usize>,
    bytes: u64,
    crc: u32,
}

/// Writes `rank`'s file of its dense store (`ep_rank` None) or of its experts' store.
fn write_store(
    partial: &Path,
    rank: usize,
    share: &Share,
    ep_rank: Option<usize>,
    desc: &Description,
) -> Result<Written> {
    let store = Store {
        stage: desc.stage,
        ep_rank,
    };
    let path = partial.join(shard_name(rank, store));
    let (bytes, crc) = write_shard(&path, share.state, desc)?;
    Ok(Written {
        buffer: (store, desc.tp_rank),
        range: share.state.owned.clone(),
        bytes,
        crc,
    })
}

/// Note [unpublished tags]: a save killed between renaming its directory into place and
/// replacing `latest` leaves a complete tag that `latest` never named, one step past it. A
/// run resumed from `latest` reaches that step again and saves the same tag: that leftover
/// (newer than every published checkpoint) is removed and written afresh. A tag `latest` names,
/// or one older than it, is never overwritten.
fn remove_unpublished(dir: &Path, tag: &str) -> Result<()> {
    let existing = &dir.join(tag);
    let refuse = || {
        Err(CheckpointError::file(
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
pub fn agree<T, E>(group: &Group, mine: std::result::Result<T, E>) -> std::result::Result<T, E>
where
    E: From<CheckpointError> + From<ds_comm::CommError>,
{
    let all = group.all_gather_u64(&[mine.is_err() as u64])?;
    match (mine, all.iter().position(|&f| f != 0)) {
        (Err(e), _) => Err(e),
        (Ok(_), Some(r)) => Err(CheckpointError::Invalid(format!(
            "checkpoint: rank {r} failed; see its error"
        ))
        .into()),
        (Ok(v), None) => Ok(v),
    }
}

fn fail_all<T>(group: &Group, e: CheckpointError) -> Result<T> {
    agree::<(), CheckpointError>(group, Err(e)).map(|_| unreachable!("an error was agreed"))
}

fn check_tag(tag: &str) -> Result<()> {
    let ok = !tag.is_empty()
        && !tag.starts_with('.')
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    match ok {
        true => Ok(()),
        false => Err(CheckpointError::Invalid(format!(
            "checkpoint tag {tag:?}: use letters, digits, '_', '-', '.'"
        ))),
    }
}

/// Rank `rank`'s file of a store: `zero_rank00003.safetensors` for the dense one (the name of
/// every checkpoint before expert parallelism), `expert_rank00003.safetensors` for its
/// experts'.
fn shard_name(rank: usize, store: Store) -> String {
    match store.ep_rank {
        None => format!("zero_rank{rank:05}.safetensors"),
        Some(_) => format!("expert_rank{rank:05}.safetensors"),
    }
}

fn write_shard(path: &Path, s: &RankState, d: &Description) -> Result<(u64, u32)> {
    let mut tensors: Vec<(&str, &[f32])> = vec![("master", &s.master)];
    tensors.extend(s.buffers.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    let meta = [
        ("start", s.owned.start.to_string()),
        ("end", s.owned.end.to_string()),
        ("global_steps", d.counters.global_steps.to_string()),
    ];
    files::write_tensors_atomic(path, &tensors, &meta)
}

/// Every rank's files (range, size, checksum), in rank order, its dense store's before its
/// experts'. Each rank sends a slot per store, empty where it wrote nothing.
fn gather_entries(group: &Group, written: &[Option<Written>]) -> Result<Vec<ShardEntry>> {
    const SLOT: usize = 8;
    let mine: Vec<u64> = written
        .iter()
        .flat_map(|w| match w {
            None => [0; SLOT],
            Some(w) => [
                1,
                w.range.start as u64,
                w.range.end as u64,
                w.bytes,
                w.crc as u64,
                w.buffer.1 as u64,
                w.buffer.0.stage as u64,
                // 0 for the dense store, else 1 + the expert-parallel rank
                w.buffer.0.ep_rank.map_or(0, |r| r as u64 + 1),
            ],
        })
        .collect();
    let all = group.all_gather_u64(&mine)?;
    Ok(all
        .chunks(mine.len())
        .enumerate()
        .flat_map(|(rank, slots)| slots.chunks(SLOT).map(move |v| (rank, v)))
        .filter(|(_, v)| v[0] == 1)
        .map(|(rank, v)| {
            let store = Store {
                stage: v[6] as usize,
                ep_rank: v[7].checked_sub(1).map(|r| r as usize),
            };
            ShardEntry {
                file: shard_name(rank, store),
                rank,
                tp_rank: v[5] as usize,
                stage: store.stage,
                ep_rank: store.ep_rank,
                start: v[1] as usize,
                end: v[2] as usize,
                bytes: v[3],
                crc32c: v[4] as u32,
            }
        })
        .collect())
}

/// What the manifest says of the optimizer: its buffers' names and its step.
pub(crate) struct Optimizer {
    pub buffers: Vec<String>,
    pub step: u64,
}

impl Optimizer {
    fn of(s: &RankState) -> Optimizer {
        Optimizer {
            buffers: s.buffers.iter().map(|(n, _)| n.clone()).collect(),
            step: s.optimizer_step,
        }
    }
}

/// Rank 0: the manifest, the rename that makes the tag visible, then `latest`.
fn commit(
    dir: &Path,
    tag: &str,
    (partial, final_dir): (&Path, &Path),
    d: Description,
    optimizer: Optimizer,
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
        optimizer_buffers: optimizer.buffers,
        optimizer_step: optimizer.step,
        shards,
        client_state: d.client_state,
        config: d.config,
        frozen: d.frozen,
    };
    let text = serde_json::to_string_pretty(&manifest).expect("invariant: plain JSON");
    write_atomic(&partial.join(MANIFEST), text.as_bytes())?;
    std::fs::rename(partial, final_dir).map_err(|e| CheckpointError::file(final_dir, e))?;
    crash_point::point("commit.renamed");
    sync_dir(dir)?;
    write_atomic(&dir.join(LATEST), tag.as_bytes())?;
    crash_point::point("commit.published");
    Ok(())
}

/// Writes checkpoint `dir/tag` of one process's whole flat model without a job (an import):
/// the files, the manifest and the publication of `save`, nothing left behind on failure.
/// `fill(0, sink)` gives the master copy's `numel` values, `fill(1 + b, sink)` buffer b's, in
/// pieces (one parameter at a time).
pub(crate) fn write_single(
    dir: &Path,
    tag: &str,
    desc: Description,
    optimizer: Optimizer,
    fill: impl FnMut(usize, &mut dyn FnMut(&[f32]) -> Result<()>) -> Result<()>,
) -> Result<PathBuf> {
    check_tag(tag)?;
    let (final_dir, partial) = (dir.join(tag), dir.join(format!(".{tag}.partial")));
    if final_dir.exists() {
        return Err(CheckpointError::file(
            &final_dir,
            "this checkpoint tag exists already; nothing was overwritten",
        ));
    }
    std::fs::create_dir_all(dir)
        .and_then(|_| match partial.exists() {
            true => std::fs::remove_dir_all(&partial),
            false => Ok(()),
        })
        .and_then(|_| std::fs::create_dir(&partial))
        .map_err(|e| CheckpointError::file(&partial, e))?;
    let store = Store {
        stage: 0,
        ep_rank: None,
    };
    let file = shard_name(0, store);
    let numel = desc.numel;
    let names: Vec<&str> = std::iter::once("master")
        .chain(optimizer.buffers.iter().map(|b| b.as_str()))
        .collect();
    let sizes: Vec<(&str, usize)> = names.iter().map(|n| (*n, numel)).collect();
    let meta = [
        ("start", "0".to_string()),
        ("end", numel.to_string()),
        ("global_steps", desc.counters.global_steps.to_string()),
    ];
    let path = partial.join(&file);
    let written =
        files::write_tensors_streaming(&path, &sizes, &meta, fill).and_then(|(bytes, crc32c)| {
            let shard = ShardEntry {
                file,
                rank: 0,
                tp_rank: 0,
                stage: 0,
                ep_rank: None,
                start: 0,
                end: numel,
                bytes,
                crc32c,
            };
            commit(
                dir,
                tag,
                (&partial, &final_dir),
                desc,
                optimizer,
                vec![shard],
            )
        });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    written.map(|_| final_dir)
}

/// The tag `latest` names in `dir`, if any.
pub fn latest(dir: &Path) -> Result<Option<String>> {
    let path = dir.join(LATEST);
    match std::fs::read_to_string(&path) {
        Ok(t) => Ok(Some(t.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CheckpointError::file(&path, e)),
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
    /// Whose slices the loading rank holds, of which stage's layers ...
    pub tp: TpRank,
    pub stage: usize,
    /// ... in which of its stores: the dense one (None) or its experts' as expert-parallel
    /// rank r (`params` name the experts' holders).
    pub ep_rank: Option<usize>,
}

impl Expect<'_> {
    fn store(&self) -> Store {
        Store {
            stage: self.stage,
            ep_rank: self.ep_rank,
        }
    }
}

/// The master copy and the optimizer buffers being read for a range.
struct Target {
    master: Vec<f32>,
    buffers: Vec<(String, Vec<f32>)>,
}

/// Reads the parts of checkpoint `dir` (a tag's directory) that cover `expect.owned`.
pub fn load(dir: &Path, expect: &Expect) -> Result<(Manifest, RankState)> {
    let (m, mut states) = load_stores(dir, std::slice::from_ref(expect))?;
    let state = states.pop().expect("invariant: one state per store asked");
    Ok((m, state))
}

/// Reads the parts of checkpoint `dir` (a tag's directory) that cover each store's
/// `owned` (a rank's dense store and its experts'), each file opened and verified once.
pub fn load_stores(dir: &Path, expects: &[Expect]) -> Result<(Manifest, Vec<RankState>)> {
    let m = Manifest::read(dir)?;
    let mut files = Files::new(dir, &m);
    let mut states = Vec::with_capacity(expects.len());
    for expect in expects {
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
        read_range(&mut files, &m, expect, &mut out)?;
        states.push(RankState {
            owned: expect.owned.clone(),
            master: out.master,
            optimizer_step: m.optimizer_step,
            buffers: out.buffers,
        });
    }
    Ok((m, states))
}

/// Reads the parts of an open checkpoint that cover `expect.owned` into `out`.
fn read_range(files: &mut Files, m: &Manifest, expect: &Expect, out: &mut Target) -> Result<()> {
    let same_place = m.params.iter().zip(expect.params).all(|(a, b)| {
        a.name == b.name && a.split == b.split && a.stage == b.stage && a.ep_rank == b.ep_rank
    });
    if m.layout.tp == expect.tp.size && same_place {
        // the same buffers: the range is the same range of the same store's same slices
        let numel = local_index(&m.params, expect.store(), expect.tp)?.numel();
        let want = expect.owned.start..expect.owned.end.min(numel);
        files.copy((expect.store(), expect.tp.rank), want, 0, out)
    } else {
        reshard(files, m, expect, out)
    }
}

/// Note [resharding]: a checkpoint saved at tensor-parallel degree tp', with its layers on
/// other pipeline stages or its experts in other expert-parallel ranks' stores is read
/// through logical coordinates. A store is a stage's dense parameters, or (under expert
/// parallelism) the experts one expert-parallel rank holds of the stage's layers, each a
/// flat buffer per tensor-parallel rank, sharded over its data-parallel group; the
/// manifest's parameters, in the model's order at every ep, say which store held each, so
/// every store's layout follows from them as a stage's does. For each parameter overlapping
/// the loading rank's range (of the store being loaded), its slice is a list of runs of
/// logical elements (`runs`); each run is found in the buffers of the store that saved the
/// parameter (every tensor-parallel rank's for a split parameter, rank 0's for a replicated
/// one), whose runs say where those elements sit in that buffer, and so in which file. An
/// expert saved at ep 2 and loaded at ep 4 or 1 is one more change of buffer, like a layer
/// that moved to another pipeline stage.
fn reshard(files: &mut Files, m: &Manifest, expect: &Expect, out: &mut Target) -> Result<()> {
    let saved_tp = m.layout.tp.max(1);
    let mut saved: HashMap<Buffer, FlatIndex> = HashMap::new();
    for store in stores_of(&m.params) {
        for rank in 0..saved_tp {
            let tp = TpRank {
                rank,
                size: saved_tp,
            };
            saved.insert((store, rank), local_index(&m.params, store, tp)?);
        }
    }
    let store_of: HashMap<&str, Store> = m
        .params
        .iter()
        .map(|p| (p.name.as_str(), Store::of(p)))
        .collect();
    let mine = local_index(expect.params, expect.store(), expect.tp)?;
    for (i, e) in mine.entries().iter().enumerate() {
        let p = e.range();
        let (a, b) = (p.start.max(expect.owned.start), p.end.min(expect.owned.end));
        if a >= b {
            continue;
        }
        let pieces = saved_pieces(&saved, store_of[e.name.as_str()], saved_tp, &e.name);
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

/// One of a layout's stores of parameters: a pipeline stage's dense store, or under expert
/// parallelism the experts' store of an expert-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Store {
    stage: usize,
    ep_rank: Option<usize>,
}

impl Store {
    fn of(p: &ParamEntry) -> Store {
        Store {
            stage: p.stage,
            ep_rank: p.ep_rank,
        }
    }
}

/// A flat buffer: a store's slices of one tensor-parallel rank.
type Buffer = (Store, usize);

/// "stage 0's tensor-parallel rank 1's buffer", "... expert-parallel rank 1's experts'
/// buffer", for errors.
fn describe(buffer: Buffer) -> String {
    let (store, tp_rank) = buffer;
    let whose = format!("stage {}'s tensor-parallel rank {tp_rank}'s", store.stage);
    match store.ep_rank {
        None => format!("{whose} buffer"),
        Some(r) => format!("{whose} expert-parallel rank {r}'s experts' buffer"),
    }
}

/// A run of a saved parameter: `len` logical elements from `logical`, held in `buffer` at
/// `flat`.
struct Piece {
    logical: usize,
    len: usize,
    buffer: Buffer,
    flat: usize,
}

/// Where parameter `name`'s logical elements were saved (by store `store`'s `tp` ranks),
/// sorted by logical position.
fn saved_pieces(
    saved: &HashMap<Buffer, FlatIndex>,
    store: Store,
    tp: usize,
    name: &str,
) -> Vec<Piece> {
    let index = |rank: usize| &saved[&(store, rank)];
    let id = index(0)
        .find(name)
        .expect("invariant: the store's index holds its parameters");
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
                    buffer: (store, rank),
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

/// The stores that hold parameters, in order.
fn stores_of(params: &[ParamEntry]) -> Vec<Store> {
    let mut stores: Vec<Store> = params.iter().map(Store::of).collect();
    stores.sort_unstable();
    stores.dedup();
    stores
}

/// The flat index of the slices `tp` holds of store `store`'s logical parameters.
fn local_index(params: &[ParamEntry], store: Store, tp: TpRank) -> Result<FlatIndex> {
    let mut index = FlatIndex::sliced(tp);
    for p in params.iter().filter(|p| Store::of(p) == store) {
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
            let store = Store {
                stage: shard.stage,
                ep_rank: shard.ep_rank,
            };
            if (store, shard.tp_rank) != buffer || lo >= hi {
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
            false => Err(CheckpointError::file(
                self.dir.join(MANIFEST),
                format!("no shard covers elements {src:?} of {}", describe(buffer)),
            )),
        }
    }
}

/// The checkpoint holds this model's parameters: the same names with the same shapes, in
/// any order (an imported DeepSpeed checkpoint keeps DeepSpeed's), and the optimizer state
/// this run keeps.
fn check_model(dir: &Path, m: &Manifest, e: &Expect) -> Result<()> {
    let path = dir.join(MANIFEST);
    let saved: HashMap<&str, &ParamEntry> = m.params.iter().map(|p| (p.name.as_str(), p)).collect();
    for now in e.params {
        match saved.get(now.name.as_str()) {
            Some(s) if s.shape == now.shape => {}
            Some(s) => {
                return Err(CheckpointError::file(
                    &path,
                    format!(
                        "parameter {} {:?} does not match this model's {:?}: a checkpoint of another model",
                        s.name, s.shape, now.shape
                    ),
                ))
            }
            None => {
                return Err(CheckpointError::file(
                    &path,
                    format!(
                        "no parameter {} (this model's {:?}): a checkpoint of another model",
                        now.name, now.shape
                    ),
                ))
            }
        }
    }
    if m.params.len() != e.params.len() || saved.len() != m.params.len() {
        return Err(CheckpointError::file(
            &path,
            format!(
                "{} parameters, this model has {}",
                m.params.len(),
                e.params.len()
            ),
        ));
    }
    if e.buffers.is_some_and(|b| m.optimizer_buffers != b) {
        return Err(CheckpointError::file(
            &path,
            format!(
                "optimizer state {:?}, this run's optimizer keeps {:?}",
                m.optimizer_buffers, e.buffers
            ),
        ));
    }
    Ok(())
}

/// Every element of every store's tensor-parallel rank's buffer must come from some shard (a
/// missing rank file is an error).
fn check_covered(dir: &Path, m: &Manifest) -> Result<()> {
    let tp = m.layout.tp.max(1);
    for (store, tp_rank) in stores_of(&m.params)
        .into_iter()
        .flat_map(|s| (0..tp).map(move |r| (s, r)))
    {
        let numel = local_index(
            &m.params,
            store,
            TpRank {
                rank: tp_rank,
                size: tp,
            },
        )?
        .numel();
        let mut ranges: Vec<Range<usize>> = m
            .shards
            .iter()
            .filter(|s| (s.stage, s.ep_rank, s.tp_rank) == (store.stage, store.ep_rank, tp_rank))
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
            return Err(CheckpointError::file(
                dir.join(MANIFEST),
                format!(
                    "no shard covers elements {at}..{numel} of {}",
                    describe((store, tp_rank))
                ),
            ));
        }
    }
    Ok(())
}

/// The logical model as one buffer: one stage, no tensor or expert parallelism.
fn whole_model(m: &Manifest) -> Vec<ParamEntry> {
    m.params
        .iter()
        .map(|p| ParamEntry {
            stage: 0,
            ep_rank: None,
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
    each_tensor_state(dir, false, |p, master, _| f(p, master))
}

/// As `each_tensor`, with each parameter's optimizer buffers (`manifest.optimizer_buffers`,
/// in that order) when `buffers`: what an export of the training state writes.
pub fn each_tensor_state(
    dir: &Path,
    buffers: bool,
    mut f: impl FnMut(&ParamEntry, &[f32], &[(String, Vec<f32>)]) -> Result<()>,
) -> Result<Manifest> {
    let m = Manifest::read(dir)?;
    let copies = 1 + if buffers {
        m.optimizer_buffers.len()
    } else {
        0
    };
    on_disk(dir, &m, m.parameters().saturating_mul(copies))?;
    let whole = whole_model(&m);
    let mut files = Files::new(dir, &m);
    for p in &whole {
        let n: usize = p.shape.iter().product();
        let expect = Expect {
            params: &whole,
            buffers: buffers.then_some(&m.optimizer_buffers[..]),
            owned: p.offset..p.offset + n,
            tp: TpRank::WHOLE,
            stage: 0,
            ep_rank: None,
        };
        let mut out = Target {
            master: vec![0f32; n],
            buffers: expect
                .buffers
                .unwrap_or_default()
                .iter()
                .map(|b| (b.clone(), vec![0f32; n]))
                .collect(),
        };
        read_range(&mut files, &m, &expect, &mut out)?;
        f(p, &out.master, &out.buffers)?;
    }
    Ok(m)
}

/// Writes checkpoint `dir`'s (a tag's directory) parameters as one safetensors file under
/// their names, in `dtype`, a tensor at a time: DeepSpeed's zero_to_fp32 without the whole
/// model in memory.
pub fn write_weights(
    dir: &Path,
    out: &Path,
    dtype: ds_nn::model::weights::SaveDtype,
) -> Result<Manifest> {
    write_weights_with(dir, out, dtype, &[])
}

/// As `write_weights`, with `extra` tensors (name, shape, values) after the checkpoint's: a
/// model's frozen parameters, which checkpoints do not hold.
pub fn write_weights_with(
    dir: &Path,
    out: &Path,
    dtype: ds_nn::model::weights::SaveDtype,
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
        ds_nn::model::weights::StreamingWriter::create(out, &tensors, dtype, &[("format", "pt")])?;
    each_tensor(dir, |_, values| Ok(w.put(values)?))?;
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
        ep_rank: None,
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
            .map_err(|e| CheckpointError::file(&path, e))?
            .len();
        bytes = bytes.saturating_add(len);
    }
    if (numel as u64).saturating_mul(4) > bytes {
        return Err(CheckpointError::file(
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
    let entries = std::fs::read_dir(dir).map_err(|e| CheckpointError::file(dir, e))?;
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
        Err(e) => return Err(CheckpointError::file(&path, e)),
        Ok(()) => {}
    }
    crash_point::point("remove.renamed");
    remove_dir(&doomed)
}

/// Deletes what a removal killed midway left (`.<tag>.removed/`).
pub fn remove_leftovers(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| CheckpointError::file(dir, e))?;
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
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(CheckpointError::file(path, e)),
        _ => Ok(()),
    }
}
