//! Errors of the communication layer. Every error that concerns a peer names its global rank.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A wait ran out of time; `missing` are the global ranks that never answered.
    #[error("{what}: timed out after {}s waiting for {}", .after.as_secs_f64(), fmt_ranks(.missing))]
    Timeout {
        what: String,
        missing: Vec<usize>,
        after: Duration,
    },
    /// A peer's connection closed or failed (the peer process died or dropped its communicator).
    #[error("{what}: lost rank {peer}: {cause}")]
    PeerLost {
        what: String,
        peer: usize,
        cause: String,
    },
    /// The store refused or could not be reached.
    #[error("rendezvous store at {addr}: {cause}")]
    Store { addr: String, cause: String },
    /// A caller's mistake: lengths that do not fit the op, a rank outside the group...
    #[error("{0}")]
    Invalid(String),
    /// The environment does not describe a job this process can join.
    #[error("{0}")]
    Env(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, CommError>;

impl CommError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> CommError {
        CommError::Io {
            what: what.into(),
            source,
        }
    }

    /// The same error with its description prefixed by the collective it happened in.
    pub fn during(self, op: &str) -> CommError {
        match self {
            CommError::Timeout {
                what,
                missing,
                after,
            } => CommError::Timeout {
                what: format!("{op}: {what}"),
                missing,
                after,
            },
            CommError::PeerLost { what, peer, cause } => CommError::PeerLost {
                what: format!("{op}: {what}"),
                peer,
                cause,
            },
            other => other,
        }
    }
}

/// "rank 3", "ranks 1, 2", "ranks 0, 1, ... and 4 more".
fn fmt_ranks(ranks: &[usize]) -> String {
    let shown: Vec<String> = ranks.iter().take(16).map(|r| r.to_string()).collect();
    let more = ranks.len().saturating_sub(shown.len());
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    match more {
        0 => format!("{noun} {}", shown.join(", ")),
        _ => format!("{noun} {} and {more} more", shown.join(", ")),
    }
}
