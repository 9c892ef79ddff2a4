//! What `ds-rs train --data` (and `eval --data`) reads: the default learnable Markov stream
//! (its entropy rate is the loss floor), the peer benchmark's uniform tokens, Megatron indexed
//! datasets, nanoGPT's and llm.c's token files, text (tokenized once by `--tokenizer`, else
//! read as bytes), or a blend of them as Megatron's `--data-path` spells it. Validation data
//! is `--eval-data`, else the `--split` validation part, else the tail of every source.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use ds_data::{
    is_indexed, is_instruction_file, parse_blend, tokenized, Blend, DataLoader, IndexedDataset,
    InstructionTokens, MarkovTokens, PaddedExamples, Part as SplitPart, SampleOrder, Samples,
    Slice, Split, SyntheticTokens, TextBytes, TextTokenizer, TokenFile, TokenSource, TokenWidth,
    Windows,
};

/// The Markov stream's size: enough windows that tiny/small models do not repeat data within
/// a few thousand steps, and cheap to generate at start (about 0.1 s, 4 MiB).
const MARKOV_TOKENS: usize = 1 << 20;
/// Successors per state: the floor is then about 1/2 + 1/3 + 1/4 = 1.08 nats.
const MARKOV_BRANCHING: usize = 4;
/// States of the chain (at most the model's vocabulary): few enough that a tiny model learns
/// the transition table within minutes on CPU.
const MARKOV_STATES: usize = 512;
/// Without --split, the fraction of each source held out for evaluation (its tail).
const HELD_OUT: usize = 20;

/// The loaders of one rank, and what the data is.
pub struct Data {
    pub train: DataLoader,
    pub eval: DataLoader,
    pub name: String,
    /// The lowest reachable mean loss in nats, when the source knows it.
    pub floor: Option<f64>,
    /// What decides which samples each step reads: recorded in checkpoints, so that a resume
    /// that would read other samples says so (see `position`).
    pub identity: serde_json::Value,
}

impl Data {
    /// Where the data stands after `steps` optimizer steps: the next sample, its epoch and
    /// its place in the epoch, beside the identity.
    pub fn position(&self, steps: u64) -> serde_json::Value {
        let next = steps * self.train.order().global_batch();
        let per_epoch = self.train.samples().len();
        let mut v = self.identity.clone();
        v["next_sample"] = next.into();
        v["epoch"] = (next / per_epoch).into();
        v["sample_in_epoch"] = (next % per_epoch).into();
        v
    }

    /// Why a checkpoint's data position cannot be continued by this run, if it cannot: the
    /// fields of the identity that differ.
    pub fn resume_conflict(&self, saved: &serde_json::Value) -> Option<String> {
        let saved = saved.as_object()?;
        let now = self.identity.as_object()?;
        let differ: Vec<String> = now
            .iter()
            .filter(|(k, v)| saved.get(*k).is_some_and(|s| s != *v))
            .map(|(k, v)| format!("{k} was {} and is now {v}", saved[k.as_str()]))
            .collect();
        (!differ.is_empty()).then(|| differ.join("; "))
    }
}

/// Where the data comes from, as the command line names it.
pub struct DataArgs<'a> {
    pub data: &'a str,
    pub eval_data: Option<&'a str>,
    pub split: Option<&'a str>,
    pub tokenizer: Option<PathBuf>,
    /// Training windows in a new order each epoch (else file order).
    pub shuffle: bool,
    /// Instruction examples packed back to back into windows (else one example a sample,
    /// padded).
    pub packing: bool,
    pub width: TokenWidth,
}

pub struct Layout {
    pub seq: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    /// The replica's index and how many: the sample streams.
    pub rank: usize,
    pub world: usize,
    /// This rank's place among the sequence-parallel ranks that split the replica's samples,
    /// and how many they are.
    pub sp_rank: usize,
    pub sp: usize,
    pub vocab: usize,
    pub seed: u64,
}

