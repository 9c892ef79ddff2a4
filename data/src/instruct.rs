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
use super::{
    instructions_cached, output_prefix, ChatTemplate, IndexedDataset, IndexedWriter, Samples,
    TextTokenizer, TokenSource,
};

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

/// Tokenized examples, memory-mapped from the cache beside the records: the ids, and for
/// each id whether it counts as a target; an example is a document.
pub struct InstructionTokens {
    name: String,
    ids: IndexedDataset,
    mask: IndexedDataset,
}

impl InstructionTokens {
    /// The records of `path` tokenized, from the cache beside it (made now if no run made it).
    pub fn open(path: &Path, tokenizer: &TextTokenizer) -> Result<InstructionTokens> {
        let stem = instructions_cached(path, tokenizer, |stem| {
            write_examples(path, tokenizer, stem)
        })?;
        let ids = IndexedDataset::open(&output_prefix(&stem, "text"), tokenizer.vocab_size())?;
        let mask = IndexedDataset::open(&output_prefix(&stem, "mask"), 2)?;
        if ids.len() != mask.len() || ids.is_empty() {
            return Err(DataError::Invalid(format!(
                "{}: {} tokens and {} mask entries in its cache {}",
                path.display(),
                ids.len(),
                mask.len(),
                stem.display()
            )));
        }
        Ok(InstructionTokens {
            name: path.display().to_string(),
            ids,
            mask,
        })
    }
}

/// An example: its ids and whether each counts.
#[derive(Default)]
struct Example {
    ids: Vec<u32>,
    counted: Vec<u32>,
}

impl Example {
    fn push(&mut self, ids: &[u32], counted: bool) {
        self.ids.extend_from_slice(ids);
        self.counted.resize(self.ids.len(), u32::from(counted));
    }
}

/// Tokenizes every record of `path` into `STEM_text_document` (ids) and `STEM_mask_document`
/// (1 where a token counts), an example a document.
fn write_examples(path: &Path, tokenizer: &TextTokenizer, stem: &Path) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|error| DataError::Open {
        path: path.display().to_string(),
        error,
    })?;
    let mut ids = IndexedWriter::create(&output_prefix(stem, "text"), tokenizer.vocab_size())?;
    let mut mask = IndexedWriter::create(&output_prefix(stem, "mask"), 2)?;
    let mut chat: Option<ChatTemplate> = None;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let at = || format!("{}:{}", path.display(), i + 1);
        let line = line.map_err(|e| DataError::Invalid(format!("{}: {e}", at())))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| DataError::Invalid(format!("{}: not a JSON line: {e}", at())))?;
        let e = match v.get("messages") {
            Some(m) => chat_example(m, &mut chat, tokenizer, &at)?,
            None => prompt_example(&v, tokenizer, &at)?,
        };
        ids.add_document(&e.ids, &[e.ids.len()])?;
        mask.add_document(&e.counted, &[e.counted.len()])?;
    }
    // the ids first: the mask's index is what says the cache is whole
    ids.finish()?;
    mask.finish()?;
    Ok(())
}

/// A prompt/completion record: the completion and the end token count.
fn prompt_example(
    v: &serde_json::Value,
    tokenizer: &TextTokenizer,
    at: &dyn Fn() -> String,
) -> Result<Example> {
    let field = |key: &str| {
        v.get(key)
            .and_then(|x| x.as_str())
            .ok_or_else(|| DataError::Invalid(format!("{}: no text under the key {key:?}", at())))
    };
    let mut e = Example::default();
    e.push(&tokenizer.encode(field("prompt")?)?, false);
    e.push(&tokenizer.encode(field("completion")?)?, true);
    if let Some(eod) = tokenizer.eod() {
        e.push(&[eod], true);
    }
    Ok(e)
}

/// A chat record: its assistant turns count (the template is read at the first one).
fn chat_example(
    messages: &serde_json::Value,
    chat: &mut Option<ChatTemplate>,
    tokenizer: &TextTokenizer,
    at: &dyn Fn() -> String,
) -> Result<Example> {
    let messages = messages
        .as_array()
        .ok_or_else(|| DataError::Invalid(format!("{}: \"messages\" is not a list", at())))?;
    if chat.is_none() {
        *chat = Some(ChatTemplate::beside(tokenizer.path())?.ok_or_else(|| {
            DataError::Invalid(format!(
                "{}: chat messages need a chat template, and neither tokenizer_config.json nor \
                 chat_template.jinja beside {} has one",
                at(),
                tokenizer.path().display()
            ))
        })?);
    }
    let mut e = Example::default();
    for (text, counted) in chat.as_ref().expect("set above").segments(messages)? {
        e.push(&tokenizer.encode(&text)?, counted);
    }
    Ok(e)
}

impl TokenSource for InstructionTokens {
    fn name(&self) -> &str {
        &self.name
    }
    fn len(&self) -> usize {
        self.ids.len()
    }
    fn vocab(&self) -> usize {
        self.ids.vocab()
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        self.ids.read(start, out)
    }
    fn document_starts(&self) -> Option<&[usize]> {
        self.ids.document_starts()
    }
    fn has_loss_mask(&self) -> bool {
        true
    }
    fn read_loss_mask(&self, start: usize, out: &mut [bool]) -> Result<()> {
        let mut m = vec![0u32; out.len()];
        self.mask.read(start, &mut m)?;
        for (o, v) in out.iter_mut().zip(m) {
            *o = v == 1;
        }
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
