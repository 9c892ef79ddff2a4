//! A TCP link: one persistent, non-blocking connection per peer pair.

use super::{Link, LinkKind, LinkResult, Sink};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

/// Receive staging: large enough that one syscall moves a lot, small enough to stay in L2.
const STAGING: usize = 512 << 10;

pub(crate) struct TcpLink {
    stream: TcpStream,
    /// Bytes read but not yet handed out; backed by u64 so the pieces are 8-byte aligned.
    staging: Vec<u64>,
    have: usize,
}

impl TcpLink {
    pub fn new(stream: TcpStream) -> std::io::Result<TcpLink> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        set_buffer_sizes(&stream);
        Ok(TcpLink {
            stream,
            staging: vec![0u64; STAGING / 8],
            have: 0,
        })
    }

    fn staging(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.staging)
    }
}

/// Big socket buffers let a whole chunk be in flight while we reduce the previous one.
fn set_buffer_sizes(stream: &TcpStream) {
    let size: libc::c_int = 4 << 20;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: setsockopt with a valid int option on a socket we own; failure is harmless.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

impl Link for TcpLink {
    fn kind(&self) -> LinkKind {
        LinkKind::Tcp
    }

    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    fn try_send(&mut self, msg: &[u8], done: &mut usize) -> LinkResult<bool> {
        let mut progress = false;
        while *done < msg.len() {
            match self.stream.write(&msg[*done..]) {
                Ok(0) => return Err("connection closed".into()),
                Ok(n) => {
                    *done += n;
                    progress = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(progress)
    }

    fn try_recv(&mut self, len: usize, done: &mut usize, sink: &mut Sink) -> LinkResult<bool> {
        let mut progress = false;
        while *done < len {
            let want = len - *done;
            // Hand out whole 8-byte units, or everything that is left of the message.
            let n = if self.have >= want {
                want
            } else {
                self.have & !7
            };
            if n > 0 {
                let have = self.have;
                let staging = self.staging();
                sink.put(*done, &staging[..n]);
                staging.copy_within(n..have, 0);
                self.have -= n;
                *done += n;
                progress = true;
                continue;
            }
            let have = self.have;
            // A plain copy reads straight into its destination once the staging is drained.
            let (read, direct) = match sink {
                Sink::Into(dst) if have == 0 => (self.stream.read(&mut dst[*done..len]), true),
                _ => {
                    let staging = bytemuck::cast_slice_mut::<u64, u8>(&mut self.staging);
                    (self.stream.read(&mut staging[have..]), false)
                }
            };
            match read {
                Ok(0) => return Err("connection closed".into()),
                Ok(k) if direct => {
                    *done += k;
                    progress = true;
                }
                Ok(k) => self.have += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(progress)
    }

    fn check_alive(&mut self, _receiving: bool) -> LinkResult<()> {
        Ok(()) // the data path itself reports a closed connection
    }
}
