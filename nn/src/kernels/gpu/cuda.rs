//! The fused kernels on candle's CUDA stream: fused.cu's and flash.cu's PTX (built by build.rs)
//! loaded once per device as candle's custom modules; storage in and out for the custom ops' `cuda_fwd`, and
//! tensors in and out for the Llama family's fused paths (rms_swiglu.rs, rotary.rs).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Result, Shape, Storage, Tensor};
use half::{bf16, f16};

use std::sync::OnceLock;

use super::launch::Launch;
use super::{ptx, Arg, Launcher};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));
const FLASH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));

/// The module of `kernel` (its name in candle's cache of custom modules) and its PTX:
/// flash.cu's kernels are named flash_*, the rest are fused.cu's. The build's PTX, or
/// `DS_RS_PTX_DIR`'s (ptx.rs), decided once per process.
fn module(kernel: &str) -> (&'static str, &'static str) {
    static FUSED: OnceLock<&'static str> = OnceLock::new();
    static FLASH: OnceLock<&'static str> = OnceLock::new();
    let chosen = |cell: &OnceLock<&'static str>, file: &str, built: &'static str| {
        // leaked once: candle's module cache keeps what it loads for the process anyway
        *cell.get_or_init(|| ptx::overridden(file).map_or(built, |p| Box::leak(p.into())))
    };
    match kernel.starts_with("flash_") {
        true => ("ds_flash", chosen(&FLASH, "flash.ptx", FLASH_PTX)),
        false => ("ds_fused", chosen(&FUSED, "fused.ptx", PTX)),
    }
}

/// Dynamic shared memory a block may have without opting in.
const STATIC_SHARED_LIMIT: u32 = 48 * 1024;

/// Launches on `dev`'s stream, where candle runs everything else, so no event is needed
/// between the kernels and the ops around them.
pub(crate) struct Cuda<'a> {
    dev: &'a CudaDevice,
}

