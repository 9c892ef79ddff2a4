//! The differentiable building blocks and the CPU fast paths beneath every layer: fused
//! kernels with their backward, the primitive compositions other devices run, and the
//! products and attention through the `gemm` crate. Kernels see tensors only: they know no
//! `Layer`, no tensor parallelism, no model.
//!
//! Imports point down this list, never up or sideways within a row:
//! - `vmath`, `cpu_matmul`, `cpu_storage`, `primitive`: candle, gemm and plain arithmetic only;
//! - `ops` (GELU, causal softmax, bias), `fused_norm_loss` (LayerNorm, cross-entropy),
//!   `scatter_rows` (rows summed by index);
//! - `grad` (linear and its backward), `cpu_attention`, `cpu_flash_attention`;
//! - `nn`: the layers and dispatchers a model calls.

pub mod autograd;
pub mod cpu_attention;
pub mod cpu_flash_attention;
mod cpu_matmul;
mod cpu_storage;
pub mod flash_attention;
pub mod fused_norm_loss;
mod gpu;
pub mod grad;
pub mod nn;
pub mod ops;
pub mod primitive;
pub mod rms_swiglu;
pub mod rotary;
pub mod scatter_rows;
mod vmath;
