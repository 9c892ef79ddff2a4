//! Text to token ids through Hugging Face's `tokenizers` (a model's `tokenizer.json`), as
//! Megatron's `preprocess_data.py` calls a Hugging Face tokenizer: no special tokens added
//! (no BOS), the end-of-document token being the tokenizer's `eos_token`.

use std::path::{Path, PathBuf};

use super::error::{DataError, Result};

/// A loaded `tokenizer.json` and, when known, its end-of-document token.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    eod: Option<u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab_size())
            .field("eod", &self.eod)
            .finish()
    }
}

fn invalid(path: &Path, what: impl std::fmt::Display) -> DataError {
    DataError::Invalid(format!("{}: {what}", path.display()))
}

impl TextTokenizer {
    /// Opens `spec`: a `tokenizer.json`, or a directory (a model's) holding one. The
    /// end-of-document token is the `eos_token` of a `tokenizer_config.json` beside it, when
    /// there is one.
    pub fn open(spec: &Path) -> Result<TextTokenizer> {
        let path = if spec.is_dir() {
            spec.join("tokenizer.json")
        } else {
            spec.to_path_buf()
        };
        let bytes = std::fs::read(&path).map_err(|error| DataError::Open {
            path: path.display().to_string(),
            error,
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| invalid(&path, format!("not a tokenizer.json that parses: {e}")))?;
        let mut t = TextTokenizer {
            inner,
            path,
            eod: None,
        };
        let config = t.path.with_file_name("tokenizer_config.json");
        if let Some(eos) = eos_token(&config)? {
            t = t.with_eod_token(&eos).map_err(|e| invalid(&config, e))?;
        }
        Ok(t)
    }

    /// The same tokenizer ending documents with `token` (a token of its vocabulary).
    pub fn with_eod_token(mut self, token: &str) -> Result<TextTokenizer> {
        let id = self.inner.token_to_id(token).ok_or_else(|| {
            invalid(
                &self.path,
                format!("the end-of-document token {token:?} is not in the vocabulary"),
            )
        })?;
        self.eod = Some(id);
        Ok(self)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Ids are below this: the vocabulary with its added tokens (`len(tokenizer)` in
    /// transformers, what Megatron sizes the dataset's dtype by).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The end-of-document token, if the tokenizer's config names one.
    pub fn eod(&self) -> Option<u32> {
        self.eod
    }

    /// The ids of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| invalid(&self.path, format!("cannot encode a text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }
}

/// The `eos_token` of a tokenizer_config.json (a string, or an added token's `content`), or
/// None if the file or the key is absent.
fn eos_token(config: &Path) -> Result<Option<String>> {
    let Ok(text) = std::fs::read_to_string(config) else {
        return Ok(None);
    };
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| invalid(config, format!("not JSON that parses: {e}")))?;
    Ok(match json.get("eos_token") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    })
}
