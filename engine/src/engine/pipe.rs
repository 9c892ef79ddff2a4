//! Pipeline parallelism in the engine: which layers this stage runs, and the execution of a
//! pipe schedule (ds-pipeline's instructions) over them, with activations and gradients sent
//! point to point between neighbouring stages.
//!
//! Note [pipeline transfers]: a transfer is a header (dtype and shape) then the data, over the
//! pipeline group, issued in the schedule's order into ds-comm's one issue order (the order
//! rules in pipeline/ARCHITECTURE.md). DeepSpeed's schedules pair each send of
//! a step with its neighbour's receive in the same step and order, so the blocking sequence
//! cannot deadlock; sends leave asynchronously (on the communicator's worker, in their place
//! in the order) while the stage computes, and are waited for before the optimizer step.
//! Receives block where the schedule puts them. The interleaved schedule, a ring, exchanges
//! once per tick with a combined send+receive instead (Note [interleaved ticks]).

use candle_core::{DType, Device, Tensor};
use ds_comm::{Group, Work};
use ds_pipeline::interleaved::{interleaved_schedule, Interleaving, Tick, Transfer};
use ds_pipeline::partition::{partition_layers, LayerInfo, PartitionMethod};
use ds_pipeline::pipe_schedule::{
    inference_schedule, train_buffers, train_schedule, Instruction, StagePlace,
};
use half::{bf16, f16};
use std::collections::HashMap;
use std::ops::Range;

use super::trainer::{Micro, Trainer};
use super::Dtype;
use crate::model::Model;
use crate::{Batch, Inputs, Targets};
use crate::{EngineError, Result};

/// This rank's place in its pipeline.
#[derive(Clone)]
pub(crate) struct Stage {
    pub group: Group,
    pub stage: usize,
    pub stages: usize,
    /// This stage's model chunks as ranges of its own layers (one chunk without
    /// interleaving).
    pub chunks: Vec<Range<usize>>,
}

impl Stage {
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
    /// The global rank of stage `s` of this pipeline (ds-comm's point-to-point and broadcast
    /// name global ranks).
    pub fn rank_of(&self, s: usize) -> usize {
        self.group.global_ranks()[s]
    }
    pub fn last(&self) -> usize {
        self.rank_of(self.stages - 1)
    }
}

/// Which layers each pipeline stage runs. The model's layers are cut into `stages * chunks`
/// virtual stages of consecutive layers (`parts`, their offsets); stage `s` runs virtual
/// stages `s, s + stages, s + 2 stages, ...`, one model chunk each (`chunks` is 1 unless the
/// interleaved schedule is on: `pipeline.virtual_stages`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipeLayout {
    pub parts: Vec<usize>,
    pub stages: usize,
    pub chunks: usize,
}

impl PipeLayout {
    /// The layer ranges of stage `stage`'s chunks, in chunk order.
    pub fn chunk_layers(&self, stage: usize) -> Vec<Range<usize>> {
        (0..self.chunks)
            .map(|c| {
                let v = c * self.stages + stage;
                self.parts[v]..self.parts[v + 1]
            })
            .collect()
    }

    /// The stage that runs layer `layer`.
    pub fn stage_of_layer(&self, layer: usize) -> usize {
        (self.parts.partition_point(|&p| p <= layer) - 1) % self.stages
    }

    /// The stage of each parameter of `model`, in order.
    pub fn param_stages(&self, model: &Model) -> Vec<usize> {
        model
            .layers()
            .iter()
            .enumerate()
            .flat_map(|(i, l)| std::iter::repeat_n(self.stage_of_layer(i), l.params().len()))
            .collect()
    }

    /// The idle fraction of the interleaved schedule in theory, (p - 1) / (v m + p - 1)
    /// (None: plain 1F1B).
    pub fn interleaved_bubble(&self, micro_batches: usize) -> Option<f64> {
        self.interleaving(micro_batches)
            .map(ds_pipeline::interleaved::interleaved_bubble)
    }

