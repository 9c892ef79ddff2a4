//! The parallel layout a config is resolved for: one value, decided once (`parallel_dims`),
//! carried by the resolved config to everything that communicates.

use serde::Serialize;

use crate::error::{ConfigError, Result};

/// The parallel layout a config is resolved for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ParallelDims {
    pub world_size: usize,
    pub tp: usize,
    pub pp: usize,
    /// Expert parallelism (DeepSpeed-MoE's `ep_size`): the data-parallel ranks in groups of
    /// `ep`, among which a mixture of experts' experts are split (1: none).
    #[serde(skip_serializing_if = "is_one")]
    pub ep: usize,
    /// Sequence parallelism (DeepSpeed-Ulysses' `sequence_parallel_size`): the data-parallel
    /// ranks in groups of `sp` consecutive ones, which share samples and split each one's
    /// sequence (1: none). ZeRO shards and gradients still span every data-parallel rank;
    /// the batch counts `dp / sp` replicas.
    #[serde(skip_serializing_if = "is_one")]
    pub sp: usize,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl ParallelDims {
    /// Checks that tp * pp divides the world size; the error shows the product.
    pub fn new(world_size: usize, tp: usize, pp: usize) -> Result<ParallelDims> {
        let product = tp.checked_mul(pp).filter(|&p| p > 0);
        if world_size == 0 || !product.is_some_and(|p| world_size.is_multiple_of(p)) {
            let product = match tp.checked_mul(pp) {
                Some(p) => p.to_string(),
                None => "more than usize holds".to_string(),
            };
            return Err(ConfigError::conflict(
                "world_size",
                format!("world size {world_size} is not a positive multiple of tp * pp = {tp} * {pp} = {product}"),
            ));
        }
        Ok(ParallelDims {
            world_size,
            tp,
            pp,
            ep: 1,
            sp: 1,
        })
    }

    /// The same layout with expert-parallel size `ep`, which must divide the data-parallel
    /// size (DeepSpeed's `_create_expert_and_data_parallel` asserts it); the error says
    /// which sizes, for the caller to name where `ep` came from.
    pub fn with_ep(self, ep: usize) -> std::result::Result<ParallelDims, String> {
        if ep > 1 && self.sp > 1 {
            return Err(format!(
                "expert-parallel size {ep} with sequence-parallel size {}: ds-rs does not combine the two",
                self.sp
            ));
        }
        if ep == 0 || !self.dp().is_multiple_of(ep) {
            return Err(format!(
                "expert-parallel size {ep} does not divide the data-parallel size {} (world {} / (tp {} * pp {}))",
                self.dp(),
                self.world_size,
                self.tp,
                self.pp
            ));
        }
        Ok(ParallelDims { ep, ..self })
    }

    /// The same layout with sequence-parallel size `sp`, which must divide the data-parallel
    /// size (DeepSpeed's `initialize_sequence_parallel` asserts it of the world); the error
    /// says which sizes.
    pub fn with_sp(self, sp: usize) -> std::result::Result<ParallelDims, String> {
        if sp > 1 && self.pp > 1 {
            return Err(format!(
                "sequence-parallel size {sp} with {} pipeline stages: Ulysses splits a stage's attention heads, and ds-rs does not combine it with pipeline parallelism (use pp 1)",
                self.pp
            ));
        }
        if sp > 1 && self.ep > 1 {
            return Err(format!(
                "sequence-parallel size {sp} with expert-parallel size {}: ds-rs does not combine the two",
                self.ep
            ));
        }
        if sp == 0 || !self.dp().is_multiple_of(sp) {
            return Err(format!(
                "sequence-parallel size {sp} does not divide the data-parallel size {} (world {} / (tp {} * pp {}))",
                self.dp(),
                self.world_size,
                self.tp,
                self.pp
            ));
        }
        Ok(ParallelDims { sp, ..self })
    }

    /// The data-parallel ranks: where gradients are averaged and ZeRO shards the states
    /// (DeepSpeed's sequence-data-parallel group under Ulysses).
    pub fn dp(&self) -> usize {
        self.world_size / (self.tp * self.pp)
    }

    /// The model replicas that read different samples: the data-parallel ranks over `sp`
    /// (the batch rule's data-parallel size).
    pub fn replicas(&self) -> usize {
        self.dp() / self.sp
    }

    /// The ranks holding the same experts: the data-parallel size over `ep`.
    pub fn expert_dp(&self) -> usize {
        self.dp() / self.ep
    }
}

/// `dp D x tp T x pp P`, with `(ep E)` under expert parallelism.
impl std::fmt::Display for ParallelDims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "dp {} x tp {} x pp {}", self.dp(), self.tp, self.pp)?;
        if self.ep > 1 {
            write!(f, " (ep {})", self.ep)?;
        }
        if self.sp > 1 {
            write!(f, " (sp {})", self.sp)?;
        }
        Ok(())
    }
}
