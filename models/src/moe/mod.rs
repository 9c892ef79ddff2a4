//! Mixture of experts (issue 37): DeepSpeed-MoE's gating and layer, and the dispatch of
//! tokens to experts every mixture shares.

pub(crate) mod dispatch;

pub mod gating;
mod layer;

pub use layer::{check_ep_divides, Gelu, MoeLayer, MoeStyle};
pub(crate) use layer::{in_order, MoeTape};
