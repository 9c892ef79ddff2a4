//! The communicator of one rank and the groups it runs collectives on.
//!
//! All collectives of a rank, of any group, run one at a time in the order they were
//! issued (like one NCCL stream): a blocking call runs on the caller's thread when its turn
//! comes, an `_async` call runs on the communicator's worker thread and returns a [`Work`]
//! handle. Every group member must issue the group's collectives in the same order.
//! After a failure (a lost peer, a timeout) the communicator is broken: the links may hold a
//! partial message, so every later collective returns the first error at once.

use crate::algo::{even_counts, ranges, Ctx};
use crate::backend::{Backend, Exec, Net};
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::exchange::Deadline;
use crate::link::Links;
use crate::logger::{CommsLogger, OpKind};
use crate::store::{StoreClient, StoreServer};
use std::ops::DerefMut;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Default time a collective waits for its peers, as torch.distributed's default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a rank that lost a peer looks for that peer's own failure note.
const FAILURE_NOTE_WAIT: Duration = Duration::from_millis(500);

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// The ticket an async collective reserved at submission, for the thread that runs it.
    static RESERVED: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

pub(crate) struct Shared {
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    net: Net,
    turns: Turns,
    broken: Mutex<Option<String>>,
    worker: Mutex<Option<mpsc::Sender<Job>>>,
    logger: Option<Mutex<CommsLogger>>,
    store: Option<StoreClient>,
    /// Rank 0 hosts the store; it lives as long as rank 0's communicator.
    _server: Option<StoreServer>,
}

/// How long a failed rank keeps its links and (rank 0) the store open before it goes: its
/// peers then see the rank that really died first, and can read this rank's failure note,
/// instead of blaming this rank for leaving.
const FAILURE_LINGER: Duration = Duration::from_millis(1000);

impl Drop for Shared {
    fn drop(&mut self) {
        let failed = self.broken.get_mut().map(|b| b.is_some()).unwrap_or(false);
        if failed && self.world > 1 {
            std::thread::sleep(FAILURE_LINGER);
        }
    }
}

/// Serves collectives in the order their tickets were taken.
#[derive(Default)]
struct Turns {
    next_ticket: Mutex<u64>,
    serving: Mutex<u64>,
    cv: Condvar,
}

impl Turns {
    fn take(&self) -> u64 {
        let mut t = self.next_ticket.lock().unwrap();
        *t += 1;
        *t - 1
    }
    fn run<R>(&self, ticket: u64, f: impl FnOnce() -> R) -> R {
        let mut serving = self.serving.lock().unwrap();
        while *serving != ticket {
            serving = self.cv.wait(serving).unwrap();
        }
        drop(serving);
        // Advance even if `f` panics, so that later collectives are not stuck behind it.
        struct Next<'a>(&'a Turns);
        impl Drop for Next<'_> {
            fn drop(&mut self) {
                *self.0.serving.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                self.0.cv.notify_all();
            }
        }
        let _next = Next(self);
        f()
    }
}

/// Everything a rank needs to join collectives: built by [`crate::init`].
pub struct Communicator {
    shared: Arc<Shared>,
}

pub(crate) struct Parts {
    pub rank: usize,
    pub world: usize,
    pub timeout: Duration,
    pub net: Net,
    pub logger: Option<CommsLogger>,
    pub store: Option<StoreClient>,
    pub server: Option<StoreServer>,
}

impl Communicator {
    pub(crate) fn new(p: Parts) -> Communicator {
        let shared = Arc::new(Shared {
            rank: p.rank,
            world: p.world,
            timeout: p.timeout,
            net: p.net,
            turns: Turns::default(),
            broken: Mutex::new(None),
            worker: Mutex::new(None),
            logger: p.logger.map(Mutex::new),
            store: p.store,
            _server: p.server,
        });
        Communicator { shared }
    }

    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    pub fn world_size(&self) -> usize {
        self.shared.world
    }

    /// The group of all ranks.
    pub fn world(&self) -> Group {
        Group {
            shared: self.shared.clone(),
            ranks: (0..self.shared.world).collect::<Vec<_>>().into(),
            me: self.shared.rank,
        }
    }

