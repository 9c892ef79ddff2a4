//! The optimizer step on this rank's shard: overflow check and loss-scale update, global-norm
//! clipping, the scheduled learning rate, the update, and publishing the new parameters.

use ds_comm::Element;
use ds_partition::Zero;

use crate::checkpoint::Counters;
use crate::loss_scale::LossScaler;
use crate::optim::{scaled_f32, Optimizer, OptimizerState, TypedGrads};
use crate::schedule::LrSchedule;
use crate::{EngineError, Result};

use super::groups::GroupPlan;
use super::offload::OffloadedStates;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// The learning rate used (the one the step would have used when skipped).
    pub lr: f64,
    /// Global gradient norm before clipping, unscaled (inf/NaN on overflow).
    pub grad_norm: f64,
    /// The step was skipped because a gradient overflowed (fp16).
    pub skipped: bool,
    /// The loss scale the gradients were computed with.
    pub loss_scale: f64,
    /// What DeepSpeed's rank 0 would log about the loss scale at this step.
    pub messages: Vec<String>,
    /// This step ended an autotuning trial's profile (its metrics are written): the program
    /// should end here, as DeepSpeed's engine ends the process.
    pub trial_complete: bool,
    /// Steps skipped so far (fp16 overflows), as DeepSpeed's progress line counts them.
    pub skipped_steps: u64,
    /// Wall time since the previous optimizer step (or the engine's start), and the samples
    /// of the whole job's step (train_batch_size) per second over it.
    pub step_seconds: f64,
    pub samples_per_s: f64,
}

/// Optimizer, LR schedule and loss scaler, with the step counters DeepSpeed keeps.
pub struct Updater {
    optimizer: Box<dyn Optimizer>,
    schedule: LrSchedule,
    scaler: LossScaler,
    /// Optimizer steps attempted (DeepSpeed's global_steps: skipped ones count).
    global_steps: u64,
    skipped_steps: u64,
    /// The master copy and the optimizer's states on NVMe (the optimizer then holds one
    /// chunk's state).
    offload: Option<OffloadedStates>,
    /// The parts of the shard in other parameter groups than the optimizer's own.
    groups: GroupPlan,
    /// The optimizer of this expert-parallel rank's experts' shard, when it holds experts
    /// (their own store): stepped with the same learning rate, loss scale and clipping.
    experts: Option<ShardOptimizer>,
}

/// An optimizer over one store's owned shard, with that shard's parameter groups.
pub struct ShardOptimizer {
    pub optimizer: Box<dyn Optimizer>,
    pub groups: GroupPlan,
}

/// Elements of the shard updated at a time (4 MiB of fp32 gradients).
pub const STEP_PIECE: usize = 1 << 20;

impl Updater {
    pub fn new(
        optimizer: Box<dyn Optimizer>,
        schedule: LrSchedule,
        scaler: LossScaler,
        groups: GroupPlan,
    ) -> Updater {
        Updater {
            optimizer,
            schedule,
            scaler,
            global_steps: 0,
            skipped_steps: 0,
            offload: None,
            groups,
            experts: None,
        }
    }

    /// The optimizer of the experts' store (expert parallelism).
    pub fn set_experts(&mut self, experts: ShardOptimizer) {
        self.experts = Some(experts);
    }

    /// The optimizer of the experts' store, under expert parallelism.
    pub fn expert_optimizer(&self) -> Option<&dyn Optimizer> {
        self.experts.as_ref().map(|e| e.optimizer.as_ref())
    }

    /// Resumes the experts' optimizer from a checkpoint's step count and this rank's
    /// experts' state.
    pub fn restore_experts(&mut self, step: u64, buffers: &[(String, Vec<f32>)]) -> Result<()> {
        let experts = self.experts.as_mut().ok_or_else(|| {
            EngineError::Resume("checkpoint: experts' state for a rank that holds none".into())
        })?;
        let state = OptimizerState {
            step,
            buffers: buffers
                .iter()
                .map(|(n, b)| (n.as_str(), b.as_slice()))
                .collect(),
        };
        experts.optimizer.load_state(&state)?;
        Ok(())
    }

    /// Bytes of the experts' optimizer states (their moments).
    pub fn expert_state_bytes(&self) -> usize {
        self.experts
            .as_ref()
            .map_or(0, |e| e.optimizer.state_bytes())
    }

    /// From now on the master copy and the optimizer's states live in `offload`.
    pub fn offload_to(&mut self, offload: OffloadedStates) {
        self.offload = Some(offload);
    }

    pub fn offloaded(&self) -> Option<&OffloadedStates> {
        self.offload.as_ref()
    }

