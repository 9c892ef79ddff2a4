//! The MPI backend (`--dist_backend mpi`, cargo feature `mpi`): each group's collectives are
//! MPI's own, on an MPI communicator of the group's ranks, so a job started by `mpirun` rides
//! the fabric MPI is tuned for (shared memory, TCP, UCX, verbs).
//!
//! - Ranks: MPI_COMM_WORLD's. No store, no MASTER_ADDR: `place` initialises MPI and reads them.
//! - Groups: `MPI_Comm_create_group` over a duplicate of the world, collective over the group's
//!   members only, made on the group's first collective (in turn, as every collective) and kept
//!   until the communicator goes.
//! - dtypes: f32 is MPI_FLOAT. MPI has no bf16/f16, so a reduction converts them to f32, reduces
//!   with MPI_SUM/MPI_MAX and rounds once at the end (Avg: the f32 sum times 1/n, then one
//!   rounding), as the built-in transport rounds once per hop; moves (gather, broadcast, p2p)
//!   carry their 16 bits as MPI_UINT16_T.
//! - Threads: collectives run one at a time (the group's turns), on the caller's thread or the
//!   worker thread, so MPI_THREAD_SERIALIZED suffices; MULTIPLE is asked for so that the
//!   watchdog may call MPI_Abort while a collective blocks.
//! - Failure: MPI's default handler aborts the job on an MPI error, and mpirun ends every rank
//!   when one dies. A collective that waits past the timeout (a rank stopped, or ranks issuing
//!   different collectives) has no MPI error: the watchdog names it and calls MPI_Abort.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ::mpi::environment::Universe;
use ::mpi::ffi;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use ::mpi::Threading;

use crate::algo::ranges;
use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};

/// MPI initialised by `place`, waiting for `init` to take it.
static PARKED: Mutex<Option<MpiWorld>> = Mutex::new(None);

/// This process's rank and the world size in MPI_COMM_WORLD, initialising MPI if needed.
pub(crate) fn place() -> Result<(usize, usize)> {
    let mut parked = PARKED.lock().unwrap_or_else(|e| e.into_inner());
    if parked.is_none() {
        *parked = Some(MpiWorld::start()?);
    }
    let w = parked.as_ref().expect("just set");
    Ok((w.rank, w.size))
}

/// The MPI world for a communicator: the one `place` initialised, or a new one.
pub(crate) fn take_world(timeout: Duration) -> Result<MpiWorld> {
    let parked = PARKED.lock().unwrap_or_else(|e| e.into_inner()).take();
    let mut w = match parked {
        Some(w) => w,
        None => MpiWorld::start()?,
    };
    w.timeout = timeout;
    Ok(w)
}

/// Tag of `MPI_Comm_create_group`: creations never overlap (they run in turn).
const CREATE_TAG: c_int = 7;
/// Tag of point-to-point messages.
const P2P_TAG: c_int = 0;

/// MPI, initialised, and the communicators of this rank's groups.
pub(crate) struct MpiWorld {
    pub rank: usize,
    pub size: usize,
    timeout: Duration,
    /// Group ranks -> communicator; the whole world's is a duplicate of MPI_COMM_WORLD, so
    /// that ds-comm's messages never meet the application's own.
    comms: Mutex<HashMap<Vec<usize>, SimpleCommunicator>>,
    watchdog: Watchdog,
    /// Finalises MPI when dropped: after the communicators.
    universe: Option<Universe>,
}

// SAFETY: MPI handles are plain identifiers into the MPI library, which was initialised with
// at least MPI_THREAD_SERIALIZED; every call through them runs in the group's turn, so never
// two at once (the watchdog's MPI_Abort aside, which MPI_THREAD_MULTIPLE covers).
unsafe impl Send for MpiWorld {}
unsafe impl Sync for MpiWorld {}

