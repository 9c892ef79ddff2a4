//! ZeRO-Infinity's optimizer tier on NVMe (`offload_optimizer: {"device": "nvme"}`): the fp32
//! master copy of the owned shard and the optimizer's state buffers live in this rank's swap
//! files; each step streams them through `buffer_count` chunk buffers (ds-partition's
//! `swap::stream`), the optimizer holding one chunk's state at a time. Every element goes
//! through the same kernel in the same order as in memory, so the values are bit-identical to
//! a run without offload.

use std::path::Path;
use std::sync::Arc;

use ds_partition::swap::{stream, SwapFile, SwapIo, SwapSpace};
use ds_partition::Zero;

use crate::optim::{scaled_f32, Optimizer};
use ds_comm::Element;

use crate::{EngineError, Result};

use super::groups::GroupPlan;
/// Elements streamed per chunk: the step's piece (4 MiB of fp32 per file).
use super::update::STEP_PIECE as CHUNK;

pub struct OffloadedStates {
    master: SwapFile,
    states: Vec<(&'static str, SwapFile)>,
    buffers: usize,
}

impl OffloadedStates {
    /// Moves `master` (the owned shard's fp32 values) to a swap file under `nvme_path` and
    /// creates zeroed ones for the optimizer's `state_names` (unlinked at once: the kernel
    /// frees them when the process ends, however it ends).
    pub fn new(
        nvme_path: &Path,
        rank: usize,
        buffers: usize,
        master: &[f32],
        state_names: &[&'static str],
        io: &Arc<SwapIo>,
    ) -> Result<OffloadedStates> {
        let space = SwapSpace::create(nvme_path, rank, "optimizer", io).map_err(|e| {
            EngineError::Setting(format!("zero_optimization.offload_optimizer: {e}"))
        })?;
        let file = space.file("master", master.len())?;
        for (i, piece) in master.chunks(CHUNK).enumerate() {
            file.write(i * CHUNK, piece)?;
        }
        let states = state_names
            .iter()
            .map(|&n| Ok((n, space.file(n, master.len())?)))
            .collect::<Result<_>>()?;
        Ok(OffloadedStates {
            master: file,
            states,
            buffers: buffers.max(1),
        })
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> usize {
        (1 + self.states.len()) * self.master.len() * 4
    }

    /// One optimizer step over the owned shard, begun already (`optimizer.begin`): streams
    /// master and states, updates each chunk with its gradients times `k`, writes the new
    /// values into the parameters, then publishes them (the collective of stages 1-2).
    pub fn step<T: Element>(
        &self,
        optimizer: &mut dyn Optimizer,
        zero: &mut Zero<T>,
        k: f32,
        groups: &GroupPlan,
    ) -> Result<()> {
        let mut files = vec![&self.master];
        files.extend(self.states.iter().map(|(_, f)| f));
        let mut fp32 = vec![0f32; CHUNK.min(self.master.len())];
        stream(&files, CHUNK, self.buffers, |at, bufs| {
            let n = bufs[0].len();
            let grads = &zero.owned_grads()[at..at + n];
            scaled_f32(&mut fp32[..n], grads, k);
            let (master, states) = bufs.split_first_mut().expect("the master file");
            for (dst, src) in optimizer.state_mut().into_iter().zip(states.iter()) {
                dst[..n].copy_from_slice(src);
            }
            for (r, g) in groups.segments(at..at + n) {
                let part = r.start - at..r.end - at;
                optimizer.update(part.start, &mut master[part.clone()], &fp32[part], g);
            }
            for (src, dst) in optimizer.state_mut().into_iter().zip(states.iter_mut()) {
                dst.copy_from_slice(&src[..n]);
            }
            zero.write_owned(at, master)
        })?;
        zero.publish_written()?;
        Ok(())
    }

    /// The whole master shard (a checkpoint's copy).
    pub fn master(&self) -> Result<Vec<f32>> {
        read_all(&self.master)
    }

    /// The whole state buffers by name, those of `names` (the optimizer's live ones).
    pub fn states(&self, names: &[&str]) -> Result<Vec<(String, Vec<f32>)>> {
        names
            .iter()
            .map(|&name| {
                let (_, file) = self
                    .states
                    .iter()
                    .find(|(n, _)| *n == name)
                    .ok_or_else(|| EngineError::Internal(format!("no offloaded state {name}")))?;
                Ok((name.to_string(), read_all(file)?))
            })
            .collect()
    }

    /// Writes a checkpoint's master shard back, and from it the parameters (a collective at
    /// stages 1-2).
    pub fn restore_master<T: Element>(&self, master: &[f32], zero: &mut Zero<T>) -> Result<()> {
        write_all(&self.master, master)?;
        stream(&[&self.master], CHUNK, self.buffers, |at, bufs| {
            zero.write_owned(at, &bufs[0])
        })?;
        zero.publish_written()?;
        Ok(())
    }

    /// Writes a checkpoint's state buffers back to the files.
    pub fn restore_states(&self, buffers: &[(String, Vec<f32>)]) -> Result<()> {
        for (name, values) in buffers {
            let (_, file) = self
                .states
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| EngineError::Internal(format!("no offloaded state {name}")))?;
            write_all(file, values)?;
        }
        Ok(())
    }
}

fn read_all(file: &SwapFile) -> Result<Vec<f32>> {
    let mut out = vec![0f32; file.len()];
    for (i, piece) in out.chunks_mut(CHUNK).enumerate() {
        file.read(i * CHUNK, piece)?;
    }
    Ok(out)
}

fn write_all(file: &SwapFile, values: &[f32]) -> Result<()> {
    if values.len() != file.len() {
        return Err(EngineError::Resume(format!(
            "{}: {} values for a shard of {}",
            file.path().display(),
            values.len(),
            file.len()
        )));
    }
    for (i, piece) in values.chunks(CHUNK).enumerate() {
        file.write(i * CHUNK, piece)?;
    }
    Ok(())
}
