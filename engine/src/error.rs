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
    /// A problem of a job's plan, named by where it lies: the config's file, a flag
    /// (`--ep 3`), the model (`--model tiny`).
    #[error("{origin}: {error}")]
    Plan {
        origin: String,
        error: Box<EngineError>,
    },
    #[error("{0}")]
    Invalid(String),
}

impl EngineError {
    /// `error`, named by where it lies (see `Plan`).
    pub fn at(origin: String, error: EngineError) -> EngineError {
        EngineError::Plan {
            origin,
            error: Box::new(error),
        }
    }

    pub fn file(path: impl AsRef<std::path::Path>, reason: impl ToString) -> EngineError {
        EngineError::File {
            path: path.as_ref().display().to_string(),
            reason: reason.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;