impl MpiWorld {
    fn start() -> Result<MpiWorld> {
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                CommError::Env(
                    "MPI was initialised before in this process: ds-comm joins an MPI job once \
                     per process"
                        .into(),
                )
            })?;
        if matches!(threading, Threading::Single | Threading::Funneled) {
            return Err(CommError::Env(format!(
                "the MPI library offers thread level {threading:?}; ds-comm needs at least \
                 MPI_THREAD_SERIALIZED (its async collectives run on a worker thread)"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let mut comms = HashMap::new();
        comms.insert((0..size).collect(), world.duplicate());
        Ok(MpiWorld {
            rank,
            size,
            timeout: crate::DEFAULT_TIMEOUT,
            comms: Mutex::new(comms),
            watchdog: Watchdog::start(rank),
            universe: Some(universe),
        })
    }

    /// Runs one collective of the group `ranks` (this rank at index `me`) under the watchdog,
    /// on the group's communicator, made on first use (collective over the group).
    pub fn run(
        &self,
        what: &str,
        ranks: &[usize],
        me: usize,
        f: impl FnOnce(&MpiGroup) -> Result<()>,
    ) -> Result<()> {
        let _armed = self.watchdog.arm(what, self.timeout);
        let mut comms = self.comms.lock().unwrap();
        if !comms.contains_key(ranks) {
            let comm = self.create(&comms, ranks)?;
            comms.insert(ranks.to_vec(), comm);
        }
        f(&MpiGroup {
            comm: &comms[ranks],
            ranks,
            me,
        })
    }

    /// `MPI_Comm_create_group` of these global ranks, in this order, from the world's.
    fn create(
        &self,
        comms: &HashMap<Vec<usize>, SimpleCommunicator>,
        ranks: &[usize],
    ) -> Result<SimpleCommunicator> {
        let world = &comms[&(0..self.size).collect::<Vec<_>>()];
        let members: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        let group = world.group().include(&members);
        world
            .split_by_subgroup_with_tag(&group, CREATE_TAG)
            .ok_or_else(|| {
                CommError::Invalid(format!("MPI_Comm_create_group {ranks:?}: no communicator"))
            })
    }

    /// Ends the whole job now (this rank failed; the others may be waiting in a collective).
    pub fn abort(&self, code: i32) -> ! {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
        std::process::exit(code)
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        self.comms.get_mut().unwrap().clear();
        // MPI_Finalize waits for the other ranks: a rank stuck elsewhere must not hold this
        // one for ever.
        let _armed = self.watchdog.arm("MPI_Finalize", self.timeout);
        drop(self.universe.take());
    }
}

/// A group's MPI communicator during one collective.
pub(crate) struct MpiGroup<'a> {
    comm: &'a SimpleCommunicator,
    /// Global ranks in group order (the communicator's rank order).
    ranks: &'a [usize],
    me: usize,
}

/// An MPI return code as a result.
fn check(what: &str, rc: c_int) -> Result<()> {
    match rc {
        0 => Ok(()),
        rc => Err(CommError::Invalid(format!("{what}: MPI error {rc}"))),
    }
}

/// An element count as MPI's int.
fn count(what: &str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        CommError::Invalid(format!(
            "{what}: {n} elements; MPI counts stop at {}",
            c_int::MAX
        ))
    })
}

/// The MPI type that carries `T`'s bits unchanged.
fn raw_type<T: Element>() -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined handles.
    unsafe {
        match T::DTYPE {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::BF16 | DType::F16 => ffi::RSMPI_UINT16_T,
        }
    }
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading MPI's predefined handles.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
        }
    }
}

/// `v` as f32: itself for f32, else converted.
fn f32_view<T: Element>(v: &[T]) -> Cow<'_, [f32]> {
    match T::DTYPE {
        DType::F32 => Cow::Borrowed(bytemuck::cast_slice(v)),
        _ => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
    }
}

/// Avg's factor on the f32 sum (applied before the one rounding into the dtype).
fn scale(op: ReduceOp, n: usize) -> f32 {
    match op {
        ReduceOp::Avg => 1.0 / n as f32,
        _ => 1.0,
    }
}

