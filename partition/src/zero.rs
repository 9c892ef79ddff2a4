//! A ZeRO stage: the parameter store and gradient store it asks for, plus the fp32 master
//! copy of the range this rank updates.

use std::ops::Range;

use ds_comm::{Element, Group, ReduceOp};
use ds_config::ZeroStage;

use crate::grads::{FullGrads, GradStore, ReduceConfig, ShardGrads};
use crate::params::{ParamStore, Publish, ReplicatedParams, ShardedParams, Stage3Config, Values};
use crate::{vector, FlatBuf, PartitionError, Placement, Result, ShardLayout, StateBytes};

/// Writes the initial values of a flat range (unpadded coordinates) into the slice given.
pub type InitFn<'a, E> = dyn FnMut(Range<usize>, &mut [f32]) -> std::result::Result<(), E> + 'a;

/// Where stage 3's parameter shard goes at start-up when it lives on NVMe (ZeRO-Infinity's
/// `offload_param`): a swap file of this rank's under `nvme_path`, its I/O counted in `io`.
pub struct ParamSwap<'a> {
    pub nvme_path: &'a std::path::Path,
    pub rank: usize,
    pub io: &'a std::sync::Arc<crate::swap::SwapIo>,
}

/// Where each kind of model state lives: all on the compute device, or (ZeRO-Offload) the
/// optimizer's part and stage 3's parameter shard in host memory while the GPU computes.
#[derive(Debug, Clone, Default)]
pub struct Placements {
    /// Parameters in the compute dtype (`offload_param` moves stage 3's shard to the host).
    pub params: Placement,
    /// Gradients in the compute dtype.
    pub grads: Placement,
    /// The fp32 master copy and the optimizer's moments (`offload_optimizer`).
    pub optimizer: Placement,
}

impl Placements {
    /// Every state in host memory: training on the CPU.
    pub fn host() -> Placements {
        Placements::default()
    }
}

/// What a stage needs from ds_config `zero_optimization`.
#[derive(Debug, Clone, Copy)]
pub struct ZeroOptions {
    pub stage: ZeroStage,
    pub reduce: ReduceConfig,
    /// Elements per all-gather piece when stages 1-2 make parameters whole after the step
    /// (`allgather_bucket_size`).
    pub allgather_bucket_size: usize,
    pub stage3: Stage3Config,
}

/// One rank's share of the model state under a ZeRO stage.
pub struct Zero<T: Element> {
    stage: ZeroStage,
    layout: ShardLayout,
    group: Group,
    params: Box<dyn ParamStore<T>>,
    grads: Box<dyn GradStore<T>>,
    /// The flat range (padded coordinates) whose master copy this rank keeps.
    owned: Range<usize>,
    master: FlatBuf<f32>,
    places: Placements,
    /// Under tensor parallelism: the group holding the other slices, and the flat ranges of
    /// the parameters every tensor-parallel rank holds whole.
    tp: Option<(Group, Vec<Range<usize>>)>,
    /// Under pipeline parallelism: the stages, each holding other layers.
    pp: Option<Group>,
    /// Flat ranges holding a copy of a parameter held elsewhere too (a tied parameter's
    /// second use): left out of the gradient norm, which counts the original.
    duplicates: Vec<Range<usize>>,
}

