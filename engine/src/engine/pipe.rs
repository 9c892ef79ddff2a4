//! Pipeline parallelism in the engine: which layers this stage runs, and the execution of a
//! pipe schedule (ds-pipeline's instructions) over them, with activations and gradients sent
//! point to point between neighbouring stages.
//!
//! Note [pipeline transfers]: every transfer is a blocking send or receive over the pipeline
//! group, a header (dtype and shape) then the data. DeepSpeed's schedules pair each send of a
//! step with its neighbour's receive in the same step and the same order (an even stage's
//! forward slot meets its odd neighbour's backward slot), so blocking transfers cannot
//! deadlock, and all of a rank's communication stays in ds-comm's one issue order.

use candle_core::{DType, Device, Tensor};
use ds_comm::{Element, Group};
use ds_pipeline::partition::{partition_layers, LayerInfo, PartitionMethod};
use ds_pipeline::pipe_schedule::{train_buffers, train_schedule, Instruction, StagePlace};
use half::{bf16, f16};

use super::trainer::{Micro, Trainer};
use super::Dtype;
use crate::data::Batch;
use crate::model::Model;
use crate::{EngineError, Result};

/// This rank's place in its pipeline.
#[derive(Clone)]
pub(crate) struct Stage {
    pub group: Group,
    pub stage: usize,
    pub stages: usize,
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
    pub fn prev(&self) -> usize {
        self.rank_of(self.stage - 1)
    }
    pub fn next(&self) -> usize {
        self.rank_of(self.stage + 1)
    }
    pub fn last(&self) -> usize {
        self.rank_of(self.stages - 1)
    }
}

/// The layer ranges of the stages (`stages + 1` offsets) for `model`, by DeepSpeed's
/// `partition_method` (`pipeline.partition`: "parameters", also what "best" means,
/// "uniform" or "type:REGEX" over the layers' report names).
pub fn stage_layers(model: &Model, stages: usize, method: &str) -> Result<Vec<usize>> {
    let method = PartitionMethod::parse(method)
        .map_err(|e| EngineError::Invalid(format!("pipeline.partition: {e}")))?;
    let layers: Vec<LayerInfo> = model
        .layers()
        .iter()
        .map(|l| LayerInfo {
            name: l.display_name(),
            params: l.params().iter().map(|p| p.numel() as u64).sum(),
        })
        .collect();
    partition_layers(&layers, stages, &method)
        .map_err(|e| EngineError::Invalid(format!("pipeline: {e}")))
}

/// The stage of each parameter of `model`, in order, for the stage boundaries `parts`.
pub fn param_stages(model: &Model, parts: &[usize]) -> Vec<usize> {
    model
        .layers()
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            let stage = parts.partition_point(|&p| p <= i) - 1;
            std::iter::repeat_n(stage, l.params().len())
        })
        .collect()
}

/// The stage boundaries of `model` for a config with `pipeline.stages` > 1, after the check
/// DeepSpeed's PipelineEngine makes (ZeRO-2 and -3 do not combine with pipelines); `train`
/// calls it before any rank starts, `Engine::initialize` for programs embedding the engine.
pub fn pipeline_layout(config: &ds_config::Config, model: &Model) -> Result<Vec<usize>> {
    let stages = config.dims.pp;
    if config.zero_stage().partitions_gradients() {
        return Err(EngineError::Invalid(format!(
            "zero_optimization.stage = {}: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism ({stages} stages); use stage 0 or 1",
            config.zero_stage()
        )));
    }
    let method = config.pipeline["partition"]
        .as_str()
        .unwrap_or("parameters");
    stage_layers(model, stages, method)
}

/// One pipeline buffer: a micro-batch's tensors between the instructions that use them.
#[derive(Default)]
struct Slot {
    /// The stage's input (token ids, or the activations received).
    input: Option<Tensor>,
    targets: Option<Tensor>,
    /// The stage's output, until sent.
    output: Option<Tensor>,
    /// The gradient of the output (received), then of the input (to send).
    grad: Option<Tensor>,
    micro: Micro,
}

