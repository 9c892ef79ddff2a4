//! The data module's error: every variant names the source (a file's path, or a generator and
//! its parameters) and what is wrong with it, so a user can fix the input without a debugger.

use thiserror::Error;

/// What went wrong while opening or reading training data.
#[derive(Debug, Error)]
pub enum DataError {
    /// The file could not be opened or mapped (missing, unreadable, a directory).
    #[error("{path}: cannot open the token file: {error}")]
    Open { path: String, error: std::io::Error },
    /// The file's size is not a whole number of tokens: most often the wrong `--data-dtype`.
    #[error("{path}: {bytes} bytes is not a whole number of {width}-byte tokens (wrong dtype?)")]
    Length {
        path: String,
        bytes: usize,
        width: usize,
    },
    /// The source cannot fill even one sample of `seq + 1` tokens.
    #[error("{name}: {tokens} tokens, fewer than one window of seq + 1 = {needed}")]
    TooShort {
        name: String,
        tokens: usize,
        needed: usize,
    },
    /// A token id in a file is not below the vocabulary size the caller gave.
    #[error(
        "{name}: token {token} at index {index} (byte {byte}) is not below the vocabulary size {vocab}"
    )]
    TokenOutOfRange {
        name: String,
        token: u32,
        index: usize,
        byte: usize,
        vocab: usize,
    },
    /// A read past the end of a source (a caller's bug: the sample order never asks for one).
    #[error("{name}: tokens {start}..{end} run past its end ({len} tokens)")]
    OutOfBounds {
        name: String,
        start: usize,
        end: usize,
        len: usize,
    },
    /// The source emits ids the model has no embedding row for.
    #[error("{name}: vocabulary of {vocab} is larger than the model's {model}")]
    VocabMismatch {
        name: String,
        vocab: usize,
        model: usize,
    },
    /// A parameter out of its range (zero batch, rank not below the world size, ...).
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, DataError>;

/// The range `start .. start + len` of a source of `total` tokens, or the error naming it.
pub(super) fn span(
    name: &str,
    start: usize,
    len: usize,
    total: usize,
) -> Result<std::ops::Range<usize>> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(start..end),
        _ => Err(DataError::OutOfBounds {
            name: name.to_string(),
            start,
            end: start.saturating_add(len),
            len: total,
        }),
    }
}
