//! Where a flat buffer's memory lives: the device-buffer module of DESIGN.md invariant 5.
//!
//! Every long-lived ZeRO buffer (parameters, gradients, the master copy, the optimizer's
//! moments) is a [`FlatBuf`] at a [`Placement`]: host memory (a `Vec`), or, with the `cuda`
//! feature, memory of one GPU. A `FlatBuf` is a `[T]` on both (`Deref`), so every store, the
//! collectives and the CPU fast paths run unchanged on either placement and nothing above this
//! module branches on the device.
//!
//! Note [managed device buffers]: the GPU placement is CUDA managed memory
//! (`cuMemAllocManaged`) advised to live on the GPU (`CU_MEM_ADVISE_SET_PREFERRED_LOCATION`)
//! and zeroed or filled there. Constraint: the host must still be able to read and write every
//! buffer (initialisation, checkpoints, the stores' bookkeeping, a layer's parameters handed to
//! candle), or each of those places would need a device branch. Solution: managed memory has
//! one address valid on the host and on the GPU; a kernel or a copy on the GPU touches it in
//! place, and a host access migrates the pages it touches (correct, and slow on the hot path,
//! which therefore uses device-side operations on the same address). Pros: one code path and
//! one set of tests for both placements; the CPU suite runs the host side. Cons: a host loop
//! over a GPU buffer is silently slow rather than an error; `train`'s device-memory report
//! (the driver's count beside these bytes) is where that shows.

use std::ops::{Deref, DerefMut};

use ds_comm::Element;

use crate::Result;

/// Where a [`FlatBuf`]'s memory lives.
#[derive(Clone, Default)]
pub enum Placement {
    /// Host memory.
    #[default]
    Host,
    /// Memory of one GPU, addressable from the host too (Note [managed device buffers]).
    #[cfg(feature = "cuda")]
    Gpu(std::sync::Arc<cudarc::driver::CudaContext>),
}

impl Placement {
    pub fn is_host(&self) -> bool {
        matches!(self, Placement::Host)
    }
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Host => f.write_str("host"),
            #[cfg(feature = "cuda")]
            Placement::Gpu(ctx) => write!(f, "cuda:{}", ctx.ordinal()),
        }
    }
}

/// A flat buffer of `T` at a [`Placement`]; a `[T]` wherever it lives.
pub struct FlatBuf<T: Element> {
    storage: Storage<T>,
}

enum Storage<T: Element> {
    Host(Vec<T>),
    #[cfg(feature = "cuda")]
    Gpu(gpu::Managed<T>),
}

impl<T: Element> FlatBuf<T> {
    /// `len` zeros at `place`.
    pub fn zeroed(place: &Placement, len: usize) -> Result<FlatBuf<T>> {
        let storage = match place {
            Placement::Host => Storage::Host(vec![T::default(); len]),
            #[cfg(feature = "cuda")]
            Placement::Gpu(ctx) => Storage::Gpu(gpu::Managed::zeroed(ctx, len)?),
        };
        Ok(FlatBuf { storage })
    }

    /// `values` at `place` (moved on the host, copied to the GPU).
    pub fn from_vec(place: &Placement, values: Vec<T>) -> Result<FlatBuf<T>> {
        let storage = match place {
            Placement::Host => Storage::Host(values),
            #[cfg(feature = "cuda")]
            Placement::Gpu(ctx) => Storage::Gpu(gpu::Managed::from_slice(ctx, &values)?),
        };
        Ok(FlatBuf { storage })
    }

    /// An empty host buffer (what a buffer handed elsewhere leaves behind).
    pub fn empty() -> FlatBuf<T> {
        FlatBuf {
            storage: Storage::Host(Vec::new()),
        }
    }

    /// Whether the memory is the host's (false: a GPU's).
    pub fn on_host(&self) -> bool {
        matches!(self.storage, Storage::Host(_))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        std::mem::size_of_val(self.deref())
    }

    /// The values as a host `Vec` (moved when on the host, copied from the GPU).
    pub fn into_vec(self) -> Vec<T> {
        match self.storage {
            Storage::Host(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Gpu(m) => m.to_vec(),
        }
    }

    /// The address kernels and collectives on the GPU use: None on the host.
    #[cfg(feature = "cuda")]
    pub fn device_ptr(&self) -> Option<cudarc::driver::sys::CUdeviceptr> {
        match &self.storage {
            Storage::Host(_) => None,
            Storage::Gpu(m) => Some(m.ptr()),
        }
    }
}

impl<T: Element> Deref for FlatBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Host(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Gpu(m) => m.as_slice(),
        }
    }
}

impl<T: Element> DerefMut for FlatBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Host(v) => v,
            #[cfg(feature = "cuda")]
            Storage::Gpu(m) => m.as_mut_slice(),
        }
    }
}

impl<T: Element> std::fmt::Debug for FlatBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match self.storage {
            Storage::Host(_) => "host",
            #[cfg(feature = "cuda")]
            Storage::Gpu(_) => "gpu",
        };
        write!(f, "FlatBuf({} x {place})", self.len())
    }
}

