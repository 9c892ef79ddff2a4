//! Parameters that do not train (frozen): stored as the ZeRO stage stores parameters, whole on
//! every rank at stages 0-2 and each rank's shard at stage 3 (gathered for a layer's compute
//! as the trainable ones are), with no gradient, no fp32 master copy and no optimizer state.
//! DeepSpeed does the same with `requires_grad=False` parameters: ZeRO-3 partitions them, and
//! they never enter the optimizer's flat groups or the gradient reduction.

use std::ops::Range;

use ds_comm::{Element, Group};
use ds_config::ZeroStage;

use crate::params::{ParamStore, Publish, ReplicatedParams, ShardedParams, Values};
use crate::zero::{initial, InitFn, ZeroOptions};
use crate::{PartitionError, Placement, Result, ShardLayout};

/// One rank's share of the frozen parameters.
pub struct Frozen<T: Element> {
    params: Box<dyn ParamStore<T>>,
    layout: ShardLayout,
    group: Group,
    sharded: bool,
}

impl<T: Element> Frozen<T> {
    /// The store for `numel` frozen parameters under `opts.stage`; `init(range, dst)` writes
    /// the initial (and only) values of a flat range, asked only for what this rank keeps.
    pub fn new<E: From<PartitionError>>(
        numel: usize,
        opts: ZeroOptions,
        group: Group,
        init: &mut InitFn<'_, E>,
        place: &Placement,
    ) -> std::result::Result<Frozen<T>, E> {
        let layout = ShardLayout::new(numel, group.size());
        let sharded = opts.stage == ZeroStage::Weights;
        let params: Box<dyn ParamStore<T>> = match sharded {
            true => {
                let shard = initial(layout, layout.shard(group.rank()), init, place)?;
                Box::new(ShardedParams::new(
                    shard,
                    layout,
                    group.clone(),
                    opts.stage3,
                ))
            }
            false => {
                let values = initial(layout, 0..layout.padded(), init, place)?;
                Box::new(ReplicatedParams::new(
                    values,
                    layout,
                    group.clone(),
                    Publish::Local,
                ))
            }
        };
        Ok(Frozen {
            params,
            layout,
            group,
            sharded,
        })
    }

    /// The whole values of flat `range`, for a layer's compute.
    pub fn params(&mut self, range: Range<usize>) -> Result<Values<'_, T>> {
        self.params.get(range)
    }

    /// `range` will be asked for next (stage 3 starts gathering it).
    pub fn prefetch(&mut self, range: Range<usize>) -> Result<()> {
        self.params.prefetch(range)
    }

    /// Bytes held between steps.
    pub fn bytes(&self) -> usize {
        self.params.bytes()
    }

    /// Most bytes of gathered parameters held at once besides `bytes` (a prefetch).
    pub fn peak_gathered_bytes(&self) -> usize {
        self.params.peak_gathered_bytes()
    }

    pub fn on_host(&self) -> bool {
        self.params.on_host()
    }

    /// Every frozen parameter's value as f32, whole (a collective at stage 3).
    pub fn gather(&self) -> Result<Vec<f32>> {
        if !self.sharded {
            return self.params.values_f32(0..self.layout.numel());
        }
        let mut all = vec![0f32; self.layout.padded()];
        let mine = self.layout.shard(self.group.rank());
        all[mine.clone()].copy_from_slice(&self.params.values_f32(mine)?);
        if self.group.size() > 1 {
            let counts = vec![self.layout.shard_len(); self.layout.world()];
            self.group.all_gather_v(&mut all, &counts)?;
        }
        all.truncate(self.layout.numel());
        Ok(all)
    }
}