    /// Megatron's interleaving of this layout over `micro_batches` (None: plain 1F1B).
    pub fn interleaving(&self, micro_batches: usize) -> Option<Interleaving> {
        (self.chunks > 1).then_some(Interleaving {
            stages: self.stages,
            chunks: self.chunks,
            micro_batches,
        })
    }
}

/// The virtual stage offsets (`stages + 1`) for `model`, by DeepSpeed's `partition_method`
/// (`pipeline.partition`: "parameters", also what "best" means, "uniform" or "type:REGEX"
/// over the layers' report names).
fn stage_layers(model: &Model, stages: usize, method: &str) -> Result<Vec<usize>> {
    let method = PartitionMethod::parse(method)
        .map_err(|e| EngineError::Setting(format!("pipeline.partition: {e}")))?;
    let layers: Vec<LayerInfo> = model
        .layers()
        .iter()
        .map(|l| LayerInfo {
            name: l.display_name(),
            params: l.params().iter().map(|p| p.numel() as u64).sum(),
        })
        .collect();
    partition_layers(&layers, stages, &method)
        .map_err(|e| EngineError::Setting(format!("pipeline: {e}")))
}

/// The pipeline layout of `model` for a config with `pipeline.stages` > 1, after the checks
/// DeepSpeed's PipelineEngine makes (ZeRO-2 and -3 do not combine with pipelines) and, with
/// `pipeline.virtual_stages`, Megatron's for interleaving; `train` calls it before any rank
/// starts, `Engine::initialize` for programs embedding the engine.
pub fn pipeline_layout(config: &ds_config::Config, model: &Model) -> Result<PipeLayout> {
    let stages = config.dims.pp;
    if config.zero_stage().partitions_gradients() {
        return Err(EngineError::Setting(format!(
            "zero_optimization.stage = {}: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism ({stages} stages); use stage 0 or 1",
            config.zero_stage()
        )));
    }
    let chunks = config.pipeline.virtual_stages()?;
    let method = config.pipeline.partition();
    let layout = PipeLayout {
        parts: stage_layers(model, stages * chunks, method)?,
        stages,
        chunks,
    };
    let micro_batches = config
        .gradient_accumulation_steps
        .as_i64()
        .unwrap_or(1)
        .max(1) as usize;
    if let Some(shape) = layout.interleaving(micro_batches) {
        shape.check().map_err(|e| {
            EngineError::Setting(format!("pipeline.virtual_stages = {chunks}: {e}"))
        })?;
    }
    Ok(layout)
}

/// One pipeline buffer: a micro-batch's tensors between the instructions that use them.
#[derive(Default)]
struct Slot {
    /// The stage's input (token ids, or the activations received).
    input: Option<Tensor>,
    targets: Option<Targets>,
    /// The stage's output, until sent.
    output: Option<Tensor>,
    /// The gradient of the output (received), then of the input (to send).
    grad: Option<Tensor>,
    micro: Micro,
}

/// Sends still leaving (Note [pipeline transfers]): waited for before the batch ends.
#[derive(Default)]
struct Pending(Vec<Work<()>>);

impl Pending {
    /// Sends the output of the micro-batch in `slot` (pipe buffer `buffer`) to the next stage.
    fn send_output(&mut self, stage: &Stage, slot: &mut Slot, buffer: usize) -> Result<()> {
        let y = slot
            .output
            .take()
            .ok_or_else(|| missing("output", buffer))?;
        self.0.extend(send_async(stage, &y, stage.stage + 1)?);
        Ok(())
    }

    fn finish(self) -> Result<()> {
        for work in self.0 {
            work.wait()?;
        }
        Ok(())
    }
}

