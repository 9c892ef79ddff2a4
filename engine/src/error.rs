use thiserror::Error;

/// Errors of the engine; each names what was wrong and where.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Nn(#[from] ds_nn::NnError),
    #[error(transparent)]
    Checkpoint(#[from] ds_checkpoint::CheckpointError),
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
    /// A program's closure failed to give the engine its input (a data loader's error).
    #[error(transparent)]
    Input(BoxError),
    /// A ds_config setting, flag or training argument that cannot be used (the message
    /// names it: its JSON path or flag, and its value).
    #[error("{0}")]
    Setting(String),
    /// A program drove the engine wrongly: a call out of order, a batch of the wrong shape,
    /// a config not resolved for the groups given.
    #[error("{0}")]
    Call(String),
    /// A combination of features ds-rs does not build; the message says what works instead.
    #[error("{0}")]
    NotBuilt(String),
    /// The model breaks a contract the engine relies on (a layer's gradients, a tie, a
    /// replicated parameter that differs between ranks, a model that cannot be built).
    #[error("{0}")]
    Model(String),
    /// A checkpoint or saved state that does not fit this run.
    #[error("{0}")]
    Resume(String),
    /// Training diverged beyond what the engine can recover (the fp16 loss scale at its
    /// minimum and still overflowing).
    #[error("{0}")]
    Diverged(String),
    /// ds-rs's own invariant broke: a bug to report, not the user's doing.
    #[error("internal error (please report): {0}")]
    Internal(String),
}

/// Any error a program's closure returns to the engine.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl EngineError {
    /// The error of a program's closure: an engine error as itself, any other as `Input`.
    pub fn input(e: impl Into<BoxError>) -> EngineError {
        match e.into().downcast::<EngineError>() {
            Ok(engine) => *engine,
            Err(other) => EngineError::Input(other),
        }
    }

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
