//! Where gradients go after a layer's backward: summed into a whole buffer and all-reduced at
//! the accumulation boundary (stages 0-1), or reduce-scattered in buckets into the owning
//! shard at every micro-step (stages 2-3).

use std::ops::Range;

use ds_comm::{Element, Group, ReduceOp, Work};

use crate::{Result, ShardLayout};

/// How gradients are reduced (ds_config `reduce_bucket_size`, `overlap_comm`,
/// `gradient_predivide_factor`).
#[derive(Debug, Clone, Copy)]
pub struct ReduceConfig {
    /// Elements per reduction.
    pub bucket_size: usize,
    /// Start a bucket's reduction and go on with backward (stages 2-3).
    pub overlap_comm: bool,
    /// Gradients are multiplied by 1/factor before the sum and by factor/dp after it, as
    /// DeepSpeed's `gradient_predivide_factor` (1.0: sum, then average).
    pub predivide_factor: f64,
}

impl ReduceConfig {
    fn scales(&self, dp: usize) -> (Option<f32>, Option<f32>) {
        let pre = (self.predivide_factor != 1.0).then(|| (1.0 / self.predivide_factor) as f32);
        let post = (self.predivide_factor != dp as f64)
            .then(|| (self.predivide_factor / dp as f64) as f32);
        (pre, post)
    }
}

/// The gradients of one flat buffer.
pub trait GradStore<T: Element>: Send {
    /// Adds the local gradient of flat `range` (already divided by the accumulation steps).
    fn add(&mut self, range: Range<usize>, grad: &[T]) -> Result<()>;
    /// Ends a micro-step's backward; `boundary` is true on the last one before a step.
    fn finish(&mut self, boundary: bool) -> Result<()>;
    /// The reduced, averaged gradients of `owned` (valid after the boundary's `finish`).
    fn owned(&self, owned: Range<usize>) -> &[T];
    fn zero(&mut self);
    fn bytes(&self) -> usize;
}

/// Stages 0-1: a whole gradient buffer per rank, all-reduced once per optimizer step.
pub struct FullGrads<T: Element> {
    grads: Vec<T>,
    group: Group,
    reduce: ReduceConfig,
}

impl<T: Element> FullGrads<T> {
    pub fn new(layout: ShardLayout, group: Group, reduce: ReduceConfig) -> Self {
        FullGrads {
            grads: vec![T::default(); layout.padded()],
            group,
            reduce,
        }
    }
}

impl<T: Element> GradStore<T> for FullGrads<T> {
    fn add(&mut self, range: Range<usize>, grad: &[T]) -> Result<()> {
        accumulate(&mut self.grads[range], grad);
        Ok(())
    }

    fn finish(&mut self, boundary: bool) -> Result<()> {
        let dp = self.group.size();
        if !boundary || dp == 1 {
            return Ok(());
        }
        let (pre, post) = self.reduce.scales(dp);
        for bucket in self.grads.chunks_mut(self.reduce.bucket_size.max(1)) {
            scale(bucket, pre);
            self.group.all_reduce(bucket, ReduceOp::Sum)?;
            scale(bucket, post);
        }
        Ok(())
    }

    fn owned(&self, owned: Range<usize>) -> &[T] {
        &self.grads[owned]
    }

    fn zero(&mut self) {
        self.grads.fill(T::default());
    }

    fn bytes(&self) -> usize {
        std::mem::size_of_val(self.grads.as_slice())
    }
}

/// Stages 2-3: gradients gather in a bucket; a full bucket is reduce-scattered and each rank
/// adds its part into the shard it owns. Only the shard is kept between steps.
pub struct ShardGrads<T: Element> {
    shard: Vec<T>,
    layout: ShardLayout,
    group: Group,
    reduce: ReduceConfig,
    /// Pending pieces, each a flat range with its values; they form one contiguous range.
    bucket: Vec<(Range<usize>, Vec<T>)>,
    bucket_len: usize,
    in_flight: Vec<(Range<usize>, Work<Vec<T>>)>,
}

impl<T: Element> ShardGrads<T> {
    pub fn new(layout: ShardLayout, group: Group, reduce: ReduceConfig) -> Self {
        ShardGrads {
            shard: vec![T::default(); layout.shard_len()],
            layout,
            group,
            reduce,
            bucket: Vec::new(),
            bucket_len: 0,
            in_flight: Vec::new(),
        }
    }

    /// Whether `range` extends the pending bucket into one contiguous range.
    fn adjacent(&self, range: &Range<usize>) -> bool {
        let lo = self.bucket.iter().map(|(r, _)| r.start).min();
        let hi = self.bucket.iter().map(|(r, _)| r.end).max();
        match (lo, hi) {
            (Some(lo), Some(hi)) => range.end == lo || range.start == hi,
            _ => true,
        }
    }

    /// Reduce-scatters the pending bucket (in the background with `overlap_comm`).
    fn flush(&mut self) -> Result<()> {
        if self.bucket.is_empty() {
            return Ok(());
        }
        let mut pieces = std::mem::take(&mut self.bucket);
        self.bucket_len = 0;
        pieces.sort_by_key(|(r, _)| r.start);
        let range = pieces[0].0.start..pieces[pieces.len() - 1].0.end;
        let mut buf: Vec<T> = pieces.into_iter().flat_map(|(_, v)| v).collect();
        let (pre, _) = self.reduce.scales(self.group.size());
        scale(&mut buf, pre);
        let counts = self.layout.counts_within(&range);
        let work = self
            .group
            .reduce_scatter_v_async(buf, counts, ReduceOp::Sum);
        self.in_flight.push((range, work));
        if !self.reduce.overlap_comm {
            self.drain()?;
        }
        Ok(())
    }

    /// Waits for the reductions in flight and adds this rank's parts into its shard.
    fn drain(&mut self) -> Result<()> {
        let (_, post) = self.reduce.scales(self.group.size());
        let me = self.group.rank();
        let shard_start = self.layout.shard(me).start;
        for (range, work) in std::mem::take(&mut self.in_flight) {
            let mut buf = work.wait()?;
            let mine = self.layout.owned_within(&range, me);
            if mine.is_empty() {
                continue;
            }
            let part = &mut buf[mine.start - range.start..mine.end - range.start];
            scale(part, post);
            accumulate(
                &mut self.shard[mine.start - shard_start..mine.end - shard_start],
                part,
            );
        }
        Ok(())
    }
}

impl<T: Element> GradStore<T> for ShardGrads<T> {
    fn add(&mut self, range: Range<usize>, grad: &[T]) -> Result<()> {
        if !self.adjacent(&range) {
            self.flush()?;
        }
        self.bucket_len += grad.len();
        self.bucket.push((range, grad.to_vec()));
        if self.bucket_len >= self.reduce.bucket_size {
            self.flush()?;
        }
        Ok(())
    }

    fn finish(&mut self, _boundary: bool) -> Result<()> {
        self.flush()?;
        self.drain()
    }

    fn owned(&self, _owned: Range<usize>) -> &[T] {
        &self.shard
    }

    fn zero(&mut self) {
        self.shard.fill(T::default());
    }

    fn bytes(&self) -> usize {
        std::mem::size_of_val(self.shard.as_slice())
    }
}

fn accumulate<T: Element>(dst: &mut [T], src: &[T]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, s)| *d = T::from_f32(d.to_f32() + s.to_f32()));
}

fn scale<T: Element>(buf: &mut [T], k: Option<f32>) {
    if let Some(k) = k {
        buf.iter_mut()
            .for_each(|v| *v = T::from_f32(v.to_f32() * k));
    }
}
