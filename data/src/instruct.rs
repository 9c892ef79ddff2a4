//! Instruction data: JSON lines of `{"prompt": ..., "completion": ...}` whose prompt tokens
//! do not count in the loss (Hugging Face's labels of -100, TRL's completion-only loss), or of
//! `{"messages": [{"role", "content"}, ...]}` rendered by the tokenizer's chat template
//! ([`super::ChatTemplate`]), whose assistant turns are what counts.
//!
//! Each example is its prompt's ids, then its completion's ids and the end-of-document token
//! (when the tokenizer has one), tokenized apart as TRL does for prompt-completion data; the
//! completion and the end token are the targets that count. Examples are packed back to back
//! into one stream ([`InstructionTokens`], read in windows like any source) or each padded
//! to one sample ([`PaddedExamples`]), as the user asks.

use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

use super::error::{DataError, Result};
use super::shuffle::permute;
use super::{ChatTemplate, Samples, TextTokenizer, TokenSource};

/// Whether a JSON-lines file holds instruction data: its first record has a `prompt` or
/// `messages`.
pub fn is_instruction_file(path: &Path) -> Result<bool> {
    let name = path.to_string_lossy();
    if !(name.ends_with(".jsonl") || name.ends_with(".json") || name.ends_with(".ndjson")) {
        return Ok(false);
    }
    let Ok(file) = std::fs::File::open(path) else {
        return Ok(false);
    };
    let first = std::io::BufReader::new(file)
        .lines()
        .map_while(std::io::Result::ok)
        .find(|l| !l.trim().is_empty());
    let Some(Ok(v)) = first.map(|l| serde_json::from_str::<serde_json::Value>(&l)) else {
        return Ok(false);
    };
    Ok(v.get("prompt").is_some() || v.get("messages").is_some())
}

/// Tokenized examples: ids, and for each id whether it counts as a target.
pub struct InstructionTokens {
    name: String,
    ids: Vec<u32>,
    counted: Vec<bool>,
    /// Where each example starts, and the total.
    starts: Vec<usize>,
    vocab: usize,
}

impl InstructionTokens {
    /// Reads and tokenizes every record of `path`.
    pub fn open(path: &Path, tokenizer: &TextTokenizer) -> Result<InstructionTokens> {
        let text = std::fs::read_to_string(path).map_err(|error| DataError::Open {
            path: path.display().to_string(),
            error,
        })?;
        let mut t = InstructionTokens {
            name: path.display().to_string(),
            ids: Vec::new(),
            counted: Vec::new(),
            starts: vec![0],
            vocab: tokenizer.vocab_size(),
        };
        let mut chat: Option<ChatTemplate> = None;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{}:{}", path.display(), i + 1);
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| DataError::Invalid(format!("{}: not a JSON line: {e}", at())))?;
            let field = |key: &str| {
                v.get(key).and_then(|x| x.as_str()).ok_or_else(|| {
                    DataError::Invalid(format!("{}: no text under the key {key:?}", at()))
                })
            };
            if let Some(messages) = v.get("messages") {
                let messages = messages.as_array().ok_or_else(|| {
                    DataError::Invalid(format!("{}: \"messages\" is not a list", at()))
                })?;
                if chat.is_none() {
                    chat = Some(ChatTemplate::beside(tokenizer.path())?.ok_or_else(|| {
                        DataError::Invalid(format!(
                            "{}: chat messages need a chat template, and neither \
                             tokenizer_config.json nor chat_template.jinja beside {} has one",
                            at(),
                            tokenizer.path().display()
                        ))
                    })?);
                }
                let template = chat.as_ref().expect("set above");
                for (text, counted) in template.segments(messages)? {
                    t.push(&tokenizer.encode(&text)?, counted);
                }
                t.starts.push(t.ids.len());
                continue;
            }
            let (prompt, completion) = (field("prompt")?, field("completion")?);
            t.push(&tokenizer.encode(prompt)?, false);
            t.push(&tokenizer.encode(completion)?, true);
            if let Some(eod) = tokenizer.eod() {
                t.push(&[eod], true);
            }
            t.starts.push(t.ids.len());
        }
        if t.ids.is_empty() {
            return Err(DataError::Invalid(format!("{}: no examples", t.name)));
        }
        Ok(t)
    }

    fn push(&mut self, ids: &[u32], counted: bool) {
        self.ids.extend_from_slice(ids);
        self.counted.resize(self.ids.len(), counted);
    }
}

impl TokenSource for InstructionTokens {
    fn name(&self) -> &str {
        &self.name
    }
    fn len(&self) -> usize {
        self.ids.len()
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let r = super::error::span(&self.name, start, out.len(), self.ids.len())?;
        out.copy_from_slice(&self.ids[r]);
        Ok(())
    }
    fn document_starts(&self) -> Option<&[usize]> {
        Some(&self.starts)
    }
    fn has_loss_mask(&self) -> bool {
        true
    }
    fn read_loss_mask(&self, start: usize, out: &mut [bool]) -> Result<()> {
        let r = super::error::span(&self.name, start, out.len(), self.ids.len())?;
        out.copy_from_slice(&self.counted[r]);
        Ok(())
    }
}

/// One example (a document of a source that knows its documents) per sample, cut to
/// `seq + 1` tokens or padded with `pad`, which never counts.
pub struct PaddedExamples {
    source: Arc<dyn TokenSource>,
    starts: Vec<usize>,
    window: usize,
    pad: u32,
    shuffle: Option<u64>,
}

impl PaddedExamples {
    pub fn new(source: Arc<dyn TokenSource>, seq: usize, pad: u32) -> Result<PaddedExamples> {
        let starts = source.document_starts().map(<[usize]>::to_vec);
        let starts = starts.filter(|s| s.len() > 1).ok_or_else(|| {
            DataError::Invalid(format!(
                "{}: padding to one example a sample needs data that knows its examples",
                source.name()
            ))
        })?;
        Ok(PaddedExamples {
            source,
            starts,
            window: seq + 1,
            pad,
            shuffle: None,
        })
    }

    /// The same samples, each epoch in the order of a permutation keyed by (`seed`, epoch).
    pub fn shuffled(self, seed: u64) -> PaddedExamples {
        PaddedExamples {
            shuffle: Some(seed),
            ..self
        }
    }

    /// The token range of the example sample `g` reads, cut to a window.
    fn example(&self, g: u64) -> std::ops::Range<usize> {
        let n = self.len();
        let pos = g % n;
        let e = match self.shuffle {
            Some(seed) => permute(seed, g / n, pos, n),
            None => pos,
        } as usize;
        let (start, end) = (self.starts[e], self.starts[e + 1]);
        start..end.min(start + self.window)
    }
}

impl Samples for PaddedExamples {
    fn name(&self) -> &str {
        self.source.name()
    }
    fn len(&self) -> u64 {
        (self.starts.len() - 1) as u64
    }
    fn sample_tokens(&self) -> usize {
        self.window
    }
    fn vocab(&self) -> usize {
        self.source.vocab()
    }
    fn read(&self, g: u64, out: &mut [u32]) -> Result<()> {
        let r = self.example(g);
        out.fill(self.pad);
        self.source.read(r.start, &mut out[..r.len()])
    }
    fn has_loss_mask(&self) -> bool {
        true
    }
    fn read_loss_mask(&self, g: u64, out: &mut [bool]) -> Result<()> {
        let r = self.example(g);
        out.fill(false);
        self.source.read_loss_mask(r.start, &mut out[..r.len()])
    }
}