/// Runs this stage's pipe schedule over `micro_batches` micro-batches from `next`:
/// DeepSpeed's TrainSchedule, or Megatron's interleaved one when the stage has several model
/// chunks. Returns the sum of the micro-batches' losses on the last stage (0 elsewhere) and
/// whether the optimizer stepped.
pub(crate) fn train_batch<T: Dtype>(
    t: &mut Trainer<T>,
    stage: &Stage,
    micro_batches: usize,
    next: &mut dyn FnMut(usize) -> Result<Batch>,
) -> Result<(f32, Option<super::StepOutcome>)> {
    if stage.chunks.len() > 1 {
        return train_batch_interleaved(t, stage, micro_batches, next);
    }
    let place = StagePlace {
        micro_batches,
        stages: stage.stages,
        stage: stage.stage,
    };
    let mut slots: Vec<Slot> = (0..train_buffers(place)).map(|_| Slot::default()).collect();
    let (mut loaded, mut loss, mut outcome) = (0, 0.0f32, None);
    let mut pending = Pending::default();
    for cmd in train_schedule(place).into_iter().flatten() {
        let t0 = std::time::Instant::now();
        match cmd {
            Instruction::LoadMicroBatch { buffer } => {
                let (ids, targets) = t.batch_tensors(&next(loaded)?)?;
                loaded += 1;
                let slot = &mut slots[buffer];
                slot.targets = targets;
                if stage.is_first() {
                    slot.input = Some(ids);
                }
            }
            Instruction::RecvActivation { buffer } => {
                slots[buffer].input = Some(recv(stage, stage.stage - 1, t.device())?);
                t.add_pipe_wait(t0.elapsed());
            }
            Instruction::ForwardPass { buffer } => {
                let slot = &mut slots[buffer];
                let input = slot.input.take().ok_or_else(|| missing("input", buffer))?;
                let y = t.forward_stage(input, Inputs::targets_only(slot.targets.take()))?;
                if stage.is_last() {
                    loss += y.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                } else {
                    slot.output = Some(y);
                }
                slot.micro = t.take_micro();
            }
            Instruction::SendActivation { buffer } => {
                pending.send_output(stage, &mut slots[buffer], buffer)?;
                t.add_pipe_wait(t0.elapsed());
            }
            Instruction::RecvGrad { buffer } => {
                slots[buffer].grad = Some(recv(stage, stage.stage + 1, t.device())?);
                t.add_pipe_wait(t0.elapsed());
            }
            Instruction::BackwardPass { buffer } => {
                let slot = &mut slots[buffer];
                t.put_micro(std::mem::take(&mut slot.micro));
                slot.grad = t.backward_stage(slot.grad.take())?;
            }
            Instruction::SendGrad { buffer } => {
                let dx = slots[buffer]
                    .grad
                    .take()
                    .ok_or_else(|| missing("gradient", buffer))?;
                pending.0.extend(send_async(stage, &dx, stage.stage - 1)?);
                t.add_pipe_wait(t0.elapsed());
            }
            // the step sums tied gradients (tied.rs); dp reduces at the last backward
            Instruction::ReduceTiedGrads | Instruction::ReduceGrads => {}
            Instruction::OptimizerStep => {
                let t0 = std::time::Instant::now();
                std::mem::take(&mut pending).finish()?;
                t.add_pipe_wait(t0.elapsed());
                outcome = t.step()?;
            }
        }
    }
    Ok((loss, outcome))
}

/// The micro-batches' token ids and targets, loaded once each as the first or last stage
/// first needs them (in micro-batch order, as DeepSpeed's LoadMicroBatch).
struct Loader<'a> {
    next: &'a mut dyn FnMut(usize) -> Result<Batch>,
    loaded: HashMap<usize, (Option<Tensor>, Option<Targets>)>,
}

impl Loader<'_> {
    fn get<T: Dtype>(
        &mut self,
        t: &Trainer<T>,
        micro: usize,
    ) -> Result<&mut (Option<Tensor>, Option<Targets>)> {
        if !self.loaded.contains_key(&micro) {
            let (ids, targets) = t.batch_tensors(&(self.next)(micro)?)?;
            self.loaded.insert(micro, (Some(ids), targets));
        }
        Ok(self.loaded.get_mut(&micro).expect("inserted above"))
    }
}

