//! Bytes held per rank, by kind: the figures of the ZeRO paper's memory formulas.

/// Bytes this rank holds for the model state (activations and temporaries not included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryReport {
    /// Parameters in the compute dtype: whole (stages 0-2) or this rank's shard (stage 3),
    /// plus gathered parameters kept resident (stage 3's persistent ones).
    pub params: usize,
    /// Gradients in the compute dtype: whole (stages 0-1) or the owned shard (stages 2-3).
    pub grads: usize,
    /// fp32 master copy of the owned range plus the optimizer's moments.
    pub optimizer_states: usize,
}

impl MemoryReport {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer_states
    }
}