impl<T: Element> Zero<T> {
    /// The stage's stores for `numel` parameters; `init(range, dst)` writes the initial
    /// values of flat `range` (within `0..numel`) into `dst`. Only the ranges this rank keeps
    /// are asked for: the whole buffer at stages 0-2, the owned shard at stage 3 (DeepSpeed's
    /// zero.Init), so no rank ever holds more than its store does.
    pub fn new<E: From<PartitionError>>(
        numel: usize,
        opts: ZeroOptions,
        group: Group,
        init: &mut InitFn<'_, E>,
        swap: Option<ParamSwap<'_>>,
        places: &Placements,
    ) -> std::result::Result<Zero<T>, E> {
        let layout = ShardLayout::new(numel, group.size());
        let owned = match opts.stage.partitions_optimizer() {
            false => 0..layout.padded(),
            true => layout.shard(group.rank()),
        };
        let params: Box<dyn ParamStore<T>> = match opts.stage {
            ZeroStage::Weights => {
                let shard = initial(layout, owned.clone(), init, &places.params)?;
                let mut store = ShardedParams::new(shard, layout, group.clone(), opts.stage3);
                if let Some(s) = swap {
                    // before the master copy is made, which then reads the file
                    store.offload(s.nvme_path, s.rank, s.io).map_err(|e| {
                        PartitionError::Invalid(format!("zero_optimization.offload_param: {e}"))
                    })?;
                }
                Box::new(store)
            }
            stage => {
                let values = initial(layout, 0..layout.padded(), init, &places.params)?;
                let publish = match stage.partitions_optimizer() {
                    false => Publish::Local,
                    true => Publish::AllGather {
                        piece: opts.allgather_bucket_size,
                    },
                };
                Box::new(ReplicatedParams::new(
                    values,
                    layout,
                    group.clone(),
                    publish,
                ))
            }
        };
        let grads: Box<dyn GradStore<T>> = match opts.stage {
            ZeroStage::Disabled | ZeroStage::OptimizerStates => Box::new(FullGrads::new(
                layout,
                group.clone(),
                opts.reduce,
                &places.grads,
            )?),
            ZeroStage::Gradients => Box::new(ShardGrads::new(
                layout,
                group.clone(),
                opts.reduce,
                &places.grads,
            )?),
            ZeroStage::Weights => {
                // The two buckets alive at once (Note [bounded buckets]) hold no more than
                // the live parameters' gradients (partition/ARCHITECTURE.md, decisions).
                let mut reduce = opts.reduce;
                let live = opts.stage3.max_live_parameters / 2;
                reduce.bucket_size = reduce.bucket_size.min(live);
                Box::new(ShardGrads::new(
                    layout,
                    group.clone(),
                    reduce,
                    &places.grads,
                )?)
            }
        };
        // The master copy starts from the compute-dtype values (rounded under bf16/fp16), as
        // DeepSpeed's does.
        let master = FlatBuf::from_vec(&places.optimizer, params.values_f32(owned.clone())?)?;
        Ok(Zero {
            stage: opts.stage,
            layout,
            group,
            params,
            grads,
            owned,
            master,
            places: places.clone(),
            tp: None,
            pp: None,
            duplicates: Vec::new(),
        })
    }

    /// This buffer holds one pipeline stage's layers; `group`'s other ranks hold the other
    /// stages': the gradient norm sums over them.
    pub fn set_pipeline(&mut self, group: Group) {
        self.pp = (group.size() > 1).then_some(group);
    }

    /// This buffer holds one tensor-parallel rank's slices, `replicated` (flat ranges) being
    /// the parameters every rank of `group` holds whole: the gradient norm then counts the
    /// slices of every rank and the replicated parameters once.
    pub fn set_tensor_parallel(&mut self, group: Group, replicated: Vec<Range<usize>>) {
        self.tp = (group.size() > 1).then_some((group, replicated));
    }

    /// `ranges` (flat, none of them replicated over tensor parallelism) are copies of
    /// parameters counted elsewhere: the gradient norm leaves them out.
    pub fn set_duplicates(&mut self, ranges: Vec<Range<usize>>) {
        self.duplicates = ranges;
    }

    /// Every gradient of the buffer, reduced (stages 0-1, after the boundary's backward),
    /// for sums across tied parameters; None where the gradients are sharded (stages 2-3).
    pub fn whole_grads_mut(&mut self) -> Option<&mut [T]> {
        self.grads.whole_mut()
    }

    /// Where each kind of state lives (the optimizer allocates its moments beside the master
    /// copy).
    pub fn placements(&self) -> &Placements {
        &self.places
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }
    /// The flat range (padded coordinates) this rank's master copy and optimizer cover.
    pub fn owned(&self) -> Range<usize> {
        self.owned.clone()
    }

