//! The NVMe tier (ZeRO-Infinity): fp32 arrays kept in files instead of memory, and streamed
//! through a few chunk buffers when a step needs them (DeepSpeed's pipelined swapper,
//! runtime/swap_tensor/pipelined_optimizer_swapper.py): while chunk i is updated, chunk i + 1
//! is read and chunk i - 1 written back on an I/O thread, so the resident cost is
//! `buffer_count` chunks whatever the array's length.
//!
//! Positional reads and writes (`pread`/`pwrite`) into owned buffers, not a memory map: a
//! mapped file's touched pages count in the process's resident set (and in a cgroup's
//! memory) until the kernel chooses to drop them, which is the memory offloading must give
//! back; buffers we own are the only resident cost, and the page cache behind them is the
//! kernel's to reclaim.
//!
//! Each rank's files are created under `nvme_path` and unlinked as soon as they are open: the
//! open descriptor keeps the data, and the kernel frees the blocks when the process ends,
//! however it ends (an error, SIGTERM, SIGKILL or the OOM killer), so no run leaves a swap
//! file behind and none has to be cleaned up.

use std::fs::File;
use std::ops::{AddAssign, Sub};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::{PartitionError, Result};

/// The bytes a rank's swap files read and wrote, and the time their reads and writes took
/// (shared by a rank's swap files; `bench train` reports it per step).
#[derive(Debug, Default)]
pub struct SwapIo {
    read: AtomicU64,
    written: AtomicU64,
    busy_ns: AtomicU64,
}

/// A reading of `SwapIo`; the difference of two is what happened between them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoTotals {
    pub read_bytes: u64,
    pub written_bytes: u64,
    /// Time inside reads and writes (summed over the threads doing them).
    pub busy: Duration,
}

impl SwapIo {
    pub fn totals(&self) -> IoTotals {
        IoTotals {
            read_bytes: self.read.load(Ordering::Relaxed),
            written_bytes: self.written.load(Ordering::Relaxed),
            busy: Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed)),
        }
    }

    fn record(&self, counter: &AtomicU64, bytes: usize, since: Instant) {
        counter.fetch_add(bytes as u64, Ordering::Relaxed);
        let ns = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
    }
}

impl IoTotals {
    /// MiB read and written per second spent inside the reads and writes.
    pub fn mib_per_s(&self) -> f64 {
        let bytes = (self.read_bytes + self.written_bytes) as f64;
        bytes / (1u64 << 20) as f64 / self.busy.as_secs_f64().max(1e-9)
    }
}

impl Sub for IoTotals {
    type Output = IoTotals;
    fn sub(self, earlier: IoTotals) -> IoTotals {
        IoTotals {
            read_bytes: self.read_bytes.saturating_sub(earlier.read_bytes),
            written_bytes: self.written_bytes.saturating_sub(earlier.written_bytes),
            busy: self.busy.saturating_sub(earlier.busy),
        }
    }
}

impl AddAssign for IoTotals {
    fn add_assign(&mut self, other: IoTotals) {
        self.read_bytes += other.read_bytes;
        self.written_bytes += other.written_bytes;
        self.busy += other.busy;
    }
}

/// One rank's swap space for one kind of state under `nvme_path`: its files are named
/// `ds-rs-swap-<pid>-rank<rank>-<tag>-<name>.f32` for the moment between their creation and
/// their unlinking.
#[derive(Debug)]
pub struct SwapSpace {
    dir: PathBuf,
    prefix: String,
    io: Arc<SwapIo>,
}

impl SwapSpace {
    /// This run's space, its files counting their I/O in `io`; the error names `nvme_path`
    /// when it is missing or not a directory (one not writable fails at the first file).
    pub fn create(nvme_path: &Path, rank: usize, tag: &str, io: &Arc<SwapIo>) -> Result<SwapSpace> {
        let bad = |why: String| {
            PartitionError::Invalid(format!("nvme_path {}: {why}", nvme_path.display()))
        };
        match std::fs::metadata(nvme_path) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(bad("not a directory".into())),
            Err(e) => return Err(bad(e.to_string())),
        }
        Ok(SwapSpace {
            dir: nvme_path.to_path_buf(),
            prefix: format!("ds-rs-swap-{}-rank{rank}-{tag}", std::process::id()),
            io: io.clone(),
        })
    }

    /// A new file of `len` f32 values (zeros), its blocks reserved, already unlinked.
    pub fn file(&self, name: &str, len: usize) -> Result<SwapFile> {
        let path = self.dir.join(format!("{}-{name}.f32", self.prefix));
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_error(&path, "creating", e))?;
        std::fs::remove_file(&path).map_err(|e| io_error(&path, "unlinking", e))?;
        let f = SwapFile {
            file,
            path,
            len,
            io: self.io.clone(),
        };
        // every block now: a full disk fails here, not in the middle of a step
        f.allocate()?;
        Ok(f)
    }
}

/// `len` f32 values in a file.
#[derive(Debug)]
pub struct SwapFile {
    file: File,
    /// The name it was created under (for messages: the file itself has none any more).
    path: PathBuf,
    len: usize,
    io: Arc<SwapIo>,
}

