//! Where a rank computes (`--device cpu|cuda[:N]`): candle's device for the layers' tensors,
//! and where the flat ZeRO buffers live (`placements`): on the GPU that computes, except what
//! ZeRO-Offload keeps in host memory (see engine/ARCHITECTURE.md, "The engine on a GPU").

use candle_core::Device;
use ds_partition::{Placement, Placements};

use crate::{NnError, Result};

#[cfg(feature = "cuda")]
pub(crate) mod gpu;

/// Which states ZeRO-Offload keeps in host memory while a GPU computes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuOffload {
    pub optimizer: bool,
    pub params: bool,
}

/// A `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// A GPU: the given ordinal, or this rank's LOCAL_RANK.
    Cuda(Option<usize>),
}

impl DeviceChoice {
    pub fn parse(s: &str) -> std::result::Result<DeviceChoice, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(None)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|n| DeviceChoice::Cuda(Some(n)))
                .ok_or_else(|| format!("device {s:?}: expected cpu, cuda or cuda:N")),
        }
    }

    /// What a rank uses when it is not told: a GPU in a build with CUDA that sees one, else the
    /// CPU.
    pub fn default_for_build() -> DeviceChoice {
        match cfg!(feature = "cuda") && open_cuda(0).is_ok() {
            true => DeviceChoice::Cuda(None),
            false => DeviceChoice::Cpu,
        }
    }

    /// Opens the device; plain `cuda` is GPU `local_rank`, as torchrun's LOCAL_RANK picks it.
    pub fn open(self, local_rank: usize) -> Result<Device> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(n) => open_cuda(n.unwrap_or(local_rank)),
        }
    }
}

/// Where the model states of a rank computing on `dev` live: all in host memory on the CPU; on
/// a GPU, in its memory except what `offload` keeps in host memory.
///
/// Unless the data-parallel group reduces GPU memory where it is (`dp_on_gpu`: one rank, or
/// `--dist_backend nccl`), they stay in host memory on a GPU too (ZeRO-Offload's layout): the
/// built-in and MPI transports reduce host memory, and a gradient reduced there would
/// otherwise move page by page between the GPU and the host.
pub fn placements(dev: &Device, offload: CpuOffload, dp_on_gpu: bool) -> Placements {
    let Some(gpu) = gpu_placement(dev).filter(|_| dp_on_gpu) else {
        return Placements::host();
    };
    let unless = |offloaded: bool| match offloaded {
        true => Placement::Host,
        false => gpu.clone(),
    };
    Placements {
        params: unless(offload.params),
        grads: gpu.clone(),
        optimizer: unless(offload.optimizer),
    }
}

/// The memory of the GPU behind `dev` (None on the CPU).
pub fn gpu_placement(dev: &Device) -> Option<Placement> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return Some(Placement::Gpu(gpu::gpu_for(d)));
    }
    let _ = dev;
    None
}

/// A tensor of `values` on `dev` made on the device, when `values` lie in a GPU buffer of
/// the same GPU (a layer's parameters materialised without passing through the host); None
/// otherwise (the caller copies them from host memory).
pub fn tensor_from_buffer<T: crate::Dtype>(
    values: &[T],
    dev: &Device,
) -> Result<Option<candle_core::Tensor>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return gpu::tensor_from_buffer(values, d);
    }
    let _ = (values, dev);
    Ok(None)
}

/// `f` of the gradient tensors copied one after the other into a GPU staging buffer (for the
/// gradient stores to add on the GPU), when they are on a GPU; None (and `f` not called)
/// otherwise.
pub fn with_staged_grads<T: crate::Dtype, R, E: From<NnError>>(
    tensors: &[candle_core::Tensor],
    f: impl FnOnce(&[T]) -> std::result::Result<R, E>,
) -> std::result::Result<Option<R>, E> {
    #[cfg(feature = "cuda")]
    if let Some(Device::Cuda(d)) = tensors.first().map(|t| t.device()) {
        return gpu::with_staged(tensors, d, f).map(Some);
    }
    let _ = (tensors, f);
    Ok(None)
}

