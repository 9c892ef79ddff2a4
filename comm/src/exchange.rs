//! The progress engine: drives a set of sends and receives over the links until all are
//! done, never blocking on one while another could move, and never longer than the deadline.
//!
//! Ops to or from one peer run in list order (a link is one byte stream). Two gates let a
//! whole ring schedule run as one exchange, each piece moving on as soon as it can (NCCL's
//! pipelined ring): a send may relay a receive, going no further than the bytes that
//! receive has delivered, and a receive may wait until a send has finished reading the
//! region it is about to overwrite.

use crate::error::{CommError, Result};
use crate::link::{LinkKind, Links, Sink};
use std::marker::PhantomData;
use std::time::{Duration, Instant};

/// Bytes an op reads or writes. Several ops of one exchange may name the same bytes (a
/// relay sends what a receive wrote); the engine orders them by the gates and only ever
/// holds one slice of a buffer at a time, inside one link call.
#[derive(Clone, Copy)]
pub(crate) struct Region<'a> {
    ptr: *mut u8,
    len: usize,
    /// False for bytes that came from a shared reference (`of`): no receive may write them.
    writable: bool,
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> Region<'a> {
    /// Bytes that are only read.
    pub fn of(bytes: &'a [u8]) -> Region<'a> {
        Region {
            ptr: bytes.as_ptr().cast_mut(),
            len: bytes.len(),
            writable: false,
            _buf: PhantomData,
        }
    }

    /// A whole buffer, which ops may read and write.
    pub fn whole<T: bytemuck::Pod>(buf: &'a mut [T]) -> Region<'a> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        Region {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            writable: true,
            _buf: PhantomData,
        }
    }

    /// The regions `ranges` (in elements) of one buffer, which ops may then both read and
    /// write.
    pub fn parts<T: bytemuck::Pod>(
        buf: &'a mut [T],
        ranges: &[std::ops::Range<usize>],
    ) -> Vec<Region<'a>> {
        let size = std::mem::size_of::<T>();
        let base = buf.as_mut_ptr().cast::<u8>();
        ranges
            .iter()
            .map(|r| {
                assert!(r.start <= r.end && r.end <= buf.len(), "part out of range");
                Region {
                    // SAFETY: r lies inside buf (asserted), so the offset stays inside it.
                    ptr: unsafe { base.add(r.start * size) },
                    len: r.len() * size,
                    writable: true,
                    _buf: PhantomData,
                }
            })
            .collect()
    }

    /// SAFETY: no other slice of these bytes may be alive while the result is; the engine
    /// keeps every slice inside one link call.
    unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.ptr, self.len)
    }

    /// SAFETY: as for `bytes`, and the region must come from a mutable buffer (`parts`).
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// Folds received bytes into their destination: (offset in the message, destination piece,
/// received piece).
pub(crate) type Reduce<'a> = &'a dyn Fn(usize, &mut [u8], &[u8]);

pub(crate) struct SendOp<'a> {
    peer: usize,
    data: Region<'a>,
    done: usize,
    /// Relays receive `i`: only bytes that receive has delivered may go.
    relays: Option<usize>,
}

pub(crate) struct RecvOp<'a> {
    peer: usize,
    into: Region<'a>,
    done: usize,
    reduce: Option<Reduce<'a>>,
    /// Starts only once send `i` has finished reading `into`.
    after_send: Option<usize>,
}

impl<'a> SendOp<'a> {
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        Self::region(peer, Region::of(data))
    }

    pub fn region(peer: usize, data: Region<'a>) -> Self {
        SendOp {
            peer,
            data,
            done: 0,
            relays: None,
        }
    }

    /// Sends `data` as receive `recv` of the same exchange delivers it.
    pub fn relay(mut self, recv: usize) -> Self {
        self.relays = Some(recv);
        self
    }
}

impl<'a> RecvOp<'a> {
    /// Receives `dst.len()` bytes into `dst`.
    pub fn to(peer: usize, dst: &'a mut [u8]) -> Self {
        Self::region(peer, Region::whole(dst))
    }

    pub fn region(peer: usize, into: Region<'a>) -> Self {
        assert!(into.writable, "a receive into read-only bytes");
        RecvOp {
            peer,
            into,
            done: 0,
            reduce: None,
            after_send: None,
        }
    }

    /// Folds the received bytes into the destination instead of copying them.
    pub fn reducing(mut self, reduce: Reduce<'a>) -> Self {
        self.reduce = Some(reduce);
        self
    }

    /// Waits for send `send` of the same exchange to finish before writing anything.
    pub fn after_send(mut self, send: usize) -> Self {
        self.after_send = Some(send);
        self
    }
}

/// How long a collective may wait for its peers.
#[derive(Clone, Copy)]
pub(crate) struct Deadline {
    pub at: Instant,
    pub timeout: Duration,
}

impl Deadline {
    pub fn after(timeout: Duration) -> Deadline {
        Deadline {
            at: Instant::now() + timeout,
            timeout,
        }
    }
}

