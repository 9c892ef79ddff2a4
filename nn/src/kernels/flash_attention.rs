//! Causal attention that never holds the T x T matrix, on the device its tensors are on: the
//! CPU's blockwise f32 attention (cpu_flash_attention.rs) or, in the cuda build, the tensor-core
//! kernels of kernels/flash.cu (bf16 and f16, head sizes 32, 64 and 128). Both keep the output
//! and each row's log-sum-exp [B, H, T] for a backward that recomputes the probabilities.
//! Each call returns None where neither applies; the models then hold the probabilities.

use candle_core::{DType, Device, Result, Tensor};

use super::cpu_flash_attention;

/// The environment variable that sends attention on a GPU through the T x T probabilities
/// (`matmul`) instead of the flash kernels: the comparison scripts/gpu-acceptance.sh measures.
pub const ATTENTION_ENV: &str = "DS_RS_ATTENTION";

/// Whether attention over `t` positions of `dtype` on `device` should take this path: on the
/// CPU (f32) from `cpu_flash_attention::MIN_SEQ`, where the probabilities stop being small; on
/// a GPU always (bf16, f16), unless DS_RS_ATTENTION=matmul.
pub fn wanted(t: usize, device: &Device, dtype: DType) -> bool {
    match device {
        Device::Cpu => t >= cpu_flash_attention::MIN_SEQ,
        Device::Cuda(_) => {
            cfg!(feature = "cuda")
                && matches!(dtype, DType::BF16 | DType::F16)
                && std::env::var(ATTENTION_ENV).map_or(true, |v| v != "matmul")
        }
        _ => false,
    }
}

/// GPT's fused projection qkv [B, T, 3d] with `heads` heads: the output [B, T, d] and the
/// log-sum-exp [B, H, T].
pub fn forward(qkv: &Tensor, heads: usize, scale: f32) -> Result<Option<(Tensor, Tensor)>> {
    match qkv.device() {
        Device::Cpu => cpu_flash_attention::forward(qkv, heads, scale),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => super::gpu::flash::on_gpu::fused_forward(qkv, heads, scale),
        _ => Ok(None),
    }
}

/// `forward`'s backward: the gradient [B, T, 3d] of qkv from that of the output.
pub fn backward(
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    heads: usize,
    scale: f32,
) -> Result<Option<Tensor>> {
    match qkv.device() {
        Device::Cpu => cpu_flash_attention::backward(qkv, out, lse, dout, heads, scale),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            super::gpu::flash::on_gpu::fused_backward(qkv, out, lse, dout, heads, scale)
        }
        _ => Ok(None),
    }
}

/// Grouped-query attention over q [B, h, T, hd] and k, v [B, g, T, hd], with `window` Some(w)
/// the sliding window: the output [B, T, h hd] and the log-sum-exp [B, h, T].
pub fn forward_grouped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Option<(Tensor, Tensor)>> {
    match q.device() {
        Device::Cpu => cpu_flash_attention::forward_grouped(q, k, v, scale, window),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => super::gpu::flash::on_gpu::grouped_forward(q, k, v, scale, window),
        _ => Ok(None),
    }
}

/// `forward_grouped`'s backward: dq [B, h, T, hd], dk and dv [B, g, T, hd].
pub fn backward_grouped(
    qkv: (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    scale: f32,
    window: Option<usize>,
) -> Result<Option<[Tensor; 3]>> {
    match qkv.0.device() {
        Device::Cpu => cpu_flash_attention::backward_grouped(qkv, out, lse, dout, scale, window),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            super::gpu::flash::on_gpu::grouped_backward(qkv, out, lse, dout, scale, window)
        }
        _ => Ok(None),
    }
}