/// What the driver says of a GPU.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub name: String,
    /// Memory in use on the whole GPU (every process, the CUDA context included), and its size.
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// The most bytes this process has had allocated on it at once (PyTorch's
    /// `max_memory_allocated`): the high-water mark of candle's memory pool beside
    /// ds-partition's managed buffers. None where the device has no memory pool.
    pub allocated_peak_bytes: Option<u64>,
}

/// The GPU behind `dev` (None on the CPU, or when the driver does not answer).
pub fn gpu_info(dev: &Device) -> Option<GpuInfo> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        let (free, total) = ctx.mem_get_info().ok()?;
        let managed = ds_partition::gpu::managed_bytes(ctx.ordinal());
        let pool = gpu::pool_peak_bytes(d).ok().flatten();
        return Some(GpuInfo {
            name: ctx.name().ok()?,
            used_bytes: (total - free) as u64,
            total_bytes: total as u64,
            allocated_peak_bytes: pool.map(|p| p + managed),
        });
    }
    let _ = dev;
    None
}

/// Dense peak TFLOP/s of a GPU named `name` for its matrix products: on the tensor cores in
/// bf16/fp16 (`half`), else fp32 without TF32; from the vendors' datasheets (SXM boards unless
/// named). None for a GPU not in the table.
pub fn peak_tflops(name: &str, half: bool) -> Option<f64> {
    // (name part, bf16/fp16 dense, fp32); more specific names first.
    const TABLE: [(&str, f64, f64); 8] = [
        ("H100 PCIe", 756.0, 51.2),
        ("H100 NVL", 835.0, 60.0),
        ("GH200", 989.4, 67.0),
        ("H200", 989.4, 67.0),
        ("H100", 989.4, 67.0),
        ("A100", 312.0, 19.5),
        ("L40S", 362.1, 91.6),
        ("A10", 125.0, 31.2),
    ];
    TABLE
        .iter()
        .find(|(part, ..)| name.contains(part))
        .map(|&(_, h, f)| if half { h } else { f })
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    let dev = Device::new_cuda(ordinal).map_err(|e| {
        // candle's message carries a backtrace on the lines after the first
        let e = e.to_string();
        let first = e.lines().next().unwrap_or_default();
        NnError::Invalid(format!("device cuda:{ordinal}: {first}"))
    })?;
    if let Device::Cuda(d) = &dev {
        gpu::prepare(d).map_err(|e| NnError::Invalid(format!("device cuda:{ordinal}: {e}")))?;
    }
    Ok(dev)
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Err(NnError::Invalid(format!(
        "device cuda:{ordinal}: this ds-rs was built without CUDA; build it with `--features cuda` \
         (scripts/check-cuda.sh)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_others_are_refused() {
        assert_eq!(DeviceChoice::parse("cpu"), Ok(DeviceChoice::Cpu));
        assert_eq!(DeviceChoice::parse("cuda"), Ok(DeviceChoice::Cuda(None)));
        assert_eq!(
            DeviceChoice::parse("cuda:3"),
            Ok(DeviceChoice::Cuda(Some(3)))
        );
        for bad in ["gpu", "cuda:", "cuda:x", "CPU"] {
            assert!(DeviceChoice::parse(bad).is_err(), "{bad}");
        }
        assert!(DeviceChoice::Cpu.open(0).unwrap().is_cpu());
        assert!(gpu_info(&Device::Cpu).is_none());
        if !cfg!(feature = "cuda") {
            let e = DeviceChoice::Cuda(None).open(1).unwrap_err().to_string();
            assert!(e.contains("cuda:1") && e.contains("--features cuda"), "{e}");
        }
    }

    #[test]
    fn peaks_come_from_the_most_specific_name() {
        assert_eq!(peak_tflops("NVIDIA H100 PCIe", true), Some(756.0));
        assert_eq!(peak_tflops("NVIDIA H100 80GB HBM3", true), Some(989.4));
        assert_eq!(peak_tflops("NVIDIA H200", false), Some(67.0));
        assert_eq!(peak_tflops("NVIDIA GH200 480GB", true), Some(989.4));
        assert_eq!(peak_tflops("Tesla V100", true), None);
    }
}
