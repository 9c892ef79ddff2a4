//! The engine's side of GPU buffers (feature `cuda`): which `ds_partition::gpu::Gpu` a candle
//! device's buffers belong to, and the copies between those buffers and candle's tensors,
//! made on the GPU (device to device) rather than through the host.

use std::any::{Any, TypeId};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{result, sys, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{Storage, Tensor};
use ds_comm::DType;
use ds_partition::gpu::{device_ptr, gpu_of, Gpu, Span};
use ds_partition::{FlatBuf, Placement};
use half::{bf16, f16};

use crate::Dtype;
use crate::{NnError, Result};

/// The `Gpu` of candle device `d`: one per device and stream, so kernels load once.
pub fn gpu_for(d: &CudaDevice) -> Arc<Gpu> {
    static GPUS: Mutex<Vec<(StreamKey, Arc<Gpu>)>> = Mutex::new(Vec::new());
    let stream = d.cuda_stream();
    let key = stream_key(d);
    let mut gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, g)) = gpus.iter().find(|(k, _)| *k == key) {
        return g.clone();
    }
    let g = Gpu::new(stream);
    gpus.push((key, g.clone()));
    g
}

/// Readies candle's device `d` for a training loop, once it is opened.
///
/// Note [one stream, a kept pool]: candle runs every op of a rank on one stream (the calling
/// thread's per-thread default stream, `CU_STREAM_PER_THREAD`), and ds-rs issues all of a
/// rank's GPU work from its training thread; NCCL's communicators run on streams of their own
/// over ds-partition's managed buffers, not candle's tensors. Two of cudarc's defaults cost
/// that loop on every op and buy it nothing:
/// - Event tracking: every allocation creates a read and a write event and every free destroys
///   them (four driver calls an op), for the ordering of a tensor used on several streams.
///   Turned off here, before any tensor of the run exists.
/// - The release threshold of the device's stream-ordered memory pool, 0 by default: at every
///   synchronisation (ds-rs has a dozen a micro-step, and the loss is read each one) the pool
///   hands its freed memory back to the driver, and the next step's activations are mapped in
///   again. Set to the maximum here, as PyTorch's caching allocator keeps its blocks: the pool
///   holds the step's peak, which the driver's count of memory in use then shows.
pub fn prepare(d: &CudaDevice) -> Result<()> {
    check_driver()?;
    // SAFETY: the conditions of `disable_event_tracking` hold by the note above: candle's
    // tensors are used on its one stream only, so no use on another stream needs ordering.
    unsafe { d.disable_event_tracking() };
    let ctx = d.cuda_stream().context().clone();
    let Some(pool) = memory_pool(&ctx)? else {
        return Ok(()); // no stream-ordered pool: cudarc allocates and frees synchronously
    };
    let mut keep = u64::MAX;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: `pool` is the device's current pool; the attribute takes a u64.
    unsafe { result::mem_pool::set_attribute(pool, attr, (&mut keep as *mut u64).cast()) }
        .map_err(cuda)
}

/// The CUDA version whose PTX the build emits (scripts/install-cuda-toolchain.sh's nvcc for
/// ds-rs's kernels and candle's, cudarc's `cuda-13000` bindings), as the driver API numbers it.
const CUDA_BUILT_FOR: i32 = 13000;

/// Refuses a driver older than the build's CUDA: it cannot load the build's PTX, and would
/// fail only at the first kernel, with CUDA_ERROR_UNSUPPORTED_PTX_VERSION.
fn check_driver() -> Result<()> {
    let mut version = 0;
    // SAFETY: writes one int; the driver is loaded (candle opened the device).
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(cuda)?;
    match version >= CUDA_BUILT_FOR {
        true => Ok(()),
        false => Err(NnError::Invalid(format!(
            "the NVIDIA driver supports CUDA {}.{}, and this ds-rs was built for CUDA {}.{}: \
             update the driver (R580 or later), or build with a CUDA {}.x toolchain",
            version / 1000,
            version % 1000 / 10,
            CUDA_BUILT_FOR / 1000,
            CUDA_BUILT_FOR % 1000 / 10,
            version / 1000,
        ))),
    }
}

