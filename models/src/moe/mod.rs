//! Mixture of experts (issue 37): DeepSpeed-MoE's gating so far.

pub mod gating;
