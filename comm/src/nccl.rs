//! NCCL backend: one rank of an NCCL communicator on one CUDA device.
//!
//! Why long: every NCCL call of a collective, its stream, its abort on timeout and its error
//! mapping, as one unsafe boundary kept in one place.
//!
//! Built on cudarc's `nccl::result`/`nccl::sys` layer rather than its safe `Comm`, because `Comm`
//! keeps the raw communicator private (so `ncclCommGetAsyncError` cannot be reached), only
//! creates blocking communicators, and panics in `Drop` if `ncclCommAbort` fails.
//!
//! # Ordering with compute
//!
//! The communicator runs on its own stream, forked from the stream it is created from, so
//! collectives overlap with compute queued there. Two ways keep the streams in order:
//!
//! * cudarc's event tracking (on by default; candle leaves it on). Each `CudaSlice` records its
//!   last read and write, and the collectives here take device pointers through
//!   `DevicePtr`/`DevicePtrMut` on the communicator's stream. So a collective waits for the
//!   kernels that wrote its input, and later compute waits for the collective that wrote its
//!   buffer. cudarc only does this for buffers of the same `CudaContext` object as the forked
//!   stream: with candle tensors, build the communicator with
//!   `NcclComm::from_stream(&cuda_device.cuda_stream(), ..)` rather than [`NcclComm::new`].
//! * By hand, when tracking is off (`CudaContext::disable_event_tracking`): call
//!   `comm.wait_for(&compute)` before a collective, `compute.wait(&comm.record_event()?)` before
//!   compute reads its result, and keep the buffers alive until the comm stream is done with them.
//!
//! # Failures and timeouts
//!
//! NCCL blocks forever when a peer dies or the ranks issue different collectives. The
//! communicator is therefore created in NCCL's non-blocking mode, and every wait here (init,
//! [`NcclComm::synchronize`], [`NcclComm::barrier`], teardown) polls `ncclCommGetAsyncError`
//! against the timeout. On an asynchronous error or a timeout the communicator is aborted with
//! `ncclCommAbort`, which also stops its kernels still spinning on the GPU; after that every call
//! returns [`NcclError::Aborted`] and the job has to build a new communicator.
//! Collectives themselves only queue work, so a hang shows up at the next wait: a caller that
//! waits on the results some other way (for example a blocking copy to the host on the compute
//! stream) is not covered, so call `synchronize` first.
//!
//! # Linking
//!
//! With `--features nccl` alone cudarc opens libcuda and libnccl at run time and panics if they
//! are missing; it looks for `libnccl.so` (not `libnccl.so.2`, the name pip's nvidia-nccl
//! wheels ship). With candle's `cuda` feature on, cudarc links them instead.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    DriverError,
};
use cudarc::nccl::result::{self, NcclStatus};
use cudarc::nccl::{sys, NcclType};

use crate::{Element, ReduceOp};

/// Size of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;
const _: () = assert!(UNIQUE_ID_BYTES == std::mem::size_of::<sys::ncclUniqueId>());

/// How long [`NcclComm::new`] lets an NCCL wait run before aborting: torch.distributed's
/// default process-group timeout, which DeepSpeed uses.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Polling in short waits (enqueue, small collectives) yields the thread; past this it sleeps.
const SPIN_FOR: Duration = Duration::from_millis(1);
const POLL_SLEEP: Duration = Duration::from_micros(50);

/// Element types NCCL can move: ds-comm's elements that cudarc maps to an NCCL data type.
pub trait NcclElement: Element + NcclType + DeviceRepr {}
impl<T: Element + NcclType + DeviceRepr> NcclElement for T {}