#[cfg(feature = "cuda")]
fn cuda_error(what: &str, e: cudarc::driver::DriverError) -> crate::PartitionError {
    crate::PartitionError::Invalid(format!("GPU buffer: {what}: {e}"))
}

#[cfg(feature = "cuda")]
mod gpu {
    //! CUDA managed memory holding `len` values of `T` (Note [managed device buffers]).

    use std::marker::PhantomData;
    use std::sync::Arc;

    use cudarc::driver::{result, sys, CudaContext};
    use ds_comm::Element;

    use super::cuda_error;
    use crate::Result;

    pub struct Managed<T: Element> {
        ptr: sys::CUdeviceptr,
        len: usize,
        ctx: Arc<CudaContext>,
        _values: PhantomData<T>,
    }

    // SAFETY: the allocation is owned like a `Vec`'s; `&`/`&mut` access follows Rust's rules
    // through `as_slice`/`as_mut_slice`, and managed memory is valid on any host thread.
    unsafe impl<T: Element> Send for Managed<T> {}
    unsafe impl<T: Element> Sync for Managed<T> {}

    impl<T: Element> Managed<T> {
        pub fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<Managed<T>> {
            let m = Managed::alloc(ctx, len)?;
            if m.bytes() > 0 {
                // SAFETY: `ptr` holds `bytes` bytes; all-zero bits are 0 for f32, bf16 and f16.
                unsafe { result::memset_d8_sync(m.ptr, 0, m.bytes()) }
                    .map_err(|e| cuda_error("zero-fill", e))?;
            }
            Ok(m)
        }

        pub fn from_slice(ctx: &Arc<CudaContext>, values: &[T]) -> Result<Managed<T>> {
            let m = Managed::alloc(ctx, values.len())?;
            if m.bytes() > 0 {
                // SAFETY: `ptr` holds exactly `values.len()` elements of `T`.
                unsafe { result::memcpy_htod_sync(m.ptr, values) }
                    .map_err(|e| cuda_error("copy to the GPU", e))?;
            }
            Ok(m)
        }

        /// A managed allocation preferring the GPU of `ctx` (nothing for `len` 0).
        fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Managed<T>> {
            ctx.bind_to_thread().map_err(|e| cuda_error("bind", e))?;
            let bytes = len * std::mem::size_of::<T>();
            let ptr = match bytes {
                0 => 0,
                _ => {
                    // SAFETY: a fresh allocation of `bytes` bytes, freed in `drop`.
                    let ptr = unsafe {
                        result::malloc_managed(bytes, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL)
                    }
                    .map_err(|e| cuda_error(&format!("allocate {bytes} bytes"), e))?;
                    let gpu = sys::CUmemLocation {
                        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: ctx.ordinal() as i32,
                    };
                    let advise = sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION;
                    // SAFETY: the range is exactly the allocation made above.
                    if let Err(e) = unsafe { result::mem_advise(ptr, bytes, advise, gpu) } {
                        // SAFETY: `ptr` was allocated above and is not used after this.
                        let _ = unsafe { result::free_sync(ptr) };
                        return Err(cuda_error("advise the GPU as its home", e));
                    }
                    ptr
                }
            };
            Ok(Managed {
                ptr,
                len,
                ctx: ctx.clone(),
                _values: PhantomData,
            })
        }

        pub fn ptr(&self) -> sys::CUdeviceptr {
            self.ptr
        }

        fn bytes(&self) -> usize {
            self.len * std::mem::size_of::<T>()
        }

        pub fn as_slice(&self) -> &[T] {
            match self.len {
                0 => &[],
                // SAFETY: managed memory is host-addressable at the same address; it holds
                // `len` initialised values (zeroed or copied in at construction).
                n => unsafe { std::slice::from_raw_parts(self.ptr as *const T, n) },
            }
        }

        pub fn as_mut_slice(&mut self) -> &mut [T] {
            match self.len {
                0 => &mut [],
                // SAFETY: as `as_slice`, and `&mut self` makes the access unique.
                n => unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, n) },
            }
        }

        pub fn to_vec(&self) -> Vec<T> {
            self.as_slice().to_vec()
        }
    }

    impl<T: Element> Drop for Managed<T> {
        fn drop(&mut self) {
            if self.ptr == 0 {
                return;
            }
            // A failure here (a context already torn down at exit) leaks the allocation with
            // the context; there is nothing else to do with it.
            if self.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated in `alloc`, freed once, never used after.
                let _ = unsafe { result::free_sync(self.ptr) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_are_slices_that_own_their_values() {
        let mut z = FlatBuf::<f32>::zeroed(&Placement::Host, 5).unwrap();
        assert_eq!(&*z, &[0.0; 5]);
        z[2] = 3.5;
        assert!(z.on_host());
        assert_eq!(z.bytes(), 20);
        assert_eq!(z.into_vec(), vec![0.0, 0.0, 3.5, 0.0, 0.0]);
        let v = FlatBuf::from_vec(&Placement::Host, vec![half::bf16::ONE; 3]).unwrap();
        assert_eq!(v.bytes(), 6);
        assert_eq!(v.into_vec(), vec![half::bf16::ONE; 3]);
        assert!(FlatBuf::<f32>::empty().is_empty());
    }
}
