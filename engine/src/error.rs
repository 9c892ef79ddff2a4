use thiserror::Error;

/// Errors of the engine; each names what was wrong and where.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Partition(#[from] ds_partition::PartitionError),
    #[error(transparent)]
    Comm(#[from] ds_comm::CommError),
    #[error(transparent)]
    Config(#[from] ds_config::ConfigError),
    #[error(transparent)]
    Optim(#[from] crate::optim::OptimError),
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    #[error("{0}")]
    Invalid(String),
}

impl EngineError {
    pub fn file(path: impl AsRef<std::path::Path>, reason: impl ToString) -> EngineError {
        EngineError::File {
            path: path.as_ref().display().to_string(),
            reason: reason.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
