//! Length-prefixed frames and the little field codec of the store and the peer handshakes.
//! Every read is capped: a peer cannot make us allocate more than the cap by lying about a length.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

/// The largest frame the store and the handshakes accept (keys, addresses, NCCL ids are tiny).
pub(crate) const MAX_FRAME: usize = 1 << 20;

pub(crate) fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| invalid("frame longer than 4 GiB"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

pub(crate) fn read_frame(r: &mut impl Read, cap: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > cap {
        return Err(invalid(&format!(
            "frame of {len} bytes exceeds the cap of {cap}"
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(payload)
}

/// `read_frame` with one deadline for the whole frame. A per-read timeout alone lets a
/// stranger that sends a byte every few seconds hold the connection, and its thread, for ever.
pub(crate) fn read_frame_by(stream: &TcpStream, cap: usize, until: Instant) -> io::Result<Vec<u8>> {
    read_frame(&mut ReadBy { stream, until }, cap)
}

struct ReadBy<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Read for ReadBy<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        (&mut &*self.stream).read(buf)
    }
}

pub(crate) fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// Builds a frame's payload field by field.
#[derive(Default)]
pub(crate) struct Encoder(pub Vec<u8>);

impl Encoder {
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(self, v: i64) -> Self {
        self.u64(v as u64)
    }
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }
    pub fn strs(self, v: &[String]) -> Self {
        let mut e = self.u64(v.len() as u64);
        for s in v {
            e = e.str(s);
        }
        e
    }
}

/// Reads fields back; any shortfall or bad UTF-8 is an InvalidData error, never a panic.
pub(crate) struct Decoder<'a>(pub &'a [u8]);

impl Decoder<'_> {
    fn take(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(invalid("truncated message"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn i64(&mut self) -> io::Result<i64> {
        Ok(self.u64()? as i64)
    }
    pub fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as usize;
        Ok(self.take(n)?.to_vec())
    }
    pub fn str(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?).map_err(|_| invalid("string is not UTF-8"))
    }
    pub fn strs(&mut self) -> io::Result<Vec<String>> {
        let n = self.u64()?;
        if n > MAX_FRAME as u64 {
            return Err(invalid("list too long"));
        }
        (0..n).map(|_| self.str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_lengths_are_capped() {
        let mut wire = Vec::new();
        let msg = Encoder::default()
            .u8(3)
            .str("key")
            .bytes(b"v")
            .i64(-5)
            .strs(&["a".into()]);
        write_frame(&mut wire, &msg.0).unwrap();
        let got = read_frame(&mut wire.as_slice(), MAX_FRAME).unwrap();
        let mut d = Decoder(&got);
        assert_eq!((d.u8().unwrap(), d.str().unwrap()), (3, "key".to_string()));
        assert_eq!((d.bytes().unwrap(), d.i64().unwrap()), (b"v".to_vec(), -5));
        assert_eq!(d.strs().unwrap(), vec!["a".to_string()]);
        assert!(d.u8().is_err(), "reading past the end is an error");

        let huge = u32::MAX.to_le_bytes();
        let err = read_frame(&mut huge.as_slice(), MAX_FRAME).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
