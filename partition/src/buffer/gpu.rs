//! The GPU side of the device-buffer module (feature `cuda`): managed allocations, the map
//! from a slice's address to the GPU holding it, and kernels compiled at build time.
//!
//! A `&[T]` of a GPU buffer is an ordinary slice whose address is also a device pointer (Note
//! [managed device buffers]), so code that holds only slices (the stores, `vector`, the
//! engine's optimizer) asks [`gpu_of`] whether it may hand the address to a kernel.

use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaStream, DriverError};

use crate::{PartitionError, Result};

/// One GPU and the stream its buffers' operations run on (the stream the layers compute on,
/// so that copies into and out of the buffers are ordered with the compute without events).
pub struct Gpu {
    stream: Arc<CudaStream>,
    /// PTX modules loaded so far, by name (each loaded once per GPU).
    modules: Mutex<Vec<(&'static str, Arc<Kernels>)>>,
}

impl Gpu {
    pub fn new(stream: Arc<CudaStream>) -> Arc<Gpu> {
        Arc::new(Gpu {
            stream,
            modules: Mutex::new(Vec::new()),
        })
    }

    /// The PTX module `name` (its source `ptx`), loaded on this GPU on first use.
    pub fn kernels(&self, name: &'static str, ptx: &str) -> Result<Arc<Kernels>> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = modules.iter().find(|(n, _)| *n == name) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::load(self, ptx)?);
        modules.push((name, k.clone()));
        Ok(k)
    }

    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Makes this GPU's context the calling thread's (the driver calls below need it).
    fn bind(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_error("bind", e))
    }

    /// Sets `bytes` bytes of GPU memory at `ptr` to zero and waits.
    pub(crate) fn zero_fill(&self, ptr: sys::CUdeviceptr, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the callers pass `bytes` bytes of a live GPU buffer.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda_error("zero-fill", e))?;
        self.sync()
    }

    /// `dst.copy_from_slice(src)` where either side may be a GPU buffer: one DMA transfer,
    /// which leaves managed pages where they are (a host loop would migrate them), queued on
    /// this GPU's stream and waited for. On the stream where the kernels that wrote its source
    /// were queued (e.g. the staged gradients a host bucket reads), so the copy is ordered after
    /// them by the stream itself: a legacy-stream copy would be ordered only through the legacy
    /// stream's implicit synchronisation, which candle's per-thread stream has and a
    /// non-blocking stream has not, and would also wait for every other stream (NCCL's).
    pub(crate) fn copy<T: Copy>(&self, dst: &mut [T], src: &[T]) -> Result<()> {
        self.bind()?;
        let on_gpu = |s: Span| gpu_of(s).is_some();
        let (bytes, stream) = (std::mem::size_of_val(src), self.stream.cu_stream());
        // SAFETY: both slices hold `src.len()` elements (`vector::copy` asserts it); a GPU
        // side is a live buffer of this process; the host side outlives the wait below.
        let copied = unsafe {
            match (on_gpu(Span::of(dst)), on_gpu(Span::of(src))) {
                (true, true) => {
                    result::memcpy_dtod_async(device_ptr(dst), device_ptr(src), bytes, stream)
                }
                (true, false) => result::memcpy_htod_async(device_ptr(dst), src, stream),
                (false, true) => result::memcpy_dtoh_async(dst, device_ptr(src), stream),
                (false, false) => {
                    dst.copy_from_slice(src);
                    return Ok(());
                }
            }
        };
        copied.map_err(|e| cuda_error("copy", e))?;
        self.sync()
    }

    /// `f(at, values)` for each piece of `piece` elements of `src` (GPU memory), copied to the
    /// host in turn: through two page-locked buffers, the copy of the next piece running on the
    /// copy engine while `f` reads this one (pageable memory would make each copy a staged,
    /// synchronous one, and the host would wait for every piece).
    pub(crate) fn stream_down<T: Copy>(
        &self,
        src: &[T],
        piece: usize,
        mut f: impl FnMut(usize, &[T]) -> Result<()>,
    ) -> Result<()> {
        self.bind()?;
        let Some(Staging { pieces, bufs, done }) = Staging::new::<T>(src.len(), piece)? else {
            return Ok(());
        };
        let stream = self.stream.cu_stream();
        let issue = |i: usize| -> Result<()> {
            let r = pieces.range(i);
            // SAFETY: the buffer holds `pieces.len` elements, and nothing reads it until the
            // event after this copy has been waited for; `src` is GPU memory of this process.
            unsafe {
                let host = bufs[i % 2].slice_mut::<T>(r.len());
                result::memcpy_dtoh_async(host, device_ptr(&src[r]), stream)
                    .map_err(|e| cuda_error("copy to the host", e))?;
            }
            done[i % 2].record(stream)
        };
        let streamed = (|| {
            issue(0)?;
            for i in 0..pieces.count {
                if i + 1 < pieces.count {
                    // into the buffer `f` read the piece before this one from
                    issue(i + 1)?;
                }
                done[i % 2].wait()?;
                let r = pieces.range(i);
                // SAFETY: the copy into it has finished (the event); the next one into this
                // buffer is issued only after `f` returns.
                f(r.start, unsafe { bufs[i % 2].slice_mut::<T>(r.len()) })?;
            }
            Ok(())
        })();
        if streamed.is_err() {
            let _ = self.sync(); // a copy still in flight must not outlive its buffer
        }
        streamed
    }

    /// `dst` (GPU memory) written piece by piece from the host: `fill(at, values)` writes each
    /// piece of `piece` elements into one of two page-locked buffers while the piece before
    /// is copied up from the other. Waits for the last copy.
    pub(crate) fn stream_up<T: Copy>(
        &self,
        dst: &mut [T],
        piece: usize,
        mut fill: impl FnMut(usize, &mut [T]),
    ) -> Result<()> {
        self.bind()?;
        let Some(Staging { pieces, bufs, done }) = Staging::new::<T>(dst.len(), piece)? else {
            return Ok(());
        };
        let stream = self.stream.cu_stream();
        let streamed = (|| {
            for i in 0..pieces.count {
                if i >= 2 {
                    done[i % 2].wait()?; // the copy out of this buffer, two pieces ago
                }
                let r = pieces.range(i);
                // SAFETY: no copy reads the buffer now (waited above); the copy below reads it
                // until its event, which is waited for before the buffer is written again.
                unsafe {
                    let host = bufs[i % 2].slice_mut::<T>(r.len());
                    fill(r.start, host);
                    result::memcpy_htod_async(device_ptr(&dst[r]), host, stream)
                        .map_err(|e| cuda_error("copy to the GPU", e))?;
                }
                done[i % 2].record(stream)?;
            }
            Ok(())
        })();
        let waited = self.sync();
        streamed.and(waited)
    }

    /// Waits for everything queued on the stream.
    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| cuda_error("wait", e))
    }

    /// ds-partition's own kernels (kernels/vector.cu).
    pub(crate) fn vector_kernels(&self) -> Result<Arc<Kernels>> {
        self.kernels("vector", VECTOR_PTX)
    }
}