/// Megatron's interleaved 1F1B (ds-pipeline's `interleaved`): this stage's ticks, each one
/// chunk's forward or backward and then one combined exchange with the neighbours.
fn train_batch_interleaved<T: Dtype>(
    t: &mut Trainer<T>,
    stage: &Stage,
    micro_batches: usize,
    next: &mut dyn FnMut(usize) -> Result<Batch>,
) -> Result<(f32, Option<super::StepOutcome>)> {
    let shape = Interleaving {
        stages: stage.stages,
        chunks: stage.chunks.len(),
        micro_batches,
    };
    let ticks: Vec<Tick> = interleaved_schedule(shape)
        .map_err(|e| EngineError::Setting(format!("pipeline.virtual_stages: {e}")))?
        .swap_remove(stage.stage);
    let last_chunk = stage.chunks.len() - 1;
    let mut loader = Loader {
        next,
        loaded: HashMap::new(),
    };
    // (chunk, micro) -> what arrived or is to leave
    let (mut inputs, mut grads) = (HashMap::new(), HashMap::new());
    let (mut outputs, mut dxs) = (HashMap::new(), HashMap::new());
    let mut micros: HashMap<(usize, usize), Micro> = HashMap::new();
    let mut loss = 0.0f32;
    for tick in ticks {
        if let Some(w) = tick.work {
            let key = (w.chunk, w.micro);
            let layers = stage.chunks[w.chunk].clone();
            let first = stage.is_first() && w.chunk == 0;
            let last = stage.is_last() && w.chunk == last_chunk;
            if w.forward {
                let input = match first {
                    true => loader.get(t, w.micro)?.0.take(),
                    false => inputs.remove(&key),
                };
                let input = input.ok_or_else(|| missing("input", w.micro))?;
                let targets = match last {
                    true => loader.get(t, w.micro)?.1.take(),
                    false => None,
                };
                let y = t.forward_layers(layers, input, Inputs::targets_only(targets))?;
                match last {
                    true => loss += y.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                    false => drop(outputs.insert(key, y)),
                }
                micros.insert(key, t.take_micro());
            } else {
                let micro = micros
                    .remove(&key)
                    .ok_or_else(|| missing("forward", w.micro))?;
                t.put_micro(micro);
                let dy = match last {
                    true => None,
                    false => Some(
                        grads
                            .remove(&key)
                            .ok_or_else(|| missing("gradient", w.micro))?,
                    ),
                };
                // chunk 0's backward is the micro-batch's last on this stage
                if let Some(dx) = t.backward_layers(dy, w.chunk == 0)? {
                    if !first {
                        dxs.insert(key, dx);
                    }
                }
            }
        }
        let t0 = std::time::Instant::now();
        let sends = tick
            .sends
            .iter()
            .map(|x| {
                let key = (x.chunk, x.micro);
                let held = match x.activation {
                    true => outputs.remove(&key),
                    false => dxs.remove(&key),
                };
                held.map(|t| (x.peer, t))
                    .ok_or_else(|| missing("tensor to send", x.micro))
            })
            .collect::<Result<Vec<_>>>()?;
        let from: Vec<usize> = tick.recvs.iter().map(|x| x.peer).collect();
        let got = exchange(stage, sends, &from, t.device())?;
        for (x, tensor) in tick.recvs.iter().zip(got) {
            let Transfer { chunk, micro, .. } = *x;
            match x.activation {
                true => inputs.insert((chunk, micro), tensor),
                false => grads.insert((chunk, micro), tensor),
            };
        }
        t.add_pipe_wait(t0.elapsed());
    }
    Ok((loss, t.step()?))
}