/// Runs `reduce`, which writes f32 results into the buffer it is given, so that they land
/// in `dst`: directly for f32, else through an f32 buffer rounded once into the dtype.
fn reduce_into<T: Element>(
    dst: &mut [T],
    k: f32,
    reduce: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    if T::DTYPE == DType::F32 {
        let out: &mut [f32] = bytemuck::cast_slice_mut(dst);
        reduce(out)?;
        if k != 1.0 {
            out.iter_mut().for_each(|x| *x *= k);
        }
        return Ok(());
    }
    let mut out = vec![0f32; dst.len()];
    reduce(&mut out)?;
    dst.iter_mut()
        .zip(&out)
        .for_each(|(d, &x)| *d = T::from_f32(x * k));
    Ok(())
}

impl MpiGroup<'_> {
    fn n(&self) -> usize {
        self.ranks.len()
    }

    fn raw(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }

    /// A global rank's index in the group (the caller checked membership).
    fn index(&self, global: usize) -> Result<c_int> {
        let i = self
            .ranks
            .iter()
            .position(|&r| r == global)
            .ok_or_else(|| CommError::Invalid(format!("rank {global} is not in this group")))?;
        Ok(i as c_int)
    }

    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let len = count("all_reduce", buf.len())?;
        // A copy: MPI's send buffer must not alias the result.
        let input: Vec<f32> = f32_view(buf).into_owned();
        reduce_into(buf, scale(op, self.n()), |out| {
            // SAFETY: both buffers hold `len` f32s; MPI writes only `out`.
            let rc = unsafe {
                ffi::MPI_Allreduce(
                    input.as_ptr().cast(),
                    out.as_mut_ptr().cast(),
                    len,
                    ffi::RSMPI_FLOAT,
                    mpi_op(op),
                    self.raw(),
                )
            };
            check("all_reduce", rc)
        })
    }

    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = vec![output.len(); self.n()];
        let input = f32_view(input);
        reduce_into(output, scale(op, self.n()), |out| {
            self.reduce_scatter_f32(&input, out, &counts, op)
        })
    }

    pub fn reduce_scatter_v<T: Element>(
        &self,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_counts("reduce_scatter_v", buf.len(), counts)?;
        let mine = ranges(counts)[self.me].clone();
        let mut out = vec![0f32; mine.len()];
        self.reduce_scatter_f32(&f32_view(buf), &mut out, counts, op)?;
        let k = scale(op, self.n());
        buf[mine]
            .iter_mut()
            .zip(&out)
            .for_each(|(d, &x)| *d = T::from_f32(x * k));
        Ok(())
    }

    fn reduce_scatter_f32(
        &self,
        input: &[f32],
        out: &mut [f32],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        count("reduce_scatter", input.len())?;
        let counts: Vec<c_int> = counts.iter().map(|&c| c as c_int).collect();
        // SAFETY: `input` holds the sum of `counts` f32s and `out` this rank's count.
        let rc = unsafe {
            ffi::MPI_Reduce_scatter(
                input.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                counts.as_ptr(),
                ffi::RSMPI_FLOAT,
                mpi_op(op),
                self.raw(),
            )
        };
        check("reduce_scatter", rc)
    }

    pub fn all_gather_v<T: Element>(&self, buf: &mut [T], counts: &[usize]) -> Result<()> {
        self.check_counts("all_gather_v", buf.len(), counts)?;
        count("all_gather_v", buf.len())?;
        let parts = ranges(counts);
        let mine: Vec<T> = buf[parts[self.me].clone()].to_vec();
        let counts_i: Vec<c_int> = counts.iter().map(|&c| c as c_int).collect();
        let displs: Vec<c_int> = parts.iter().map(|r| r.start as c_int).collect();
        // SAFETY: `mine` holds this rank's count of T and `buf` every part at its offset.
        let rc = unsafe {
            ffi::MPI_Allgatherv(
                mine.as_ptr().cast(),
                mine.len() as c_int,
                raw_type::<T>(),
                buf.as_mut_ptr().cast(),
                counts_i.as_ptr(),
                displs.as_ptr(),
                raw_type::<T>(),
                self.raw(),
            )
        };
        check("all_gather_v", rc)
    }

    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()> {
        self.check_counts("all_to_all_v", input.len(), send)?;
        self.check_counts("all_to_all_v", output.len(), recv)?;
        count("all_to_all_v", input.len().max(output.len()))?;
        let ints = |c: &[usize]| c.iter().map(|&c| c as c_int).collect::<Vec<c_int>>();
        let displs = |c: &[usize]| {
            ranges(c)
                .iter()
                .map(|r| r.start as c_int)
                .collect::<Vec<_>>()
        };
        let (send_counts, send_displs) = (ints(send), displs(send));
        let (recv_counts, recv_displs) = (ints(recv), displs(recv));
        // SAFETY: `input` holds every send part at its offset, `output` every receive part.
        let rc = unsafe {
            ffi::MPI_Alltoallv(
                input.as_ptr().cast(),
                send_counts.as_ptr(),
                send_displs.as_ptr(),
                raw_type::<T>(),
                output.as_mut_ptr().cast(),
                recv_counts.as_ptr(),
                recv_displs.as_ptr(),
                raw_type::<T>(),
                self.raw(),
            )
        };
        check("all_to_all_v", rc)
    }

    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let len = count("broadcast", buf.len())?;
        // SAFETY: `buf` holds `len` T on every rank.
        let rc = unsafe {
            ffi::MPI_Bcast(
                buf.as_mut_ptr().cast(),
                len,
                raw_type::<T>(),
                root as c_int,
                self.raw(),
            )
        };
        check("broadcast", rc)
    }

    pub fn send<T: Element>(&self, buf: &[T], to: usize) -> Result<()> {
        let (to, len) = (self.index(to)?, count("send", buf.len())?);
        // SAFETY: `buf` holds `len` T.
        let rc = unsafe {
            ffi::MPI_Send(
                buf.as_ptr().cast(),
                len,
                raw_type::<T>(),
                to,
                P2P_TAG,
                self.raw(),
            )
        };
        check("send", rc)
    }

    /// Receives exactly `buf.len()` elements: a message of another length is an error
    /// naming both, not MPI's truncation abort.
    pub fn recv<T: Element>(&self, buf: &mut [T], from: usize) -> Result<()> {
        let src = self.index(from)?;
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
        let mut sent: c_int = 0;
        // SAFETY: `status` is written by MPI_Probe before MPI_Get_count reads it.
        let rc = unsafe {
            let rc = ffi::MPI_Probe(src, P2P_TAG, self.raw(), status.as_mut_ptr());
            match rc {
                0 => ffi::MPI_Get_count(status.as_ptr(), raw_type::<T>(), &mut sent),
                rc => rc,
            }
        };
        check("recv", rc)?;
        if sent as usize != buf.len() {
            return Err(CommError::Invalid(format!(
                "recv: rank {from} sent {sent} elements, this rank expected {}",
                buf.len()
            )));
        }
        // SAFETY: the probed message holds exactly `buf.len()` T.
        let rc = unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr().cast(),
                sent,
                raw_type::<T>(),
                src,
                P2P_TAG,
                self.raw(),
                ffi::RSMPI_STATUS_IGNORE,
            )
        };
        check("recv", rc)
    }

    /// Every send and receive posted at once (MPI_Isend/Irecv), then waited for together;
    /// MPI keeps messages between a pair in order, so several to one peer pair up in list
    /// order.
    pub fn send_recv(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        // Every peer and length checked before anything is posted: a request left pending by
        // an early return would write into a buffer its caller has dropped.
        let mut ops = Vec::with_capacity(sends.len() + recvs.len());
        for (peer, bytes) in recvs.iter_mut() {
            let (peer, len) = (self.index(*peer)?, count("send_recv", bytes.len())?);
            ops.push((true, peer, bytes.as_mut_ptr().cast::<c_void>(), len));
        }
        for (peer, bytes) in sends {
            let (peer, len) = (self.index(*peer)?, count("send_recv", bytes.len())?);
            ops.push((false, peer, bytes.as_ptr().cast_mut().cast::<c_void>(), len));
        }
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(ops.len());
        for (receive, peer, ptr, len) in ops {
            let mut req = std::mem::MaybeUninit::uninit();
            // SAFETY: `ptr` holds `len` bytes that outlive the request (waited for below); a
            // send's bytes are only read.
            let rc = unsafe {
                match receive {
                    true => ffi::MPI_Irecv(
                        ptr,
                        len,
                        ffi::RSMPI_UINT8_T,
                        peer,
                        P2P_TAG,
                        self.raw(),
                        req.as_mut_ptr(),
                    ),
                    false => ffi::MPI_Isend(
                        ptr,
                        len,
                        ffi::RSMPI_UINT8_T,
                        peer,
                        P2P_TAG,
                        self.raw(),
                        req.as_mut_ptr(),
                    ),
                }
            };
            check("send_recv", rc)?;
            // SAFETY: the call succeeded and wrote the request.
            reqs.push(unsafe { req.assume_init() });
        }
        // SAFETY: every request is live; their buffers outlive this call.
        let rc = unsafe {
            ffi::MPI_Waitall(
                reqs.len() as c_int,
                reqs.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        };
        check("send_recv", rc)
    }

    pub fn barrier(&self) -> Result<()> {
        // SAFETY: a collective on a live communicator.
        check("barrier", unsafe { ffi::MPI_Barrier(self.raw()) })
    }

    fn check_counts(&self, what: &str, len: usize, counts: &[usize]) -> Result<()> {
        if counts.len() != self.n() || counts.iter().sum::<usize>() != len {
            return Err(CommError::Invalid(format!(
                "{what}: {} counts summing to {} for a buffer of {len} in a group of {}",
                counts.len(),
                counts.iter().sum::<usize>(),
                self.n()
            )));
        }
        Ok(())
    }
}