/// The most bytes of `d`'s stream-ordered pool in use at once so far (candle's tensors:
/// activations, layer parameters and gradients, temporaries): PyTorch's `max_memory_allocated`
/// but for ds-partition's managed buffers. None where the device has no pool.
pub fn pool_peak_bytes(d: &CudaDevice) -> Result<Option<u64>> {
    let ctx = d.cuda_stream().context().clone();
    let Some(pool) = memory_pool(&ctx)? else {
        return Ok(None);
    };
    let mut high = 0u64;
    let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    // SAFETY: `pool` is the device's current pool; the attribute is a u64.
    unsafe { result::mem_pool::get_attribute(pool, attr, (&mut high as *mut u64).cast()) }
        .map_err(cuda)?;
    Ok(Some(high))
}

/// The current stream-ordered memory pool of `ctx`'s device, where cudarc's allocations come
/// from; None where the device has none.
fn memory_pool(
    ctx: &Arc<candle_core::cuda_backend::cudarc::driver::CudaContext>,
) -> Result<Option<sys::CUmemoryPool>> {
    let supported = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
    if ctx.attribute(supported).map_err(cuda)? == 0 {
        return Ok(None);
    }
    ctx.bind_to_thread().map_err(cuda)?;
    // SAFETY: the context's own device.
    let pool = unsafe { result::device::get_mem_pool(ctx.cu_device()) }.map_err(cuda)?;
    Ok(Some(pool))
}

/// What tells one device's stream from another's: the GPU's ordinal beside the stream's
/// handle, which is the same `CU_STREAM_PER_THREAD` on every device candle opens.
pub(crate) type StreamKey = (usize, usize);

pub(crate) fn stream_key(d: &CudaDevice) -> StreamKey {
    let stream = d.cuda_stream();
    (stream.context().ordinal(), stream.cu_stream() as usize)
}

/// A tensor of `values` on `d`, copied on the GPU when `values` lie in a GPU buffer; None
/// when they are host memory (the caller copies them up).
pub fn tensor_from_buffer<T: Dtype>(values: &[T], d: &CudaDevice) -> Result<Option<Tensor>> {
    if gpu_of(Span::of(values)).is_none() {
        return Ok(None);
    }
    let src = device_ptr(values);
    let storage = match <T as ds_comm::Element>::DTYPE {
        DType::F32 => copy_out::<f32>(src, values.len(), d)?,
        DType::BF16 => copy_out::<bf16>(src, values.len(), d)?,
        DType::F16 => copy_out::<f16>(src, values.len(), d)?,
    };
    let storage = Storage::Cuda(storage);
    Ok(Some(Tensor::from_storage(
        storage,
        values.len(),
        BackpropOp::none(),
        false,
    )))
}

/// `len` elements at GPU address `src` into a new allocation of candle's.
fn copy_out<U: CudaDType + DeviceRepr>(
    src: sys::CUdeviceptr,
    len: usize,
    d: &CudaDevice,
) -> Result<CudaStorage> {
    let stream = d.cuda_stream();
    // SAFETY: every element is written by the copy below before anything reads it.
    let mut dst = unsafe { stream.alloc::<U>(len) }.map_err(cuda)?;
    {
        let (to, _recorded) = dst.device_ptr_mut(&stream);
        let bytes = len * std::mem::size_of::<U>();
        // SAFETY: `src` holds `len` elements of GPU memory (a live buffer), `to` as many.
        unsafe { result::memcpy_dtod_async(to, src, bytes, stream.cu_stream()) }.map_err(cuda)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(dst, d.clone()))
}

/// Staging buffers kept between layers and micro-steps, one per GPU (its stream) and dtype:
/// a managed allocation per layer and micro-step would cost an allocation, a zero fill and a
/// free, which synchronises the device, every time. Each holds the largest layer's gradients
/// seen so far.
static STAGING: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// A kept staging buffer: its GPU stream, its element type, the `FlatBuf` itself.
type Kept = (StreamKey, TypeId, Box<dyn Any + Send>);

