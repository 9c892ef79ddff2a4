//! Mixture of experts (issue 37): DeepSpeed-MoE's gating and its layer at ep_size 1.

pub mod gating;
mod layer;

pub use layer::MoeLayer;
