//! DeepSpeed's ZeRO checkpoints (stage 1-3, fp32, bf16 and fp16 runs, any data-parallel
//! size) read as logical tensors, as deepspeed/utils/zero_to_fp32.py reads them, and
//! imported as a ds-rs checkpoint that resumes in any layout. Note [DeepSpeed's flat groups].
//!
//! Why long: DeepSpeed's layouts (ZeRO 1-2 flat groups, ZeRO-3 partitions, pipeline layer
//! files) read into one logical view and imported; each layout is a section of this file.
//!
//! Note [DeepSpeed's flat groups]: a tag directory holds the model states
//! (`mp_rank_00_model_states.pt` at stage 1-2, `zero_pp_rank_R_mp_rank_00_model_states.pt`
//! per rank at stage 3: `param_shapes`, one ordered name -> shape map per parameter group,
//! the step counters, the scheduler, the ds_config) and per data-parallel rank R the
//! optimizer states (`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`).
//! - Stage 1-2 (and the bf16 optimizer): each group's parameters are one flat buffer, in
//!   `param_shapes` order with no gaps, padded at the end to a multiple of the ranks; rank R
//!   holds the R-th equal part (`single_partition_of_fp32_groups[g]`, Adam's moments in
//!   `base_optimizer_state.state[g]`).
//! - Stage 3: every parameter is split on its own: rank R holds elements
//!   [R c, (R+1) c) of a parameter of n elements, c = ceil(n / ranks), zero-padded; a rank's
//!   parts follow each other in `param_shapes` order across its `fp32_flat_groups` (its sub
//!   groups, concatenated), the moments in `optimizer_state_dict.state[k]`.
//!
//! So a parameter is a list of pieces, each a range of one rank's concatenated buffers, and
//! reading it reads those ranges from the storage records: one parameter in memory at a time.

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::torch::{Obj, TensorRef, TorchFile};
use super::{manifest, Counters, Description};
use crate::manifest::LossScaleState;
use crate::{CheckpointError, Result};

/// No parameter has more elements than this (2^48); the sums of shapes stay far from
/// overflowing.
const MAX_ELEMENTS: usize = 1 << 48;

/// A DeepSpeed checkpoint tag, opened: what it holds and where each parameter's pieces lie.
pub struct DeepSpeedCheckpoint {
    pub dir: PathBuf,
    pub stage: u8,
    /// The data-parallel ranks that saved it.
    pub world: usize,
    /// Its pipeline stages (1 without a pipeline).
    pub pp: usize,
    /// The compute dtype: f32, bf16 or f16.
    pub dtype: &'static str,
    /// Every trainable parameter, in DeepSpeed's flat order.
    pub params: Vec<(String, Vec<usize>)>,
    pub counters: Counters,
    /// Adam's step count (its bias correction).
    pub optimizer_step: u64,
    /// The optimizer's per-element states (exp_avg, exp_avg_sq for Adam), by DeepSpeed's names.
    pub buffers: Vec<String>,
    /// The scheduler's state_dict (None without a scheduler).
    pub lr_scheduler: serde_json::Value,
    /// The ds_config DeepSpeed ran with.
    pub config: serde_json::Value,
    ranks: Vec<RankFile>,
    /// Each parameter's pieces: (rank, range of that rank's concatenated buffers).
    pieces: Vec<Pieces>,
}

/// Where a parameter's elements lie: (rank, range of that rank's concatenated buffers), in
/// order.
type Pieces = Vec<(usize, Range<usize>)>;

/// A parameter group's (name, shape) in flat order.
type Group = Vec<(String, Vec<usize>)>;

/// One data-parallel rank's optimizer-states file (of one stage) and its tensors: the fp32 master buffers (one per group
/// or sub-group, concatenated in order) and each optimizer buffer's.
struct RankFile {
    file: TorchFile,
    master: Vec<TensorRef>,
    buffers: Vec<Vec<TensorRef>>,
}

/// Which of a parameter's values to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Master,
    /// The i-th of `buffers`.
    Buffer(usize),
}

