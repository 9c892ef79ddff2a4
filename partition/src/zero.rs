//! A ZeRO stage: the parameter store and gradient store it asks for, plus the fp32 master
//! copy of the range this rank updates.

use std::borrow::Cow;
use std::ops::Range;

use ds_comm::{Element, Group, ReduceOp};

use crate::grads::{FullGrads, GradStore, ReduceConfig, ShardGrads};
use crate::params::{ParamStore, ReplicatedParams, ShardedParams, Stage3Config};
use crate::{MemoryReport, Result, ShardLayout};

/// What a stage needs from ds_config `zero_optimization`.
#[derive(Debug, Clone, Copy)]
pub struct ZeroOptions {
    /// 0 (plain data parallelism) to 3.
    pub stage: u8,
    pub reduce: ReduceConfig,
    pub stage3: Stage3Config,
}

/// One rank's share of the model state under a ZeRO stage.
pub struct Zero<T: Element> {
    stage: u8,
    layout: ShardLayout,
    group: Group,
    params: Box<dyn ParamStore<T>>,
    grads: Box<dyn GradStore<T>>,
    /// The flat range (padded coordinates) whose master copy this rank keeps.
    owned: Range<usize>,
    master: Vec<f32>,
}

impl<T: Element> Zero<T> {
    /// `values` are the whole initial parameters in flat order (the same on every rank).
    pub fn new(values: Vec<T>, opts: ZeroOptions, group: Group) -> Result<Zero<T>> {
        if opts.stage > 3 {
            return Err(crate::PartitionError::Invalid(format!(
                "ZeRO stage {} does not exist (0-3)",
                opts.stage
            )));
        }
        let layout = ShardLayout::new(values.len(), group.size());
        let owned = match opts.stage {
            0 => 0..layout.padded(),
            _ => layout.shard(group.rank()),
        };
        let params: Box<dyn ParamStore<T>> = match opts.stage {
            3 => Box::new(ShardedParams::new(
                &values,
                layout,
                group.clone(),
                opts.stage3,
            )),
            s => Box::new(ReplicatedParams::new(values, layout, group.clone(), s > 0)),
        };
        let grads: Box<dyn GradStore<T>> = match opts.stage {
            0 | 1 => Box::new(FullGrads::new(layout, group.clone(), opts.reduce)),
            _ => Box::new(ShardGrads::new(layout, group.clone(), opts.reduce)),
        };
        let master = params.values_f32(owned.clone());
        Ok(Zero {
            stage: opts.stage,
            layout,
            group,
            params,
            grads,
            owned,
            master,
        })
    }

    pub fn stage(&self) -> u8 {
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
    pub fn params(&mut self, range: Range<usize>) -> Result<Cow<'_, [T]>> {
        self.params.get(range)
    }

    pub fn prefetch(&mut self, range: Range<usize>) -> Result<()> {
        self.params.prefetch(range)
    }

    pub fn add_grad(&mut self, range: Range<usize>, grad: &[T]) -> Result<()> {
        self.grads.add(range, grad)
    }

    pub fn finish_backward(&mut self, boundary: bool) -> Result<()> {
        self.grads.finish(boundary)
    }

    /// The reduced gradients of the owned range.
    pub fn owned_grads(&self) -> &[T] {
        self.grads.owned(self.owned.clone())
    }

    /// Sum of squares of all gradients of the model, over every rank's shard; not finite when
    /// any gradient is inf or NaN on any rank, which is how an overflow is detected.
    pub fn grad_norm_sq(&self) -> Result<f64> {
        let local = sum_squares(self.owned_grads());
        if self.stage == 0 || self.group.size() == 1 {
            return Ok(local);
        }
        let mut buf = [local as f32];
        self.group.all_reduce(&mut buf, ReduceOp::Sum)?;
        Ok(buf[0] as f64)
    }

    /// The fp32 master values of the owned range (the optimizer's parameters).
    pub fn master_mut(&mut self) -> &mut [f32] {
        &mut self.master
    }

    pub fn master(&self) -> &[f32] {
        &self.master
    }

    /// After an optimizer step: master values back into the parameters; gradients cleared.
    pub fn publish(&mut self) -> Result<()> {
        self.params.publish(self.owned.clone(), &self.master)?;
        self.grads.zero();
        Ok(())
    }

    /// Drops the gradients of a skipped step (fp16 overflow).
    pub fn zero_grads(&mut self) {
        self.grads.zero();
    }

    /// The whole fp32 master parameters (numel elements), gathered from every rank.
    pub fn gather_master(&self) -> Result<Vec<f32>> {
        let mut all = vec![0f32; self.layout.padded()];
        all[self.owned.clone()].copy_from_slice(&self.master);
        if self.stage > 0 && self.group.size() > 1 {
            let counts = vec![self.layout.shard_len(); self.layout.world()];
            self.group.all_gather_v(&mut all, &counts)?;
        }
        all.truncate(self.layout.numel());
        Ok(all)
    }

    /// Bytes held for parameters, gradients and optimizer states (`optimizer_bytes` are
    /// the moments the optimizer reports; the master copy is counted here).
    pub fn memory(&self, optimizer_bytes: usize) -> MemoryReport {
        MemoryReport {
            params: self.params.bytes(),
            grads: self.grads.bytes(),
            optimizer_states: std::mem::size_of_val(self.master.as_slice()) + optimizer_bytes,
        }
    }
}

/// The sum of squares in f64, over 8 running partial sums: one serial chain of f64 adds
/// waits on each add's latency, 8 independent ones vectorise.
fn sum_squares<T: Element>(g: &[T]) -> f64 {
    const LANES: usize = 8;
    let mut lanes = [0f64; LANES];
    let mut chunks = g.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let v = c[i].to_f32() as f64;
            lanes[i] += v * v;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|v| (v.to_f32() as f64).powi(2))
        .sum();
    lanes.iter().sum::<f64>() + tail
}
