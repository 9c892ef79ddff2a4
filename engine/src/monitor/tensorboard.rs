//! The TensorBoard monitor: one event file per `Monitor`, named and laid out as torch's
//! `SummaryWriter` (through tensorboard's `EventFileWriter`) does, so TensorBoard, and any tool
//! that globs `events.out.tfevents.*`, reads it as a DeepSpeed run.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::error::MonitorError;
use super::{event, record};

/// Recorded in the first event's `source_metadata.writer`, so a file says who wrote it.
const WRITER: &str = "ds-rs";

/// The last part of the file name; tensorboard's `_global_uid` likewise counts per process,
/// so two writers opened in the same second by one process never share a name.
static NEXT_UID: AtomicU64 = AtomicU64::new(0);

/// How many existing names to step over before giving up (only a directory already full of
/// our own names could exhaust it).
const NAME_ATTEMPTS: usize = 1000;

#[derive(Debug)]
pub(crate) struct TensorBoardWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl TensorBoardWriter {
    /// Creates `log_dir` and a new event file in it, starting with the file-version record.
    pub(crate) fn create(log_dir: &Path) -> Result<TensorBoardWriter, MonitorError> {
        fs::create_dir_all(log_dir).map_err(|e| MonitorError::create_dir(log_dir, e))?;
        let (path, file) = create_event_file(log_dir)?;
        let mut writer = TensorBoardWriter {
            path,
            file: BufWriter::new(file),
        };
        writer.put(&event::file_version_event(wall_time(), WRITER))?;
        writer.flush()?;
        Ok(writer)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// `add_scalar(tag, value, step)`: the value is stored as a 32-bit float, as TensorBoard's
    /// `simple_value` is.
    pub(crate) fn write_scalar(
        &mut self,
        tag: &str,
        value: f64,
        step: u64,
    ) -> Result<(), MonitorError> {
        self.put(&event::scalar_event(wall_time(), step, tag, value as f32))
    }

    pub(crate) fn flush(&mut self) -> Result<(), MonitorError> {
        self.file
            .flush()
            .map_err(|e| MonitorError::write(&self.path, e))
    }

    fn put(&mut self, event: &[u8]) -> Result<(), MonitorError> {
        self.file
            .write_all(&record::frame(event))
            .map_err(|e| MonitorError::write(&self.path, e))
    }
}

/// `events.out.tfevents.{secs:010}.{host}.{pid}.{uid}`, tensorboard's `EventFileWriter` name.
/// Opened with `create_new`, so an existing file is never truncated: a clash moves to the
/// next uid.
fn create_event_file(dir: &Path) -> Result<(PathBuf, File), MonitorError> {
    let prefix = format!(
        "events.out.tfevents.{:010}.{}.{}",
        wall_time() as u64,
        hostname(),
        std::process::id()
    );
    let mut last = dir.join(&prefix);
    for _ in 0..NAME_ATTEMPTS {
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        last = dir.join(format!("{prefix}.{uid}"));
        match OpenOptions::new().write(true).create_new(true).open(&last) {
            Ok(file) => return Ok((last, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(MonitorError::open(&last, e)),
        }
    }
    let clash = io::Error::new(
        io::ErrorKind::AlreadyExists,
        "every candidate name is taken",
    );
    Err(MonitorError::open(&last, clash))
}

/// Seconds since the Unix epoch, as Python's `time.time()`; a clock before 1970 gives 0.
fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `socket.gethostname()`: the kernel's node name on Linux. '/' cannot appear in a host name
/// but would turn the file name into a path, so it is replaced defensively.
fn hostname() -> String {
    let name = fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "localhost".to_string());
    name.replace('/', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ds_tb_{name}_{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn file_name_follows_tensorboard() {
        let dir = scratch("name");
        let w = TensorBoardWriter::create(&dir).expect("writer");
        let name = w
            .path()
            .file_name()
            .expect("name")
            .to_string_lossy()
            .to_string();
        let parts: Vec<&str> = name.split('.').collect();
        assert_eq!(&parts[..3], ["events", "out", "tfevents"]);
        assert_eq!(
            parts[3].len(),
            10,
            "{name}: seconds are zero-padded to 10 digits"
        );
        assert!(parts[3].bytes().all(|b| b.is_ascii_digit()), "{name}");
        let pid = std::process::id().to_string();
        assert_eq!(parts[parts.len() - 2], pid, "{name}");
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn two_writers_never_share_a_file() {
        let dir = scratch("two");
        let a = TensorBoardWriter::create(&dir).expect("a");
        let b = TensorBoardWriter::create(&dir).expect("b");
        assert_ne!(a.path(), b.path());
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn file_starts_with_the_version_record() {
        let dir = scratch("first");
        let w = TensorBoardWriter::create(&dir).expect("writer");
        let bytes = fs::read(w.path()).expect("read");
        let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        assert_eq!(
            bytes.len(),
            8 + 4 + len + 4,
            "exactly one record after create"
        );
        let data = &bytes[12..12 + len];
        let found = data.windows(13).any(|w| w == b"brain.Event:2");
        assert!(found, "file_version missing");
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