pub(crate) fn exchange(
    links: &mut Links,
    sends: &mut [SendOp],
    recvs: &mut [RecvOp],
    deadline: Deadline,
) -> Result<()> {
    check_gates(sends, recvs);
    let (mut idle, mut waits) = (Idle::default(), Waits::default());
    loop {
        let (mut progress, mut unfinished) = (false, false);
        waits.clear(); // reused: this loop spins, and should not allocate each turn
        for s in sends.iter_mut() {
            let ready = s.relays.map_or(s.data.len, |r| recvs[r].done);
            unfinished |= s.done < s.data.len;
            let unheld = s.done < ready;
            if !waits.claim(s.peer, s.done < s.data.len, libc::POLLOUT, unheld) || !unheld {
                continue;
            }
            // SAFETY: the only slice of these bytes alive, for this one call.
            let msg = unsafe { &s.data.bytes()[..ready] };
            progress |= links
                .get(s.peer)
                .try_send(msg, &mut s.done)
                .map_err(|c| lost(s.peer, c))?;
        }
        for r in recvs.iter_mut() {
            let gated = r
                .after_send
                .is_some_and(|s| sends[s].done < sends[s].data.len);
            unfinished |= r.done < r.into.len;
            if !waits.claim(r.peer, r.done < r.into.len, libc::POLLIN, !gated) || gated {
                continue;
            }
            progress |= receive(links, r)?;
        }
        if !unfinished {
            return Ok(());
        }
        if progress {
            idle = Idle::default();
        } else {
            idle.wait(links, &waits, deadline)?;
        }
    }
}

fn receive(links: &mut Links, r: &mut RecvOp) -> Result<bool> {
    // SAFETY: the only slice of these bytes alive, for this one call.
    let dst = unsafe { r.into.bytes_mut() };
    let link = links.get(r.peer);
    let moved = match r.reduce {
        None => link.try_recv(r.into.len, &mut r.done, &mut Sink::Into(dst)),
        Some(reduce) => {
            let mut fold =
                |off: usize, raw: &[u8]| reduce(off, &mut dst[off..off + raw.len()], raw);
            link.try_recv(r.into.len, &mut r.done, &mut Sink::Fold(&mut fold))
        }
    };
    moved.map_err(|c| lost(r.peer, c))
}

/// Gates may only point backwards in a ring schedule's order, so some op can always move.
fn check_gates(sends: &[SendOp], recvs: &[RecvOp]) {
    for s in sends {
        if let Some(r) = s.relays {
            debug_assert_eq!(
                recvs[r].into.len, s.data.len,
                "a relay sends what it receives"
            );
        }
    }
    for r in recvs {
        debug_assert!(r.after_send.is_none_or(|s| s < sends.len()));
    }
}

fn lost(peer: usize, cause: String) -> CommError {
    CommError::PeerLost {
        what: "exchange".into(),
        peer,
        cause,
    }
}

/// Which peer and direction an unfinished op already holds (ops of one peer run in order),
/// and the poll events of those that can move now (not held by a gate).
#[derive(Default)]
struct Waits {
    held: Vec<(usize, libc::c_short)>,
    polls: Vec<(usize, libc::c_short)>,
}

impl Waits {
    /// True when an unfinished op is the first of its peer in its direction.
    fn claim(&mut self, peer: usize, unfinished: bool, event: libc::c_short, unheld: bool) -> bool {
        if !unfinished || self.held.contains(&(peer, event)) {
            return false;
        }
        self.held.push((peer, event));
        if unheld {
            self.polls.push((peer, event));
        }
        true
    }
    fn clear(&mut self) {
        self.held.clear();
        self.polls.clear();
    }
    fn peers(&self) -> Vec<usize> {
        let mut p: Vec<usize> = self.polls.iter().map(|(p, _)| *p).collect();
        p.sort_unstable();
        p.dedup();
        p
    }
}

/// Backing off while nothing moves: spin briefly (a shm peer is usually a few hundred
/// nanoseconds behind), then yield, then sleep or poll; check liveness and the deadline.
#[derive(Default)]
struct Idle {
    rounds: u32,
    last_check: Option<Instant>,
}

const SPIN_ROUNDS: u32 = 200;
const YIELD_ROUNDS: u32 = 2000;
const LIVENESS_EVERY: Duration = Duration::from_millis(20);

impl Idle {
    fn wait(&mut self, links: &mut Links, pending: &Waits, deadline: Deadline) -> Result<()> {
        self.rounds += 1;
        let any_shm = pending
            .polls
            .iter()
            .any(|(p, _)| links.get(*p).kind() == LinkKind::Shm);
        if any_shm && self.rounds < SPIN_ROUNDS {
            std::hint::spin_loop();
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline.at {
            return Err(CommError::Timeout {
                what: "exchange".into(),
                missing: pending.peers(),
                after: deadline.timeout,
            });
        }
        if self.last_check.is_none_or(|t| now - t >= LIVENESS_EVERY) {
            self.last_check = Some(now);
            for p in pending.peers() {
                let receiving = pending.polls.contains(&(p, libc::POLLIN));
                links
                    .get(p)
                    .check_alive(receiving)
                    .map_err(|c| lost(p, c))?;
            }
        }
        if any_shm {
            match self.rounds < YIELD_ROUNDS {
                true => std::thread::yield_now(),
                false => std::thread::sleep(Duration::from_micros(50)),
            }
            return Ok(());
        }
        let left = deadline.at - now;
        poll(links, pending, left.min(LIVENESS_EVERY));
        Ok(())
    }
}

/// Sleeps until one of the pending TCP sockets is ready (or the timeout passes).
fn poll(links: &mut Links, pending: &Waits, timeout: Duration) {
    let mut fds: Vec<libc::pollfd> = pending
        .polls
        .iter()
        .map(|(p, ev)| libc::pollfd {
            fd: links.get(*p).fd(),
            events: *ev,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: fds is a valid array of pollfd for the duration of the call.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
}
