//! Where gradients go after a layer's backward: summed into a whole buffer and all-reduced at
//! the accumulation boundary (stages 0-1), or reduce-scattered in buckets into the owning
//! shard at every micro-step (stages 2-3).

use std::ops::Range;

use ds_comm::{Element, Group, ReduceOp, Work};

use crate::{vector, FlatBuf, Placement, Result, ShardLayout};

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
    /// Adds the local gradient of flat `range` (already divided by the accumulation steps),
    /// given as consecutive parts (a layer's parameters) that together cover the range.
    fn add(&mut self, range: Range<usize>, parts: &[&[T]]) -> Result<()>;
    /// Ends a micro-step's backward; `boundary` is true on the last one before a step.
    fn finish(&mut self, boundary: bool) -> Result<()>;
    /// The reduced, averaged gradients of `owned` (valid after the boundary's `finish`).
    fn owned(&self, owned: Range<usize>) -> &[T];
    fn owned_mut(&mut self, owned: Range<usize>) -> &mut [T];
    fn zero(&mut self) -> Result<()>;
    /// Bytes of gradients held between steps.
    fn bytes(&self) -> usize;
    /// Whether the gradients kept between steps are in host memory (false: a GPU's).
    fn on_host(&self) -> bool;
    /// The whole buffer's gradients, where this store holds them all (stages 0-1).
    fn whole_mut(&mut self) -> Option<&mut [T]> {
        None
    }
    /// Most bytes held at once in reduction buffers besides the gradients (buckets).
    fn peak_buffer_bytes(&self) -> usize {
        0
    }
    /// The flat ranges gradients will be added in, in model order (backward adds them in
    /// reverse), so that buckets can be sized exactly.
    fn plan(&mut self, layers: &[Range<usize>]) {
        let _ = layers;
    }
}

/// Stages 0-1: a whole gradient buffer per rank, all-reduced once per optimizer step.
pub struct FullGrads<T: Element> {
    grads: FlatBuf<T>,
    group: Group,
    reduce: ReduceConfig,
}

impl<T: Element> FullGrads<T> {
    pub fn new(
        layout: ShardLayout,
        group: Group,
        reduce: ReduceConfig,
        place: &Placement,
    ) -> Result<Self> {
        Ok(FullGrads {
            grads: FlatBuf::zeroed(place, layout.padded())?,
            group,
            reduce,
        })
    }
}

impl<T: Element> GradStore<T> for FullGrads<T> {
    fn add(&mut self, range: Range<usize>, parts: &[&[T]]) -> Result<()> {
        let mut at = range.start;
        for part in parts {
            vector::accumulate(&mut self.grads[at..at + part.len()], part)?;
            at += part.len();
        }
        debug_assert_eq!(at, range.end);
        Ok(())
    }

    fn finish(&mut self, boundary: bool) -> Result<()> {
        let dp = self.group.size();
        if !boundary || dp == 1 {
            return Ok(());
        }
        let (pre, post) = self.reduce.scales(dp);
        for bucket in self.grads.chunks_mut(self.reduce.bucket_size.max(1)) {
            vector::scale(bucket, pre)?;
            self.group.all_reduce(bucket, ReduceOp::Sum)?;
            vector::scale(bucket, post)?;
        }
        Ok(())
    }

    fn owned(&self, owned: Range<usize>) -> &[T] {
        &self.grads[owned]
    }

    fn owned_mut(&mut self, owned: Range<usize>) -> &mut [T] {
        &mut self.grads[owned]
    }

    fn zero(&mut self) -> Result<()> {
        vector::zero(&mut self.grads)
    }

    fn bytes(&self) -> usize {
        self.grads.bytes()
    }

    fn on_host(&self) -> bool {
        self.grads.on_host()
    }

    fn whole_mut(&mut self) -> Option<&mut [T]> {
        Some(&mut self.grads)
    }
}

/// Stages 2-3: gradients gather in a bucket; a full bucket is reduce-scattered and each rank
/// adds its part into the shard it owns. Only the shard is kept between steps.
///
/// Note [bounded buckets]: at most two bucket buffers exist, as DeepSpeed's double-buffered
/// ipg buckets: the one being filled and the one being reduced (with `overlap_comm`). A
/// layer's gradient is copied once, straight to its place in the bucket; a bucket holds at
/// most `reduce_bucket_size` elements (and at most `bucket_bound`) unless one layer's gradient
/// alone is larger. Each element is reduced along the same chain whatever bucket it rides in,
/// so bucket sizes change no value (checked bit for bit on 3 ranks at every stage).
///
/// The buckets live where the shard does (`place`): under `--dist_backend nccl` a GPU's, so
/// a layer's gradients reach them by device copies, NCCL reduces them where they are, and
/// the owned part is added into the shard by a kernel (in host buckets it crossed to the host
/// and back, and was added by a host loop over the shard's managed pages).
pub struct ShardGrads<T: Element> {
    shard: FlatBuf<T>,
    place: Placement,
    layout: ShardLayout,
    group: Group,
    reduce: ReduceConfig,
    filling: Option<Bucket<T>>,
    /// The bucket being reduced: its range, its buffer's length and the reduction.
    in_flight: Option<(Range<usize>, usize, Work<Filled<T>>)>,
    /// The buffer of the last finished reduction, reused by the next bucket it can hold.
    spare: Option<FlatBuf<T>>,
    /// Most elements held in bucket buffers at once (communication buffers, for the report).
    peak_bucket_elems: usize,
    /// The buckets backward will fill, when the layers are known (`plan`).
    planned: Vec<Range<usize>>,
}

