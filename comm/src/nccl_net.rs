//! `--dist_backend nccl`: a group's collectives on GPU memory run as NCCL's, on each group's own
//! NCCL communicator; everything else (host buffers, point to point, barriers) keeps to the
//! built-in links, which also carry each communicator's unique id when the group first needs
//! one (torch.distributed's NCCL groups bootstrap through its store the same way).
//!
//! Note [ordering NCCL with compute]: a communicator runs on its own stream, forked from the
//! GPU's default stream (`NcclComm::from_stream`), and every collective here is waited for
//! (`NcclComm::synchronize`, bounded by the job's timeout) before it returns. The buffers it
//! reads were written by work the writer already waited for (ds-partition's GPU loops and
//! copies wait for their stream), and what reads its result comes after the wait, so the comm
//! stream needs no event against any compute stream; an `_async` collective waits on
//! ds-comm's worker thread, so compute overlaps it as with the built-in transport.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{
    result, sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use half::{bf16, f16};

use crate::algo::{self, Ctx};
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::nccl::{NcclComm, NcclElement, NcclError, UNIQUE_ID_BYTES};

/// Runs `$body` with `$u` the NCCL element type of `$t`'s dtype (the same bits).
macro_rules! as_nccl {
    ($t:ty, $u:ident => $body:expr) => {
        match <$t as Element>::DTYPE {
            DType::F32 => {
                type $u = f32;
                $body
            }
            DType::BF16 => {
                type $u = bf16;
                $body
            }
            DType::F16 => {
                type $u = f16;
                $body
            }
        }
        .map_err(nccl)
    };
}

/// One rank's NCCL side: its GPU, and a communicator per group that has moved GPU memory.
pub(crate) struct NcclNet {
    parent: Arc<CudaStream>,
    timeout: Duration,
    /// By the group's global ranks, in order.
    comms: Mutex<Vec<(Vec<usize>, NcclComm)>>,
}

impl NcclNet {
    /// NCCL on GPU `ordinal` (this rank's; the primary context candle uses too).
    pub fn new(ordinal: usize, timeout: Duration) -> Result<NcclNet> {
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| CommError::Env(format!("dist_backend nccl: GPU cuda:{ordinal}: {e}")))?;
        Ok(NcclNet {
            parent: ctx.default_stream(),
            timeout,
            comms: Mutex::new(Vec::new()),
        })
    }

    /// Runs `f` on the group's communicator, made at its first GPU collective: group rank 0
    /// makes the unique id and broadcasts it over the links; every member then joins
    /// (collective). Then waits for the comm stream (Note [ordering NCCL with compute]).
    fn with_comm(&self, cx: &mut Ctx, f: impl FnOnce(&NcclComm) -> Result<()>) -> Result<()> {
        let mut comms = self.comms.lock().unwrap_or_else(|e| e.into_inner());
        let at = match comms.iter().position(|(r, _)| r.as_slice() == cx.ranks) {
            Some(at) => at,
            None => {
                let comm = self.join(cx)?;
                comms.push((cx.ranks.to_vec(), comm));
                comms.len() - 1
            }
        };
        let comm = &comms[at].1;
        f(comm)?;
        comm.synchronize().map_err(nccl)
    }

    fn join(&self, cx: &mut Ctx) -> Result<NcclComm> {
        let mut id = [0f32; UNIQUE_ID_BYTES / 4];
        if cx.me == 0 {
            let made = NcclComm::unique_id().map_err(nccl)?;
            bytemuck::cast_slice_mut::<f32, u8>(&mut id).copy_from_slice(&made);
        }
        // a move of bits, no arithmetic: any pattern arrives as sent
        algo::broadcast(cx, &mut id, 0)?;
        let id: &[u8] = bytemuck::cast_slice(&id);
        NcclComm::from_stream(&self.parent, id, cx.me, cx.ranks.len(), self.timeout).map_err(nccl)
    }

    /// Whether `s` is GPU memory (asked with this GPU's context current, as on a worker
    /// thread it may not be). The context is made current directly: cudarc's `bind_to_thread`
    /// first returns (and clears) any error an earlier drop recorded, and reading that as
    /// "host memory" would send this rank to the links while its peers are in NCCL.
    fn on_gpu<T>(&self, s: &[T]) -> Result<bool> {
        // SAFETY: the context lives as long as `parent`, its stream.
        unsafe { result::ctx::set_current(self.parent.context().cu_ctx()) }.map_err(|e| {
            CommError::Invalid(format!("NCCL: making the GPU's context current: {e}"))
        })?;
        Ok(is_gpu_memory(s))
    }

    pub fn all_reduce<T: Element>(&self, cx: &mut Ctx, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if !self.on_gpu(buf)? {
            return algo::all_reduce(cx, buf, op);
        }
        self.with_comm(
            cx,
            |comm| as_nccl!(T, U => comm.all_reduce(&mut Region::<U>::of(buf, comm), op)),
        )
    }

    pub fn reduce_scatter_into<T: Element>(
        &self,
        cx: &mut Ctx,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        if !(self.on_gpu(input)? && self.on_gpu(output)?) {
            return algo::reduce_scatter_into(cx, input, output, op);
        }
        self.with_comm(cx, |comm| {
            as_nccl!(T, U => comm.reduce_scatter(
                &Region::<U>::of(input, comm),
                &mut Region::<U>::of(output, comm),
                op
            ))
        })
    }

    /// Uneven parts: one in-place `ncclReduce` per part onto its owner (NCCL has no `_v`
    /// collectives); a part's owner ends with it reduced, the others' copies are left as
    /// they were, which is all `reduce_scatter_v` promises.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        cx: &mut Ctx,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        if !self.on_gpu(buf)? {
            return algo::reduce_scatter_v(cx, buf, counts, op);
        }
        self.with_comm(cx, |comm| {
            per_owner(buf, counts, |owner, part| {
                as_nccl!(T, U => comm.reduce(&mut Region::<U>::of(part, comm), op, owner))
            })
        })
    }

    /// Uneven parts: one `ncclBroadcast` per part from its owner.
    pub fn all_gather_v<T: Element>(
        &self,
        cx: &mut Ctx,
        buf: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        if !self.on_gpu(buf)? {
            return algo::all_gather_v(cx, buf, counts);
        }
        self.with_comm(cx, |comm| {
            per_owner(buf, counts, |owner, part| {
                as_nccl!(T, U => comm.broadcast(&mut Region::<U>::of(part, comm), owner))
            })
        })
    }

    pub fn broadcast<T: Element>(&self, cx: &mut Ctx, buf: &mut [T], root: usize) -> Result<()> {
        if !self.on_gpu(buf)? {
            return algo::broadcast(cx, buf, root);
        }
        self.with_comm(
            cx,
            |comm| as_nccl!(T, U => comm.broadcast(&mut Region::<U>::of(buf, comm), root)),
        )
    }
}