/// Whether `dir` (a tag's directory) is a DeepSpeed checkpoint rather than a ds-rs one.
pub fn is_deepspeed(dir: &Path) -> bool {
    !dir.join(manifest::MANIFEST).exists()
        && std::fs::read_dir(dir).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with("model_states.pt"))
        })
}

impl DeepSpeedCheckpoint {
    /// Opens tag directory `dir`: the model states, then every rank's optimizer states, of
    /// every pipeline stage.
    pub fn open(dir: &Path) -> Result<DeepSpeedCheckpoint> {
        let stage_files = model_states_files(dir)?;
        // every stage's model states, each opened and parsed once
        let models = stage_files
            .iter()
            .map(|p| TorchFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        let m = models[0].root();
        let pp = pipeline_stages(&m, stage_files.len())?;
        let global_steps = m.get("global_steps")?.usize()? as u64;
        let skipped_steps = m.get("skipped_steps")?.usize()? as u64;
        let lr_scheduler = m.get("lr_scheduler")?.to_json()?;
        let config = m.get("ds_config")?.to_json()?;
        let bf16 = bf16_enabled(&m)?;
        let parts = models
            .iter()
            .enumerate()
            .map(|(s, model)| StagePart::open(dir, s, model))
            .collect::<Result<Vec<_>>>()?;
        let first = &parts[0];
        if let Some((s, p)) = parts.iter().enumerate().find(|(_, p)| !first.agrees(p)) {
            return Err(CheckpointError::file(
                &stage_files[s],
                format!(
                    "pipeline stage {s}: ZeRO-{} at dp {}, Adam at step {} keeping {:?}; stage 0's: ZeRO-{} at dp {}, step {}, {:?}",
                    p.stage, p.ranks.len(), p.step, p.buffers, first.stage, first.ranks.len(), first.step, first.buffers
                ),
            ));
        }
        let (scaler, scaled) = {
            let optim = first.ranks[0].file.root().get("optimizer_state_dict")?;
            loss_scaler(&optim.get("loss_scaler")?)?
        };
        let dtype = match (scaled, first.bf16_files || bf16) {
            (true, _) => "f16",
            (false, true) => "bf16",
            (false, false) => "f32",
        };
        let mut ck = DeepSpeedCheckpoint {
            dir: dir.to_path_buf(),
            stage: first.stage,
            world: first.ranks.len(),
            pp,
            dtype,
            params: Vec::new(),
            counters: Counters {
                global_steps,
                skipped_steps,
                loss_scaler: LossScaleState {
                    cur_iter: scaler.cur_iter.unwrap_or(global_steps),
                    ..scaler.state
                },
            },
            optimizer_step: first.step,
            buffers: first.buffers.clone(),
            lr_scheduler,
            config,
            ranks: Vec::new(),
            pieces: Vec::new(),
        };
        ck.check_schedule(&stage_files[0])?;
        for part in parts {
            let offset = ck.ranks.len();
            ck.params.extend(part.params);
            ck.pieces.extend(part.pieces.into_iter().map(|p| {
                p.into_iter()
                    .map(|(r, range)| (r + offset, range))
                    .collect()
            }));
            ck.ranks.extend(part.ranks);
        }
        if pp > 1 {
            ck.params = pipeline_names(&ck.params).map_err(|e| CheckpointError::file(dir, e))?;
        }
        Ok(ck)
    }

    /// DeepSpeed steps the scheduler once per applied (not skipped) step, as ds-rs derives
    /// the lr from the applied steps; a scheduler stepped otherwise (by the training script)
    /// would give another lr, so it is refused.
    /// `model_states`: the file that holds the scheduler's state.
    fn check_schedule(&self, model_states: &Path) -> Result<()> {
        let applied = self.counters.global_steps - self.counters.skipped_steps;
        match self
            .lr_scheduler
            .get("last_batch_iteration")
            .and_then(|v| v.as_i64())
        {
            Some(last) if last != applied as i64 - 1 => Err(CheckpointError::file(
                model_states,
                format!(
                    "lr_scheduler.last_batch_iteration {last} after {applied} applied steps \
                     (DeepSpeed's engine leaves {}): the scheduler was stepped outside the \
                     engine, and ds-rs derives the lr from the applied steps",
                    applied as i64 - 1
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Parameter `i`'s values of `part`, whole, as f32.
    pub fn read(&self, i: usize, part: Part) -> Result<Vec<f32>> {
        let n: usize = self.params[i].1.iter().product();
        let mut out = Vec::with_capacity(n);
        for (rank, range) in &self.pieces[i] {
            let r = &self.ranks[*rank];
            let tensors = match part {
                Part::Master => &r.master,
                Part::Buffer(b) => &r.buffers[b],
            };
            read_concat(&r.file, tensors, range.clone(), &mut out)?;
        }
        out.truncate(n);
        Ok(out)
    }

    /// The logical parameters as a ds-rs checkpoint records them: DeepSpeed's order, whole
    /// tensors (tensor parallelism 1, one stage).
    pub fn param_entries(&self) -> Vec<manifest::ParamEntry> {
        let mut offset = 0;
        self.params
            .iter()
            .map(|(name, shape)| {
                let e = manifest::ParamEntry {
                    name: name.clone(),
                    shape: shape.clone(),
                    offset,
                    split: Default::default(),
                    stage: 0,
                    ep_rank: None,
                };
                offset += shape.iter().product::<usize>();
                e
            })
            .collect()
    }
}

/// One model-parallel rank's part of a checkpoint (a pipeline stage's; the whole model
/// without a pipeline): its parameters and its data-parallel ranks' optimizer states.
struct StagePart {
    params: Vec<(String, Vec<usize>)>,
    stage: u8,
    bf16_files: bool,
    step: u64,
    buffers: Vec<String>,
    ranks: Vec<RankFile>,
    /// Pieces of `params`, by index into `ranks`.
    pieces: Vec<Pieces>,
}

impl StagePart {
    /// Opens model-parallel rank `mp`'s optimizer states, beside its model states `model`.
    fn open(dir: &Path, mp: usize, model: &TorchFile) -> Result<StagePart> {
        let (optim_files, bf16_files) = optimizer_files(dir, mp)?;
        let world = optim_files.len();
        let model_path = model.path();
        let m = model.root();
        let groups = param_groups(&m)?;
        if let Some(frozen) = m.opt("frozen_param_shapes")? {
            if !frozen.is_none() && !frozen.items()?.is_empty() {
                return Err(frozen.error(
                    "frozen parameters: ds-rs checkpoints hold trainable parameters only; \
                     import the trainable ones by training without freezing",
                ));
            }
        }
        let saved_world = m.get("dp_world_size")?.usize()?;
        if saved_world != world {
            return Err(CheckpointError::file(
                model_path,
                format!("dp_world_size {saved_world}, but {world} optimizer-states files"),
            ));
        }
        let files = optim_files
            .iter()
            .map(|p| TorchFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        let stage = zero_stage(&files[0].root().get("optimizer_state_dict")?)?;
        let mut part = StagePart {
            params: groups.iter().flatten().cloned().collect(),
            stage,
            bf16_files,
            step: 0,
            buffers: Vec::new(),
            ranks: Vec::with_capacity(world),
            pieces: Vec::new(),
        };
        for file in files {
            let (rank, step, names) = rank_tensors(file, stage)?;
            if part.ranks.is_empty() {
                (part.step, part.buffers) = (step, names);
            } else if names != part.buffers || step != part.step {
                return Err(CheckpointError::file(
                    rank.file.path(),
                    format!(
                        "optimizer state {names:?} at step {step}, rank 0's is {:?} at step {}",
                        part.buffers, part.step
                    ),
                ));
            }
            part.ranks.push(rank);
        }
        part.pieces = match stage {
            3 => {
                let size = part.ranks[0].master.iter().map(|t| t.numel()).sum();
                stage3_pieces(&part.params, world, size)
                    .map_err(|e| CheckpointError::file(part.ranks[0].file.path(), e))?
            }
            _ => part.flat_pieces(&groups)?,
        };
        part.check_sizes()?;
        Ok(part)
    }

    /// The same ZeRO stage, data-parallel size and optimizer state as `other`.
    fn agrees(&self, other: &StagePart) -> bool {
        (self.stage, self.ranks.len(), self.step, &self.buffers)
            == (other.stage, other.ranks.len(), other.step, &other.buffers)
    }

    /// Stage 1-2: each group's flat buffer is the ranks' partitions end to end.
    fn flat_pieces(&self, groups: &[Group]) -> Result<Vec<Pieces>> {
        let parts: Vec<usize> = self.ranks[0].master.iter().map(|t| t.numel()).collect();
        if parts.len() != groups.len() {
            return Err(CheckpointError::file(
                self.ranks[0].file.path(),
                format!(
                    "{} fp32 partitions for {} parameter groups",
                    parts.len(),
                    groups.len()
                ),
            ));
        }
        let mut pieces = Vec::new();
        let mut base = 0; // where group g starts in a rank's concatenated buffers
        for (group, &part) in groups.iter().zip(&parts) {
            if part == 0 && group.iter().any(|(_, s)| s.iter().product::<usize>() > 0) {
                return Err(CheckpointError::file(
                    self.ranks[0].file.path(),
                    "an empty fp32 partition for a group with parameters",
                ));
            }
            let total: usize = group.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
            if total > part * self.ranks.len() {
                return Err(CheckpointError::file(
                    self.ranks[0].file.path(),
                    format!(
                        "a group of {total} elements in {} partitions of {part}: \
                         param_shapes and the optimizer states disagree",
                        self.ranks.len()
                    ),
                ));
            }
            let mut at = 0;
            for (_, shape) in group {
                let n: usize = shape.iter().product();
                let mut p = Vec::new();
                let mut pos = at;
                while pos < at + n {
                    let (rank, local) = (pos / part, pos % part);
                    let len = (part - local).min(at + n - pos);
                    p.push((rank, base + local..base + local + len));
                    pos += len;
                }
                pieces.push(p);
                at += n;
            }
            base += part;
        }
        Ok(pieces)
    }

    /// Every rank's buffers have the same sizes, and every piece lies inside them.
    fn check_sizes(&self) -> Result<()> {
        let sizes = |r: &RankFile| -> Vec<usize> { r.master.iter().map(|t| t.numel()).collect() };
        let want = sizes(&self.ranks[0]);
        let total: usize = want.iter().sum();
        for (r, rank) in self.ranks.iter().enumerate() {
            let bad_buffer = rank
                .buffers
                .iter()
                .any(|b| b.iter().map(|t| t.numel()).collect::<Vec<_>>() != want);
            if sizes(rank) != want || bad_buffer {
                return Err(CheckpointError::file(
                    rank.file.path(),
                    format!("rank {r}'s partitions differ in size from rank 0's {want:?}"),
                ));
            }
        }
        let beyond = self.pieces.iter().zip(&self.params).find(|(p, _)| {
            p.iter()
                .any(|(rank, range)| *rank >= self.ranks.len() || range.end > total)
        });
        match beyond {
            Some((_, (name, shape))) => Err(CheckpointError::file(
                self.ranks[0].file.path(),
                format!(
                    "parameter {name} {shape:?} lies beyond the {} ranks' partitions of {total} elements: \
                     param_shapes and the optimizer states disagree",
                    self.ranks.len()
                ),
            )),
            None => Ok(()),
        }
    }
}

/// Reads `range` of the concatenation of `tensors` into `out`.
fn read_concat(
    file: &TorchFile,
    tensors: &[TensorRef],
    range: Range<usize>,
    out: &mut Vec<f32>,
) -> Result<()> {
    let mut start = 0;
    for t in tensors {
        let end = start + t.numel();
        let (lo, hi) = (range.start.max(start), range.end.min(end));
        if lo < hi {
            out.extend(file.read_f32(t, lo - start..hi - start)?);
        }
        start = end;
    }
    Ok(())
}

/// Stage 3: parameter i of n elements is c = ceil(n / world) elements of every rank's
/// buffers, at the same place on each; all of them must fit in a rank's `part` elements.
fn stage3_pieces(
    params: &[(String, Vec<usize>)],
    world: usize,
    part: usize,
) -> std::result::Result<Vec<Pieces>, String> {
    let mut at = 0usize;
    let mut pieces = Vec::with_capacity(params.len());
    for (name, shape) in params {
        let n: usize = shape.iter().product();
        let c = n.div_ceil(world);
        if at.saturating_add(c) > part {
            return Err(format!(
                "parameter {name} {shape:?} lies beyond a rank's {part} elements: \
                 param_shapes and the optimizer states disagree"
            ));
        }
        pieces.push(
            (0..world)
                .filter(|r| r * c < n)
                .map(|r| (r, at..at + c.min(n - r * c)))
                .collect(),
        );
        at += c;
    }
    Ok(pieces)
}

/// Each model-parallel rank's model states file, in order: `mp_rank_MM_model_states.pt`
/// (stage 1-2, pipelines), or rank 0's `zero_pp_rank_0_mp_rank_MM_model_states.pt` (stage 3).
fn model_states_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let file = |mp: usize| {
        [
            dir.join(format!("mp_rank_{mp:02}_model_states.pt")),
            dir.join(format!("zero_pp_rank_0_mp_rank_{mp:02}_model_states.pt")),
        ]
        .into_iter()
        .find(|p| p.exists())
    };
    let files: Vec<PathBuf> = (0..).map_while(file).collect();
    match files.is_empty() {
        true => Err(CheckpointError::file(
            dir,
            "no mp_rank_00_model_states.pt: not a DeepSpeed checkpoint's tag directory",
        )),
        false => Ok(files),
    }
}

/// The pipeline stages of a checkpoint with `files` model-parallel ranks: DeepSpeed's
/// `checkpoint_parallel_dimensions` must say they are pipeline stages, not tensor slices
/// (Megatron's model parallelism, whose slices ds-rs does not join).
fn pipeline_stages(m: &Obj, files: usize) -> Result<usize> {
    let dims = m.opt("checkpoint_parallel_dimensions")?;
    let degree = |k: &str| -> Result<usize> {
        match &dims {
            Some(d) if !d.is_none() => match d.opt(k)? {
                Some(v) => v.usize(),
                None => Ok(1),
            },
            _ => Ok(1),
        }
    };
    let (pp, tp) = (degree("pp_degree")?, degree("tp_degree")?);
    if tp > 1 || (files > 1 && pp != files) {
        return Err(m.error(format!(
            "a model-parallel checkpoint (tp_degree {tp}, pp_degree {pp}, {files} mp_rank files): \
             ds-rs imports ZeRO checkpoints of data parallelism and pipelines, not tensor slices"
        )));
    }
    Ok(files)
}

/// A pipeline's parameter names ("3.attn.c_attn.weight": layer 3's) as the built-in GPT's,
/// whose PipelineModule is the embeddings, the blocks and the head (scripts/bench/
/// deepspeed_pipe.py): the first layer's and the last layer's parameters keep their own
/// names (`wte.weight`, `lm_head.weight`), the layers between are the blocks `h.0.`, `h.1.`...
fn pipeline_names(
    params: &[(String, Vec<usize>)],
) -> std::result::Result<Vec<(String, Vec<usize>)>, String> {
    let split = |name: &str| -> std::result::Result<(usize, String), String> {
        name.split_once('.')
            .and_then(|(l, rest)| Some((l.parse().ok()?, rest.to_string())))
            .ok_or_else(|| format!("pipeline parameter {name:?} is not LAYER.NAME"))
    };
    let layers: Vec<usize> = params
        .iter()
        .map(|(n, _)| split(n).map(|(l, _)| l))
        .collect::<std::result::Result<_, _>>()?;
    let mut blocks: Vec<usize> = layers.clone();
    blocks.sort_unstable();
    blocks.dedup();
    let (first, last) = (blocks.first().copied(), blocks.last().copied());
    let mut seen = std::collections::HashSet::new();
    params
        .iter()
        .map(|(name, shape)| {
            let (layer, rest) = split(name)?;
            let renamed = match blocks.binary_search(&layer) {
                _ if Some(layer) == first || Some(layer) == last => rest,
                Ok(k) => format!("h.{}.{rest}", k - 1),
                Err(_) => unreachable!("invariant: every layer is listed"),
            };
            match seen.insert(renamed.clone()) {
                true => Ok((renamed, shape.clone())),
                false => Err(format!(
                    "two pipeline layers hold {renamed} (tied layers are not imported)"
                )),
            }
        })
        .collect()
}

/// Model-parallel rank `mp`'s optimizer-states files, in data-parallel rank order, and
/// whether they carry the bf16 optimizer's prefix.
fn optimizer_files(dir: &Path, mp: usize) -> Result<(Vec<PathBuf>, bool)> {
    for prefix in ["", "bf16_"] {
        let name = |r: usize| {
            dir.join(format!(
                "{prefix}zero_pp_rank_{r}_mp_rank_{mp:02}_optim_states.pt"
            ))
        };
        let files: Vec<PathBuf> = (0..).map(name).take_while(|p| p.exists()).collect();
        if !files.is_empty() {
            return Ok((files, prefix == "bf16_"));
        }
    }
    Err(CheckpointError::file(
        dir,
        format!(
            "no zero_pp_rank_0_mp_rank_{mp:02}_optim_states.pt: not a DeepSpeed ZeRO checkpoint. \
             Stage 0 keeps its optimizer in the model states, which ds-rs does not import: \
             DeepSpeed 0.19.8 records Adam's step there as 0 (fp32) or one past the steps taken \
             (bf16), so the bias correction could not go on as it was"
        ),
    ))
}

/// `param_shapes`: each group's parameters, names and shapes, in flat order.
fn param_groups(m: &Obj) -> Result<Vec<Group>> {
    let shapes = m.get("param_shapes")?;
    let groups = match shapes.seq() {
        Ok(groups) => groups,
        // older DeepSpeed: one dict for all
        Err(_) => vec![shapes],
    };
    groups
        .iter()
        .map(|g| {
            g.items()?
                .into_iter()
                .map(|(k, v)| {
                    let shape = v.shape()?;
                    match shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) {
                        Some(n) if n <= MAX_ELEMENTS => Ok((k.str()?.to_string(), shape)),
                        _ => Err(v.error(format!("shape {shape:?} is too large"))),
                    }
                })
                .collect()
        })
        .collect()
}

fn zero_stage(optim: &Obj) -> Result<u8> {
    let z = optim.get("zero_stage")?;
    let stage = match z.enum_member() {
        Ok((_, v)) => v,
        Err(_) => z.int()?,
    };
    match stage {
        1..=3 => Ok(stage as u8),
        s => Err(z.error(format!("ZeRO stage {s}"))),
    }
}

fn bf16_enabled(m: &Obj) -> Result<bool> {
    let config = m.get("ds_config")?.to_json()?;
    Ok(config["bf16"]["enabled"].as_bool() == Some(true)
        || config["bfloat16"]["enabled"].as_bool() == Some(true))
}

/// A loss scaler's state as ds-rs keeps it, the iteration when DeepSpeed recorded one.
struct Scaler {
    state: LossScaleState,
    cur_iter: Option<u64>,
}

/// DeepSpeed's `LossScaler` (static) or `DynamicLossScaler` object; whether it scales (fp16).
fn loss_scaler(o: &Obj) -> Result<(Scaler, bool)> {
    let (class, state) = o.object()?;
    let int = |k: &str, default: i64| -> Result<i64> {
        Ok(match state.opt(k)? {
            Some(v) => v.int()?,
            None => default,
        })
    };
    let cur_scale = state.get("cur_scale")?.float()?;
    let dynamic = class.ends_with("DynamicLossScaler");
    let scaled = dynamic || cur_scale != 1.0;
    let cur_iter = match state.opt("cur_iter")? {
        Some(v) => Some(v.usize()? as u64),
        None => None,
    };
    Ok((
        Scaler {
            state: LossScaleState {
                cur_scale,
                cur_iter: 0,
                last_overflow_iter: int("last_overflow_iter", -1)?,
                cur_hysteresis: int("cur_hysteresis", 0)?,
            },
            cur_iter,
        },
        scaled,
    ))
}

/// A rank's master and buffer tensors, its optimizer step and the buffers' names.
fn rank_tensors(file: TorchFile, stage: u8) -> Result<(RankFile, u64, Vec<String>)> {
    let (master, states) = {
        let o = file.root().get("optimizer_state_dict")?;
        let (master, optimizer) = match stage {
            3 => (o.get("fp32_flat_groups")?, o.get("optimizer_state_dict")?),
            _ => (
                o.get("single_partition_of_fp32_groups")?,
                o.get("base_optimizer_state")?,
            ),
        };
        let master: Vec<TensorRef> = master
            .seq()?
            .iter()
            .map(|t| file.stored(t))
            .collect::<Result<_>>()?;
        let state = optimizer.get("state").map_err(|_| {
            optimizer.error("not a torch optimizer state_dict (elastic_checkpoint's per-group list is not read)")
        })?;
        let groups = (0..master.len() as i64)
            .map(|k| {
                let s = state.get_int(k)?;
                let step = step_of(&file, &s.get("step")?)?;
                let tensors = s
                    .items()?
                    .into_iter()
                    .filter(|(_, v)| v.tensor().is_ok())
                    .map(|(k, v)| Ok((k.str()?.to_string(), file.stored(&v)?)))
                    .collect::<Result<Vec<_>>>()?;
                Ok((step, tensors))
            })
            .collect::<Result<Vec<_>>>()?;
        (master, groups)
    };
    let names: Vec<String> = states
        .first()
        .map(|(_, t)| t.iter().map(|(n, _)| n.clone()).collect())
        .unwrap_or_default();
    let step = states.first().map_or(0, |(s, _)| *s);
    let mut buffers = vec![Vec::new(); names.len()];
    for (s, tensors) in &states {
        let these: Vec<&String> = tensors.iter().map(|(n, _)| n).collect();
        if these != names.iter().collect::<Vec<_>>() || *s != step {
            return Err(CheckpointError::file(
                file.path(),
                format!("the optimizer's groups keep different states ({names:?} at step {step}, {these:?} at step {s})"),
            ));
        }
        for (b, (_, t)) in buffers.iter_mut().zip(tensors) {
            b.push(t.clone());
        }
    }
    Ok((
        RankFile {
            file,
            master,
            buffers,
        },
        step,
        names,
    ))
}

/// Adam's `step`: an int, or a one-element tensor (torch's own optimizers).
fn step_of(file: &TorchFile, s: &Obj) -> Result<u64> {
    match s.usize() {
        Ok(n) => Ok(n as u64),
        Err(_) => {
            let t = s.tensor()?;
            match file.tensor_f32(&t)?[..] {
                [v] if v >= 0.0 => Ok(v as u64),
                _ => Err(s.error("a step that is not one count")),
            }
        }
    }
}

/// Imports DeepSpeed tag directory `src` as ds-rs checkpoint `out/TAG` (and `out/latest`),
/// the same tag.
pub fn import_tag(src: &Path, out: &Path) -> Result<(DeepSpeedCheckpoint, PathBuf)> {
    let tag = src
        .file_name()
        .map(|t| t.to_string_lossy().into_owned())
        .ok_or_else(|| CheckpointError::file(src, "not a checkpoint tag's directory"))?;
    if let Some(latest) = super::latest(out)? {
        return Err(CheckpointError::file(
            out,
            format!(
                "holds checkpoints already (`latest` names {latest}); import into a new directory"
            ),
        ));
    }
    let ck = DeepSpeedCheckpoint::open(src)?;
    let client_state = serde_json::json!({
        "step": ck.counters.global_steps,
        "imported_from": {
            "deepspeed": src.display().to_string(),
            "lr_scheduler": ck.lr_scheduler,
        },
    });
    let path = import(&ck, out, &tag, client_state)?;
    Ok((ck, path))
}

/// Writes checkpoint `ck` as ds-rs checkpoint `out/tag` (and `out/latest`): one shard
/// holding the whole flat model, which any layout loads (Note [resharding]).
fn import(
    ck: &DeepSpeedCheckpoint,
    out: &Path,
    tag: &str,
    client_state: serde_json::Value,
) -> Result<PathBuf> {
    let params = ck.param_entries();
    let numel: usize = ck
        .params
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    // tensor 0 is the master copy, 1 + b the optimizer's buffer b: a parameter at a time
    let fill = |t: usize, sink: &mut dyn FnMut(&[f32]) -> Result<()>| {
        let part = match t {
            0 => Part::Master,
            b => Part::Buffer(b - 1),
        };
        (0..ck.params.len()).try_for_each(|i| sink(&ck.read(i, part)?))
    };
    let optimizer = super::Optimizer {
        buffers: ck.buffers.clone(),
        step: ck.optimizer_step,
    };
    let desc = Description {
        layout: manifest::Layout {
            world_size: ck.world * ck.pp,
            dp: ck.world,
            tp: 1,
            pp: ck.pp,
            zero_stage: ck.stage,
            dtype: ck.dtype.to_string(),
            ep: 1,
        },
        params,
        numel,
        tp_rank: 0,
        stage: 0,
        ep_rank: 0,
        counters: ck.counters,
        client_state,
        config: ck.config.clone(),
        frozen: None,
    };
    super::write_single(out, tag, desc, optimizer, fill)
}

/// Writes the checkpoint's fp32 parameters as one safetensors file (zero_to_fp32's job), a
/// parameter at a time.
pub fn write_weights(
    ck: &DeepSpeedCheckpoint,
    out: &Path,
    dtype: ds_nn::model::weights::SaveDtype,
) -> Result<()> {
    let mut w = ds_nn::model::weights::StreamingWriter::create(
        out,
        &ck.params,
        dtype,
        &[("format", "pt")],
    )?;
    for i in 0..ck.params.len() {
        w.put(&ck.read(i, Part::Master)?)?;
    }
    Ok(w.finish()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(names: &[&str]) -> Vec<(String, Vec<usize>)> {
        names.iter().map(|n| (n.to_string(), vec![2])).collect()
    }

    #[test]
    fn a_pipeline_s_layers_are_the_gpt_s_embeddings_blocks_and_head() {
        let got = pipeline_names(&params(&[
            "0.wte.weight",
            "1.ln_1.weight",
            "2.ln_1.weight",
            "3.ln_f.weight",
            "3.lm_head.weight",
        ]))
        .unwrap();
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "wte.weight",
                "h.0.ln_1.weight",
                "h.1.ln_1.weight",
                "ln_f.weight",
                "lm_head.weight"
            ]
        );
        let e = pipeline_names(&params(&["0.wte.weight", "2.wte.weight"])).unwrap_err();
        assert!(e.contains("two pipeline layers hold wte.weight"), "{e}");
        let e = pipeline_names(&params(&["wte.weight"])).unwrap_err();
        assert!(e.contains("not LAYER.NAME"), "{e}");
    }

    #[test]
    fn stage3_parts_are_padded_to_equal_sizes() {
        // 5 elements on 2 ranks: 3 + 2 (one padding), then 4: 2 + 2
        let p = vec![("a".to_string(), vec![5]), ("b".to_string(), vec![2, 2])];
        let got = stage3_pieces(&p, 2, 5).unwrap();
        assert_eq!(
            got,
            vec![vec![(0, 0..3), (1, 0..2)], vec![(0, 3..5), (1, 3..5)]]
        );
        assert!(stage3_pieces(&p, 2, 4)
            .unwrap_err()
            .contains("beyond a rank's 4 elements"));
    }
}