    /// A group of the given global ranks, in that order; this rank must be one of them.
    pub fn group(&self, ranks: &[usize]) -> Result<Group> {
        let mut seen = vec![false; self.shared.world];
        for &r in ranks {
            if r >= self.shared.world || std::mem::replace(&mut seen[r], true) {
                return Err(CommError::Invalid(format!(
                    "group {ranks:?}: rank {r} is out of range or repeated (world size {})",
                    self.shared.world
                )));
            }
        }
        let me = ranks
            .iter()
            .position(|&r| r == self.shared.rank)
            .ok_or_else(|| {
                CommError::Invalid(format!(
                    "group {ranks:?} does not contain this rank ({})",
                    self.shared.rank
                ))
            })?;
        Ok(Group {
            shared: self.shared.clone(),
            ranks: ranks.to_vec().into(),
            me,
        })
    }

    /// The rendezvous store (absent in a job of one rank).
    pub fn store(&self) -> Option<&StoreClient> {
        self.shared.store.as_ref()
    }

    /// Which backend moves this communicator's data.
    pub fn backend(&self) -> Backend {
        self.shared.net.backend()
    }

    /// Ends this rank now, and the job with it: under MPI, MPI_Abort(`code`), which ends
    /// every rank (they may be waiting for this one in a collective, and MPI would not tell
    /// them); over the built-in transport the process exits and its peers see its links close.
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if let Net::Mpi(world) = &self.shared.net {
            world.abort(code)
        }
        std::process::exit(code)
    }

    /// The comms logger's end-of-run table, when `comms_logger.enabled`.
    pub fn comms_summary(&self) -> Option<String> {
        self.shared
            .logger
            .as_ref()
            .map(|l| l.lock().unwrap().summary())
    }
}

/// A set of ranks that run collectives together. Cheap to clone.
#[derive(Clone)]
pub struct Group {
    shared: Arc<Shared>,
    ranks: Arc<[usize]>,
    me: usize,
}

/// A collective running on the worker thread.
pub struct Work<R> {
    rx: mpsc::Receiver<Result<R>>,
}

impl<R> Work<R> {
    /// Waits for the collective and returns its buffer (or its error).
    pub fn wait(self) -> Result<R> {
        self.rx.recv().unwrap_or_else(|_| {
            Err(CommError::Invalid(
                "the communicator's worker stopped".into(),
            ))
        })
    }
}