/// Gradients of a contiguous flat range `lo..hi`, filled from the top down (backward visits
/// layers in reverse flat order): they end at `buf[cap]` (`buf` may be a larger spare).
struct Bucket<T: Element> {
    buf: FlatBuf<T>,
    cap: usize,
    lo: usize,
    hi: usize,
}

impl<T: Element> Bucket<T> {
    fn room(&self) -> usize {
        self.cap - (self.hi - self.lo)
    }

    /// Writes the gradient of `range` (in parts), which ends where the bucket starts.
    fn put(&mut self, range: Range<usize>, parts: &[&[T]]) -> Result<()> {
        let mut at = self.cap - (self.hi - range.start);
        for part in parts {
            vector::copy(&mut self.buf[at..at + part.len()], part)?;
            at += part.len();
        }
        self.lo = range.start;
        Ok(())
    }

    /// The buffer's part holding exactly `lo..hi` (where it lies: moving it to the front
    /// would be a host loop over a GPU buffer), and that range.
    fn into_filled(self) -> (Filled<T>, Range<usize>) {
        let filled = Filled {
            within: self.cap - (self.hi - self.lo)..self.cap,
            buf: self.buf,
        };
        (filled, self.lo..self.hi)
    }
}

/// A bucket's filled part, `buf[within]`: the slice a reduction takes.
struct Filled<T: Element> {
    buf: FlatBuf<T>,
    within: Range<usize>,
}

impl<T: Element> std::ops::Deref for Filled<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.within.clone()]
    }
}

impl<T: Element> std::ops::DerefMut for Filled<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.within.clone()]
    }
}

impl<T: Element> ShardGrads<T> {
    pub fn new(
        layout: ShardLayout,
        group: Group,
        mut reduce: ReduceConfig,
        place: &Placement,
    ) -> Result<Self> {
        reduce.bucket_size = reduce.bucket_size.min(bucket_bound(layout));
        Ok(ShardGrads {
            shard: FlatBuf::zeroed(place, layout.shard_len())?,
            place: place.clone(),
            layout,
            group,
            reduce,
            filling: None,
            in_flight: None,
            spare: None,
            peak_bucket_elems: 0,
            planned: Vec::new(),
        })
    }

    /// A group of one without scaling (the default predivide factor): a bucket would be
    /// copied, "reduced" by itself and added into the shard, which is the whole buffer, so
    /// the gradients are added into it directly, the same sums. On a GPU that keeps them on
    /// the device (an accumulate kernel), where a bucket is host memory.
    fn alone(&self) -> bool {
        self.group.size() == 1 && self.reduce.scales(1) == (None, None)
    }

    /// A bucket for gradients ending at `hi`, big enough for `first` elements: a reduced
    /// bucket's buffer when one is free and large enough.
    fn open(&mut self, hi: usize, first: usize) -> Result<Bucket<T>> {
        let cap = match self.planned.iter().find(|b| b.end == hi) {
            Some(b) if b.len() >= first => b.len(),
            _ => self.reduce.bucket_size.min(hi).max(first),
        };
        // every element of the bucket's range is written by `put` before it is reduced
        let buf = match self.spare.take() {
            Some(spare) if spare.len() >= cap => spare,
            _ => FlatBuf::zeroed(&self.place, cap)?,
        };
        let in_flight = self.in_flight.as_ref().map_or(0, |(_, held, _)| *held);
        self.peak_bucket_elems = self.peak_bucket_elems.max(buf.len() + in_flight);
        Ok(Bucket {
            buf,
            cap,
            lo: hi,
            hi,
        })
    }

    /// Reduce-scatters the bucket being filled (in the background with `overlap_comm`),
    /// after the one before it has finished.
    fn flush(&mut self) -> Result<()> {
        let Some(bucket) = self.filling.take() else {
            return Ok(());
        };
        let (mut filled, range) = bucket.into_filled();
        let (pre, _) = self.reduce.scales(self.group.size());
        vector::scale(&mut filled, pre)?;
        self.drain()?;
        let counts = self.layout.counts_within(&range);
        let held = filled.buf.len();
        let work = self
            .group
            .reduce_scatter_v_async(filled, counts, ReduceOp::Sum);
        self.in_flight = Some((range, held, work));
        if !self.reduce.overlap_comm {
            self.drain()?;
        }
        Ok(())
    }

