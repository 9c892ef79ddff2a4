//! What data's integration tests share: a scratch directory removed even when a test fails.

use std::path::PathBuf;

/// A directory under the temporary one, removed when dropped (a failing test included).
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let s = Scratch(std::env::temp_dir().join(format!("ds-rs-{tag}-{}", std::process::id())));
        std::fs::create_dir_all(&s.0).unwrap();
        s
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
