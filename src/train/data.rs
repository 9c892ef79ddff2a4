//! What `ds-rs train --data` reads: the default learnable Markov stream (its entropy rate is
//! the loss floor), the peer benchmark's uniform tokens, a token .bin, or a text file as bytes.
//! The tail of every source is held out for evaluation.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use ds_data::{
    is_indexed, DataLoader, IndexedDataset, MarkovTokens, SampleOrder, Slice, SyntheticTokens,
    TextBytes, TokenFile, TokenSource, TokenWidth,
};

/// The Markov stream's size: enough windows that tiny/small models do not repeat data within
/// a few thousand steps, and cheap to generate at start (about 0.1 s, 4 MiB).
const MARKOV_TOKENS: usize = 1 << 20;
/// Successors per state: the floor is then about 1/2 + 1/3 + 1/4 = 1.08 nats.
const MARKOV_BRANCHING: usize = 4;
/// States of the chain (at most the model's vocabulary): few enough that a tiny model learns
/// the transition table within minutes on CPU.
const MARKOV_STATES: usize = 512;
/// Fraction of the tokens held out for evaluation.
const HELD_OUT: usize = 20;

/// The loaders of one rank, and what the data is.
pub struct Data {
    pub train: DataLoader,
    pub eval: DataLoader,
    pub name: String,
    /// The lowest reachable mean loss in nats, when the source knows it.
    pub floor: Option<f64>,
}

pub struct Layout {
    pub seq: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub rank: usize,
    pub world: usize,
    pub vocab: usize,
    pub seed: u64,
}

/// The token source `--data` names, whole.
pub fn source(
    spec: &str,
    width: TokenWidth,
    vocab: usize,
    seed: u64,
) -> anyhow::Result<Arc<dyn TokenSource>> {
    Ok(read_source(spec, width, vocab, seed)?.0)
}

/// Opens `--data` and splits it into a training and a held-out part.
pub fn open(spec: &str, width: TokenWidth, l: &Layout) -> anyhow::Result<Data> {
    let (source, floor) = read_source(spec, width, l.vocab, l.seed)?;
    let name = source.name().to_string();
    let window = l.seq + 1;
    let (train, eval) = Slice::split(source.clone(), source.len() / HELD_OUT, window)
        .with_context(|| format!("--data {spec}"))?;
    let order = SampleOrder::new(l.seq, l.micro_batch, l.grad_accum, l.rank, l.world)?;
    // Evaluation batches are global batches too, split like training ones, so that every
    // layout evaluates the same samples.
    let eval_order = order;
    Ok(Data {
        train: DataLoader::new(Arc::new(train), order, l.vocab)
            .with_context(|| format!("--data {spec}"))?,
        eval: DataLoader::new(Arc::new(eval), eval_order, l.vocab)
            .with_context(|| format!("--data {spec}"))?,
        name,
        floor,
    })
}

/// Opens `--data`: the source and the lowest reachable mean loss, when it knows it.
fn read_source(
    spec: &str,
    width: TokenWidth,
    vocab: usize,
    seed: u64,
) -> anyhow::Result<(Arc<dyn TokenSource>, Option<f64>)> {
    Ok(match spec {
        "markov" => {
            let m = MarkovTokens::new(
                vocab.min(MARKOV_STATES),
                MARKOV_BRANCHING,
                MARKOV_TOKENS,
                seed,
            )?;
            let floor = m.entropy_rate_nats();
            (Arc::new(m), Some(floor))
        }
        "uniform" => {
            let s =
                SyntheticTokens::new(vocab, SyntheticTokens::PEER_LEN, SyntheticTokens::PEER_SEED)?;
            (Arc::new(s), Some((vocab as f64).ln()))
        }
        path if is_indexed(Path::new(path)) => (
            Arc::new(IndexedDataset::open(Path::new(path), vocab)?),
            None,
        ),
        path if path.ends_with(".bin") => (
            Arc::new(TokenFile::open(Path::new(path), width, vocab)?),
            None,
        ),
        path => (Arc::new(TextBytes::open(Path::new(path))?), None),
    })
}