impl SwapFile {
    /// Opens an existing file (for tests and tools); its length must hold `len` values.
    pub fn open(path: &Path, len: usize) -> Result<SwapFile> {
        let file = File::options()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| io_error(path, "opening", e))?;
        Ok(SwapFile {
            file,
            path: path.to_path_buf(),
            len,
            io: Arc::default(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reserves every block of the file (reading them gives zeros) without writing them.
    fn allocate(&self) -> Result<()> {
        let bytes = (self.len as u64)
            .checked_mul(4)
            .and_then(|b| libc::off_t::try_from(b).ok())
            .ok_or_else(|| {
                PartitionError::Invalid(format!(
                    "{}: {} values do not fit in a file",
                    self.path.display(),
                    self.len
                ))
            })?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the descriptor is this open file's; posix_fallocate only changes the file's
        // size and blocks.
        match unsafe { libc::posix_fallocate(self.file.as_raw_fd(), 0, bytes) } {
            0 => Ok(()),
            e => Err(io_error(
                &self.path,
                "allocating",
                std::io::Error::from_raw_os_error(e),
            )),
        }
    }

    /// Reads values `at..at + out.len()`.
    pub fn read(&self, at: usize, out: &mut [f32]) -> Result<()> {
        self.check(at, out.len())?;
        let bytes = as_bytes_mut(out);
        let t0 = Instant::now();
        self.file
            .read_exact_at(bytes, (at * 4) as u64)
            .map_err(|e| io_error(&self.path, "reading", e))?;
        self.io.record(&self.io.read, bytes.len(), t0);
        Ok(())
    }

    /// Writes `values` at `at`.
    pub fn write(&self, at: usize, values: &[f32]) -> Result<()> {
        self.check(at, values.len())?;
        let bytes = as_bytes(values);
        let t0 = Instant::now();
        self.file
            .write_all_at(bytes, (at * 4) as u64)
            .map_err(|e| io_error(&self.path, "writing", e))?;
        self.io.record(&self.io.written, bytes.len(), t0);
        Ok(())
    }

    fn check(&self, at: usize, n: usize) -> Result<()> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(PartitionError::Invalid(format!(
                "{}: values {at}..{} outside its {} values",
                self.path.display(),
                at.saturating_add(n),
                self.len
            ))),
        }
    }
}

fn io_error(path: &Path, what: &str, e: std::io::Error) -> PartitionError {
    PartitionError::Invalid(format!("{what} swap file {}: {e}", path.display()))
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every bit pattern is a valid u8 sequence; the length in
    // bytes is 4 per value and the lifetime is the slice's.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; any bytes written make valid f32 values.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Chunk buffers, one per file, travelling between the update and the I/O thread.
type Set = Vec<Vec<f32>>;

enum Job {
    Read(usize, Set),
    Write(usize, Set),
}

enum Done {
    Read(usize, Set, Result<()>),
    Written(Set, Result<()>),
}

/// Streams `files` (of equal length) through memory, `chunk` values at a time, in order:
/// `update(at, buffers)` gets chunk `at..at + n` of every file (one buffer each) and what it
/// leaves there is written back. With `buffers` >= 3 sets, the next chunk is read and the
/// previous one written while `update` runs; the values are the same with any count.
pub fn stream(
    files: &[&SwapFile],
    chunk: usize,
    buffers: usize,
    mut update: impl FnMut(usize, &mut [Vec<f32>]) -> Result<()>,
) -> Result<()> {
    let len = files.first().map_or(0, |f| f.len());
    if files.iter().any(|f| f.len() != len) {
        return Err(PartitionError::Invalid(
            "stream: files of different lengths".into(),
        ));
    }
    let chunk = chunk.max(1);
    let chunks = len.div_ceil(chunk);
    let span = |i: usize| i * chunk..((i + 1) * chunk).min(len);
    std::thread::scope(|s| {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel::<Done>();
        s.spawn(move || {
            for job in job_rx {
                let reply = match job {
                    Job::Read(i, mut set) => {
                        let r = span(i);
                        let res = files.iter().zip(set.iter_mut()).try_for_each(|(f, b)| {
                            b.resize(r.len(), 0.0);
                            f.read(r.start, b)
                        });
                        Done::Read(i, set, res)
                    }
                    Job::Write(i, set) => {
                        let r = span(i);
                        let res = files
                            .iter()
                            .zip(&set)
                            .try_for_each(|(f, b)| f.write(r.start, b));
                        Done::Written(set, res)
                    }
                };
                if done_tx.send(reply).is_err() {
                    return;
                }
            }
        });
        let mut free: Vec<Set> = (0..buffers.max(1))
            .map(|_| files.iter().map(|_| Vec::with_capacity(chunk)).collect())
            .collect();
        let (mut next_read, mut writes_pending) = (0, 0);
        let mut ready: Option<(usize, Set)> = None;
        let mut first_error: Option<PartitionError> = None;
        let io_gone = || PartitionError::Invalid("swap: the I/O thread stopped".into());
        for i in 0..chunks {
            // keep reads ahead while buffers are free
            while next_read < chunks && next_read <= i + 1 && first_error.is_none() {
                let Some(set) = free.pop() else { break };
                jobs.send(Job::Read(next_read, set))
                    .map_err(|_| io_gone())?;
                next_read += 1;
            }
            while ready.is_none() {
                match done.recv().map_err(|_| io_gone())? {
                    Done::Read(j, set, res) => {
                        res?;
                        debug_assert_eq!(j, i, "reads complete in order");
                        ready = Some((j, set));
                    }
                    Done::Written(set, res) => {
                        writes_pending -= 1;
                        if let Err(e) = res {
                            first_error.get_or_insert(e);
                        }
                        free.push(set);
                        // a buffer came back: the read of chunk i may now start
                        if next_read == i && first_error.is_none() {
                            let set = free.pop().expect("just returned");
                            jobs.send(Job::Read(next_read, set))
                                .map_err(|_| io_gone())?;
                            next_read += 1;
                        }
                    }
                }
            }
            if let Some(e) = first_error.take() {
                return Err(e);
            }
            let (j, mut set) = ready.take().expect("read above");
            update(span(j).start, &mut set)?;
            jobs.send(Job::Write(j, set)).map_err(|_| io_gone())?;
            writes_pending += 1;
        }
        drop(jobs);
        while writes_pending > 0 {
            match done.recv().map_err(|_| io_gone())? {
                Done::Written(_, res) => {
                    writes_pending -= 1;
                    res?;
                }
                Done::Read(_, _, res) => res?,
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ds-rs-swap-test-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn values_survive_the_round_trip_and_no_file_is_left_even_while_open() {
        let root = scratch("roundtrip");
        let space = SwapSpace::create(&root, 0, "t", &Arc::default()).unwrap();
        let f = space.file("master", 1000).unwrap();
        assert!(
            std::fs::read_dir(&root).unwrap().next().is_none(),
            "a swap file has a name under nvme_path"
        );
        let values: Vec<f32> = (0..1000)
            .map(|i| (i as f32).sin() * 1e-3 + f32::EPSILON)
            .collect();
        f.write(0, &values).unwrap();
        let mut back = vec![0f32; 1000];
        f.read(0, &mut back).unwrap();
        assert_eq!(
            back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    /// Every element is updated once, in order, with the chunk's values: checked against the
    /// same update applied to an in-memory copy, for buffer counts 1 to 4 and a last chunk
    /// shorter than the others.
    #[test]
    fn streaming_updates_every_chunk_once_whatever_the_buffer_count() {
        let root = scratch("stream");
        let io = Arc::new(SwapIo::default());
        let dir = SwapSpace::create(&root, 3, "t", &io).unwrap();
        let n = 10_007;
        let a0: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b0: Vec<f32> = (0..n).map(|i| (n - i) as f32 * 0.5).collect();
        let expect_a: Vec<f32> = a0.iter().zip(&b0).map(|(a, b)| a * 2.0 + b).collect();
        for buffers in 1..=4 {
            let (a, b) = (
                dir.file(&format!("a{buffers}"), n).unwrap(),
                dir.file(&format!("b{buffers}"), n).unwrap(),
            );
            a.write(0, &a0).unwrap();
            b.write(0, &b0).unwrap();
            let mut seen = Vec::new();
            let before = io.totals();
            stream(&[&a, &b], 1000, buffers, |at, bufs| {
                seen.push(at);
                let (x, y) = bufs.split_at_mut(1);
                for (x, y) in x[0].iter_mut().zip(&y[0]) {
                    *x = *x * 2.0 + *y;
                }
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, (0..n).step_by(1000).collect::<Vec<_>>());
            // each file read once and written once, 4 bytes a value
            let moved = io.totals() - before;
            assert_eq!(
                (moved.read_bytes, moved.written_bytes),
                (8 * n as u64, 8 * n as u64)
            );
            let mut back = vec![0f32; n];
            a.read(0, &mut back).unwrap();
            assert_eq!(back, expect_a, "buffers {buffers}");
            b.read(0, &mut back).unwrap();
            assert_eq!(back, b0, "buffers {buffers}: b changed");
        }
        drop(dir);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_missing_or_unwritable_path_and_a_full_disk_are_named() {
        let missing = std::env::temp_dir().join("ds-rs-no-such-dir/deeper");
        let e = SwapSpace::create(&missing, 0, "t", &Arc::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nvme_path") && e.contains("ds-rs-no-such-dir"),
            "{e}"
        );
        // /dev/full answers every write with ENOSPC, as a full disk does
        let full = SwapFile::open(Path::new("/dev/full"), 1 << 20).unwrap();
        let e = full.write(0, &[1.0; 4096]).unwrap_err().to_string();
        assert!(
            e.contains("/dev/full") && e.contains("No space left"),
            "{e}"
        );
        let e = stream(&[&full], 1024, 3, |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/full"), "{e}");
    }
}
