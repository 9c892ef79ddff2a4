//! Carries a rank's output to the launcher's console, each line prefixed with the rank
//! (`[rank3] ...`), and optionally into a per-rank log file. A carriage return ends a segment
//! too, so that a progress bar redrawn in place stays one line on a terminal.

use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Where one rank's output goes.
#[derive(Clone)]
pub struct Sink {
    /// `[rankN] `, or empty to pass output through unchanged.
    pub prefix: String,
    /// False with DeepSpeed's --enable_each_rank_log: the log file only.
    pub console: bool,
    pub log: Option<Arc<Mutex<File>>>,
}

/// Which console stream a pipe is relayed to.
#[derive(Clone, Copy)]
pub enum Stream {
    Out,
    Err,
}

/// Relays `pipe` until it closes (the rank and everything it started have exited).
pub fn spawn(pipe: impl Read + Send + 'static, stream: Stream, sink: Sink) -> JoinHandle<()> {
    std::thread::spawn(move || relay(pipe, stream, &sink))
}

fn relay(mut pipe: impl Read, stream: Stream, sink: &Sink) {
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        while let Some(end) = pending.iter().position(|&b| b == b'\n' || b == b'\r') {
            let segment: Vec<u8> = pending.drain(..=end).collect();
            emit(&segment, stream, sink);
        }
    }
    if !pending.is_empty() {
        pending.push(b'\n');
        emit(&pending, stream, sink);
    }
}

/// Writes one whole segment at once, so lines of different ranks never interleave.
fn emit(segment: &[u8], stream: Stream, sink: &Sink) {
    if let Some(log) = &sink.log {
        if let Ok(mut f) = log.lock() {
            let _ = f.write_all(segment);
        }
    }
    if !sink.console {
        return;
    }
    let mut line = Vec::with_capacity(sink.prefix.len() + segment.len());
    line.extend_from_slice(sink.prefix.as_bytes());
    line.extend_from_slice(segment);
    // A closed console (the launcher's reader went away) must not stop the relay: the rank
    // would block on a full pipe.
    let _ = match stream {
        Stream::Out => std::io::stdout().lock().write_all(&line),
        Stream::Err => std::io::stderr().lock().write_all(&line),
    };
}