#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// NCCL reported an error, either from the call or later through `ncclCommGetAsyncError`.
    #[error("NCCL {op} failed on rank {rank}: {code:?}: {message}")]
    Nccl {
        op: &'static str,
        rank: usize,
        code: sys::ncclResult_t,
        message: String,
    },
    #[error("NCCL {op} on rank {rank}: CUDA error: {source}")]
    Cuda {
        op: &'static str,
        rank: usize,
        #[source]
        source: DriverError,
    },
    #[error("NCCL {op} on rank {rank}: {what} has length {actual}, expected {expected}")]
    Length {
        op: &'static str,
        rank: usize,
        what: &'static str,
        actual: usize,
        expected: usize,
    },
    #[error("NCCL {op} on rank {rank}: invalid {what} {value} for world size {world}")]
    Rank {
        op: &'static str,
        rank: usize,
        what: &'static str,
        value: usize,
        world: usize,
    },
    #[error("NCCL {op} on rank {rank}: buffer is on CUDA device {buffer}, communicator on {comm}")]
    Device {
        op: &'static str,
        rank: usize,
        buffer: usize,
        comm: usize,
    },
    #[error("NCCL {op} on rank {rank} did not finish within {timeout:?} (a peer may have died or issued a different collective); communicator aborted")]
    Timeout {
        op: &'static str,
        rank: usize,
        timeout: Duration,
    },
    #[error("NCCL {op} on rank {rank}: the communicator was aborted earlier and must be rebuilt")]
    Aborted { op: &'static str, rank: usize },
}

