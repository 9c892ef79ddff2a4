//! Where parameter values live between steps: whole on every rank, or one shard per rank.

use std::ops::{Deref, Range};
use std::path::Path;
use std::sync::Arc;

use ds_comm::{Element, Group, Work};

use crate::swap::{SwapFile, SwapIo, SwapSpace};
use crate::{vector, FlatBuf, Placement, Result, ShardLayout};

/// A range of parameter values a store hands out: lent from what it keeps, or gathered for
/// the caller, in the memory the store keeps its shard in (a GPU's under `--dist_backend
/// nccl`: NCCL gathers there, and the layer's tensor is made from it by a device copy).
pub enum Values<'a, T: Element> {
    Lent(&'a [T]),
    Gathered(FlatBuf<T>),
}

impl<T: Element> Deref for Values<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Values::Lent(v) => v,
            Values::Gathered(b) => b,
        }
    }
}

/// The parameters of one flat buffer, in the compute dtype.
pub trait ParamStore<T: Element>: Send {
    /// The whole values of flat `range`, for a layer's compute.
    fn get(&mut self, range: Range<usize>) -> Result<Values<'_, T>>;
    /// `range` will be asked for next: a sharded store starts gathering it now.
    fn prefetch(&mut self, range: Range<usize>) -> Result<()>;
    /// Writes updated fp32 master values of `range` (within this rank's owned range) into
    /// the compute-dtype copy; the owned range may come in parts (streamed from disk).
    fn write_owned(&mut self, range: Range<usize>, master: &[f32]) -> Result<()>;
    /// After the owned range was written: makes the parameters whole again where the store
    /// keeps them whole.
    fn publish(&mut self) -> Result<()>;
    /// The current values of `range` (within this rank's keeping) as f32.
    fn values_f32(&self, range: Range<usize>) -> Result<Vec<f32>>;
    /// Bytes held between steps.
    fn bytes(&self) -> usize;
    /// Whether the values kept between steps are in host memory (false: a GPU's; true too
    /// when they are on disk).
    fn on_host(&self) -> bool;
    /// Most bytes of gathered parameters held by the store at once besides `bytes`: a
    /// prefetch in flight and the buffers kept for reuse (what `get` hands out of host
    /// memory is the caller's to count).
    fn peak_gathered_bytes(&self) -> usize {
        0
    }
    /// Bytes kept on disk instead of memory.
    fn offloaded_bytes(&self) -> usize {
        0
    }
}

/// How replicated parameters become whole again after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Publish {
    /// Stage 0: every rank updated every parameter.
    Local,
    /// Stages 1-2: each rank updated its shard; all-gathered in pieces of this many elements
    /// (`allgather_bucket_size`), in place.
    AllGather { piece: usize },
}

/// Stages 0-2: every rank keeps all parameters.
pub struct ReplicatedParams<T: Element> {
    values: FlatBuf<T>,
    layout: ShardLayout,
    group: Group,
    publish: Publish,
}

impl<T: Element> ReplicatedParams<T> {
    /// `values` are the whole initial parameters, padded.
    pub fn new(values: FlatBuf<T>, layout: ShardLayout, group: Group, publish: Publish) -> Self {
        debug_assert_eq!(values.len(), layout.padded());
        ReplicatedParams {
            values,
            layout,
            group,
            publish,
        }
    }
}