/// A slice of GPU-addressable memory as cudarc's device-pointer traits take it, read as `U`
/// (an element type of the same size and bits). Its pointers carry no event: the callers wait
/// for the comm stream themselves (Note [ordering NCCL with compute]).
struct Region<'a, U> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _values: PhantomData<&'a [U]>,
}

impl<'a, U: NcclElement> Region<'a, U> {
    /// `s` (elements of a type of `U`'s size) on `comm`'s stream. Taking `&[T]` for writes too
    /// is sound only because NCCL writes through the device address, never through `s`, and
    /// the caller holds the `&mut` the write belongs to until the comm stream is done.
    fn of<T: Element>(s: &[T], comm: &'a NcclComm) -> Region<'a, U> {
        debug_assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<U>());
        Region {
            ptr: s.as_ptr() as sys::CUdeviceptr,
            len: s.len(),
            stream: comm.stream(),
            _values: PhantomData,
        }
    }
}

impl<U> DeviceSlice<U> for Region<'_, U> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<U> DevicePtr<U> for Region<'_, U> {
    fn device_ptr<'b>(&'b self, _stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<U> DevicePtrMut<U> for Region<'_, U> {
    fn device_ptr_mut<'b>(
        &'b mut self,
        _stream: &'b CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// Calls `f(owner, part)` for each rank's non-empty part of `buf` (`counts[owner]` elements).
fn per_owner<T>(
    buf: &[T],
    counts: &[usize],
    mut f: impl FnMut(usize, &[T]) -> Result<()>,
) -> Result<()> {
    for (owner, part) in algo::ranges(counts).into_iter().enumerate() {
        if !part.is_empty() {
            f(owner, &buf[part])?;
        }
    }
    Ok(())
}

/// Whether `s` is memory a GPU kernel can address: CUDA managed memory (ds-partition's GPU
/// buffers) or device memory. Host memory, and anything the driver does not know, is not.
fn is_gpu_memory<T>(s: &[T]) -> bool {
    use sys::CUpointer_attribute::{
        CU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    };
    let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    !s.is_empty()
        && (pointer_attribute(s, CU_POINTER_ATTRIBUTE_IS_MANAGED).is_some_and(|m| m != 0)
            || pointer_attribute(s, CU_POINTER_ATTRIBUTE_MEMORY_TYPE) == Some(device))
}

/// An unsigned-int attribute of the memory at `s` (None where the driver does not know it).
fn pointer_attribute<T>(s: &[T], attribute: sys::CUpointer_attribute) -> Option<u32> {
    let mut value: u32 = 0;
    // SAFETY: `value` is a valid out-pointer for an unsigned-int attribute (both asked here
    // are); the query only reads the driver's tables.
    let status = unsafe {
        sys::cuPointerGetAttribute(
            &mut value as *mut u32 as *mut c_void,
            attribute,
            s.as_ptr() as sys::CUdeviceptr,
        )
    };
    (status == sys::CUresult::CUDA_SUCCESS).then_some(value)
}

fn nccl(e: NcclError) -> CommError {
    CommError::Invalid(e.to_string())
}