/// One rank of an NCCL communicator on one CUDA device.
///
/// `Send` but not `Sync`: NCCL lets a communicator move between threads but not be used by two
/// at once.
#[derive(Debug)]
pub struct NcclComm {
    /// Null once aborted: NCCL frees the communicator, so it must never be passed to NCCL again.
    comm: Cell<sys::ncclComm_t>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

// SAFETY: NCCL communicators may be used from any thread as long as calls on one are not
// concurrent; the `Cell` keeps `NcclComm` from being `Sync`, so they cannot be.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// A fresh NCCL unique id as bytes (rank 0 creates it and shares it through the job's store).
    pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], NcclError> {
        let id = result::get_uniqueid()
            .map_err(|e| Self::error(ptr::null_mut(), "unique_id", 0, e.0))?;
        Ok(id.internal.map(|c| c.to_ne_bytes()[0]))
    }

    /// Join the communicator: `rank` of `world`, on CUDA device `ordinal`, with the id rank 0
    /// made. The stream is forked from the device's default stream; see the module docs for why
    /// candle users want [`NcclComm::from_stream`]. Waits at most [`DEFAULT_TIMEOUT`].
    pub fn new(id: &[u8], rank: usize, world: usize, ordinal: usize) -> Result<Self, NcclError> {
        let ctx = CudaContext::new(ordinal).map_err(|source| NcclError::Cuda {
            op: "init",
            rank,
            source,
        })?;
        Self::from_stream(&ctx.default_stream(), id, rank, world, DEFAULT_TIMEOUT)
    }

    /// Join the communicator on the device of `parent` (a stream of a primary context, as
    /// candle's are), with a stream forked from `parent`. `timeout` bounds every wait on this
    /// communicator, this one included.
    pub fn from_stream(
        parent: &Arc<CudaStream>,
        id: &[u8],
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        const OP: &str = "init";
        let id = parse_id(id, rank)?;
        let c_world = to_c_int(OP, rank, world, "world size", world)?;
        let c_rank = rank_in(OP, rank, world, "rank", rank)?;
        let cuda = |source| NcclError::Cuda {
            op: OP,
            rank,
            source,
        };
        let stream = parent.fork().map_err(cuda)?;
        // NCCL takes the device from the thread's current context.
        stream.context().bind_to_thread().map_err(cuda)?;
        let mut config = nonblocking_config();
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` and `config` are valid for the call; `config` was built like
        // NCCL_CONFIG_INITIALIZER for the struct layout of the NCCL version cudarc binds.
        let status =
            unsafe { result::comm_init_rank_config(&mut raw, c_world, id, c_rank, &mut config) };
        // Owning `raw` from here on lets Drop free it on every error path below.
        let comm = Self {
            comm: Cell::new(raw),
            stream,
            rank,
            world,
            timeout,
        };
        comm.finish(OP, status)?;
        Ok(comm)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.world
    }

    /// The CUDA device the communicator runs on.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The communicator's own stream, on which every collective is queued.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// In-place all-reduce of `buf` across all ranks.
    pub fn all_reduce<T: NcclElement>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        const OP: &str = "all_reduce";
        self.check_device(OP, buf)?;
        let count = buf.len();
        if count == 0 {
            return Ok(());
        }
        let (ptr, _written) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` holds `count` elements of `T` on this device and stays alive and ordered
        // by cudarc's events until `_written` records the write; NCCL allows in-place all-reduce.
        self.issue(OP, |comm, stream| unsafe {
            result::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                T::as_nccl_type(),
                nccl_op(op),
                comm,
                stream,
            )
        })
    }

    /// Reduces `input` across ranks and leaves block `rank` of the result in `output`;
    /// `input` must hold `world * output.len()` elements.
    pub fn reduce_scatter<T: NcclElement>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<(), NcclError> {
        const OP: &str = "reduce_scatter";
        self.check_device(OP, input)?;
        self.check_device(OP, output)?;
        let count = output.len();
        expect_len(
            OP,
            self.rank,
            "input",
            input.len(),
            count.checked_mul(self.world),
        )?;
        if count == 0 {
            return Ok(());
        }
        let (src, _read) = input.device_ptr(&self.stream);
        let (dst, _written) = output.device_ptr_mut(&self.stream);
        // SAFETY: `src` holds `world * count` and `dst` `count` elements of `T` on this device,
        // both kept alive and ordered by cudarc's events until the guards drop.
        self.issue(OP, |comm, stream| unsafe {
            result::reduce_scatter(
                src as *const c_void,
                dst as *mut c_void,
                count,
                T::as_nccl_type(),
                nccl_op(op),
                comm,
                stream,
            )
        })
    }

    /// Concatenates every rank's `input`, in rank order, into `output`; `output` must hold
    /// `world * input.len()` elements.
    pub fn all_gather<T: NcclElement>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        const OP: &str = "all_gather";
        self.check_device(OP, input)?;
        self.check_device(OP, output)?;
        let count = input.len();
        expect_len(
            OP,
            self.rank,
            "output",
            output.len(),
            count.checked_mul(self.world),
        )?;
        if count == 0 {
            return Ok(());
        }
        let (src, _read) = input.device_ptr(&self.stream);
        let (dst, _written) = output.device_ptr_mut(&self.stream);
        // SAFETY: `src` holds `count` and `dst` `world * count` elements of `T` on this device,
        // both kept alive and ordered by cudarc's events until the guards drop.
        self.issue(OP, |comm, stream| unsafe {
            result::all_gather(
                src as *const c_void,
                dst as *mut c_void,
                count,
                T::as_nccl_type(),
                comm,
                stream,
            )
        })
    }

    /// In place: `buf` of rank `root` becomes the reduction of every rank's `buf`; the other
    /// ranks' are left as they were.
    pub fn reduce<T: NcclElement>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), NcclError> {
        // SAFETY (of the call): NCCL allows in-place reduce.
        self.rooted(
            "reduce",
            buf,
            root,
            |ptr, count, root, comm, stream| unsafe {
                result::reduce(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    count,
                    T::as_nccl_type(),
                    nccl_op(op),
                    root,
                    comm,
                    stream,
                )
            },
        )
    }

    /// Copies `buf` of rank `root` into `buf` of every other rank.
    pub fn broadcast<T: NcclElement>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<(), NcclError> {
        // SAFETY (of the call): NCCL allows in-place broadcast.
        self.rooted(
            "broadcast",
            buf,
            root,
            |ptr, count, root, comm, stream| unsafe {
                result::broadcast(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    count,
                    T::as_nccl_type(),
                    root,
                    comm,
                    stream,
                )
            },
        )
    }

    /// An in-place collective with a root over `buf` (reduce, broadcast): the device and root
    /// checks they share, nothing for an empty buffer, then `call(ptr, count, root, comm,
    /// stream)` on the comm stream. `ptr` holds `count` elements of `T` on this device, kept
    /// alive and ordered by cudarc's events until the call has been queued.
    fn rooted<T: NcclElement>(
        &self,
        op: &'static str,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
        call: impl FnOnce(
            cudarc::driver::sys::CUdeviceptr,
            usize,
            c_int,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> Result<NcclStatus, result::NcclError>,
    ) -> Result<(), NcclError> {
        self.check_device(op, buf)?;
        let root = rank_in(op, self.rank, self.world, "root", root)?;
        let count = buf.len();
        if count == 0 {
            return Ok(());
        }
        let (ptr, _written) = buf.device_ptr_mut(&self.stream);
        self.issue(op, |comm, stream| call(ptr, count, root, comm, stream))
    }

    /// Sends `buf` to rank `peer`, which must post a matching [`NcclComm::recv`]. Both sides
    /// block their comm streams until the pair matches, so two ranks that each send before they
    /// receive deadlock on large buffers: order the pairs (as pipeline schedules do).
    pub fn send<T: NcclElement>(
        &self,
        buf: &impl DevicePtr<T>,
        peer: usize,
    ) -> Result<(), NcclError> {
        const OP: &str = "send";
        self.check_device(OP, buf)?;
        let peer = self.peer(OP, peer)?;
        let count = buf.len();
        if count == 0 {
            return Ok(());
        }
        let (src, _read) = buf.device_ptr(&self.stream);
        // SAFETY: `src` holds `count` elements of `T` on this device, kept alive and ordered by
        // cudarc's events until `_read` drops.
        self.issue(OP, |comm, stream| unsafe {
            result::send(
                src as *const c_void,
                count,
                T::as_nccl_type(),
                peer,
                comm,
                stream,
            )
        })
    }

    /// Receives into `buf` what rank `peer` sends with [`NcclComm::send`]; the lengths must match.
    pub fn recv<T: NcclElement>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        peer: usize,
    ) -> Result<(), NcclError> {
        const OP: &str = "recv";
        self.check_device(OP, buf)?;
        let peer = self.peer(OP, peer)?;
        let count = buf.len();
        if count == 0 {
            return Ok(());
        }
        let (dst, _written) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `dst` holds `count` elements of `T` on this device, kept alive and ordered by
        // cudarc's events until `_written` drops.
        self.issue(OP, |comm, stream| unsafe {
            result::recv(
                dst as *mut c_void,
                count,
                T::as_nccl_type(),
                peer,
                comm,
                stream,
            )
        })
    }

    /// Returns once every rank has reached the barrier and all work queued on the comm stream
    /// has finished, or fails after the timeout.
    pub fn barrier(&self) -> Result<(), NcclError> {
        let mut token = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| self.cuda_error("barrier", e))?;
        self.all_reduce(&mut token, ReduceOp::Sum)?;
        self.synchronize()
    }

    /// Waits until the work queued on the comm stream has finished. Unlike a plain stream
    /// synchronize this is bounded by the timeout and notices NCCL's asynchronous errors; either
    /// aborts the communicator.
    pub fn synchronize(&self) -> Result<(), NcclError> {
        const OP: &str = "synchronize";
        let done = self.record_event()?;
        self.poll(OP, || {
            done.try_is_complete().map_err(|e| self.cuda_error(OP, e))
        })
    }

    /// An event marking the work queued on the comm stream so far; `compute.wait(&event)` makes
    /// later compute wait for those collectives.
    pub fn record_event(&self) -> Result<CudaEvent, NcclError> {
        self.stream
            .record_event(None)
            .map_err(|e| self.cuda_error("record_event", e))
    }

    /// Makes the comm stream wait for the work queued on `other` so far, e.g. the backward pass
    /// that writes the gradients about to be reduced.
    pub fn wait_for(&self, other: &CudaStream) -> Result<(), NcclError> {
        self.stream
            .join(other)
            .map_err(|e| self.cuda_error("wait_for", e))
    }

    /// Tears the communicator down at once, stopping its kernels still running on the GPU; use
    /// it when the job learns by other means that a peer is gone. Later calls return
    /// [`NcclError::Aborted`].
    pub fn abort(&self) {
        let comm = self.comm.replace(ptr::null_mut());
        if !comm.is_null() {
            // SAFETY: `comm` is live and, being swapped out, never used again. Its result is
            // ignored: abort is the last resort, and nothing is left to clean up if it fails.
            unsafe { sys::ncclCommAbort(comm) };
        }
    }

    /// The live communicator, or `Aborted`.
    fn raw(&self, op: &'static str) -> Result<sys::ncclComm_t, NcclError> {
        let comm = self.comm.get();
        if comm.is_null() {
            return Err(NcclError::Aborted {
                op,
                rank: self.rank,
            });
        }
        Ok(comm)
    }

    /// Runs one NCCL call on the live communicator and the comm stream, then waits until NCCL
    /// has queued it.
    fn issue(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<NcclStatus, result::NcclError>,
    ) -> Result<(), NcclError> {
        let comm = self.raw(op)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.cuda_error(op, e))?;
        let status = call(comm, self.stream.cu_stream().cast());
        self.finish(op, status)
    }

    /// A non-blocking communicator may answer `ncclInProgress`: NCCL then finishes the call in
    /// the background, and nothing else may be called on it until its state is `ncclSuccess`.
    fn finish(
        &self,
        op: &'static str,
        status: Result<NcclStatus, result::NcclError>,
    ) -> Result<(), NcclError> {
        match status {
            Ok(NcclStatus::InProgress) => self.poll(op, || Ok(true)),
            Ok(_) => Ok(()),
            Err(e) => Err(Self::error(self.comm.get(), op, self.rank, e.0)),
        }
    }

    /// Polls until the communicator is idle and `done` holds, aborting on an asynchronous
    /// error or once the timeout has passed.
    fn poll(
        &self,
        op: &'static str,
        mut done: impl FnMut() -> Result<bool, NcclError>,
    ) -> Result<(), NcclError> {
        let start = Instant::now();
        loop {
            if self.idle(op)? && done()? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.abort();
                return Err(NcclError::Timeout {
                    op,
                    rank: self.rank,
                    timeout: self.timeout,
                });
            }
            if waited < SPIN_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }

    /// Whether NCCL has no call in progress. An asynchronous error aborts the communicator,
    /// since NCCL cannot recover one and its kernels may be stuck waiting on a dead peer.
    fn idle(&self, op: &'static str) -> Result<bool, NcclError> {
        let comm = self.raw(op)?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is live and `state` is a valid out-pointer.
        let code = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        // A query that fails says as much about the communicator as a failed state does.
        let state = if code == sys::ncclResult_t::ncclSuccess {
            state
        } else {
            code
        };
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(true),
            sys::ncclResult_t::ncclInProgress => Ok(false),
            failed => {
                let err = Self::error(comm, op, self.rank, failed);
                self.abort();
                Err(err)
            }
        }
    }

    fn check_device<T>(
        &self,
        op: &'static str,
        buf: &impl DeviceSlice<T>,
    ) -> Result<(), NcclError> {
        let buffer = buf.stream().context().ordinal();
        let comm = self.ordinal();
        if buffer != comm {
            return Err(NcclError::Device {
                op,
                rank: self.rank,
                buffer,
                comm,
            });
        }
        Ok(())
    }

    /// A send/recv peer: another rank of this communicator (talking to oneself needs a group).
    fn peer(&self, op: &'static str, peer: usize) -> Result<c_int, NcclError> {
        if peer == self.rank {
            return Err(NcclError::Rank {
                op,
                rank: self.rank,
                what: "peer (self)",
                value: peer,
                world: self.world,
            });
        }
        rank_in(op, self.rank, self.world, "peer", peer)
    }

    fn cuda_error(&self, op: &'static str, source: DriverError) -> NcclError {
        NcclError::Cuda {
            op,
            rank: self.rank,
            source,
        }
    }

    /// NCCL's text for `code`, with the detail `ncclGetLastError` keeps for the failure.
    fn error(
        comm: sys::ncclComm_t,
        op: &'static str,
        rank: usize,
        code: sys::ncclResult_t,
    ) -> NcclError {
        // SAFETY: both return NUL-terminated strings owned by NCCL (or null); the comm argument
        // of ncclGetLastError may be null.
        let (text, detail) = unsafe {
            (
                c_string(sys::ncclGetErrorString(code)),
                c_string(sys::ncclGetLastError(comm)),
            )
        };
        let message = if detail.is_empty() {
            text
        } else {
            format!("{text}: {detail}")
        };
        NcclError::Nccl {
            op,
            rank,
            code,
            message,
        }
    }
}