    /// Whole parameter values of flat `range` for compute.
    pub fn params(&mut self, range: Range<usize>) -> Result<Values<'_, T>> {
        self.params.get(range)
    }

    /// The flat ranges of the model's layers, in order: gradient buckets are then sized to
    /// the layers they will hold.
    pub fn plan_buckets(&mut self, layers: &[Range<usize>]) {
        self.grads.plan(layers);
    }

    pub fn prefetch(&mut self, range: Range<usize>) -> Result<()> {
        self.params.prefetch(range)
    }

    /// Adds the local gradient of flat `range`, in consecutive parts covering it.
    pub fn add_grad(&mut self, range: Range<usize>, parts: &[&[T]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len != range.len() {
            return Err(PartitionError::Invalid(format!(
                "a gradient of {len} elements for the flat range {range:?}"
            )));
        }
        self.grads.add(range, parts)
    }

    pub fn finish_backward(&mut self, boundary: bool) -> Result<()> {
        self.grads.finish(boundary)
    }

    /// Sums the reduced gradients of two flat ranges of one length (a tied parameter's two
    /// uses) into both, where each rank holds only its shard of them (stages 2-3): piece by
    /// piece, every rank contributes the parts it owns of both ranges to one all-reduce
    /// (a sum with zeros: exact), then writes `a + b`, taken in f32, into its parts. The
    /// result is the bits of the whole-buffer sum at stages 0-1.
    pub fn sum_sharded_pair(&mut self, a: Range<usize>, b: Range<usize>) -> Result<()> {
        const PIECE: usize = 1 << 20;
        let (n, owned) = (a.len(), self.owned.clone());
        let mut buf = vec![T::default(); 2 * PIECE.min(n)];
        let mut at = 0;
        while at < n {
            let len = PIECE.min(n - at);
            let buf = &mut buf[..2 * len];
            buf.fill(T::default());
            let pieces = [
                a.start + at..a.start + at + len,
                b.start + at..b.start + at + len,
            ];
            let mine = |r: &Range<usize>| r.start.max(owned.start)..r.end.min(owned.end);
            let grads = self.grads.owned(owned.clone());
            for (half, r) in pieces.iter().enumerate() {
                let m = mine(r);
                if m.start < m.end {
                    let dst = half * len + (m.start - r.start)..half * len + (m.end - r.start);
                    buf[dst].copy_from_slice(&grads[m.start - owned.start..m.end - owned.start]);
                }
            }
            self.group.all_reduce(buf, ReduceOp::Sum)?;
            let grads = self.grads.owned_mut(owned.clone());
            for r in &pieces {
                for e in mine(r) {
                    let i = e - r.start;
                    grads[e - owned.start] = T::from_f32(buf[i].to_f32() + buf[len + i].to_f32());
                }
            }
            at += len;
        }
        Ok(())
    }

    /// The reduced gradients of the owned range.
    pub fn owned_grads(&self) -> &[T] {
        self.grads.owned(self.owned.clone())
    }

    /// Sum of squares of all gradients of the model, over every rank's shard; not finite when
    /// any gradient is inf or NaN on any rank, which is how an overflow is detected.
    pub fn grad_norm_sq(&self) -> Result<f64> {
        let grads = self.owned_grads();
        let total = vector::sum_squares(grads)?;
        let within = |ranges: &[Range<usize>]| -> Result<f64> {
            let mut sum = 0.0;
            for r in ranges {
                let (a, b) = (r.start.max(self.owned.start), r.end.min(self.owned.end));
                if a < b {
                    sum += vector::sum_squares(&grads[a - self.owned.start..b - self.owned.start])?;
                }
            }
            Ok(sum)
        };
        let replicated = match &self.tp {
            Some((_, r)) => within(r)?,
            None => 0.0,
        };
        let duplicated = within(&self.duplicates)?;
        // [sliced, replicated] over the data-parallel shards
        let mut buf = [(total - replicated - duplicated) as f32, replicated as f32];
        if self.stage.partitions_optimizer() && self.group.size() > 1 {
            self.group.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        if let Some((tp, _)) = &self.tp {
            let mut sliced = [buf[0]];
            tp.all_reduce(&mut sliced, ReduceOp::Sum)?;
            buf[0] = sliced[0];
        }
        let total = buf[0] as f64 + buf[1] as f64;
        match &self.pp {
            None => Ok(total),
            Some(pp) => {
                let mut stages = [total as f32];
                pp.all_reduce(&mut stages, ReduceOp::Sum)?;
                Ok(stages[0] as f64)
            }
        }
    }

    /// The fp32 master values of the owned range (the optimizer's parameters).
    pub fn master_mut(&mut self) -> &mut [f32] {
        &mut self.master
    }

    /// The master values and the reduced gradients of the owned range, for the step.
    pub fn master_and_grads(&mut self) -> (&mut [f32], &[T]) {
        (&mut self.master, self.grads.owned(self.owned.clone()))
    }

    pub fn master(&self) -> &[f32] {
        &self.master
    }

    /// After an optimizer step: master values back into the parameters; gradients cleared.
    pub fn publish(&mut self) -> Result<()> {
        self.params.write_owned(self.owned.clone(), &self.master)?;
        self.publish_written()
    }

    /// Bytes of parameters kept on disk.
    pub fn offloaded_param_bytes(&self) -> usize {
        self.params.offloaded_bytes()
    }

    /// Hands the master copy over (to the NVMe tier, which then streams it through
    /// `write_owned` and `publish_written` at each step); this store keeps none.
    pub fn take_master(&mut self) -> Vec<f32> {
        std::mem::replace(&mut self.master, FlatBuf::empty()).into_vec()
    }

    /// Writes updated master values of the owned range from offset `at` into the parameters.
    pub fn write_owned(&mut self, at: usize, values: &[f32]) -> Result<()> {
        let start = self.owned.start + at;
        self.params.write_owned(start..start + values.len(), values)
    }

    /// After the owned range was written through `write_owned`: the parameters made whole
    /// again where kept whole, gradients cleared.
    pub fn publish_written(&mut self) -> Result<()> {
        self.params.publish()?;
        self.grads.zero()
    }

    /// Drops the gradients of a skipped step (fp16 overflow).
    pub fn zero_grads(&mut self) -> Result<()> {
        self.grads.zero()
    }

    /// The whole fp32 master parameters (numel elements), gathered from every rank.
    pub fn gather_master(&self) -> Result<Vec<f32>> {
        self.gather(&self.master)
    }

    /// The whole fp32 parameters from every rank's owned `local` values (numel elements).
    pub fn gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let mut all = vec![0f32; self.layout.padded()];
        all[self.owned.clone()].copy_from_slice(local);
        if self.stage.partitions_optimizer() && self.group.size() > 1 {
            let counts = vec![self.layout.shard_len(); self.layout.world()];
            self.group.all_gather_v(&mut all, &counts)?;
        }
        all.truncate(self.layout.numel());
        Ok(all)
    }

    /// Bytes held for parameters, gradients and optimizer states (`optimizer_bytes` are
    /// the moments the optimizer reports; the master copy is counted here).
    pub fn memory(&self, optimizer_bytes: usize) -> StateBytes {
        let (params, grads) = (self.params.bytes(), self.grads.bytes());
        let optimizer_states = self.master.bytes() + optimizer_bytes;
        let on_gpu = |on_host: bool, bytes: usize| if on_host { 0 } else { bytes };
        StateBytes {
            params,
            grads,
            optimizer_states,
            comm_buffers: self.params.peak_gathered_bytes() + self.grads.peak_buffer_bytes(),
            gpu: on_gpu(self.params.on_host(), params)
                + on_gpu(self.grads.on_host(), grads)
                + on_gpu(self.master.on_host(), optimizer_states),
        }
    }
}

/// The initial values of `range` (padded coordinates) in the compute dtype, generated in
/// pieces of at most `INIT_PIECE` elements so the f32 staging stays small; padding is zero.
pub(crate) fn initial<T: Element, E: From<PartitionError>>(
    layout: ShardLayout,
    range: Range<usize>,
    init: &mut InitFn<'_, E>,
    place: &Placement,
) -> std::result::Result<FlatBuf<T>, E> {
    const INIT_PIECE: usize = 1 << 20;
    let mut out = FlatBuf::zeroed(place, range.len())?;
    let mut staging = vec![0f32; INIT_PIECE.min(range.len())];
    let real_end = range.end.min(layout.numel());
    let mut at = range.start;
    while at < real_end {
        let end = (at + INIT_PIECE).min(real_end);
        let piece = &mut staging[..end - at];
        init(at..end, piece)?;
        vector::convert_into(&mut out[at - range.start..end - range.start], piece)?;
        at = end;
    }
    out.settle()?;
    Ok(out)
}