/// The summed loss of `micro_batches` micro-batches from `next` without gradients, on every
/// stage: DeepSpeed's InferenceSchedule (two buffers, neighbours' sends and receives paired
/// by stage parity); with model chunks, each micro-batch goes round the stages chunk by chunk.
pub(crate) fn eval_batch<T: Dtype>(
    t: &mut Trainer<T>,
    stage: &Stage,
    micro_batches: usize,
    next: &mut dyn FnMut(usize) -> Result<Batch>,
) -> Result<f32> {
    let mut loss = [0f32];
    if stage.chunks.len() > 1 {
        for micro in 0..micro_batches {
            loss[0] += eval_round(t, stage, &next(micro)?)?;
        }
    } else {
        let place = StagePlace {
            micro_batches,
            stages: stage.stages,
            stage: stage.stage,
        };
        let mut slots: [Slot; 2] = Default::default();
        let (mut loaded, mut pending) = (0, Pending::default());
        for cmd in inference_schedule(place).into_iter().flatten() {
            match cmd {
                Instruction::LoadMicroBatch { buffer } => {
                    let (ids, targets) = t.batch_tensors(&next(loaded)?)?;
                    loaded += 1;
                    slots[buffer].targets = targets;
                    if stage.is_first() {
                        slots[buffer].input = Some(ids);
                    }
                }
                Instruction::RecvActivation { buffer } => {
                    slots[buffer].input = Some(recv(stage, stage.stage - 1, t.device())?);
                }
                Instruction::ForwardPass { buffer } => {
                    let slot = &mut slots[buffer];
                    let input = slot.input.take().ok_or_else(|| missing("input", buffer))?;
                    let y = t.evaluate_stage(input, Inputs::targets_only(slot.targets.take()))?;
                    match stage.is_last() {
                        true => loss[0] += y.to_dtype(DType::F32)?.to_scalar::<f32>()?,
                        false => slot.output = Some(y),
                    }
                }
                Instruction::SendActivation { buffer } => {
                    pending.send_output(stage, &mut slots[buffer], buffer)?;
                }
                other => {
                    return Err(EngineError::Internal(format!(
                        "inference schedule: unexpected {}",
                        other.name()
                    )))
                }
            }
        }
        pending.finish()?;
    }
    stage.group.broadcast(&mut loss, stage.last())?;
    Ok(loss[0])
}

/// One micro-batch forward through every chunk of an interleaved pipeline, one virtual stage
/// after another (a chain: one transfer in flight at a time); the loss on every stage's
/// return value is the last virtual stage's (0 elsewhere).
fn eval_round<T: Dtype>(t: &mut Trainer<T>, stage: &Stage, batch: &Batch) -> Result<f32> {
    let (ids, targets) = t.batch_tensors(batch)?;
    let (p, last_chunk) = (stage.stages, stage.chunks.len() - 1);
    let (mut ids, mut targets) = (Some(ids), targets);
    let mut loss = 0.0;
    for (c, layers) in stage.chunks.clone().into_iter().enumerate() {
        let first = stage.is_first() && c == 0;
        let last = stage.is_last() && c == last_chunk;
        let input = match first {
            true => ids.take().expect("chunk 0 runs once"),
            false => recv(stage, (stage.stage + p - 1) % p, t.device())?,
        };
        let tg = match last {
            true => targets.take(),
            false => None,
        };
        let y = t.evaluate_layers(layers, input, Inputs::targets_only(tg))?;
        match last {
            true => loss = y.to_dtype(DType::F32)?.to_scalar::<f32>()?,
            false => send(stage, &y, (stage.stage + 1) % p)?,
        }
    }
    Ok(loss)
}

fn missing(what: &str, at: usize) -> EngineError {
    EngineError::Internal(format!(
        "pipe schedule: no {what} for buffer or micro-batch {at} (an instruction out of order)"
    ))
}

/// The header of a transfer: dtype code, rank, then up to 6 dimensions (f32 holds them
/// exactly below 2^24).
const HEADER: usize = 8;

/// A tensor's elements on their way to or from another stage.
enum Payload {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

/// A tensor as it crosses: its header and its elements.
struct Wire {
    header: [f32; HEADER],
    payload: Payload,
}

impl Wire {
    fn of(t: &Tensor) -> Result<Wire> {
        let dims = t.dims();
        if dims.len() > HEADER - 2 {
            return Err(EngineError::Model(format!(
                "pipeline: a tensor of {} dimensions cannot be sent (at most {})",
                dims.len(),
                HEADER - 2
            )));
        }
        let flat = t.flatten_all()?;
        let (code, payload) = match t.dtype() {
            DType::F32 => (0.0, Payload::F32(flat.to_vec1()?)),
            DType::BF16 => (1.0, Payload::Bf16(flat.to_vec1()?)),
            DType::F16 => (2.0, Payload::F16(flat.to_vec1()?)),
            d => {
                return Err(EngineError::Model(format!(
                    "pipeline: cannot send {d:?} tensors"
                )))
            }
        };
        let mut header = [0f32; HEADER];
        header[0] = code;
        header[1] = dims.len() as f32;
        for (h, d) in header[2..].iter_mut().zip(dims) {
            *h = *d as f32;
        }
        Ok(Wire { header, payload })
    }