/// `n` elements cut into pieces of at most `len` (the last one shorter).
struct Pieces {
    n: usize,
    len: usize,
    count: usize,
}

impl Pieces {
    fn of(n: usize, piece: usize) -> Pieces {
        let len = piece.max(1).min(n.max(1));
        Pieces {
            n,
            len,
            count: n.div_ceil(len),
        }
    }

    fn range(&self, i: usize) -> std::ops::Range<usize> {
        let at = i * self.len;
        at..(at + self.len).min(self.n)
    }
}

/// What a transfer in pieces goes through: two page-locked buffers of a piece each, and the
/// events marking the copies in and out of them.
struct Staging {
    pieces: Pieces,
    bufs: [Pinned; 2],
    done: [Event; 2],
}

impl Staging {
    /// For `n` elements of `T` in pieces of `piece`; None for no elements. The GPU's context
    /// must be current.
    fn new<T>(n: usize, piece: usize) -> Result<Option<Staging>> {
        let pieces = Pieces::of(n, piece);
        if pieces.count == 0 {
            return Ok(None);
        }
        Ok(Some(Staging {
            bufs: [Pinned::new::<T>(pieces.len)?, Pinned::new::<T>(pieces.len)?],
            done: [Event::new()?, Event::new()?],
            pieces,
        }))
    }
}

/// Page-locked host memory: the copy engines move it while the host computes (a copy from
/// pageable memory goes through the driver's staging and returns when done).
struct Pinned {
    ptr: *mut c_void,
}

impl Pinned {
    /// Room for `len` values of `T` (page-aligned, so aligned for any `T` here).
    fn new<T>(len: usize) -> Result<Pinned> {
        // SAFETY: a fresh allocation, freed in `drop`; read only after a copy wrote it.
        let ptr = unsafe { result::malloc_host(len * std::mem::size_of::<T>(), 0) }
            .map_err(|e| cuda_error("page-locked host memory", e))?;
        Ok(Pinned { ptr })
    }

    /// The first `len` values.
    ///
    /// # Safety
    /// `len` within the allocation; no copy in flight writes what is read through it, and no
    /// other slice of the buffer is alive.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<T>(&self, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.ptr.cast::<T>(), len)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: from `malloc_host`; every copy using it was waited for by its owner.
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

/// A CUDA event marking a point of a stream.
struct Event(sys::CUevent);

impl Event {
    fn new() -> Result<Event> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(|e| cuda_error("event", e))
    }