impl Drop for NcclComm {
    /// Finalize flushes the queued operations (bounded by the timeout) before destroy frees the
    /// communicator; if that fails it is aborted instead, so a drop waits at most the timeout.
    fn drop(&mut self) {
        if self.comm.get().is_null() {
            return;
        }
        // SAFETY (closure): the communicator is live; finalize takes no buffers.
        match self.issue("finalize", |comm, _| unsafe { result::comm_finalize(comm) }) {
            Ok(()) => {
                let comm = self.comm.replace(ptr::null_mut());
                // SAFETY: finalized, swapped out, never used again; nothing to do on failure.
                unsafe { sys::ncclCommDestroy(comm) };
            }
            Err(_) => self.abort(),
        }
    }
}

/// NCCL_CONFIG_INITIALIZER for the ncclConfig_t layout of NCCL 2.28 (cudarc's `nccl-02028`),
/// with `blocking = 0`; every other field keeps NCCL's default.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF_INT: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef, // NCCL_API_MAGIC
        version: 22800,     // NCCL_VERSION(2, 28, 0): the fields NCCL may read
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        // ncclAvg (NCCL >= 2.10) scales by 1/world inside the reduction kernel: no extra pass.
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

fn parse_id(id: &[u8], rank: usize) -> Result<sys::ncclUniqueId, NcclError> {
    let bytes: &[u8; UNIQUE_ID_BYTES] = id.try_into().map_err(|_| NcclError::Length {
        op: "init",
        rank,
        what: "unique id",
        actual: id.len(),
        expected: UNIQUE_ID_BYTES,
    })?;
    Ok(sys::ncclUniqueId {
        internal: bytes.map(|b| c_char::from_ne_bytes([b])),
    })
}

