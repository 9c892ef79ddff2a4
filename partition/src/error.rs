use thiserror::Error;

#[derive(Debug, Error)]
pub enum PartitionError {
    #[error(transparent)]
    Comm(#[from] ds_comm::CommError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, PartitionError>;