impl<T: Element> ParamStore<T> for ReplicatedParams<T> {
    fn get(&mut self, range: Range<usize>) -> Result<Values<'_, T>> {
        Ok(Values::Lent(&self.values[range]))
    }

    fn prefetch(&mut self, _range: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn write_owned(&mut self, range: Range<usize>, master: &[f32]) -> Result<()> {
        vector::convert_into(&mut self.values[range], master)
    }

    fn publish(&mut self) -> Result<()> {
        let Publish::AllGather { piece } = self.publish else {
            return Ok(());
        };
        if self.layout.world() == 1 {
            return Ok(());
        }
        let padded = self.layout.padded();
        for start in (0..padded).step_by(piece.max(1)) {
            let range = start..(start + piece.max(1)).min(padded);
            let counts = self.layout.counts_within(&range);
            self.group.all_gather_v(&mut self.values[range], &counts)?;
        }
        Ok(())
    }

    fn values_f32(&self, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.values[range].iter().map(|v| v.to_f32()).collect())
    }

    fn bytes(&self) -> usize {
        self.values.bytes()
    }

    fn on_host(&self) -> bool {
        self.values.on_host()
    }
}

/// Limits of stage 3's gathering, in elements (ds_config `stage3_*`).
#[derive(Debug, Clone, Copy)]
pub struct Stage3Config {
    /// Largest range gathered ahead of its use (`stage3_prefetch_bucket_size`).
    pub prefetch_bucket_size: usize,
    /// Most gathered elements alive at once, prefetch included (`stage3_max_live_parameters`).
    pub max_live_parameters: usize,
    /// Ranges this small stay whole once gathered, until the next step changes them
    /// (`stage3_param_persistence_threshold`): they cost a collective each for little memory.
    pub param_persistence_threshold: usize,
}

/// Stage 3: each rank keeps its shard; a layer's range is all-gathered when asked for and
/// dropped after use.
///
/// Where the shard is a GPU's, the gathered buffers are kept and reused (Note [kept gather
/// buffers]); in host memory the gathered values become the caller's (the layer's tensor takes
/// the `Vec` without a copy).
pub struct ShardedParams<T: Element> {
    shard: Shard<T>,
    layout: ShardLayout,
    group: Group,
    limits: Stage3Config,
    /// The range being gathered, its buffer's length and the gather.
    in_flight: Option<(Range<usize>, usize, Work<Window<T>>)>,
    persistent: Vec<(Range<usize>, Window<T>)>,
    /// Whether gathered buffers are kept for the next gathers (a GPU shard).
    reuse: bool,
    /// With `reuse`: the buffer the last gathered range was lent from, and a free one.
    lent: Option<Window<T>>,
    spare: Option<FlatBuf<T>>,
    /// Most elements of gather buffers held at once (a gather in flight, and the kept ones;
    /// what `get` hands out of host memory becomes the caller's).
    peak_held: usize,
}

// Note [kept gather buffers]: on a GPU a gathered range was a managed allocation per layer,
// forward and backward, freed after the layer's tensor was copied out of it; the free of
// managed memory synchronises the device, and the new pages are mapped again on first touch.
// So a GPU store keeps two buffers, the one the layer in use was lent from and one for the
// gather ahead, each the largest range seen (the previous ranges' buffers are reused when
// large enough, else the larger is kept): twice the largest layer, for as long as the store
// lives. A reused buffer is written only after its stream has drained (the copy of the layer
// out of it may still be queued), and ranges small enough to stay whole
// (`param_persistence_threshold`) get buffers of their own.

/// A gathered range's values: the first `len` elements of `buf` (a larger kept buffer, or
/// exactly the range).
struct Window<T: Element> {
    buf: FlatBuf<T>,
    len: usize,
}

impl<T: Element> Window<T> {
    fn whole(buf: FlatBuf<T>) -> Window<T> {
        Window {
            len: buf.len(),
            buf,
        }
    }
}

impl<T: Element> Deref for Window<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[..self.len]
    }
}

impl<T: Element> std::ops::DerefMut for Window<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[..self.len]
    }
}

impl<T: Element> ShardedParams<T> {
    /// `shard` holds this rank's initial values (its shard of the padded buffer).
    pub fn new(shard: FlatBuf<T>, layout: ShardLayout, group: Group, limits: Stage3Config) -> Self {
        debug_assert_eq!(shard.len(), layout.shard_len());
        ShardedParams {
            reuse: !shard.on_host(),
            shard: Shard::Memory(shard),
            layout,
            group,
            limits,
            in_flight: None,
            persistent: Vec::new(),
            lent: None,
            spare: None,
            peak_held: 0,
        }
    }