/// Runs DeepSpeed's TrainSchedule for this stage over `micro_batches` micro-batches from
/// `next`; returns the sum of the micro-batches' losses on the last stage (0 elsewhere) and
/// whether the optimizer stepped.
pub(crate) fn train_batch<T: Dtype>(
    t: &mut Trainer<T>,
    stage: &Stage,
    micro_batches: usize,
    next: &mut dyn FnMut(usize) -> Result<Batch>,
) -> Result<(f32, Option<super::StepOutcome>)> {
    let place = StagePlace {
        micro_batches,
        stages: stage.stages,
        stage: stage.stage,
    };
    let mut slots: Vec<Slot> = (0..train_buffers(place)).map(|_| Slot::default()).collect();
    let (mut loaded, mut loss, mut outcome) = (0, 0.0f32, None);
    for cmd in train_schedule(place).into_iter().flatten() {
        match cmd {
            Instruction::LoadMicroBatch { buffer } => {
                let (ids, targets) = t.batch_tensors(&next(loaded)?)?;
                loaded += 1;
                let slot = &mut slots[buffer];
                slot.targets = Some(targets);
                if stage.is_first() {
                    slot.input = Some(ids);
                }
            }
            Instruction::RecvActivation { buffer } => {
                let t0 = std::time::Instant::now();
                slots[buffer].input = Some(recv(&stage.group, stage.prev(), t.device())?);
                t.add_pipe_wait(t0.elapsed());
            }
            Instruction::ForwardPass { buffer } => {
                let slot = &mut slots[buffer];
                let input = slot.input.take().ok_or_else(|| missing("input", buffer))?;
                // middle stages have no targets of their own; the loss layer is elsewhere
                let targets = match slot.targets.take() {
                    Some(t) => t,
                    None => input.zeros_like()?.to_dtype(DType::U32)?,
                };
                let y = t.forward_stage(input, targets)?;
                if stage.is_last() {
                    loss += y.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                } else {
                    slot.output = Some(y);
                }
                slot.micro = t.take_micro();
            }
            Instruction::SendActivation { buffer } => {
                let y = slots[buffer]
                    .output
                    .take()
                    .ok_or_else(|| missing("output", buffer))?;
                let t0 = std::time::Instant::now();
                send(&stage.group, &y, stage.next())?;
                t.add_pipe_wait(t0.elapsed());
            }
            Instruction::RecvGrad { buffer } => {
                let t0 = std::time::Instant::now();
                slots[buffer].grad = Some(recv(&stage.group, stage.next(), t.device())?);
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
                let t0 = std::time::Instant::now();
                send(&stage.group, &dx, stage.prev())?;
                t.add_pipe_wait(t0.elapsed());
            }
            // no tied parameters yet; gradients are reduced at the last backward's boundary
            Instruction::ReduceTiedGrads | Instruction::ReduceGrads => {}
            Instruction::OptimizerStep => outcome = t.step()?,
        }
    }
    Ok((loss, outcome))
}

/// The loss of one micro-batch without gradients: forward stage after stage (DeepSpeed's
/// InferenceSchedule with one micro-batch); the last stage's loss, on every stage.
pub(crate) fn eval_batch<T: Dtype>(
    t: &mut Trainer<T>,
    stage: &Stage,
    batch: &Batch,
) -> Result<f32> {
    let (ids, targets) = t.batch_tensors(batch)?;
    let input = match stage.is_first() {
        true => ids,
        false => recv(&stage.group, stage.prev(), t.device())?,
    };
    let y = t.forward_stage(input, targets)?;
    t.drop_saved();
    let mut loss = [0f32];
    match stage.is_last() {
        true => loss[0] = y.to_dtype(DType::F32)?.to_scalar::<f32>()?,
        false => send(&stage.group, &y, stage.next())?,
    }
    stage.group.broadcast(&mut loss, stage.last())?;
    Ok(loss[0])
}

fn missing(what: &str, buffer: usize) -> EngineError {
    EngineError::Invalid(format!(
        "pipe schedule: no {what} in buffer {buffer} (an instruction out of order)"
    ))
}

/// The header of a transfer: dtype code, rank, then up to 6 dimensions (f32 holds them
/// exactly below 2^24).
const HEADER: usize = 8;

fn send(group: &Group, t: &Tensor, to: usize) -> Result<()> {
    let dims = t.dims();
    if dims.len() > HEADER - 2 {
        return Err(EngineError::Invalid(format!(
            "pipeline: a tensor of {} dimensions cannot be sent (at most {})",
            dims.len(),
            HEADER - 2
        )));
    }
    let code = match t.dtype() {
        DType::F32 => 0.0,
        DType::BF16 => 1.0,
        DType::F16 => 2.0,
        d => {
            return Err(EngineError::Invalid(format!(
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
    group.send(&header, to)?;
    let flat = t.flatten_all()?;
    match t.dtype() {
        DType::F32 => group.send(&flat.to_vec1::<f32>()?, to)?,
        DType::BF16 => group.send(&flat.to_vec1::<bf16>()?, to)?,
        _ => group.send(&flat.to_vec1::<f16>()?, to)?,
    }
    Ok(())
}

fn recv(group: &Group, from: usize, dev: &Device) -> Result<Tensor> {
    let mut header = [0f32; HEADER];
    group.recv(&mut header, from)?;
    let rank = header[1] as usize;
    let dims: Vec<usize> = header[2..2 + rank.min(HEADER - 2)]
        .iter()
        .map(|d| *d as usize)
        .collect();
    match header[0] as u8 {
        0 => recv_as::<f32>(group, from, dims, dev),
        1 => recv_as::<bf16>(group, from, dims, dev),
        _ => recv_as::<f16>(group, from, dims, dev),
    }
}

fn recv_as<T: Element + candle_core::WithDType>(
    group: &Group,
    from: usize,
    dims: Vec<usize>,
    dev: &Device,
) -> Result<Tensor> {
    let mut buf = vec![T::default(); dims.iter().product()];
    group.recv(&mut buf, from)?;
    Ok(Tensor::from_vec(buf, dims, dev)?)
}
