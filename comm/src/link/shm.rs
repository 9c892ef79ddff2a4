//! A shared-memory link between two ranks of one host: two single-producer single-consumer
//! byte rings in one file under /dev/shm (NCCL's SHM transport and DeepSpeed's CPU shm
//! all-reduce do the same). The rings are small so that a chunk a rank writes is still in
//! the shared cache when its peer reads it. The pair's TCP connection stays open beside it
//! only to notice a peer that dies: the kernel closes its socket.

use super::{round8, socket_closed, Link, LinkKind, LinkResult, Sink};
use memmap2::{MmapMut, MmapOptions};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes of data per ring (per direction).
const CAP: usize = 1 << 20;
/// Header page per ring: head, tail and closed on separate cache lines.
const HEADER: usize = 4096;
const RING: usize = HEADER + CAP;
/// The file holds both directions: the lower rank's outgoing ring first.
pub(crate) const FILE_SIZE: usize = 2 * RING;

struct Ring {
    base: *mut u8,
}

impl Ring {
    fn head(&self) -> &AtomicU64 {
        // SAFETY: base points at a live, page-aligned mapping of RING bytes (see ShmLink).
        unsafe { &*(self.base as *const AtomicU64) }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as above; offset 128 is 8-aligned and inside the header.
        unsafe { &*(self.base.add(128) as *const AtomicU64) }
    }
    fn closed(&self) -> &AtomicU32 {
        // SAFETY: as above; offset 256 is inside the header.
        unsafe { &*(self.base.add(256) as *const AtomicU32) }
    }
    fn data(&self, pos: u64) -> *mut u8 {
        // SAFETY: pos % CAP < CAP, inside the data area.
        unsafe { self.base.add(HEADER + (pos as usize % CAP)) }
    }

    /// Writes up to `bytes.len()` bytes; returns how many (a multiple of 8 unless all of them).
    fn push(&self, bytes: &[u8]) -> usize {
        let head = self.head().load(Ordering::Relaxed);
        let free = CAP - (head - self.tail().load(Ordering::Acquire)) as usize;
        let n = if bytes.len() <= free {
            bytes.len()
        } else {
            free
        };
        if n == 0 {
            return 0;
        }
        let first = n.min(CAP - head as usize % CAP);
        // SAFETY: the region [head, head+n) is free (the consumer is behind `free`), and the
        // two pieces lie inside the data area; source and ring never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data(head), first);
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr().add(first),
                self.data(head + first as u64),
                n - first,
            );
        }
        // Positions stay multiples of 8: a message's unaligned end is padded.
        self.head()
            .store(head + round8(n) as u64, Ordering::Release);
        n
    }

    /// Bytes written and not yet read.
    fn unread(&self) -> u64 {
        self.head().load(Ordering::Acquire) - self.tail().load(Ordering::Relaxed)
    }

    /// Hands up to `want` readable bytes to `sink` in contiguous pieces; returns how many.
    fn pop(&self, want: usize, offset: usize, sink: &mut Sink) -> usize {
        let tail = self.tail().load(Ordering::Relaxed);
        let avail = (self.head().load(Ordering::Acquire) - tail) as usize;
        let n = want.min(avail);
        if n == 0 {
            return 0;
        }
        let first = n.min(CAP - tail as usize % CAP);
        // SAFETY: [tail, tail+n) was published by the producer's Release store of head and is
        // not rewritten until we advance tail.
        unsafe {
            sink.put(offset, std::slice::from_raw_parts(self.data(tail), first));
            if n > first {
                sink.put(
                    offset + first,
                    std::slice::from_raw_parts(self.data(tail + first as u64), n - first),
                );
            }
        }
        let advance = if n == want { round8(n) } else { n };
        self.tail().store(tail + advance as u64, Ordering::Release);
        n
    }
}

pub(crate) struct ShmLink {
    _map: MmapMut,
    tx: Ring,
    rx: Ring,
    control: TcpStream,
}

// SAFETY: the rings point into `_map`, which the link owns and which lives as long as it;
// each ring end is used by one thread at a time (the link is not Sync).
unsafe impl Send for ShmLink {}