/// A staging buffer of at least `len` elements for GPU `gpu` (cache key `key`): the kept one
/// when it is large enough, else a new one (the smaller one freed).
fn take_staging<T: Dtype>(gpu: Arc<Gpu>, key: StreamKey, len: usize) -> Result<FlatBuf<T>> {
    let mut cache = STAGING.lock().unwrap_or_else(|e| e.into_inner());
    let kept = cache
        .iter()
        .position(|(k, t, _)| *k == key && *t == TypeId::of::<T>())
        .map(|i| cache.swap_remove(i).2.downcast::<FlatBuf<T>>());
    drop(cache);
    match kept {
        Some(Ok(buf)) if buf.len() >= len => Ok(*buf),
        _ => Ok(FlatBuf::<T>::zeroed(&Placement::Gpu(gpu), len)?),
    }
}

fn keep_staging<T: Dtype>(key: StreamKey, buf: FlatBuf<T>) {
    let mut cache = STAGING.lock().unwrap_or_else(|e| e.into_inner());
    cache.push((key, TypeId::of::<T>(), Box::new(buf)));
}

/// Calls `f` with the gradients `tensors` (contiguous, on GPU `d`, in the compute dtype)
/// copied one after the other into a GPU staging buffer, which the gradient stores then add
/// on the GPU. The buffer is kept for the next call.
pub fn with_staged<T: Dtype, R, E: From<NnError>>(
    tensors: &[Tensor],
    d: &CudaDevice,
    f: impl FnOnce(&[T]) -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    let total = tensors.iter().map(|t| t.elem_count()).sum();
    let key = stream_key(d);
    let staged = take_staging::<T>(gpu_for(d), key, total)?;
    let out = copy_into(tensors, d, &staged, f);
    if out.is_err() {
        // copies queued before the failure may still be writing it: a buffer kept while they
        // run could be handed to work that nothing orders after them
        d.cuda_stream().synchronize().map_err(cuda)?;
    }
    keep_staging(key, staged);
    out
}

/// `tensors` copied into the front of `staged`, then `f` of that front.
fn copy_into<T: Dtype, R, E: From<NnError>>(
    tensors: &[Tensor],
    d: &CudaDevice,
    staged: &FlatBuf<T>,
    f: impl FnOnce(&[T]) -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    let total: usize = tensors.iter().map(|t| t.elem_count()).sum();
    let stream = d.cuda_stream();
    let mut at = 0;
    for t in tensors {
        let n = t.elem_count();
        let (storage, layout) = t.storage_and_layout();
        let (Storage::Cuda(cs), Some((a, _))) = (&*storage, layout.contiguous_offsets()) else {
            return Err(NnError::Invalid(
                "a gradient on the GPU that is not a contiguous GPU tensor".into(),
            )
            .into());
        };
        let src = match <T as ds_comm::Element>::DTYPE {
            DType::F32 => address::<f32>(cs, a, &stream)?,
            DType::BF16 => address::<bf16>(cs, a, &stream)?,
            DType::F16 => address::<f16>(cs, a, &stream)?,
        };
        let dst = device_ptr(&staged[at..at + n]);
        let bytes = n * std::mem::size_of::<T>();
        if bytes > 0 {
            // SAFETY: both ranges hold `n` elements of GPU memory; the source's memory is
            // freed on this stream (candle frees asynchronously), so after the copy.
            unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
                .map_err(cuda)?;
        }
        at += n;
    }
    // No wait: the stores read the staged gradients on this stream, by a kernel or by
    // ds-partition's copies (queued on it, then waited for).
    f(&staged[..total])
}

/// The GPU address of element `offset` of a candle storage holding `U`s.
fn address<U: CudaDType>(
    cs: &CudaStorage,
    offset: usize,
    stream: &Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<sys::CUdeviceptr> {
    let slice = cs.as_cuda_slice::<U>()?;
    let (base, _recorded) = slice.device_ptr(stream);
    Ok(base + (offset * std::mem::size_of::<U>()) as sys::CUdeviceptr)
}

fn cuda(e: result::DriverError) -> NnError {
    NnError::Invalid(format!("GPU: {e}"))
}
