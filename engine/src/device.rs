//! Where a rank computes (`--device cpu|cuda[:N]`): candle's device for the layers' tensors.
//! The flat ZeRO buffers (master copy, optimizer states, gradient shards) stay in host memory
//! on either device; a layer's parameters are copied to the device when it is materialised
//! and its gradients copied back (see ARCHITECTURE.md, "The engine on a GPU").

use candle_core::Device;

use crate::{EngineError, Result};

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

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal)
        .map_err(|e| EngineError::Invalid(format!("device cuda:{ordinal}: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Err(EngineError::Invalid(format!(
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
        if !cfg!(feature = "cuda") {
            let e = DeviceChoice::Cuda(None).open(1).unwrap_err().to_string();
            assert!(e.contains("cuda:1") && e.contains("--features cuda"), "{e}");
        }
    }
}