    /// Room for the tensor a received header announces.
    fn expect(header: [f32; HEADER]) -> Wire {
        let n = Self::dims_of(&header).iter().product();
        let payload = match header[0] as u8 {
            0 => Payload::F32(vec![0.0; n]),
            1 => Payload::Bf16(vec![bf16::ZERO; n]),
            _ => Payload::F16(vec![f16::ZERO; n]),
        };
        Wire { header, payload }
    }

    fn dims_of(header: &[f32; HEADER]) -> Vec<usize> {
        let rank = (header[1] as usize).min(HEADER - 2);
        header[2..2 + rank].iter().map(|d| *d as usize).collect()
    }

    fn bytes(&self) -> &[u8] {
        match &self.payload {
            Payload::F32(v) => bytemuck::cast_slice(v),
            Payload::Bf16(v) => bytemuck::cast_slice(v),
            Payload::F16(v) => bytemuck::cast_slice(v),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.payload {
            Payload::F32(v) => bytemuck::cast_slice_mut(v),
            Payload::Bf16(v) => bytemuck::cast_slice_mut(v),
            Payload::F16(v) => bytemuck::cast_slice_mut(v),
        }
    }

    fn into_tensor(self, dev: &Device) -> Result<Tensor> {
        let dims = Self::dims_of(&self.header);
        Ok(match self.payload {
            Payload::F32(v) => Tensor::from_vec(v, dims, dev)?,
            Payload::Bf16(v) => Tensor::from_vec(v, dims, dev)?,
            Payload::F16(v) => Tensor::from_vec(v, dims, dev)?,
        })
    }
}

/// A communication failure inside a pipeline step that involves ranks of this pipeline
/// names their stages too, whatever collective it happened in (a transfer, the loss broadcast,
/// the gradient norm, tied gradients): "pipeline stage 1: recv: timed out ... rank 1".
pub(crate) fn name_stages(e: EngineError, stage: &Stage) -> EngineError {
    name_stages_among(e, stage.group.global_ranks())
}

/// `name_stages` for the pipeline whose stage `s` is global rank `pipeline[s]`.
fn name_stages_among(e: EngineError, pipeline: &[usize]) -> EngineError {
    // The gradient norm's all-reduce over the stages fails inside ds-partition, so its
    // communication error arrives wrapped as a partition error.
    let c = match e {
        EngineError::Comm(c) | EngineError::Partition(ds_partition::PartitionError::Comm(c)) => c,
        other => return other,
    };
    let ranks = match &c {
        ds_comm::CommError::Timeout { missing, .. } => missing.clone(),
        ds_comm::CommError::PeerLost { peer, .. } => vec![*peer],
        _ => Vec::new(),
    };
    let stages: Vec<String> = ranks
        .iter()
        .filter_map(|r| pipeline.iter().position(|g| g == r))
        .map(|s| s.to_string())
        .collect();
    match stages.is_empty() {
        true => EngineError::Comm(c),
        false => EngineError::Comm(c.during(&format!("pipeline stage {}", stages.join(", ")))),
    }
}

fn send(stage: &Stage, t: &Tensor, to: usize) -> Result<()> {
    let wire = Wire::of(t)?;
    let rank = stage.rank_of(to);
    let g = &stage.group;
    let sent = g
        .send(&wire.header, rank)
        .and_then(|_| match &wire.payload {
            Payload::F32(v) => g.send(v, rank),
            Payload::Bf16(v) => g.send(v, rank),
            Payload::F16(v) => g.send(v, rank),
        });
    Ok(sent?)
}

/// Sends `t` to stage `to` on the communicator's worker thread, in this rank's issue order:
/// the stage goes on computing while it leaves (Note [pipeline transfers]).
fn send_async(stage: &Stage, t: &Tensor, to: usize) -> Result<Vec<Work<()>>> {
    let wire = Wire::of(t)?;
    let rank = stage.rank_of(to);
    let header = stage.group.send_async(wire.header.to_vec(), rank);
    let data = match wire.payload {
        Payload::F32(v) => stage.group.send_async(v, rank),
        Payload::Bf16(v) => stage.group.send_async(v, rank),
        Payload::F16(v) => stage.group.send_async(v, rank),
    };
    Ok(vec![header, data])
}

fn recv(stage: &Stage, from: usize, dev: &Device) -> Result<Tensor> {
    let rank = stage.rank_of(from);
    let mut header = [0f32; HEADER];
    stage.group.recv(&mut header, rank)?;
    let mut wire = Wire::expect(header);
    let g = &stage.group;
    match &mut wire.payload {
        Payload::F32(v) => g.recv(v, rank),
        Payload::Bf16(v) => g.recv(v, rank),
        Payload::F16(v) => g.recv(v, rank),
    }?;
    wire.into_tensor(dev)
}

/// One tick's exchange (Note [interleaved ticks]): the headers of every tensor both ways,
/// then their elements, each as one combined send+receive with both neighbours.
fn exchange(
    stage: &Stage,
    sends: Vec<(usize, Tensor)>,
    from: &[usize],
    dev: &Device,
) -> Result<Vec<Tensor>> {
    let out: Vec<(usize, Wire)> = sends
        .iter()
        .map(|(to, t)| Ok((stage.rank_of(*to), Wire::of(t)?)))
        .collect::<Result<_>>()?;
    let from: Vec<usize> = from.iter().map(|&s| stage.rank_of(s)).collect();
    let what = format!(
        "pipeline: stage {} exchanging with its neighbours",
        stage.stage
    );
    let fail = |e: ds_comm::CommError| EngineError::Comm(e.during(&what));
    let mut headers = vec![[0f32; HEADER]; from.len()];
    let head_out: Vec<(usize, &[u8])> = out
        .iter()
        .map(|(r, w)| (*r, bytemuck::cast_slice(&w.header[..])))
        .collect();
    let mut head_in: Vec<(usize, &mut [u8])> = from
        .iter()
        .zip(headers.iter_mut())
        .map(|(r, h)| (*r, bytemuck::cast_slice_mut(&mut h[..])))
        .collect();
    stage
        .group
        .send_recv(&head_out, &mut head_in)
        .map_err(fail)?;
    let mut wires: Vec<Wire> = headers.into_iter().map(Wire::expect).collect();
    let data_out: Vec<(usize, &[u8])> = out.iter().map(|(r, w)| (*r, w.bytes())).collect();
    let mut data_in: Vec<(usize, &mut [u8])> = from
        .iter()
        .zip(wires.iter_mut())
        .map(|(r, w)| (*r, w.bytes_mut()))
        .collect();
    stage
        .group
        .send_recv(&data_out, &mut data_in)
        .map_err(fail)?;
    wires.into_iter().map(|w| w.into_tensor(dev)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn timeout(what: &str, missing: Vec<usize>) -> ds_comm::CommError {
        ds_comm::CommError::Timeout {
            what: what.into(),
            missing,
            after: Duration::from_secs(4),
        }
    }

    /// Whichever layer the timed-out collective ran in, the silent rank's stage is named:
    /// a transfer's error arrives as a communication error, the gradient norm's all-reduce
    /// over the stages as ds-partition's.
    #[test]
    fn a_timeout_names_the_silent_stage_however_it_arrives() {
        let pipeline = [4, 6];
        let direct = EngineError::Comm(timeout("recv", vec![6]));
        let wrapped = EngineError::Partition(timeout("all_reduce", vec![6]).into());
        for e in [direct, wrapped] {
            let said = name_stages_among(e, &pipeline).to_string();
            assert!(said.starts_with("pipeline stage 1: "), "{said}");
            assert!(said.contains("waiting for rank 6"), "{said}");
        }
    }

    /// A rank outside this pipeline is no stage of it: the error stays as it was.
    #[test]
    fn a_rank_outside_the_pipeline_names_no_stage() {
        let said = name_stages_among(EngineError::Comm(timeout("recv", vec![5])), &[4, 6]);
        assert!(!said.to_string().contains("pipeline stage"), "{said}");
    }
}