/// Aborts the MPI job when a collective outlives the timeout.
struct Watchdog {
    state: Arc<(Mutex<Watch>, Condvar)>,
}

#[derive(Default)]
struct Watch {
    armed: Option<(Instant, String, Duration)>,
    stop: bool,
}

impl Watchdog {
    fn start(rank: usize) -> Watchdog {
        let state = Arc::new((Mutex::new(Watch::default()), Condvar::new()));
        let s = state.clone();
        let _ = std::thread::Builder::new()
            .name("ds-comm-mpi-watchdog".into())
            .spawn(move || watch(rank, &s));
        Watchdog { state }
    }

    fn arm(&self, what: &str, timeout: Duration) -> Armed<'_> {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap().armed = Some((Instant::now() + timeout, what.to_string(), timeout));
        cv.notify_all();
        Armed(self)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, cv) = &*self.state;
        lock.lock().unwrap().stop = true;
        cv.notify_all();
    }
}

/// Disarms the watchdog when the collective ends.
struct Armed<'a>(&'a Watchdog);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        let (lock, cv) = &*self.0.state;
        lock.lock().unwrap_or_else(|e| e.into_inner()).armed = None;
        cv.notify_all();
    }
}

fn watch(rank: usize, state: &(Mutex<Watch>, Condvar)) {
    let (lock, cv) = state;
    let mut w = lock.lock().unwrap();
    while !w.stop {
        let Some((deadline, what, after)) = w.armed.clone() else {
            w = cv.wait(w).unwrap();
            continue;
        };
        let now = Instant::now();
        if now < deadline {
            w = cv.wait_timeout(w, deadline - now).unwrap().0;
            continue;
        }
        eprintln!(
            "error: rank {rank}: {what}: timed out after {}s waiting for the other ranks over \
             MPI (a rank stopped, or the ranks issued different collectives); aborting the job",
            after.as_secs_f64()
        );
        // SAFETY: MPI is initialised (the world outlives its watchdog); MPI_THREAD_MULTIPLE
        // allows this call beside the blocked one. It ends every rank of the job.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    }
}
