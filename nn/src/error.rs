use thiserror::Error;

/// Errors of the model layer; each names what was wrong and where.
#[derive(Debug, Error)]
pub enum NnError {
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

impl NnError {
    pub fn file(path: impl AsRef<std::path::Path>, reason: impl ToString) -> NnError {
        NnError::File {
            path: path.as_ref().display().to_string(),
            reason: reason.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, NnError>;