    pub fn loss_scale(&self) -> f64 {
        self.scaler.scale()
    }
    pub fn global_steps(&self) -> u64 {
        self.global_steps
    }
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }
    pub fn state_bytes(&self) -> usize {
        self.optimizer.state_bytes()
    }

    /// The learning rate of the next step. The schedule advances only on steps taken, as
    /// DeepSpeed does not call `lr_scheduler.step()` after an overflow.
    pub fn lr(&self) -> f64 {
        self.schedule.lr_at(self.global_steps - self.skipped_steps)
    }

    /// The counters a checkpoint carries.
    pub fn counters(&self) -> Counters {
        Counters {
            global_steps: self.global_steps,
            skipped_steps: self.skipped_steps,
            loss_scaler: self.scaler.state(),
        }
    }

    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// Resumes from a checkpoint's counters and this rank's optimizer state.
    pub fn restore(
        &mut self,
        c: Counters,
        step: u64,
        buffers: &[(String, Vec<f32>)],
    ) -> Result<()> {
        if let Some(o) = &self.offload {
            o.restore_states(buffers)?;
        }
        // offloaded, the optimizer holds one chunk: it takes the step count and which
        // buffers are live, and each step streams the values in
        let held = match self.offload {
            Some(_) => self.optimizer.shard_len(),
            None => usize::MAX,
        };
        let state = OptimizerState {
            step,
            buffers: buffers
                .iter()
                .map(|(n, b)| (n.as_str(), &b[..held.min(b.len())]))
                .collect(),
        };
        self.optimizer.load_state(&state)?;
        self.scaler.set_state(c.loss_scaler);
        self.global_steps = c.global_steps;
        self.skipped_steps = c.skipped_steps;
        Ok(())
    }

    /// The step on the dense store `zero` and, under expert parallelism, on the experts'
    /// store with the sum of squares of every expert gradient of the job: one global norm for
    /// overflow and clipping, as DeepSpeed computes over all of its parameter groups.
    pub fn step<T: Element>(
        &mut self,
        zero: &mut Zero<T>,
        mut experts: Option<(&mut Zero<T>, f64)>,
        clip: f64,
    ) -> Result<StepOutcome> {
        let scale = self.scaler.scale();
        let lr = self.lr();
        let experts_sq = experts.as_ref().map_or(0.0, |(_, sq)| *sq);
        let norm = (zero.grad_norm_sq()? + experts_sq).sqrt() / scale;
        let overflow = !norm.is_finite();
        self.global_steps += 1;
        let scaled = self.scaler.update(overflow).map_err(|e| {
            EngineError::Diverged(format!("fp16: {e} (loss scale {})", e.cur_scale))
        })?;
        let messages = scaled.log.into_iter().map(|l| l.text).collect();
        let outcome = StepOutcome {
            lr,
            grad_norm: norm,
            skipped: scaled.skipped,
            loss_scale: scale,
            messages,
            trial_complete: false,
            skipped_steps: 0,
            step_seconds: 0.0,
            samples_per_s: 0.0,
        };
        if scaled.skipped {
            self.skipped_steps += 1;
            zero.zero_grads()?;
            if let Some((ez, _)) = experts.as_mut() {
                ez.zero_grads()?;
            }
            return Ok(outcome);
        }
        // torch's clip_grad_norm_ and DeepSpeed: scale by max / (norm + 1e-6) when above max.
        let clip_coef = match clip > 0.0 && norm + 1e-6 > clip {
            true => clip / (norm + 1e-6),
            false => 1.0,
        };
        let k = (clip_coef / scale) as f32;
        let momentum = self
            .schedule
            .momentum_at(self.global_steps - 1 - self.skipped_steps);
        if let (Some(e), Some((ez, _))) = (self.experts.as_mut(), experts) {
            if let Some(m) = momentum {
                e.optimizer.set_momentum(m);
            }
            e.optimizer.begin(lr);
            update_shard(e.optimizer.as_mut(), &e.groups, ez, k)?;
        }
        if let Some(m) = momentum {
            self.optimizer.set_momentum(m);
        }
        self.optimizer.begin(lr);
        match &self.offload {
            Some(o) => o.step(self.optimizer.as_mut(), zero, k, &self.groups)?,
            None => update_shard(self.optimizer.as_mut(), &self.groups, zero, k)?,
        }
        Ok(outcome)
    }
}

/// The update of one store's owned shard with gradients times `k`, then the new values
/// published: on the GPU where the buffers are, else on the host in pieces.
fn update_shard<T: Element>(
    optimizer: &mut dyn Optimizer,
    groups: &GroupPlan,
    zero: &mut Zero<T>,
    k: f32,
) -> Result<()> {
    let (master, grads) = zero.master_and_grads();
    if !step_on_gpu(optimizer, groups, master, grads, k)? {
        // The owned range in pieces: the fp32 gradients of one piece at a time, never of
        // the whole shard (a whole-model temporary at stage 0). Gradients on a GPU (the
        // optimizer offloaded to the CPU) come down a piece at a time, the next one's copy
        // running while this one steps: a host loop over their managed pages would migrate
        // them to the host and back.
        let mut scratch = vec![0f32; STEP_PIECE.min(master.len())];
        let grads = &grads[..master.len()];
        ds_partition::vector::for_each_host_piece(grads, STEP_PIECE, |at, piece| {
            for (r, group) in groups.segments(at..at + piece.len()) {
                let fp32 = &mut scratch[..r.len()];
                scaled_f32(fp32, &piece[r.start - at..r.end - at], k);
                optimizer.update(r.start, &mut master[r], fp32, group);
            }
            Ok(())
        })?;
    }
    zero.publish()?;
    Ok(())
}

/// The step on the GPU, a kernel per part of the shard with its group's settings; false when
/// the buffers are not all on one GPU (nothing was done).
fn step_on_gpu<T: Element>(
    optimizer: &mut dyn Optimizer,
    groups: &GroupPlan,
    master: &mut [f32],
    grads: &[T],
    k: f32,
) -> Result<bool> {
    for (i, (r, group)) in groups.segments(0..master.len()).into_iter().enumerate() {
        let grads = TypedGrads::of(&grads[r.clone()]);
        let done = optimizer.update_on_gpu(r.start, &mut master[r], grads, k, group)?;
        // every part lies where the first does: one answer for the whole shard
        debug_assert!(
            done || i == 0,
            "invariant: a shard's buffers share one placement"
        );
        if !done {
            return Ok(false);
        }
    }
    Ok(true)
}
