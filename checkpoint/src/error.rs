use thiserror::Error;

/// Errors of a checkpoint's files; each names the file or the tensor.
#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Nn(#[from] ds_nn::NnError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Partition(#[from] ds_partition::PartitionError),
    #[error(transparent)]
    Comm(#[from] ds_comm::CommError),
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
}

impl CheckpointError {
    pub fn file(path: impl AsRef<std::path::Path>, reason: impl ToString) -> CheckpointError {
        CheckpointError::File {
            path: path.as_ref().display().to_string(),
            reason: reason.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, CheckpointError>;
