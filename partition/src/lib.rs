//! ZeRO partitioning: where each parameter, gradient and optimizer-state element lives.
//!
//! All parameters of a model sit in one flat buffer, in layer order (`FlatIndex`). A
//! `ShardLayout` cuts that buffer into one equal, padded shard per data-parallel rank. A ZeRO
//! stage is a pair of stores behind small traits: a `ParamStore` (whole parameters on every
//! rank, or only this rank's shard gathered per layer) and a `GradStore` (whole gradients
//! all-reduced, or buckets reduce-scattered into the owning shard). `Zero` combines the pair
//! the stage asks for and keeps the fp32 master copy of the owned range.
//!
//! This crate knows flat ranges, dtypes and groups; it never sees a candle tensor, a layer or an
//! optimizer formula (those live in ds-engine).

mod buffer;
mod error;
mod flat;
mod frozen;
mod grads;
mod layout;
mod memory;
mod params;
mod slice;
pub mod swap;
pub mod vector;
mod zero;

#[cfg(feature = "cuda")]
pub use buffer::gpu;
pub use buffer::{FlatBuf, Placement};
pub use error::{PartitionError, Result};
pub use flat::{FlatEntry, FlatIndex, ParamId};
pub use frozen::Frozen;
pub use grads::{GradStore, ReduceConfig};
pub use layout::ShardLayout;
pub use memory::StateBytes;
pub use params::{ParamStore, Publish, Stage3Config, Values};
pub use slice::{local_shape, runs, runs_within, Run, Split, TpRank};
pub use zero::{InitFn, ParamSwap, Placements, Zero, ZeroOptions};
