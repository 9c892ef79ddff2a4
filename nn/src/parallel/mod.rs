//! Tensor parallelism's building blocks (Megatron-LM's scheme), for the built-in GPT and for
//! a user's own layers, expert parallelism's (`Ep`, DeepSpeed-MoE's) and sequence
//! parallelism's (`Sp`, DeepSpeed-Ulysses'): the tensor-parallel group as layers see it (`Tp`), the collectives
//! between regions (`mappings`), and the vocabulary-parallel embedding and cross-entropy
//! (`vocab`). Column- and row-parallel linears need no type of their own: a column-parallel
//! linear is an ordinary `linear` over the rank's rows whose input gradient goes through
//! `Tp::reduce`; a row-parallel one is a `linear` over the rank's columns whose output goes
//! through `Tp::reduce` before its bias is added (`row_parallel_linear`).
//!
//! A layer declares how each logical tensor is split (`ParamSpec::split`); the engine gives it
//! only its slice, in the local shape (`local_shape`), and never the whole tensor.

mod experts;
mod mappings;
mod partition_config;
mod sequence;
pub mod vocab;

pub use ds_partition::{local_shape, Split, TpRank};
pub use experts::Ep;
pub use mappings::Tp;
pub use partition_config::PartitionConfig;
pub use sequence::Sp;
pub use vocab::vocab_parallel_cross_entropy;

use candle_core::{Result, Tensor};

use crate::kernels::grad::linear;

/// A row-parallel linear `x W^T + b`: `x` is this rank's part of the input features
/// [.., in/tp], `w` its columns [out, in/tp]; the partial products are summed over the
/// tensor-parallel group, then the (replicated) bias, where there is one, is added once. At
/// tp = 1 the plain fused linear.
pub fn row_parallel_linear(tp: &Tp, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if tp.size() == 1 {
        return linear(x, w, b);
    }
    let y = tp.reduce(&linear(x, w, None)?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// The layout as a model's layers see it: the groups its layers split over, given to the
/// model when it is built (`Parallel::of` from the job's groups).
#[derive(Clone, Default)]
pub struct Parallel {
    pub tp: Tp,
    pub ep: Ep,
    pub sp: Sp,
    /// Positions per tile of the MLPs and of the logits and loss (DeepSpeed's `TiledMLP` and
    /// `TiledFusedLogitsLoss`): their activations then no longer grow with the sequence.
    /// None: whole sequences at once.
    pub tile: Option<usize>,
}

impl Parallel {
    /// One process: nothing split.
    pub fn none() -> Parallel {
        Parallel::default()
    }

    /// Tensor parallelism alone.
    pub fn tensor(tp: Tp) -> Parallel {
        Parallel {
            tp,
            ..Parallel::default()
        }
    }

    /// The same layout computing the MLPs and the loss `tile` positions at a time.
    pub fn with_tile(mut self, tile: Option<usize>) -> Parallel {
        self.tile = tile;
        self
    }

    /// This rank's layout in `groups`, Megatron's sequence parallelism as `megatron_sp`.
    pub fn of(groups: &ds_comm::Groups, megatron_sp: bool) -> Parallel {
        Parallel {
            tp: Tp::new(groups.tp().clone()).with_sequence_parallel(megatron_sp),
            ep: Ep::new(groups.experts().ep.clone()),
            sp: Sp::new(groups.sp().clone()),
            tile: None,
        }
    }
}