impl Group {
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
    /// Which backend moves the group's data (`nccl`: GPU memory can be reduced where it is).
    pub fn backend(&self) -> Backend {
        self.shared.net.backend()
    }
    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.me
    }
    pub fn global_ranks(&self) -> &[usize] {
        &self.ranks
    }

    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let bytes = std::mem::size_of_val(buf) as u64;
        self.run(OpKind::AllReduce, bytes, |ex| ex.all_reduce(buf, op))
    }

    /// `input` holds one part per rank (`input.len() == size * output.len()`); this rank's
    /// reduced part lands in `output`.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size();
        if input.len() != n * output.len() {
            return Err(CommError::Invalid(format!(
                "reduce_scatter: input has {} elements, expected group size {n} x output {}",
                input.len(),
                output.len()
            )));
        }
        let bytes = std::mem::size_of_val(input) as u64;
        self.run(OpKind::ReduceScatter, bytes, |ex| {
            ex.reduce_scatter_into(input, output, op)
        })
    }

    /// In place, with parts of any sizes (`counts[i]` elements for rank i, summing to
    /// `buf.len()`): this rank's part of `buf` ends up reduced over the group.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(buf) as u64;
        self.run(OpKind::ReduceScatter, bytes, |ex| {
            ex.reduce_scatter_v(buf, counts, op)
        })
    }

    /// Gathers every rank's `input` (all of one length) into `output`, in group order.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let n = self.size();
        if output.len() != n * input.len() {
            return Err(CommError::Invalid(format!(
                "all_gather: output has {} elements, expected group size {n} x input {}",
                output.len(),
                input.len()
            )));
        }
        output[self.me * input.len()..][..input.len()].copy_from_slice(input);
        self.all_gather_v(output, &vec![input.len(); n])
    }

    /// Gathers every rank's integers (all of one count), in group order, exactly: the
    /// collectives carry floats and an f32 holds any 24-bit integer exactly, so each value
    /// travels as two 24-bit halves. Values must be below 2^48 (byte counts, checksums).
    pub fn all_gather_u64(&self, input: &[u64]) -> Result<Vec<u64>> {
        const HALF: u64 = 1 << 24;
        if let Some(v) = input.iter().find(|&&v| v >= HALF * HALF) {
            return Err(CommError::Invalid(format!(
                "all_gather_u64: {v} is not below 2^48"
            )));
        }
        let split: Vec<f32> = input
            .iter()
            .flat_map(|&v| [(v / HALF) as f32, (v % HALF) as f32])
            .collect();
        let mut all = vec![0f32; split.len() * self.size()];
        self.all_gather(&split, &mut all)?;
        Ok(all
            .chunks(2)
            .map(|p| p[0] as u64 * HALF + p[1] as u64)
            .collect())
    }

    /// In place, with parts of any sizes: rank i's part `counts[i]` is sent to everyone.
    pub fn all_gather_v<T: Element>(&self, buf: &mut [T], counts: &[usize]) -> Result<()> {
        let bytes = counts
            .get(self.me)
            .map_or(0, |c| (c * std::mem::size_of::<T>()) as u64);
        self.run(OpKind::AllGather, bytes, |ex| ex.all_gather_v(buf, counts))
    }

    /// All-to-all of equal parts (`all_to_all_single` with even splits): `input` holds one
    /// part per rank, part j goes to the group's j-th rank, and the j-th rank's part for this
    /// rank lands in part j of `output` (as long as `input`).
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let n = self.size();
        if input.len() != output.len() || !input.len().is_multiple_of(n) {
            return Err(CommError::Invalid(format!(
                "all_to_all: input of {} and output of {} elements, expected one length divisible by the group size {n}",
                input.len(),
                output.len()
            )));
        }
        let counts = vec![input.len() / n; n];
        self.all_to_all_v(input, &counts, output, &counts)
    }

    /// All-to-all with parts of any sizes (`all_to_all_single` with split sizes, MPI's
    /// `Alltoallv`): `input`'s j-th part (`send_counts[j]` elements) goes to the group's j-th
    /// rank, and the i-th rank's part for this rank lands in `output`'s i-th part
    /// (`recv_counts[i]` elements). Each rank's `send_counts[j]` must equal rank j's
    /// `recv_counts[i]`, as in MPI.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(input) as u64;
        self.run(OpKind::AllToAllSingle, bytes, |ex| {
            ex.all_to_all_v(input, send_counts, output, recv_counts)
        })
    }

    /// `all_to_all` on the worker thread; returns the output (over MPI: Note [all-to-all
    /// async over MPI]).
    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.spawn_all_to_all(move |g| {
            let mut output = vec![T::default(); input.len()];
            g.all_to_all(&input, &mut output).map(|_| output)
        })
    }

    /// `all_to_all_v` on the worker thread; returns the output (over MPI: Note [all-to-all
    /// async over MPI]).
    pub fn all_to_all_v_async<T: Element>(
        &self,
        input: Vec<T>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Work<Vec<T>> {
        self.spawn_all_to_all(move |g| {
            let mut output = vec![T::default(); recv_counts.iter().sum()];
            g.all_to_all_v(&input, &send_counts, &mut output, &recv_counts)
                .map(|_| output)
        })
    }

    /// Note [all-to-all async over MPI]: with the all-to-all on the worker thread, one rank of
    /// the 4-rank collective matrix over OpenMPI 4.1.4 exited without a message in about one
    /// run of three (MPI_Alltoallv and Isend/Irecv pairs alike, shared-memory and TCP
    /// transports alike, not the stack); the same calls on the caller's thread never failed
    /// in 16 runs, nor did the other async collectives. Not understood yet, so over MPI the
    /// async all-to-all completes on the caller's thread before it returns.
    fn spawn_all_to_all<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Group) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        if self.backend() != Backend::Mpi {
            return self.spawn(f);
        }
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(f(self));
        Work { rx }
    }

    /// Copies `buf` of global rank `root` into `buf` of every member.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let root = self.index_of(root)?;
        let bytes = std::mem::size_of_val(buf) as u64;
        self.run(OpKind::Broadcast, bytes, |ex| ex.broadcast(buf, root))
    }

    /// Sends `buf` to global rank `to`, which must `recv` a buffer of the same length.
    pub fn send<T: Element>(&self, buf: &[T], to: usize) -> Result<()> {
        self.peer(to)?;
        self.run(OpKind::Send, std::mem::size_of_val(buf) as u64, |ex| {
            ex.send(buf, to)
        })
    }

    pub fn recv<T: Element>(&self, buf: &mut [T], from: usize) -> Result<()> {
        self.peer(from)?;
        let bytes = std::mem::size_of_val(buf) as u64;
        self.run(OpKind::Recv, bytes, |ex| ex.recv(buf, from))
    }

    /// A combined send and receive (Megatron's `batch_isend_irecv`): bytes to and from global
    /// ranks in one exchange, all progressing together, so that neighbours sending to each
    /// other at once (a ring) cannot deadlock. Each buffer meets one of the same length at its
    /// peer; several to or from one peer pair up in list order.
    pub fn send_recv(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        let peers: Vec<usize> = sends
            .iter()
            .map(|s| s.0)
            .chain(recvs.iter().map(|r| r.0))
            .collect();
        for peer in peers {
            self.peer(peer)?;
        }
        let bytes = sends.iter().map(|(_, b)| b.len() as u64).sum();
        self.run(OpKind::Send, bytes, |ex| ex.send_recv(sends, recvs))
    }

    /// Sends `buf` to global rank `to` on the worker thread, in this rank's collective order:
    /// the caller goes on computing while the bytes leave.
    pub fn send_async<T: Element>(&self, buf: Vec<T>, to: usize) -> Work<()> {
        self.spawn(move |g| g.send(&buf, to))
    }

    pub fn barrier(&self) -> Result<()> {
        self.run(OpKind::Barrier, 0, |ex| ex.barrier())
    }

    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.spawn(move |g| g.all_reduce(&mut buf, op).map(|_| buf))
    }

    /// Reduce-scatter of parts as even as possible; returns the whole buffer (this rank's part reduced).
    pub fn reduce_scatter_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let counts = even_counts(buf.len(), self.size());
        self.spawn(move |g| g.reduce_scatter_v(&mut buf, &counts, op).map(|_| buf))
    }

    /// All-gather in place of parts as even as possible.
    pub fn all_gather_async<T: Element>(&self, mut buf: Vec<T>) -> Work<Vec<T>> {
        let counts = even_counts(buf.len(), self.size());
        self.spawn(move |g| g.all_gather_v(&mut buf, &counts).map(|_| buf))
    }

    /// Reduce-scatter in place with parts of the given sizes (see `reduce_scatter_v`). `buf`
    /// is any owner of a slice (a `Vec`, a GPU buffer), handed back by `wait`.
    pub fn reduce_scatter_v_async<T: Element, B: DerefMut<Target = [T]> + Send + 'static>(
        &self,
        mut buf: B,
        counts: Vec<usize>,
        op: ReduceOp,
    ) -> Work<B> {
        self.spawn(move |g| g.reduce_scatter_v(&mut buf, &counts, op).map(|_| buf))
    }

    /// All-gather in place with parts of the given sizes (see `all_gather_v`). `buf` is any
    /// owner of a slice (a `Vec`, a GPU buffer), handed back by `wait`.
    pub fn all_gather_v_async<T: Element, B: DerefMut<Target = [T]> + Send + 'static>(
        &self,
        mut buf: B,
        counts: Vec<usize>,
    ) -> Work<B> {
        self.spawn(move |g| g.all_gather_v(&mut buf, &counts).map(|_| buf))
    }

    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.spawn(move |g| g.broadcast(&mut buf, root).map(|_| buf))
    }

    /// The range of this rank's part when `len` elements are split as evenly as possible.
    pub fn my_part(&self, len: usize) -> std::ops::Range<usize> {
        ranges(&even_counts(len, self.size()))[self.me].clone()
    }

    fn index_of(&self, global: usize) -> Result<usize> {
        self.ranks.iter().position(|&r| r == global).ok_or_else(|| {
            CommError::Invalid(format!(
                "rank {global} is not in this group {:?}",
                &self.ranks[..self.ranks.len().min(16)]
            ))
        })
    }

    fn peer(&self, global: usize) -> Result<()> {
        match self.index_of(global)? == self.me {
            true => Err(CommError::Invalid(format!(
                "rank {global} cannot send to or receive from itself"
            ))),
            false => Ok(()),
        }
    }

    /// Runs `f` on the worker thread in this rank's collective order, as the `_async`
    /// collectives do: for one collective whose input takes work to make (ZeRO-3 reading its
    /// parameter shard from disk before the all-gather), so that the work overlaps the
    /// caller's compute too. `f` makes exactly one collective call on the group it is given.
    pub fn spawn_collective<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Group) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        self.spawn(f)
    }

    /// Runs `f` on the worker thread in this rank's collective order.
    fn spawn<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Group) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let (tx, rx) = mpsc::channel();
        let ticket = self.shared.turns.take();
        let g = self.clone();
        let job: Job = Box::new(move || {
            let _ = tx.send(g.run_ticketed(ticket, f));
        });
        if let Err(mpsc::SendError(job)) = self.worker().send(job) {
            job(); // the worker is gone only while shutting down; run in place
        }
        Work { rx }
    }

    /// Runs `f`, whose one collective takes the ticket reserved when it was queued.
    fn run_ticketed<R>(&self, ticket: u64, f: impl FnOnce(&Group) -> Result<R>) -> Result<R> {
        RESERVED.with(|r| r.set(Some(ticket)));
        let out = f(self);
        RESERVED.with(|r| r.set(None));
        out
    }

    fn worker(&self) -> mpsc::Sender<Job> {
        let mut w = self.shared.worker.lock().unwrap();
        w.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            let _ = std::thread::Builder::new()
                .name("ds-comm-worker".into())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                });
            tx
        })
        .clone()
    }

    /// Runs one collective in turn: refuses on a broken communicator, times it for the
    /// comms logger, and breaks the communicator on a transport failure.
    fn run(&self, kind: OpKind, bytes: u64, f: impl FnOnce(&mut Exec) -> Result<()>) -> Result<()> {
        let ticket = RESERVED
            .with(|r| r.take())
            .unwrap_or_else(|| self.shared.turns.take());
        self.shared.turns.run(ticket, || {
            if let Some(first) = self.shared.broken.lock().unwrap().as_ref() {
                return Err(CommError::Invalid(format!(
                    "{}: communicator unusable after an earlier failure: {first}",
                    kind.ds_name()
                )));
            }
            let start = Instant::now();
            let result = self.exec(kind, f).map_err(|e| e.during(kind.ds_name()));
            match result {
                Err(e @ (CommError::PeerLost { .. } | CommError::Timeout { .. })) => {
                    let e = self.root_cause(e);
                    *self.shared.broken.lock().unwrap() = Some(e.to_string());
                    Err(e)
                }
                Ok(()) => {
                    self.log(kind, bytes, start.elapsed());
                    Ok(())
                }
                Err(e) => Err(e),
            }
        })
    }

    /// Runs `f` on this group's way to its peers.
    #[cfg_attr(not(feature = "mpi"), allow(unused_variables))]
    fn exec(&self, kind: OpKind, f: impl FnOnce(&mut Exec) -> Result<()>) -> Result<()> {
        match &self.shared.net {
            Net::Links(links) => self.on_links(links, |cx| f(&mut Exec::Links(cx))),
            #[cfg(feature = "nccl")]
            Net::Nccl(links, nccl) => self.on_links(links, |cx| f(&mut Exec::Nccl(cx, nccl))),
            #[cfg(feature = "mpi")]
            Net::Mpi(world) => world.run(kind.ds_name(), &self.ranks, self.me, |g| {
                f(&mut Exec::Mpi(g))
            }),
        }
    }

    /// Runs `f` with the group's view of the links, under the collective's deadline.
    fn on_links<R>(&self, links: &Mutex<Links>, f: impl FnOnce(&mut Ctx) -> R) -> R {
        let mut links = links.lock().unwrap();
        let mut cx = Ctx {
            links: &mut links,
            ranks: &self.ranks,
            me: self.me,
            deadline: Deadline::after(self.shared.timeout),
        };
        f(&mut cx)
    }

    /// Failures cascade: a rank that loses its peer stops, and its own peers then lose it.
    /// Each failing rank leaves its cause in the store first, so that a rank that lost a peer
    /// can tell whether that peer merely failed because of another, and name the first.
    fn root_cause(&self, e: CommError) -> CommError {
        let Some(store) = &self.shared.store else {
            return e;
        };
        let _ = store.set(
            &format!("failed/{}", self.shared.rank),
            e.to_string().as_bytes(),
        );
        let CommError::PeerLost { what, peer, cause } = e else {
            return e;
        };
        let theirs = store
            .get_within(&format!("failed/{peer}"), FAILURE_NOTE_WAIT)
            .ok()
            .flatten();
        match theirs.map(|t| String::from_utf8_lossy(&t).into_owned()) {
            Some(t) => CommError::PeerLost {
                what,
                peer,
                cause: format!("{cause}; rank {peer} had failed first: {t}"),
            },
            None => CommError::PeerLost { what, peer, cause },
        }
    }

    fn log(&self, kind: OpKind, bytes: u64, latency: Duration) {
        if let Some(l) = &self.shared.logger {
            let mut l = l.lock().unwrap();
            if l.wants(kind) {
                l.record(kind, bytes, latency, self.size());
            }
        }
    }
}