    /// Waits for the reduction in flight and adds this rank's part into its shard.
    fn drain(&mut self) -> Result<()> {
        let Some((range, _, work)) = self.in_flight.take() else {
            return Ok(());
        };
        let mut filled = work.wait()?;
        let (_, post) = self.reduce.scales(self.group.size());
        let me = self.group.rank();
        let mine = self.layout.owned_within(&range, me);
        if !mine.is_empty() {
            let shard_start = self.layout.shard(me).start;
            let part = &mut filled[mine.start - range.start..mine.end - range.start];
            vector::scale(part, post)?;
            vector::accumulate(
                &mut self.shard[mine.start - shard_start..mine.end - shard_start],
                part,
            )?;
        }
        self.spare = Some(filled.buf);
        Ok(())
    }
}

impl<T: Element> GradStore<T> for ShardGrads<T> {
    fn add(&mut self, range: Range<usize>, parts: &[&[T]]) -> Result<()> {
        if self.alone() {
            let mut at = range.start;
            for part in parts {
                vector::accumulate(&mut self.shard[at..at + part.len()], part)?;
                at += part.len();
            }
            return Ok(());
        }
        let fits = self
            .filling
            .as_ref()
            .is_some_and(|b| range.end == b.lo && range.len() <= b.room());
        if !fits {
            self.flush()?;
            self.filling = Some(self.open(range.end, range.len())?);
        }
        let bucket = self.filling.as_mut().expect("invariant: opened above");
        bucket.put(range, parts)?;
        if bucket.room() == 0 {
            self.flush()?;
        }
        Ok(())
    }

    fn finish(&mut self, _boundary: bool) -> Result<()> {
        self.flush()?;
        self.drain()?;
        if self.place.is_host() {
            // host buckets live only during backward; a GPU's is kept for the next one, as
            // DeepSpeed keeps its bucket: a managed allocation and free every micro-step
            // would synchronise the device and map fresh pages
            self.spare = None;
        }
        Ok(())
    }

    fn owned(&self, _owned: Range<usize>) -> &[T] {
        &self.shard
    }

    fn owned_mut(&mut self, _owned: Range<usize>) -> &mut [T] {
        &mut self.shard
    }

    fn zero(&mut self) -> Result<()> {
        vector::zero(&mut self.shard)
    }

    fn bytes(&self) -> usize {
        self.shard.bytes()
    }

    fn on_host(&self) -> bool {
        self.shard.on_host()
    }

    fn peak_buffer_bytes(&self) -> usize {
        self.peak_bucket_elems * std::mem::size_of::<T>()
    }

    fn plan(&mut self, layers: &[Range<usize>]) {
        self.planned = bucket_plan(layers, self.reduce.bucket_size);
    }
}

/// The most elements a bucket holds: the two buckets alive at once hold at most half of the
/// gradients the other ranks own (`(N-1)/N` of the model), so stages 2-3 always hold less
/// gradient than stage 1 (which keeps all of it), whatever `reduce_bucket_size` says; its
/// default (5e8) would otherwise make one bucket of the whole gradient of any model below
/// 500M parameters. Buckets this large are still far beyond the size at which a reduction
/// reaches full bandwidth. Bucket boundaries change no value (Note [bounded buckets]).
fn bucket_bound(layout: ShardLayout) -> usize {
    ((layout.padded() - layout.shard_len()) / 4).max(1)
}

/// The buckets backward fills: layers taken in reverse order join the bucket below which they
/// end while it stays within `bucket_size` (DeepSpeed's rule: a bucket is reduced before it
/// would overflow); a layer larger than `bucket_size` is a bucket of its own.
fn bucket_plan(layers: &[Range<usize>], bucket_size: usize) -> Vec<Range<usize>> {
    let mut plan: Vec<Range<usize>> = Vec::new();
    for layer in layers.iter().rev().filter(|l| !l.is_empty()) {
        match plan.last_mut() {
            Some(b) if layer.end == b.start && b.end - layer.start <= bucket_size => {
                b.start = layer.start
            }
            _ => plan.push(layer.clone()),
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::bucket_plan;

    #[test]
    fn buckets_group_adjacent_layers_from_the_top_without_overflowing() {
        let layers = [0..10, 10..10, 10..40, 40..45, 45..50, 50..120, 120..125];
        // worked by hand from the top: 50..120 cannot join 120..125 (75 > 60) and is larger
        // than a bucket, so it is alone; 45..50 cannot join it either; then 40..45, 10..40
        // and 0..10 join 45..50 (50 <= 60)
        assert_eq!(bucket_plan(&layers, 60), vec![120..125, 50..120, 0..50]);
        assert_eq!(bucket_plan(&layers, 1000), vec![0..125]);
        assert_eq!(bucket_plan(&layers, 0).len(), 6); // every non-empty layer alone
        assert!(bucket_plan(&[], 10).is_empty());
    }
}
