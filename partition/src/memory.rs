//! Bytes held per rank, by kind: the figures of the ZeRO paper's memory formulas.

/// Bytes this rank holds for the model state, and the most its communication buffers held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBytes {
    /// Parameters in the compute dtype: whole (stages 0-2) or this rank's shard (stage 3),
    /// plus gathered parameters kept resident (stage 3's persistent ones).
    pub params: usize,
    /// Gradients in the compute dtype: whole (stages 0-1) or the owned shard (stages 2-3).
    pub grads: usize,
    /// fp32 master copy of the owned range plus the optimizer's moments.
    pub optimizer_states: usize,
    /// Most bytes held at once by reduction buckets and parameter gathers so far (they live
    /// only during forward and backward).
    pub comm_buffers: usize,
    /// How many of the model-state bytes (`params + grads + optimizer_states`) are in GPU
    /// memory; the rest are in host memory (or on disk, which none of these count).
    pub gpu: usize,
}

impl StateBytes {
    /// Parameters, gradients and optimizer states: what the ZeRO formulas count.
    pub fn model_states(&self) -> usize {
        self.params + self.grads + self.optimizer_states
    }

    /// Adds another store's bytes (an expert-parallel rank's experts): its buffers live
    /// beside these.
    pub fn add(&mut self, other: &StateBytes) {
        self.params += other.params;
        self.grads += other.grads;
        self.optimizer_states += other.optimizer_states;
        self.comm_buffers += other.comm_buffers;
        self.gpu += other.gpu;
    }
}
