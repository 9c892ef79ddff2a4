//! Where a flat buffer's memory lives: the device-buffer module of ARCHITECTURE.md invariant 5.
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
//! over a GPU buffer is silently slow rather than an error, so the loops of a step go through
//! `vector` (and the engine's optimizer), which run them as kernels where the memory is a GPU's.
//!
//! Every GPU operation here runs on the stream the layers compute on (the `Gpu` the placement
//! was made with) and is waited for before it returns, so host code that reads a buffer next
//! never races a kernel.

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
    Gpu(std::sync::Arc<gpu::Gpu>),
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
            Placement::Gpu(gpu) => write!(f, "cuda:{}", gpu.ordinal()),
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
            Placement::Gpu(gpu) => Storage::Gpu(gpu::Managed::zeroed(gpu, len)?),
        };
        Ok(FlatBuf { storage })
    }

    /// `values` at `place` (moved on the host, copied to the GPU).
    pub fn from_vec(place: &Placement, values: Vec<T>) -> Result<FlatBuf<T>> {
        let storage = match place {
            Placement::Host => Storage::Host(values),
            #[cfg(feature = "cuda")]
            Placement::Gpu(gpu) => Storage::Gpu(gpu::Managed::from_slice(gpu, &values)?),
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

    /// Where the memory lives.
    pub fn placement(&self) -> Placement {
        match &self.storage {
            Storage::Host(_) => Placement::Host,
            #[cfg(feature = "cuda")]
            Storage::Gpu(m) => Placement::Gpu(m.gpu().clone()),
        }
    }

    /// After writes from the host: moves a GPU buffer's pages to the GPU in one transfer
    /// (nothing on the host).
    pub fn settle(&self) -> Result<()> {
        match &self.storage {
            Storage::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Storage::Gpu(m) => m.settle(),
        }
    }

    /// Before a kept buffer is written again: waits for the GPU work queued on its stream,
    /// which may still read it (a layer's tensor copied out of it). Nothing on the host.
    pub fn wait_for_readers(&self) -> Result<()> {
        match &self.storage {
            Storage::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Storage::Gpu(m) => m.wait_for_readers(),
        }
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
pub mod gpu;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_are_slices_that_own_their_values() {
        let mut z = FlatBuf::<f32>::zeroed(&Placement::Host, 5).unwrap();
        assert_eq!(&*z, &[0.0; 5]);
        z[2] = 3.5;
        assert!(z.on_host() && z.placement().is_host());
        assert_eq!(z.bytes(), 20);
        assert_eq!(z.into_vec(), vec![0.0, 0.0, 3.5, 0.0, 0.0]);
        let v = FlatBuf::from_vec(&Placement::Host, vec![half::bf16::ONE; 3]).unwrap();
        assert_eq!(v.bytes(), 6);
        assert_eq!(v.into_vec(), vec![half::bf16::ONE; 3]);
        assert!(FlatBuf::<f32>::empty().is_empty());
    }
}