    /// Keeps gathered buffers for reuse in host memory too, as on a GPU (for the tests).
    #[cfg(test)]
    fn reusing(mut self) -> Self {
        self.reuse = true;
        self
    }

    /// Moves the shard to a file under `nvme_path` (ZeRO-Infinity's parameter tier).
    pub fn offload(&mut self, nvme_path: &Path, rank: usize, io: &Arc<SwapIo>) -> Result<()> {
        let Shard::Memory(values) = &self.shard else {
            return Ok(());
        };
        let space = SwapSpace::create(nvme_path, rank, "params", io)?;
        let file = space.file("params", values.len())?;
        let mut staging = Vec::new();
        for (i, piece) in values.chunks(DISK_PIECE).enumerate() {
            staging.clear();
            staging.extend(piece.iter().map(|v| v.to_f32()));
            file.write(i * DISK_PIECE, &staging)?;
        }
        self.shard = Shard::Disk(Arc::new(file));
        Ok(())
    }

    /// The all-gather of `range` with this rank's part read from `file` first, both on the
    /// communication thread: the read ahead overlaps the caller's compute as the gather does.
    fn read_and_gather(&self, file: Arc<SwapFile>, range: &Range<usize>) -> Work<Window<T>> {
        let me = self.group.rank();
        let mine = self.layout.owned_within(range, me);
        let shard_start = self.layout.shard(me).start;
        let counts = self.layout.counts_within(range);
        let len = range.len();
        // where this rank's part goes in the buffer, and where it is in the shard
        let part = (!mine.is_empty()).then(|| {
            let from = mine.start - shard_start..mine.end - shard_start;
            (mine.start - range.start, from)
        });
        self.group.spawn_collective(move |g| {
            let mut buf = vec![T::default(); len];
            if let Some((at, from)) = part {
                let n = from.len();
                read_disk(&file, from, &mut buf[at..at + n])
                    .map_err(|e| ds_comm::CommError::Invalid(e.to_string()))?;
            }
            g.all_gather_v(&mut buf, &counts)?;
            FlatBuf::from_vec(&Placement::Host, buf)
                .map(Window::whole)
                .map_err(|e| ds_comm::CommError::Invalid(e.to_string()))
        })
    }

    /// The whole flat buffer, when this rank's shard is all of it in memory (a group of one):
    /// `get` then lends it, with nothing to gather. On a GPU that keeps the parameters'
    /// way to the layer on the device (a copy there), where a gather went through host memory.
    fn whole_in_memory(&self) -> Option<&[T]> {
        match &self.shard {
            Shard::Memory(v) if self.group.size() == 1 && v.len() >= self.layout.numel() => Some(v),
            _ => None,
        }
    }

    /// A buffer for `range` holding this rank's part in place, with the parts' counts: where
    /// the shard lives (a disk shard's in host memory), the spare when it is kept and large
    /// enough.
    fn gather_input(&mut self, range: &Range<usize>) -> Result<(Window<T>, Vec<usize>)> {
        let me = self.group.rank();
        let mine = self.layout.owned_within(range, me);
        let shard_start = self.layout.shard(me).start;
        let place = match &self.shard {
            Shard::Memory(v) => v.placement(),
            Shard::Disk(_) => Placement::Host,
        };
        let persists = range.len() <= self.limits.param_persistence_threshold;
        // every element is written below or by the gather: the kept contents do not matter
        let buf = match self.spare.take() {
            Some(spare) if !persists && spare.len() >= range.len() => {
                spare.wait_for_readers()?;
                spare
            }
            spare => {
                // a range that stays whole leaves the spare kept; for any other a spare too
                // small is freed, so that at most two buffers are held
                if persists {
                    self.spare = spare;
                }
                FlatBuf::zeroed(&place, range.len())?
            }
        };
        let mut buf = Window {
            buf,
            len: range.len(),
        };
        if !mine.is_empty() {
            self.shard.read(
                mine.start - shard_start..mine.end - shard_start,
                &mut buf[mine.start - range.start..mine.end - range.start],
            )?;
        }
        Ok((buf, self.layout.counts_within(range)))
    }