    /// Marks the point the stream has reached (everything queued on it so far).
    fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live event; the stream is this GPU's.
        unsafe { result::event::record(self.0, stream) }.map_err(|e| cuda_error("event", e))
    }

    /// Waits until the stream has passed the recorded point.
    fn wait(&self) -> Result<()> {
        // SAFETY: a live event.
        unsafe { result::event::synchronize(self.0) }.map_err(|e| cuda_error("wait", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once (the driver defers it past pending work).
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// kernels/vector.cu as PTX (build.rs runs nvcc).
const VECTOR_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/vector.ptx"));

/// A PTX module loaded on one GPU, its functions found by name.
pub struct Kernels {
    module: sys::CUmodule,
}

// SAFETY: a CUmodule is a handle the driver lets any thread use.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

/// Threads per block of every launch here (vector.cu's reductions size shared memory for it).
pub const BLOCK: u32 = 256;

impl Kernels {
    /// Loads `ptx` (the driver compiles it for the GPU at hand).
    pub fn load(gpu: &Gpu, ptx: &str) -> Result<Kernels> {
        gpu.bind()?;
        let src =
            CString::new(ptx).map_err(|_| PartitionError::Invalid("PTX with a NUL".into()))?;
        // SAFETY: `src` is a NUL-terminated PTX image that outlives the call.
        let module = unsafe { result::module::load_data(src.as_ptr() as *const c_void) }
            .map_err(|e| cuda_error("load kernels", e))?;
        Ok(Kernels { module })
    }

    /// Launches `name` over `n` elements on `gpu`'s stream (a grid-stride loop: at most 4096
    /// blocks of [`BLOCK`] threads) and waits for it. `args` point at the kernel's arguments.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and type, and every pointer among
    /// them must be valid on the GPU for what the kernel touches.
    pub unsafe fn launch(
        &self,
        gpu: &Gpu,
        name: &str,
        n: usize,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        gpu.bind()?;
        let cname = CString::new(name).expect("kernel names have no NUL");
        let f = result::module::get_function(self.module, cname)
            .map_err(|e| cuda_error(&format!("kernel {name}"), e))?;
        let blocks = n.div_ceil(BLOCK as usize).min(4096) as u32;
        result::launch_kernel(
            f,
            (blocks, 1, 1),
            (BLOCK, 1, 1),
            0,
            gpu.stream.cu_stream(),
            args,
        )
        .map_err(|e| cuda_error(&format!("launch {name}"), e))?;
        gpu.sync()
    }
}

/// Where a slice lies: its address and length in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    addr: usize,
    bytes: usize,
}

impl Span {
    pub fn of<T>(s: &[T]) -> Span {
        Span {
            addr: s.as_ptr() as usize,
            bytes: std::mem::size_of_val(s),
        }
    }
}

/// The GPU holding all of `s`, when `s` lies in one of this process's GPU buffers (None for
/// an empty slice or host memory).
pub fn gpu_of(s: Span) -> Option<Arc<Gpu>> {
    if s.bytes == 0 {
        return None;
    }
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    let (_, (region_end, gpu)) = live.range(..=s.addr).next_back()?;
    (s.addr + s.bytes <= *region_end).then(|| gpu.clone())
}

/// The GPU holding every non-empty one of `spans`, when they all lie in the same GPU's
/// buffers and not all are empty: then a kernel may take their addresses. Buffers of one GPU
/// made through different `Gpu` values (streams) are the same memory, hence the ordinals.
pub fn one_gpu(spans: &[Span]) -> Option<Arc<Gpu>> {
    let mut found: Option<Arc<Gpu>> = None;
    for s in spans.iter().filter(|s| s.bytes > 0) {
        let g = gpu_of(*s)?;
        match &found {
            Some(f) if f.ordinal() != g.ordinal() => return None,
            Some(_) => {}
            None => found = Some(g),
        }
    }
    found
}

/// The device address of a slice of a GPU buffer ([`one_gpu`]).
pub fn device_ptr<T>(s: &[T]) -> sys::CUdeviceptr {
    s.as_ptr() as sys::CUdeviceptr
}

/// The kernel-name suffix of a dtype (`accumulate_bf16`, `adam_f16`, ...).
pub fn suffix(dtype: ds_comm::DType) -> &'static str {
    match dtype {
        ds_comm::DType::F32 => "f32",
        ds_comm::DType::BF16 => "bf16",
        ds_comm::DType::F16 => "f16",
    }
}

/// A kernel argument for [`Kernels::launch`]: a pointer to the value.
pub fn arg<A>(a: &mut A) -> *mut c_void {
    a as *mut A as *mut c_void
}

/// Live managed allocations: start address -> (end address, GPU).
static LIVE: Mutex<BTreeMap<usize, (usize, Arc<Gpu>)>> = Mutex::new(BTreeMap::new());

/// Bytes of the managed allocations now live on GPU `ordinal` (this process's ZeRO buffers and
/// staging): memory the device's stream-ordered pool, where candle allocates, does not count.
pub fn managed_bytes(ordinal: usize) -> u64 {
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.iter()
        .filter(|(_, (_, gpu))| gpu.ordinal() == ordinal)
        .map(|(start, (end, _))| (end - start) as u64)
        .sum()
}

/// CUDA managed memory holding `len` values of `T` (Note [managed device buffers]): plain
/// numbers whose all-zero bits are 0 (ds-comm's elements, and f64 for reductions).
pub(crate) struct Managed<T: Copy> {
    ptr: sys::CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
    _values: PhantomData<T>,
}

// SAFETY: the allocation is owned like a `Vec`'s; `&`/`&mut` access follows Rust's rules
// through `as_slice`/`as_mut_slice`, and managed memory is valid on any host thread.
unsafe impl<T: Copy> Send for Managed<T> {}
unsafe impl<T: Copy> Sync for Managed<T> {}

impl<T: Copy> Managed<T> {
    pub fn zeroed(gpu: &Arc<Gpu>, len: usize) -> Result<Managed<T>> {
        let m = Managed::alloc(gpu, len)?;
        gpu.zero_fill(m.ptr, m.bytes())?; // all-zero bits are 0 in every T held here
        Ok(m)
    }

    pub fn from_slice(gpu: &Arc<Gpu>, values: &[T]) -> Result<Managed<T>> {
        let mut m = Managed::alloc(gpu, values.len())?;
        m.as_mut_slice().copy_from_slice(values);
        m.settle()?;
        Ok(m)
    }

    /// The GPU the memory prefers.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Moves the pages to the GPU after host writes, in one transfer, so that the first kernel
    /// does not fault them over one by one.
    pub fn settle(&self) -> Result<()> {
        if self.ptr == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let home = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.gpu.ordinal() as i32,
        };
        let stream = self.gpu.stream.cu_stream();
        // SAFETY: the range is exactly this allocation.
        unsafe { result::mem_prefetch_async(self.ptr, self.bytes(), home, stream) }
            .map_err(|e| cuda_error("move to the GPU", e))?;
        self.gpu.sync()
    }

    /// Waits for everything queued on the buffer's stream (`FlatBuf::wait_for_readers`).
    pub fn wait_for_readers(&self) -> Result<()> {
        self.gpu.bind()?;
        self.gpu.sync()
    }

    /// A managed allocation preferring `gpu` (nothing for `len` 0), in the live map.
    fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<Managed<T>> {
        let ctx = gpu.stream.context();
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
                let home = sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: ctx.ordinal() as i32,
                };
                let advise = sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION;
                // SAFETY: the range is exactly the allocation made above.
                if let Err(e) = unsafe { result::mem_advise(ptr, bytes, advise, home) } {
                    // SAFETY: `ptr` was allocated above and is not used after this.
                    let _ = unsafe { result::free_sync(ptr) };
                    return Err(cuda_error("advise the GPU as its home", e));
                }
                let start = ptr as usize;
                let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
                live.insert(start, (start + bytes, gpu.clone()));
                ptr
            }
        };
        Ok(Managed {
            ptr,
            len,
            gpu: gpu.clone(),
            _values: PhantomData,
        })
    }

    fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    pub fn as_slice(&self) -> &[T] {
        match self.len {
            0 => &[],
            // SAFETY: managed memory is host-addressable at the same address; it holds `len`
            // initialised values (zeroed or copied in at construction).
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

impl<T: Copy> Drop for Managed<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.ptr as usize));
        // The context is made current directly: cudarc's `bind_to_thread` first returns (and
        // clears) any error an earlier drop of candle's recorded, which would skip the free.
        // A failure here (a context already torn down at exit) leaks the allocation with the
        // context; there is nothing else to do with it.
        let ctx = self.gpu.stream.context().cu_ctx();
        // SAFETY: the context outlives its buffers (the `Gpu` holds its stream); the stream
        // wait lets a copy still reading the buffer (a gathered layer's, into its tensor)
        // finish before the free, which cuMemFree does not promise to wait for.
        unsafe {
            if result::ctx::set_current(ctx).is_ok()
                && result::stream::synchronize(self.gpu.stream.cu_stream()).is_ok()
            {
                // allocated in `alloc`, freed once, never used after
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

fn cuda_error(what: &str, e: DriverError) -> PartitionError {
    PartitionError::Invalid(format!("GPU buffer: {what}: {e}"))
}
