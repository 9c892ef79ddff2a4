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
    /// prefetch in flight (what `get` hands out is the caller's to count).
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
/// dropped by the caller after use.
pub struct ShardedParams<T: Element> {
    shard: Shard<T>,
    layout: ShardLayout,
    group: Group,
    limits: Stage3Config,
    in_flight: Option<(Range<usize>, Work<FlatBuf<T>>)>,
    persistent: Vec<(Range<usize>, FlatBuf<T>)>,
    /// The largest range prefetched, in elements (a gather in flight; what `get` hands out
    /// becomes the caller's).
    peak_prefetch: usize,
}

impl<T: Element> ShardedParams<T> {
    /// `shard` holds this rank's initial values (its shard of the padded buffer).
    pub fn new(shard: FlatBuf<T>, layout: ShardLayout, group: Group, limits: Stage3Config) -> Self {
        debug_assert_eq!(shard.len(), layout.shard_len());
        ShardedParams {
            shard: Shard::Memory(shard),
            layout,
            group,
            limits,
            in_flight: None,
            persistent: Vec::new(),
            peak_prefetch: 0,
        }
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
    fn read_and_gather(&self, file: Arc<SwapFile>, range: &Range<usize>) -> Work<FlatBuf<T>> {
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
    /// the shard lives (a disk shard's in host memory).
    fn gather_input(&self, range: &Range<usize>) -> Result<(FlatBuf<T>, Vec<usize>)> {
        let me = self.group.rank();
        let mine = self.layout.owned_within(range, me);
        let shard_start = self.layout.shard(me).start;
        let place = match &self.shard {
            Shard::Memory(v) => v.placement(),
            Shard::Disk(_) => Placement::Host,
        };
        let mut buf = FlatBuf::zeroed(&place, range.len())?;
        if !mine.is_empty() {
            self.shard.read(
                mine.start - shard_start..mine.end - shard_start,
                &mut buf[mine.start - range.start..mine.end - range.start],
            )?;
        }
        Ok((buf, self.layout.counts_within(range)))
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
            Some((r, work)) if r == range => work.wait()?,
            other => {
                if let Some((_, work)) = other {
                    work.wait()?; // not what was prefetched: finish it to keep collectives aligned
                }
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
        Ok(Values::Gathered(gathered))
    }

    fn prefetch(&mut self, range: Range<usize>) -> Result<()> {
        // The caller holds at most one gathered layer while this one is in flight.
        let fits = range.len() <= self.limits.prefetch_bucket_size
            && 2 * range.len() <= self.limits.max_live_parameters;
        let kept = self.persistent.iter().any(|(r, _)| *r == range);
        let whole = self.whole_in_memory().is_some();
        if self.in_flight.is_none() && fits && !kept && !whole && !range.is_empty() {
            let work = match &self.shard {
                Shard::Memory(_) => {
                    let (buf, counts) = self.gather_input(&range)?;
                    self.group.all_gather_v_async(buf, counts)
                }
                Shard::Disk(file) => self.read_and_gather(file.clone(), &range),
            };
            self.peak_prefetch = self.peak_prefetch.max(range.len());
            self.in_flight = Some((range, work));
        }
        Ok(())
    }

    fn write_owned(&mut self, range: Range<usize>, master: &[f32]) -> Result<()> {
        if let Some((_, work)) = self.in_flight.take() {
            // a stale prefetch: finish it (it reads the shard) so the collective order stays
            // aligned
            work.wait()?;
        }
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
        self.peak_prefetch * std::mem::size_of::<T>()
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
