use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// A monitor failure: every variant names the file or directory and the OS reason, because a
/// monitor problem (full disk, read-only output_path) must be fixable from the message alone.
#[derive(Debug, Error)]
pub enum MonitorError {
    #[error("monitor: cannot create directory {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("monitor: cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("monitor: cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl MonitorError {
    pub(crate) fn create_dir(path: &Path, source: io::Error) -> MonitorError {
        MonitorError::CreateDir {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn open(path: &Path, source: io::Error) -> MonitorError {
        MonitorError::Open {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn write(path: &Path, source: io::Error) -> MonitorError {
        MonitorError::Write {
            path: path.to_path_buf(),
            source,
        }
    }
}
