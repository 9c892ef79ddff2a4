//! The progress engine: drives a set of sends and receives over the links until all are
//! done, never blocking on one while another could move, and never longer than the deadline.

use crate::error::{CommError, Result};
use crate::link::{LinkKind, Links, Sink};
use std::time::{Duration, Instant};

pub(crate) struct SendOp<'a> {
    pub peer: usize,
    pub data: &'a [u8],
    pub done: usize,
}

pub(crate) struct RecvOp<'a> {
    pub peer: usize,
    pub len: usize,
    pub done: usize,
    pub sink: Sink<'a>,
}

impl<'a> SendOp<'a> {
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        SendOp {
            peer,
            data,
            done: 0,
        }
    }
}

impl<'a> RecvOp<'a> {
    /// Hands (offset in the message, bytes) to `fold` as they arrive.
    pub fn new(peer: usize, len: usize, fold: &'a mut dyn FnMut(usize, &[u8])) -> Self {
        RecvOp {
            peer,
            len,
            done: 0,
            sink: Sink::Fold(fold),
        }
    }

    /// Receives `dst.len()` bytes into `dst`.
    pub fn to(peer: usize, dst: &'a mut [u8]) -> Self {
        RecvOp {
            peer,
            len: dst.len(),
            done: 0,
            sink: Sink::Into(dst),
        }
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
    let mut idle = Idle::default();
    loop {
        let mut progress = false;
        for s in sends.iter_mut().filter(|s| s.done < s.data.len()) {
            progress |= links
                .get(s.peer)
                .try_send(s.data, &mut s.done)
                .map_err(|c| lost(s.peer, c))?;
        }
        for r in recvs.iter_mut().filter(|r| r.done < r.len) {
            progress |= links
                .get(r.peer)
                .try_recv(r.len, &mut r.done, &mut r.sink)
                .map_err(|c| lost(r.peer, c))?;
        }
        let pending = Pending::of(sends, recvs);
        if pending.is_empty() {
            return Ok(());
        }
        if progress {
            idle = Idle::default();
        } else {
            idle.wait(links, &pending, deadline)?;
        }
    }
}

fn lost(peer: usize, cause: String) -> CommError {
    CommError::PeerLost {
        what: "exchange".into(),
        peer,
        cause,
    }
}

/// The peers an exchange still waits on, with the poll events each needs.
struct Pending(Vec<(usize, libc::c_short)>);

impl Pending {
    fn of(sends: &[SendOp], recvs: &[RecvOp]) -> Pending {
        let s = sends
            .iter()
            .filter(|s| s.done < s.data.len())
            .map(|s| (s.peer, libc::POLLOUT));
        let r = recvs
            .iter()
            .filter(|r| r.done < r.len)
            .map(|r| (r.peer, libc::POLLIN));
        Pending(s.chain(r).collect())
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn peers(&self) -> Vec<usize> {
        let mut p: Vec<usize> = self.0.iter().map(|(p, _)| *p).collect();
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
    fn wait(&mut self, links: &mut Links, pending: &Pending, deadline: Deadline) -> Result<()> {
        self.rounds += 1;
        let any_shm = pending
            .0
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
                links.get(p).check_alive().map_err(|c| lost(p, c))?;
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
fn poll(links: &mut Links, pending: &Pending, timeout: Duration) {
    let mut fds: Vec<libc::pollfd> = pending
        .0
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