    /// A gathered buffer no longer in use: kept as the spare when buffers are reused and it
    /// is larger than the spare.
    fn retire(&mut self, buf: FlatBuf<T>) {
        if self.reuse && self.spare.as_ref().is_none_or(|s| s.len() < buf.len()) {
            self.spare = Some(buf);
        }
    }

    /// Waits for a gather in flight that is not the one wanted (so the collectives stay
    /// aligned across ranks) and retires its buffer.
    fn finish_stale(&mut self) -> Result<()> {
        if let Some((_, _, work)) = self.in_flight.take() {
            let stale = work.wait()?;
            self.retire(stale.buf);
        }
        Ok(())
    }

    fn note_held(&mut self) {
        let held = self.lent.as_ref().map_or(0, |w| w.buf.len())
            + self.spare.as_ref().map_or(0, |b| b.len())
            + self.in_flight.as_ref().map_or(0, |(_, held, _)| *held);
        self.peak_held = self.peak_held.max(held);
    }
}

impl<T: Element> ParamStore<T> for ShardedParams<T> {
    fn get(&mut self, range: Range<usize>) -> Result<Values<'_, T>> {
        if self.whole_in_memory().is_some() {
            let whole = self.whole_in_memory().expect("invariant: checked above");
            return Ok(Values::Lent(&whole[range]));
        }
        if let Some(i) = self.persistent.iter().position(|(r, _)| *r == range) {
            return Ok(Values::Lent(&self.persistent[i].1));
        }
        let gathered = match self.in_flight.take() {
            Some((r, _, work)) if r == range => work.wait()?,
            other => {
                self.in_flight = other;
                self.finish_stale()?;
                let (mut buf, counts) = self.gather_input(&range)?;
                self.group.all_gather_v(&mut buf, &counts)?;
                buf
            }
        };
        if range.len() <= self.limits.param_persistence_threshold {
            self.persistent.push((range, gathered));
            let kept = &self.persistent.last().expect("invariant: just pushed").1;
            return Ok(Values::Lent(kept));
        }
        if !self.reuse {
            // a buffer of its own (never a kept one): exactly the range, the caller's now
            debug_assert_eq!(gathered.len, gathered.buf.len());
            return Ok(Values::Gathered(gathered.buf));
        }
        if let Some(before) = self.lent.replace(gathered) {
            self.retire(before.buf);
        }
        self.note_held();
        Ok(Values::Lent(
            self.lent.as_deref().expect("invariant: just set"),
        ))
    }

    fn prefetch(&mut self, range: Range<usize>) -> Result<()> {
        // The caller holds at most one gathered layer while this one is in flight.
        let fits = range.len() <= self.limits.prefetch_bucket_size
            && 2 * range.len() <= self.limits.max_live_parameters;
        let kept = self.persistent.iter().any(|(r, _)| *r == range);
        let whole = self.whole_in_memory().is_some();
        if self.in_flight.is_none() && fits && !kept && !whole && !range.is_empty() {
            let (work, held) = match &self.shard {
                Shard::Memory(_) => {
                    let (buf, counts) = self.gather_input(&range)?;
                    let held = buf.buf.len();
                    (self.group.all_gather_v_async(buf, counts), held)
                }
                Shard::Disk(file) => (self.read_and_gather(file.clone(), &range), range.len()),
            };
            self.in_flight = Some((range, held, work));
            self.note_held();
        }
        Ok(())
    }

    fn write_owned(&mut self, range: Range<usize>, master: &[f32]) -> Result<()> {
        // a stale prefetch reads the shard: finished first (and the collective order stays
        // aligned)
        self.finish_stale()?;
        let start = self.layout.shard(self.group.rank()).start;
        self.shard
            .write(range.start - start..range.end - start, master)
    }

    fn publish(&mut self) -> Result<()> {
        self.persistent.clear(); // the step changed them
        Ok(())
    }

    fn values_f32(&self, range: Range<usize>) -> Result<Vec<f32>> {
        let start = self.layout.shard(self.group.rank()).start;
        let range = range.start - start..range.end - start;
        match &self.shard {
            // no staging copy: this is the master copy, built at start-up beside the shard
            Shard::Memory(v) => Ok(v[range].iter().map(|v| v.to_f32()).collect()),
            // the file holds the values as f32 already: read straight into the copy, so the
            // shard and its master copy are never in memory together
            Shard::Disk(file) => {
                let mut out = vec![0f32; range.len()];
                file.read(range.start, &mut out)?;
                Ok(out)
            }
        }
    }

    fn bytes(&self) -> usize {
        let kept: usize = self.persistent.iter().map(|(_, v)| v.len()).sum();
        self.shard.resident_bytes() + kept * std::mem::size_of::<T>()
    }

    fn peak_gathered_bytes(&self) -> usize {
        self.peak_held * std::mem::size_of::<T>()
    }

    fn on_host(&self) -> bool {
        match &self.shard {
            Shard::Memory(v) => v.on_host(),
            Shard::Disk(_) => true,
        }
    }

    fn offloaded_bytes(&self) -> usize {
        match &self.shard {
            Shard::Memory(_) => 0,
            Shard::Disk(file) => file.len() * 4,
        }
    }
}