/// `expected` is `None` when computing it overflowed, which no real buffer can match.
fn expect_len(
    op: &'static str,
    rank: usize,
    what: &'static str,
    actual: usize,
    expected: Option<usize>,
) -> Result<(), NcclError> {
    match expected {
        Some(expected) if expected == actual => Ok(()),
        expected => Err(NcclError::Length {
            op,
            rank,
            what,
            actual,
            expected: expected.unwrap_or(usize::MAX),
        }),
    }
}

/// `value` as an NCCL rank of a communicator of `world` ranks.
fn rank_in(
    op: &'static str,
    rank: usize,
    world: usize,
    what: &'static str,
    value: usize,
) -> Result<c_int, NcclError> {
    if value >= world {
        return Err(NcclError::Rank {
            op,
            rank,
            what,
            value,
            world,
        });
    }
    to_c_int(op, rank, world, what, value)
}

fn to_c_int(
    op: &'static str,
    rank: usize,
    world: usize,
    what: &'static str,
    value: usize,
) -> Result<c_int, NcclError> {
    c_int::try_from(value).map_err(|_| NcclError::Rank {
        op,
        rank,
        what,
        value,
        world,
    })
}

/// # Safety
/// `p` is null or points to a NUL-terminated string.
unsafe fn c_string(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    CStr::from_ptr(p).to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    // The collectives on a GPU: tests/nccl_device.rs.

    #[test]
    fn unique_id_must_be_128_bytes() {
        assert!(parse_id(&[7; UNIQUE_ID_BYTES], 0).is_ok());
        let err = parse_id(&[7; 16], 3).unwrap_err();
        assert!(
            matches!(
                err,
                NcclError::Length {
                    actual: 16,
                    expected: 128,
                    rank: 3,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn length_mismatch_is_an_error() {
        assert!(expect_len("all_gather", 0, "output", 12, Some(12)).is_ok());
        let err = expect_len("all_gather", 1, "output", 10, Some(12)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "NCCL all_gather on rank 1: output has length 10, expected 12"
        );
        assert!(expect_len("reduce_scatter", 0, "input", 10, None).is_err());
    }

    #[test]
    fn ranks_must_lie_in_the_world() {
        assert_eq!(rank_in("broadcast", 0, 4, "root", 3).unwrap(), 3);
        let err = rank_in("broadcast", 0, 4, "root", 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "NCCL broadcast on rank 0: invalid root 4 for world size 4"
        );
        assert!(rank_in("init", 0, 0, "rank", 0).is_err());
    }

    #[test]
    fn config_asks_for_a_nonblocking_communicator() {
        let config = nonblocking_config();
        assert_eq!(config.blocking, 0);
        assert_eq!(config.magic, 0xcafe_beef);
        assert_eq!(config.size, std::mem::size_of::<sys::ncclConfig_t>());
    }
}