impl ShmLink {
    /// Creates the pair's file (the lower rank does); the caller unlinks it once both mapped it.
    pub fn create(path: &Path, control: TcpStream) -> std::io::Result<ShmLink> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(FILE_SIZE as u64)?;
        // Allocate every page now: a page the first lap of a ring touches would otherwise
        // fault (tmpfs allocates and zeroes it), ~5 us on the first small messages.
        // SAFETY: fallocate on a file we own; failure leaves the file sparse, which works.
        unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, FILE_SIZE as libc::off_t) };
        Self::map(&file, control, true)
    }

    /// Maps the file its lower-ranked peer created. (The caller makes `control` non-blocking
    /// once the pair's handshake on it is over.)
    pub fn open(path: &Path, control: TcpStream) -> std::io::Result<ShmLink> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        if file.metadata()?.len() != FILE_SIZE as u64 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "shared-memory file has the wrong size",
            ));
        }
        Self::map(&file, control, false)
    }

    fn map(file: &std::fs::File, control: TcpStream, lower: bool) -> std::io::Result<ShmLink> {
        // SAFETY: the file is private to this job (0600, random name) and is only accessed
        // through the atomics and the ring protocol above.
        // populate: map every page up front, for the same reason as the fallocate in create.
        let mut map = unsafe { MmapOptions::new().populate().map_mut(file)? };
        let base = map.as_mut_ptr();
        // SAFETY: RING < FILE_SIZE; both rings are inside the mapping.
        let (first, second) = (
            Ring { base },
            Ring {
                base: unsafe { base.add(RING) },
            },
        );
        let (tx, rx) = if lower {
            (first, second)
        } else {
            (second, first)
        };
        Ok(ShmLink {
            _map: map,
            tx,
            rx,
            control,
        })
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.tx.closed().store(1, Ordering::Release);
        self.rx.closed().store(1, Ordering::Release);
    }
}

impl Link for ShmLink {
    fn kind(&self) -> LinkKind {
        LinkKind::Shm
    }

    fn fd(&self) -> RawFd {
        self.control.as_raw_fd()
    }

    fn try_send(&mut self, msg: &[u8], done: &mut usize) -> LinkResult<bool> {
        if self.tx.closed().load(Ordering::Acquire) != 0 {
            return Err("peer closed its shared-memory link".into());
        }
        let n = self.tx.push(&msg[*done..]);
        *done += n;
        Ok(n > 0)
    }

    fn try_recv(&mut self, len: usize, done: &mut usize, sink: &mut Sink) -> LinkResult<bool> {
        let mut n = self.rx.pop(len - *done, *done, sink);
        if n == 0 && self.rx.closed().load(Ordering::Acquire) != 0 {
            // A peer may write its last message and close between our pop and this load:
            // what it wrote before closing is visible now, so look once more.
            n = self.rx.pop(len - *done, *done, sink);
            if n == 0 {
                return Err("peer closed its shared-memory link".into());
            }
        }
        *done += n;
        Ok(n > 0)
    }

    fn check_alive(&mut self, receiving: bool) -> LinkResult<()> {
        // A peer that wrote its last message and exited is not lost: the message is ours.
        if !socket_closed(self.control.as_raw_fd()) || (receiving && self.rx.unread() > 0) {
            return Ok(());
        }
        Err("peer's connection closed (process gone?)".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair of links over a fresh file, as the rendezvous makes them.
    fn pair() -> (ShmLink, ShmLink) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        let path = std::env::temp_dir().join(format!("ds-rs-shm-test-{}", std::process::id()));
        let lower = ShmLink::create(&path, a).unwrap();
        let upper = ShmLink::open(&path, b).unwrap();
        std::fs::remove_file(&path).unwrap();
        (lower, upper)
    }

    /// Receives a `len`-byte message, or as much of it as is there.
    fn recv(link: &mut ShmLink, len: usize) -> LinkResult<Vec<u8>> {
        let mut got = vec![0u8; len];
        let mut done = 0;
        link.try_recv(len, &mut done, &mut Sink::Into(&mut got))?;
        got.truncate(done);
        Ok(got)
    }

    #[test]
    fn a_peer_that_sent_and_left_is_read_before_it_is_declared_lost() {
        let (mut lower, mut upper) = pair();
        let msg = [7u8; 24];
        let mut sent = 0;
        assert!(upper.try_send(&msg, &mut sent).unwrap());
        // The peer exits: its socket closes and its rings are marked closed.
        drop(upper);
        // Waiting for data, the message left behind keeps the peer from being lost...
        assert!(lower.check_alive(true).is_ok());
        // ...but a rank that only waits to send to it learns at once that it is gone.
        assert!(lower.check_alive(false).is_err());
        assert_eq!(recv(&mut lower, 24).unwrap(), msg);
        // Everything read, the peer is gone on both counts.
        assert!(lower.check_alive(true).is_err());
        assert!(recv(&mut lower, 8).is_err());
    }
}