/// Elements staged per read or write of an offloaded shard.
const DISK_PIECE: usize = 1 << 20;

/// Stage 3's own shard: in memory, or in a file (kept as f32: bf16 and f16 round-trip
/// exactly through it).
enum Shard<T: Element> {
    Memory(FlatBuf<T>),
    /// Shared with the reads ahead on the communication thread.
    Disk(Arc<SwapFile>),
}

impl<T: Element> Shard<T> {
    /// Values `range` (shard coordinates) into `out`.
    fn read(&self, range: Range<usize>, out: &mut [T]) -> Result<()> {
        match self {
            Shard::Memory(v) => vector::copy(out, &v[range])?,
            Shard::Disk(file) => read_disk(file, range, out)?,
        }
        Ok(())
    }

    /// Updated master values of `range` (shard coordinates), in the compute dtype.
    fn write(&mut self, range: Range<usize>, master: &[f32]) -> Result<()> {
        match self {
            Shard::Memory(v) => vector::convert_into(&mut v[range], master)?,
            Shard::Disk(file) => {
                let mut staging = vec![0f32; DISK_PIECE.min(range.len())];
                for (i, src) in master.chunks(DISK_PIECE).enumerate() {
                    let part = &mut staging[..src.len()];
                    // rounded to the compute dtype, as in memory
                    part.iter_mut()
                        .zip(src)
                        .for_each(|(d, m)| *d = T::from_f32(*m).to_f32());
                    file.write(range.start + i * DISK_PIECE, part)?;
                }
            }
        }
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        match self {
            Shard::Memory(v) => v.bytes(),
            Shard::Disk(_) => 0,
        }
    }
}

