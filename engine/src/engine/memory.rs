//! What one rank's memory holds, by kind: the model states the ZeRO formulas count, and the
//! working memory of a step at its peak, so that peak RSS can be explained.

use ds_partition::StateBytes;

/// Bytes one rank holds. The first three are held between steps; the others are the most a
/// step has held so far (0 before the first forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryReport {
    /// Trainable parameters in the compute dtype (whole at stages 0-2, the shard at stage 3).
    pub params: usize,
    /// Frozen parameters (`Model::freeze`), in the compute dtype, stored as the trainable
    /// ones are; they have no gradients and no optimizer states.
    pub frozen_params: usize,
    /// Gradients in the compute dtype (whole at stages 0-1, the shard at stages 2-3).
    pub grads: usize,
    /// The fp32 master copy of the owned range and the optimizer's moments.
    pub optimizer_states: usize,
    /// Of the three above, this rank's experts' share under expert parallelism (their own
    /// store: experts / ep of them, sharded over the expert-data-parallel group).
    pub experts: ExpertBytes,
    /// Activations kept for backward at the end of forward, where they peak.
    pub activations: usize,
    /// Layers' parameters materialised as tensors at once, at most: the layer being computed,
    /// the ZeRO-3 layers that keep their graph (Note [ZeRO-3 reuse]) and layers without a
    /// tape (Note [tapes hold no parameters]).
    pub layer_params: usize,
    /// The largest layer's gradients during its backward (handed to the gradient store in
    /// place).
    pub layer_grads: usize,
    /// Reduction buckets and parameter gathers, at their most.
    pub comm_buffers: usize,
    /// On disk, not in memory: the master copy and optimizer states offloaded to NVMe (the
    /// chunk they stream through is in `optimizer_states`).
    pub offloaded: usize,
    /// Of the bytes above (not `offloaded`), those in GPU memory: the model states placed there
    /// and, when the layers compute on a GPU, the step's activations, layer parameters and
    /// layer gradients (candle tensors on the device). The rest are in host memory.
    pub gpu: usize,
}

/// An expert-parallel rank's experts' parameters, gradients and optimizer states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertBytes {
    pub params: usize,
    pub grads: usize,
    pub optimizer_states: usize,
}

impl ExpertBytes {
    pub(crate) fn of(states: &StateBytes) -> ExpertBytes {
        ExpertBytes {
            params: states.params,
            grads: states.grads,
            optimizer_states: states.optimizer_states,
        }
    }
}

impl MemoryReport {
    /// `step_on_gpu`: the layers compute on a GPU, so the step's working memory is there.
    /// `states` include the experts' (`experts`).
    pub(crate) fn new(
        states: StateBytes,
        experts: ExpertBytes,
        frozen_params: usize,
        step: StepPeak,
        offloaded: usize,
        step_on_gpu: bool,
    ) -> MemoryReport {
        let step_bytes = step.activations + step.layer_params + step.layer_grads;
        MemoryReport {
            params: states.params,
            frozen_params,
            grads: states.grads,
            optimizer_states: states.optimizer_states,
            experts,
            activations: step.activations,
            layer_params: step.layer_params,
            layer_grads: step.layer_grads,
            comm_buffers: states.comm_buffers,
            offloaded,
            gpu: states.gpu + if step_on_gpu { step_bytes } else { 0 },
        }
    }

    /// Parameters, gradients and optimizer states: what the ZeRO formulas count.
    pub fn model_states(&self) -> usize {
        self.params + self.frozen_params + self.grads + self.optimizer_states
    }

    /// Everything accounted: the model states plus the step's peaks (an upper bound of what
    /// is live at once, since the peaks need not coincide).
    pub fn total(&self) -> usize {
        self.model_states()
            + self.activations
            + self.layer_params
            + self.layer_grads
            + self.comm_buffers
    }
}

/// The most a step has held of its working memory, by kind.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepPeak {
    pub activations: usize,
    pub layer_params: usize,
    pub layer_grads: usize,
}