impl Layout {
    /// This rank's place in the job's data: tensor-parallel, pipeline and sequence-parallel
    /// peers read the same samples, so the order follows the replica; sequence-parallel
    /// peers each take their positions of them.
    pub fn of(
        model: &ds_models::ModelSpec,
        s: &ds_engine::Settings,
        groups: &ds_comm::Groups,
        seed: u64,
    ) -> Layout {
        Layout {
            seq: model.seq_len,
            micro_batch: s.micro_batch,
            grad_accum: s.grad_accum,
            rank: groups.replica(),
            world: groups.dims().replicas(),
            sp_rank: groups.sp().rank(),
            sp: groups.dims().sp,
            vocab: model.vocab_size(),
            seed,
        }
    }
}

/// `--token-width`.
pub fn token_width(arg: &str) -> anyhow::Result<TokenWidth> {
    match arg {
        "u16" => Ok(TokenWidth::U16),
        "u32" => Ok(TokenWidth::U32),
        w => anyhow::bail!("--token-width {w}: expected u16 or u32"),
    }
}

/// The tokenizer for text data: `--tokenizer`, else the model directory's tokenizer.json.
pub fn tokenizer_path(arg: Option<&Path>, model: &str) -> Option<PathBuf> {
    let from_model = Path::new(model).join("tokenizer.json");
    arg.map(Path::to_path_buf)
        .or_else(|| from_model.is_file().then_some(from_model))
}

/// Opens the training and validation data of one rank.
pub fn open(a: &DataArgs, l: &Layout) -> anyhow::Result<Data> {
    let split = a.split.map(Split::parse).transpose()?;
    let sources = open_sources(a.data, a, l)?;
    let floor = match &sources[..] {
        [(_, _, floor)] => *floor,
        _ => None,
    };
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for (i, (weight, source, _)) in sources.into_iter().enumerate() {
        let (t, h) = divide(source, split.as_ref(), a.eval_data.is_none(), l.seq)
            .with_context(|| format!("--data {}", a.data))?;
        // each part of a blend in its own order; one source keeps the run's seed
        let seed = l.seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        train.push((
            weight,
            samples(t, l.seq, a.shuffle.then_some(seed), a.packing)?,
        ));
        if let Some(h) = h {
            held.push((weight, samples(h, l.seq, None, a.packing)?));
        }
    }
    let eval = match a.eval_data {
        Some(spec) => whole(spec, a, l).with_context(|| format!("--eval-data {spec}"))?,
        None => blend(held)?,
    };
    let train = blend(train)?;
    let name = train.name().to_string();
    let order = SampleOrder::new(l.seq, l.micro_batch, l.grad_accum, l.rank, l.world)?;
    let identity = serde_json::json!({
        "data": a.data, "eval_data": a.eval_data, "split": a.split,
        "tokenizer": a.tokenizer.as_ref().map(|t| t.display().to_string()),
        "seed": l.seed, "shuffle": a.shuffle, "packing": a.packing, "seq": l.seq, "global_batch": order.global_batch(),
        "samples_per_epoch": train.len(),
    });
    // Evaluation batches are global batches too, split like training ones, so that every
    // layout evaluates the same samples.
    Ok(Data {
        train: DataLoader::new(train, order, l.vocab)
            .and_then(|d| d.with_sequence_shard(l.sp_rank, l.sp))
            .with_context(|| format!("--data {}", a.data))?,
        eval: DataLoader::new(eval, order, l.vocab)
            .and_then(|d| d.with_sequence_shard(l.sp_rank, l.sp))
            .with_context(|| format!("--eval-data {}", a.eval_data.unwrap_or(a.data)))?,
        name,
        floor,
        identity,
    })
}

