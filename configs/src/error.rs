//! Errors of the config reader. Every variant names where the problem is (file or JSON path).

use std::fmt;
use std::path::PathBuf;

use crate::hjson::HjsonError;

pub type Result<T> = std::result::Result<T, ConfigError>;

/// One problem found in a ds_config.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {file}: {reason}")]
    Io { file: PathBuf, reason: String },

    #[error("{file}: {source}")]
    Parse { file: PathBuf, source: HjsonError },

    /// A value of the wrong type or out of range.
    #[error("{path}: found {found}, expected {expected}")]
    Invalid {
        path: String,
        found: String,
        expected: String,
    },

    /// A key DeepSpeed does not know, in a section that forbids unknown keys.
    #[error("{path}: unknown key{}", suggestion_text(.suggestion))]
    Unknown {
        path: String,
        suggestion: Option<String>,
    },

    /// A section DeepSpeed 0.19.8 removed and now rejects.
    #[error("{path}: {message}")]
    Removed { path: String, message: String },

    /// Two settings that cannot go together, or a rule across several keys.
    #[error("{path}: {message}")]
    Conflict { path: String, message: String },

    /// Settings DeepSpeed accepts that ds-rs cannot carry out yet (`Config::check_implemented`),
    /// all of them on one line: a training command refuses them with a single error.
    #[error("{}", join_refusals(.0))]
    NotImplemented(Vec<NotImplemented>),

    /// Training arguments the user gave that contradict numbers of the config (HF's
    /// `trainer_config_finalize` mismatch check), all of them on one line.
    #[error(
        "the ds_config contradicts the training arguments: {}; set these keys to \"auto\" or leave the arguments out",
        join_mismatches(.0)
    )]
    Mismatch(Vec<Mismatch>),

    /// Several problems in one section (pydantic reports them all at once).
    #[error("{} problems:\n  {}", .0.len(), join_lines(.0))]
    Many(Vec<ConfigError>),
}

impl ConfigError {
    pub fn invalid(path: &str, found: impl ToString, expected: impl ToString) -> Self {
        ConfigError::Invalid {
            path: path.to_string(),
            found: found.to_string(),
            expected: expected.to_string(),
        }
    }

    pub fn conflict(path: &str, message: impl ToString) -> Self {
        ConfigError::Conflict {
            path: path.to_string(),
            message: message.to_string(),
        }
    }

    /// The JSON path of the (first) problem.
    pub fn path(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { path, .. }
            | ConfigError::Unknown { path, .. }
            | ConfigError::Removed { path, .. }
            | ConfigError::Conflict { path, .. } => Some(path),
            ConfigError::Many(all) => all.first().and_then(ConfigError::path),
            ConfigError::NotImplemented(all) => all.first().map(|n| n.path),
            ConfigError::Mismatch(all) => all.first().map(|m| m.path.as_str()),
            ConfigError::Io { .. } | ConfigError::Parse { .. } => None,
        }
    }

    /// All paths named by this error, in order.
    pub fn paths(&self) -> Vec<&str> {
        match self {
            ConfigError::Many(all) => all.iter().flat_map(ConfigError::paths).collect(),
            ConfigError::NotImplemented(all) => all.iter().map(|n| n.path).collect(),
            ConfigError::Mismatch(all) => all.iter().map(|m| m.path.as_str()).collect(),
            other => other.path().into_iter().collect(),
        }
    }

    /// Folds a list of problems into one error (None when the list is empty).
    pub fn from_list(mut errors: Vec<ConfigError>) -> Option<ConfigError> {
        match errors.len() {
            0 => None,
            1 => errors.pop(),
            _ => Some(ConfigError::Many(errors)),
        }
    }
}

/// A config value against the training argument that contradicts it.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The config's JSON path.
    pub path: String,
    /// The config's value, as Python prints it.
    pub config: String,
    /// Where the argument's value comes from (`--per_device_train_batch_size`).
    pub arg: String,
    pub value: String,
}

fn join_mismatches(all: &[Mismatch]) -> String {
    all.iter()
        .map(|m| {
            format!(
                "{} = {} in the config vs {} from {}",
                m.path, m.config, m.value, m.arg
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn suggestion_text(suggestion: &Option<String>) -> String {
    match suggestion {
        Some(s) => format!(" (did you mean `{s}`?)"),
        None => String::new(),
    }
}

fn join_refusals(all: &[NotImplemented]) -> String {
    all.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(". ")
}

fn join_lines(errors: &[ConfigError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n  ")
}

/// The closest known key to `key`, if one is close enough to be a likely typo.
pub fn closest<'a>(key: &str, known: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let key_l = key.to_lowercase();
    known
        .into_iter()
        .map(|k| (strsim::damerau_levenshtein(&key_l, &k.to_lowercase()), k))
        .filter(|(d, k)| *d <= (k.len().max(key.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closest_finds_typos_and_ignores_strangers() {
        let known = [
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "overlap_comm",
        ];
        assert_eq!(
            closest("stage3_param_persitance_threshold", known).as_deref(),
            Some("stage3_param_persistence_threshold")
        );
        assert_eq!(
            closest("overlap_com", known).as_deref(),
            Some("overlap_comm")
        );
        assert_eq!(closest("tensorboard", known), None);
    }

    #[test]
    fn unknown_key_message_names_path_and_suggestion() {
        let e = ConfigError::Unknown {
            path: "zero_optimization.stagee".into(),
            suggestion: Some("stage".into()),
        };
        assert_eq!(
            e.to_string(),
            "zero_optimization.stagee: unknown key (did you mean `stage`?)"
        );
    }
}

/// A setting DeepSpeed acts on that ds-rs reads but cannot carry out yet (unimplemented.rs
/// finds them), named by its JSON path.
#[derive(Debug, Clone, PartialEq)]
pub struct NotImplemented {
    pub path: &'static str,
    /// The value found, as JSON.
    pub value: String,
    /// What the value asks for.
    pub feature: &'static str,
    /// The value that asks for nothing.
    pub off: &'static str,
}

impl NotImplemented {
    /// `path = value: feature is not implemented yet in ds-rs`.
    pub fn describe(&self) -> String {
        format!(
            "{} = {}: {} is not implemented yet in ds-rs",
            self.path, self.value, self.feature
        )
    }
}

/// The refusal: what is missing and how to do without it (several join with ". ").
impl fmt::Display for NotImplemented {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; remove it or set it to {}",
            self.describe(),
            self.off
        )
    }
}