impl Launcher for Cuda<'_> {
    type Scratch = CudaSlice<f32>;
    fn scratch(&self, len: usize) -> Result<(CudaSlice<f32>, u64)> {
        // SAFETY: the kernels write scratch before they read it.
        let s = unsafe { self.dev.alloc::<f32>(len.max(1)) }?;
        let stream = self.dev.cuda_stream();
        let at = s.device_ptr(&stream).0;
        Ok((s, at))
    }
    fn launch(&self, kernel: &str, at: Launch, args: &[Arg]) -> Result<()> {
        let (name, ptx) = module(kernel);
        let f = self.dev.get_or_load_custom_func(kernel, name, ptx)?;
        let mut b = f.builder();
        for a in args {
            match a {
                Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
                Arg::U32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        if at.shared > STATIC_SHARED_LIMIT {
            // past 48 KiB a kernel must be allowed its dynamic shared memory first
            let most = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(most, at.shared as i32).w()?;
        }
        let cfg = LaunchConfig {
            grid_dim: (at.grid, 1, 1),
            block_dim: (at.block, 1, 1),
            shared_mem_bytes: at.shared,
        };
        // SAFETY: `args` match `kernel`'s parameters in fused.cu (the emulator tests check the
        // calls), and every address is a live allocation of the sizes the calls give.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// A new storage of `len` elements of `dtype` on `dev`, filled by `call` (given the launcher,
/// the inputs' addresses and the output's), with `inputs` converted to `dtype` first where
/// they differ (u32 inputs stay u32): a custom op's `cuda_fwd`.
pub(crate) fn with_output(
    dev: &CudaDevice,
    dtype: DType,
    len: usize,
    inputs: &[(&CudaStorage, &Layout)],
    call: impl FnOnce(&Cuda, &[u64], u64) -> Result<()>,
) -> Result<CudaStorage> {
    let converted: Vec<Option<CudaStorage>> = inputs
        .iter()
        .map(|(s, l)| match s.dtype() {
            DType::U32 => Ok(None),
            d if d == dtype => Ok(None),
            _ => s.to_dtype(l, dtype).map(Some),
        })
        .collect::<Result<_>>()?;
    let inputs: Vec<(&CudaStorage, usize)> = inputs
        .iter()
        .zip(&converted)
        .map(|((s, l), c)| match c {
            // a conversion is a new contiguous storage from element 0
            Some(c) => Ok((c, 0)),
            None => Ok((*s, start(l)?)),
        })
        .collect::<Result<_>>()?;
    let mut out = with_outputs(dev, &inputs, &[(dtype, len)], |k, a, o| call(k, a, o[0]))?;
    Ok(out.remove(0))
}

/// New storages of `outputs` (dtype, length) on `dev`, filled by `call` from `inputs` (each
/// a storage and the element its data starts at).
fn with_outputs(
    dev: &CudaDevice,
    inputs: &[(&CudaStorage, usize)],
    outputs: &[(DType, usize)],
    call: impl FnOnce(&Cuda, &[u64], &[u64]) -> Result<()>,
) -> Result<Vec<CudaStorage>> {
    let mut outs: Vec<CudaStorage> = outputs
        .iter()
        .map(|&(dtype, len)| alloc(dev, dtype, len))
        .collect::<Result<_>>()?;
    let stream = dev.cuda_stream();
    // The guards record the stream's reads and writes of each buffer when they drop, after
    // the launches.
    let mut guards = Vec::with_capacity(inputs.len() + outs.len());
    let mut ins = Vec::with_capacity(inputs.len());
    for &(s, first) in inputs {
        let (a, g) = address(s, first, &stream)?;
        ins.push(a);
        guards.push(g);
    }
    let mut os = Vec::with_capacity(outs.len());
    for s in outs.iter_mut() {
        let (a, g) = written(s, &stream)?;
        os.push(a);
        guards.push(g);
    }
    call(&Cuda { dev }, &ins, &os)?;
    drop(guards);
    Ok(outs)
}

/// Runs `call` on untracked tensors on a GPU (made contiguous), into new tensors of `outputs`
/// (dtype, shape); None where the first input is not on a GPU or autograd tracks one, so the
/// caller's other path applies. The kernels take the inputs' dtypes as they are.
pub(crate) fn on_tensors(
    inputs: &[&Tensor],
    outputs: &[(DType, Shape)],
    call: impl FnOnce(&Cuda, &[u64], &[u64]) -> Result<()>,
) -> Result<Option<Vec<Tensor>>> {
    let Some(Device::Cuda(dev)) = inputs.first().map(|t| t.device()) else {
        return Ok(None);
    };
    if inputs.iter().any(|t| t.track_op()) {
        return Ok(None);
    }
    let contiguous: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<_>>()?;
    let guards: Vec<_> = contiguous.iter().map(|t| t.storage_and_layout()).collect();
    let storages: Vec<(&CudaStorage, usize)> = guards
        .iter()
        .map(|(s, l)| match &**s {
            Storage::Cuda(c) => Ok((c, start(l)?)),
            _ => candle_core::bail!("fused kernel: inputs on different devices"),
        })
        .collect::<Result<_>>()?;
    let lens: Vec<(DType, usize)> = outputs.iter().map(|(d, s)| (*d, s.elem_count())).collect();
    let outs = with_outputs(dev, &storages, &lens, call)?;
    let tensors = outs
        .into_iter()
        .zip(outputs)
        .map(|(s, (_, shape))| {
            Tensor::from_storage(Storage::Cuda(s), shape.clone(), BackpropOp::none(), false)
        })
        .collect();
    Ok(Some(tensors))
}

/// The first element of a contiguous layout.
fn start(l: &Layout) -> Result<usize> {
    match l.contiguous_offsets() {
        Some((a, _)) => Ok(a),
        None => candle_core::bail!("fused kernel: input must be contiguous"),
    }
}

/// The address of element `at` of `s`, and the guard that records the stream's use of it.
fn address<'a>(
    s: &'a CudaStorage,
    at: usize,
    stream: &'a std::sync::Arc<CudaStream>,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let (base, guard) = match &s.slice {
        CudaStorageSlice::F32(v) => v.device_ptr(stream),
        CudaStorageSlice::BF16(v) => v.device_ptr(stream),
        CudaStorageSlice::F16(v) => v.device_ptr(stream),
        CudaStorageSlice::U32(v) => v.device_ptr(stream),
        _ => candle_core::bail!("fused kernel: unsupported dtype {:?}", s.dtype()),
    };
    Ok((base + (at * s.dtype().size_in_bytes()) as u64, guard))
}

/// The address of a new output storage, and the guard that records the stream's write to it.
fn written<'a>(
    s: &'a mut CudaStorage,
    stream: &'a std::sync::Arc<CudaStream>,
) -> Result<(u64, SyncOnDrop<'a>)> {
    Ok(match &mut s.slice {
        CudaStorageSlice::F32(v) => v.device_ptr_mut(stream),
        CudaStorageSlice::BF16(v) => v.device_ptr_mut(stream),
        CudaStorageSlice::F16(v) => v.device_ptr_mut(stream),
        _ => candle_core::bail!("fused kernel: unsupported output dtype"),
    })
}

fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    let len = len.max(1);
    // SAFETY (each): the caller's kernels write every element the result exposes.
    Ok(match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(len) }?, dev.clone()),
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<bf16>(len) }?, dev.clone())
        }
        DType::F16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f16>(len) }?, dev.clone()),
        other => candle_core::bail!("fused kernel: unsupported dtype {other:?}"),
    })
}
