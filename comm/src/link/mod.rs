//! Point-to-point links between two ranks: TCP between hosts, shared memory within one.
//!
//! A link moves whole messages, non-blocking: the exchange engine drives many links at once
//! so that sending, receiving and reducing overlap. Pieces handed to a receive sink are
//! multiples of 8 bytes (so element casts are aligned) except a message's last piece.

pub(crate) mod shm;
pub(crate) mod tcp;

use std::os::fd::RawFd;

/// Why a link failed; the exchange engine turns it into an error naming the peer.
pub(crate) type LinkResult<T> = std::result::Result<T, String>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkKind {
    Tcp,
    Shm,
}

pub(crate) trait Link: Send {
    fn kind(&self) -> LinkKind;
    /// The socket to poll: the data socket of a TCP link, the liveness socket of a shm link.
    fn fd(&self) -> RawFd;
    /// Writes more of `msg` from `*done` on, without blocking; true when it made progress.
    fn try_send(&mut self, msg: &[u8], done: &mut usize) -> LinkResult<bool>;
    /// Hands more of a `len`-byte message to `sink(offset, bytes)`, without blocking.
    fn try_recv(&mut self, len: usize, done: &mut usize, sink: &mut Sink) -> LinkResult<bool>;
    /// Err when the peer is known to be gone (for links whose data path cannot see it).
    /// `receiving`: this rank waits for data from the peer, which a peer that sent its last
    /// message and exited may have left unread.
    fn check_alive(&mut self, receiving: bool) -> LinkResult<()>;
}

/// Where received bytes go: straight into a buffer (a TCP link then reads into it with no
/// staging copy), or through a function (a reduction).
pub(crate) enum Sink<'a> {
    Into(&'a mut [u8]),
    Fold(&'a mut dyn FnMut(usize, &[u8])),
}

impl Sink<'_> {
    pub fn put(&mut self, offset: usize, bytes: &[u8]) {
        match self {
            Sink::Into(dst) => dst[offset..offset + bytes.len()].copy_from_slice(bytes),
            Sink::Fold(f) => f(offset, bytes),
        }
    }
}

/// The links of one rank, indexed by global peer rank (None for itself).
pub(crate) struct Links {
    pub links: Vec<Option<Box<dyn Link>>>,
}

impl Links {
    pub fn get(&mut self, peer: usize) -> &mut dyn Link {
        self.links[peer].as_deref_mut().expect("no link to self")
    }
}

pub(crate) fn round8(n: usize) -> usize {
    (n + 7) & !7
}

/// True when `fd` has hung up or has bytes to read (a shm link's liveness socket never
/// carries data, so either means the peer is gone).
pub(crate) fn socket_closed(fd: RawFd) -> bool {
    let mut byte = 0u8;
    // SAFETY: a one-byte peek into a local buffer on a socket we own.
    let n = unsafe {
        libc::recv(
            fd,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return true;
    }
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        );
    }
    true
}