/// The samples `spec` names (all of it, in order): what `eval --data` and `--eval-data` read.
pub fn whole(spec: &str, a: &DataArgs, l: &Layout) -> anyhow::Result<Arc<dyn Samples>> {
    let parts = open_sources(spec, a, l)?
        .into_iter()
        .map(|(w, s, _)| Ok((w, samples(s, l.seq, None, a.packing)?)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    blend(parts)
}

type Part = Arc<dyn TokenSource>;

/// The training part of a source and, when validation comes from it, the held-out part.
fn divide(
    source: Part,
    split: Option<&Split>,
    hold_out: bool,
    seq: usize,
) -> ds_data::Result<(Part, Option<Part>)> {
    let part = |s: &Split, p| -> ds_data::Result<Part> { Ok(Arc::new(s.part(source.clone(), p)?)) };
    Ok(match (split, hold_out) {
        (Some(s), true) => (
            part(s, SplitPart::Train)?,
            Some(part(s, SplitPart::Validation)?),
        ),
        (Some(s), false) => (part(s, SplitPart::Train)?, None),
        (None, true) => {
            let (t, h) = Slice::split(source.clone(), source.len() / HELD_OUT, seq + 1)?;
            (Arc::new(t), Some(Arc::new(h)))
        }
        (None, false) => (source, None),
    })
}

/// A source's samples: windows packed across documents, or, for instruction data without
/// `--packing`, one example a sample padded to seq + 1 (TRL's default).
fn samples(
    source: Arc<dyn TokenSource>,
    seq: usize,
    shuffle: Option<u64>,
    packing: bool,
) -> anyhow::Result<Arc<dyn Samples>> {
    if source.has_loss_mask() && !packing {
        let p = PaddedExamples::new(source, seq, 0)?;
        return Ok(match shuffle {
            Some(seed) => Arc::new(p.shuffled(seed)),
            None => Arc::new(p),
        });
    }
    let w = Windows::new(source, seq)?;
    Ok(match shuffle {
        Some(seed) => Arc::new(w.shuffled(seed)),
        None => Arc::new(w),
    })
}

/// One part as itself, several as a blend.
fn blend(mut parts: Vec<(Option<f64>, Arc<dyn Samples>)>) -> anyhow::Result<Arc<dyn Samples>> {
    if parts.len() == 1 {
        return Ok(parts.remove(0).1);
    }
    Ok(Arc::new(Blend::new(parts)?))
}

type Source = (Option<f64>, Arc<dyn TokenSource>, Option<f64>);

/// Each source of `spec` (one, or a blend's), with its weight and loss floor.
fn open_sources(spec: &str, a: &DataArgs, l: &Layout) -> anyhow::Result<Vec<Source>> {
    parse_blend(spec)?
        .into_iter()
        .map(|(w, one)| {
            let (s, floor) = read_source(&one, a, l.vocab, l.seed)?;
            Ok((w, s, floor))
        })
        .collect()
}

/// Opens one source: the source and the lowest reachable mean loss, when it knows it.
fn read_source(
    spec: &str,
    a: &DataArgs,
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
            Arc::new(TokenFile::open(Path::new(path), a.width, vocab)?),
            None,
        ),
        path => match &a.tokenizer {
            Some(t) if is_instruction_file(Path::new(path))? => {
                let tokenizer = TextTokenizer::open(t)?;
                (
                    Arc::new(InstructionTokens::open(Path::new(path), &tokenizer)?),
                    None,
                )
            }
            Some(t) => {
                let tokenizer = TextTokenizer::open(t)?;
                anyhow::ensure!(
                    tokenizer.vocab_size() <= vocab,
                    "{}: a vocabulary of {} is larger than the model's {vocab}",
                    t.display(),
                    tokenizer.vocab_size()
                );
                let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
                let prefix = tokenized(Path::new(path), &tokenizer, workers)?;
                (Arc::new(IndexedDataset::open(&prefix, vocab)?), None)
            }
            None => (Arc::new(TextBytes::open(Path::new(path))?), None),
        },
    })
}