/// Values `range` (shard coordinates) of an offloaded shard into `out`, through a staging
/// piece of f32.
fn read_disk<T: Element>(file: &SwapFile, range: Range<usize>, out: &mut [T]) -> Result<()> {
    let mut staging = vec![0f32; DISK_PIECE.min(range.len())];
    for (i, dst) in out.chunks_mut(DISK_PIECE).enumerate() {
        let part = &mut staging[..dst.len()];
        file.read(range.start + i * DISK_PIECE, part)?;
        dst.iter_mut()
            .zip(part.iter())
            .for_each(|(d, s)| *d = T::from_f32(*s));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ds_comm::testkit::run_ranks;

    use super::*;
    use crate::PartitionError;

    /// Layers in flat order: the second is the largest, so a kept buffer is sometimes too
    /// small and sometimes larger than the range; the last stays whole once gathered.
    const LAYERS: [Range<usize>; 4] = [0..30, 30..330, 330..530, 530..541];
    const NUMEL: usize = 541;
    const PERSIST: usize = 20;

    /// Parameter i's value after `step` updates (exact in f32).
    fn value(i: usize, step: usize) -> f32 {
        (i * 3 + step * 1000) as f32
    }

    /// Stage 3 over `world` ranks, `reuse` forcing kept buffers in host memory: every layer
    /// gathered in forward order (prefetching the next), in backward order (prefetching the
    /// one before), once with a prefetch that is not what is asked next, over three steps that
    /// change the values. Returns rank 0's peak of gathered bytes.
    fn gather_steps(world: usize, reuse: bool) -> usize {
        let peaks = run_ranks(world, Duration::from_secs(30), move |comm| {
            let layout = ShardLayout::new(NUMEL, world);
            let me = comm.rank();
            let shard = layout.shard(me);
            let initial = (shard.start..shard.end)
                .map(|i| if i < NUMEL { value(i, 0) } else { 0.0 })
                .collect();
            let limits = Stage3Config {
                prefetch_bucket_size: 1000,
                max_live_parameters: 10_000,
                param_persistence_threshold: PERSIST,
            };
            let buf = FlatBuf::from_vec(&Placement::Host, initial)?;
            let mut store = ShardedParams::new(buf, layout, comm.world(), limits);
            if reuse {
                store = store.reusing();
            }
            let check = |store: &mut ShardedParams<f32>, i: usize, step: usize| {
                let r = LAYERS[i].clone();
                let got = store.get(r.clone())?.to_vec();
                let want: Vec<f32> = r.map(|j| value(j, step)).collect();
                assert_eq!(got, want, "rank {me}, layer {i}, step {step}");
                Ok::<_, PartitionError>(())
            };
            for step in 0..3 {
                for i in 0..LAYERS.len() {
                    if let Some(next) = LAYERS.get(i + 1) {
                        store.prefetch(next.clone())?;
                    }
                    check(&mut store, i, step)?;
                }
                for i in (0..LAYERS.len()).rev() {
                    if i > 0 {
                        store.prefetch(LAYERS[i - 1].clone())?;
                    }
                    check(&mut store, i, step)?;
                }
                store.prefetch(LAYERS[2].clone())?;
                check(&mut store, 1, step)?; // not the range prefetched
                let owned = shard.start..shard.end.min(NUMEL);
                let master: Vec<f32> = owned.clone().map(|j| value(j, step + 1)).collect();
                store.write_owned(owned, &master)?;
                store.publish()?;
            }
            Ok::<_, PartitionError>(store.peak_gathered_bytes())
        })
        .unwrap();
        peaks[0]
    }

    #[test]
    fn kept_gather_buffers_give_the_same_values_as_fresh_ones() {
        let f32s = std::mem::size_of::<f32>();
        for world in [2, 3] {
            // fresh buffers: the store holds only a prefetch in flight, the largest layer
            assert_eq!(gather_steps(world, false), 300 * f32s, "{world} ranks");
            // kept buffers: two, each at most the largest layer, and a range that stays
            // whole in flight beside them
            let kept = gather_steps(world, true);
            assert!(
                (300 * f32s..=(2 * 300 + PERSIST) * f32s).contains(&kept),
                "{world} ranks: {kept} bytes held"
            );
        }
    }
}
