//! Test helpers: a scratch directory for token files written by tests.

use std::path::PathBuf;

/// A fresh directory under the system temp dir, removed when dropped (even on failure).
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A directory unique to this process, `tag` and the current time.
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("ds-data-{tag}-{}-{nanos}", std::process::id());
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `bytes` to `name` in the directory and returns its path.
    pub fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Best effort: a leftover scratch dir must not turn a passing test into a failure.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
