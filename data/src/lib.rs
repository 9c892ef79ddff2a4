//! ds-data: training data, where tokens come from and which of them each rank trains on.
//!
//! Token sources sit behind [`TokenSource`]: the peer benchmark's synthetic stream
//! ([`SyntheticTokens`], bit-identical to `shared/bench/make_tokens.py`), memory-mapped token
//! files ([`TokenFile`], nanoGPT's flat `.bin`), Megatron-LM's indexed datasets
//! ([`IndexedDataset`], `.bin` + `.idx`), plain text as bytes ([`TextBytes`]) and a
//! learnable Markov chain with a known entropy floor ([`MarkovTokens`]).
//!
//! [`Samples`] are what a step reads, `seq + 1` tokens each: [`Windows`] packs a source into
//! windows, shuffled per epoch by the seed; [`Blend`] mixes datasets by weight as Megatron's
//! `--data-path` does; [`Split`] divides a source into train / validation / test parts as
//! Megatron's `--split`. [`SampleOrder`] maps (step, micro-step, row) to a sample index. It
//! depends on the step and the global batch only, never on how the global batch is split into
//! ranks and micro-steps, so every layout trains on the same samples per step. [`DataLoader`]
//! binds samples to an order and hands out [`Batch`]es.
//!
//! Text arrives through [`TextTokenizer`] (a tokenizer.json): [`preprocess`] writes Megatron
//! indexed datasets ([`IndexedWriter`]) on every core, and [`tokenized`] caches a text file's
//! tokens beside it for `train --data`.

mod blend;
mod cache;
mod chat;
mod error;
mod file;
mod indexed;
mod indexed_writer;
mod instruct;
mod loader;
mod markov;
mod order;
mod preprocess;
mod samples;
mod shuffle;
mod slice;
mod split;
mod synthetic;
#[cfg(test)]
mod testing;
mod tokenizer;

pub use blend::{parse_blend, Blend};
pub use cache::{instructions_cached, tokenized};
pub use chat::ChatTemplate;
pub use error::{DataError, Result};
pub use file::{TextBytes, TokenFile, TokenWidth};
pub use indexed::{indexed_paths, is_indexed, IndexedDataset};
pub use indexed_writer::{IndexedSummary, IndexedWriter};
pub use instruct::{is_instruction_file, InstructionTokens, PaddedExamples};
pub use loader::DataLoader;
pub use markov::MarkovTokens;
pub use order::SampleOrder;
pub use preprocess::{input_files, output_prefix, preprocess, PreprocessJob, PreprocessReport};
pub use samples::{Samples, Windows};
pub use slice::Slice;
pub use split::{Part, Split};
pub use synthetic::SyntheticTokens;
pub use tokenizer::TextTokenizer;

pub use ds_nn::Batch;

/// A flat, random-access sequence of token ids, each below [`TokenSource::vocab`].
///
/// `Send + Sync` so one source can serve every thread of a rank behind an `Arc`.
pub trait TokenSource: Send + Sync {
    /// What the tokens are (a file's path, or a generator and its parameters), for errors
    /// and logs.
    fn name(&self) -> &str;
    /// The number of tokens.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Every token id is below this.
    fn vocab(&self) -> usize;
    /// Tokens `start .. start + out.len()` into `out`. Errors name the source: a read past the
    /// end, or (for files) a token not below the vocabulary.
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()>;
    /// Where documents start (token offsets, ending with the length), for sources that know
    /// their documents: a split then divides documents, as Megatron's does.
    fn document_starts(&self) -> Option<&[usize]> {
        None
    }
    /// Whether some tokens do not count as targets (instruction data's prompts).
    fn has_loss_mask(&self) -> bool {
        false
    }
    /// For tokens `start .. start + out.len()`, whether each counts as a target.
    fn read_loss_mask(&self, _start: usize, out: &mut [bool]) -> Result<()> {
        out.fill(true);
        Ok(())
    }
}
