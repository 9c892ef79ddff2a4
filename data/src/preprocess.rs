//! `ds-rs data preprocess`: documents (JSON lines, or whole text files) tokenized on every
//! core into Megatron indexed datasets, as Megatron-LM's `tools/preprocess_data.py` writes
//! them: one dataset per JSON key (`PREFIX_KEY_document.bin/.idx`), a key's list value read
//! as sentences (one sequence each), empty sentences dropped, and with `append_eod` the
//! end-of-document token appended to every non-empty document.
//!
//! A reader thread cuts the input into chunks of lines, workers parse and tokenize chunks,
//! and the calling thread writes them back in input order. Every queue is bounded, so a
//! corpus larger than memory streams through in a few chunks per worker.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use super::error::{DataError, Result};
use super::indexed_writer::{IndexedSummary, IndexedWriter};
use super::tokenizer::TextTokenizer;

/// Lines per chunk, and a chunk's byte bound: small enough that workers stay busy on a
/// small corpus, large enough that the queues cost nothing per document.
const CHUNK_LINES: usize = 256;
const CHUNK_BYTES: usize = 1 << 20;

/// What to preprocess and where.
#[derive(Debug, Clone)]
pub struct PreprocessJob {
    /// Input files, in order (see [`input_files`]).
    pub inputs: Vec<PathBuf>,
    /// The JSON keys to read; each gets its own dataset.
    pub json_keys: Vec<String>,
    /// Datasets go to `{output_prefix}_{key}_document.bin/.idx`.
    pub output_prefix: PathBuf,
    pub append_eod: bool,
    pub workers: usize,
}

/// What a run read and wrote.
#[derive(Debug, Clone)]
pub struct PreprocessReport {
    pub documents: u64,
    pub bytes: u64,
    /// Each key's dataset prefix and what it holds.
    pub outputs: Vec<(PathBuf, IndexedSummary)>,
}

/// The input files `spec` names: itself, or a directory's files (recursively, by name).
/// A `.jsonl`, `.json` or `.ndjson` file (optionally `.gz`) holds one document a line; any
/// other file is one document.
pub fn input_files(spec: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(spec).map_err(|error| DataError::Open {
        path: spec.display().to_string(),
        error,
    })?;
    if !meta.is_dir() {
        return Ok(vec![spec.to_path_buf()]);
    }
    let mut entries = std::fs::read_dir(spec)
        .and_then(|d| {
            d.map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<Vec<_>>>()
        })
        .map_err(|error| DataError::Open {
            path: spec.display().to_string(),
            error,
        })?;
    entries.sort();
    let mut files = Vec::new();
    for e in entries {
        files.extend(input_files(&e)?);
    }
    if files.is_empty() {
        return Err(DataError::Invalid(format!(
            "{}: the directory holds no files",
            spec.display()
        )));
    }
    Ok(files)
}

/// The dataset prefix of `key`: `{prefix}_{key}_document`.
pub fn output_prefix(prefix: &Path, key: &str) -> PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(format!("_{key}_document"));
    PathBuf::from(p)
}

/// Whether a file holds JSON lines (else it is one text document).
fn is_json_lines(path: &Path) -> bool {
    let name = path.to_string_lossy();
    let name = name.strip_suffix(".gz").unwrap_or(&name);
    [".jsonl", ".json", ".ndjson"]
        .iter()
        .any(|e| name.ends_with(e))
}

fn open_text(path: &Path) -> Result<Box<dyn BufRead + Send>> {
    let file = std::fs::File::open(path).map_err(|error| DataError::Open {
        path: path.display().to_string(),
        error,
    })?;
    let inner: Box<dyn Read + Send> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    Ok(Box::new(BufReader::with_capacity(1 << 20, inner)))
}

/// Lines of one input, to parse and tokenize.
struct Chunk {
    seq: u64,
    file: Arc<PathBuf>,
    /// The 1-based line number of the first line (for errors).
    first_line: u64,
    json: bool,
    lines: Vec<String>,
}

/// One document's ids and sequence lengths, per key.
type Encoded = Vec<(Vec<u32>, Vec<usize>)>;

/// A tokenized chunk: its documents and input bytes.
struct Done {
    seq: u64,
    docs: Result<Vec<Encoded>>,
    bytes: u64,
}

/// Runs `job`, calling `progress(documents, bytes)` after each chunk written.
pub fn preprocess(
    job: &PreprocessJob,
    tokenizer: &TextTokenizer,
    mut progress: impl FnMut(u64, u64),
) -> Result<PreprocessReport> {
    if job.append_eod && tokenizer.eod().is_none() {
        return Err(DataError::Invalid(format!(
            "{}: --append-eod needs an end-of-document token: no tokenizer_config.json beside \
             it names an eos_token; give --eod-token",
            tokenizer.path().display()
        )));
    }
    let mut writers = job
        .json_keys
        .iter()
        .map(|k| {
            IndexedWriter::create(
                &output_prefix(&job.output_prefix, k),
                tokenizer.vocab_size(),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let workers = job.workers.max(1);
    let (chunk_tx, chunk_rx) = sync_channel::<Chunk>(2 * workers);
    let (done_tx, done_rx) = sync_channel::<Done>(2 * workers);
    let chunk_rx = Arc::new(Mutex::new(chunk_rx));
    let (mut documents, mut bytes) = (0u64, 0u64);
    std::thread::scope(|s| -> Result<()> {
        let reader = s.spawn(|| read_chunks(&job.inputs, chunk_tx));
        for _ in 0..workers {
            let (rx, tx) = (chunk_rx.clone(), done_tx.clone());
            s.spawn(move || encode_chunks(&rx, &tx, job, tokenizer));
        }
        drop(done_tx);
        let written = write_in_order(&done_rx, &mut writers, |n, b| {
            documents += n;
            bytes += b;
            progress(documents, bytes);
        });
        // On an error, dropping the receiver ends the workers, and then the reader.
        drop(done_rx);
        let read = reader.join().expect("the reader thread does not panic");
        written.and(read)
    })?;
    let mut outputs = Vec::new();
    for (key, w) in job.json_keys.iter().zip(writers) {
        outputs.push((output_prefix(&job.output_prefix, key), w.finish()?));
    }
    Ok(PreprocessReport {
        documents,
        bytes,
        outputs,
    })
}

/// Cuts every input into chunks and sends them, in order, until done or nobody listens.
fn read_chunks(inputs: &[PathBuf], tx: SyncSender<Chunk>) -> Result<()> {
    let mut seq = 0;
    let mut send = |mut chunk: Chunk| {
        chunk.seq = seq;
        seq += 1;
        tx.send(chunk).is_ok()
    };
    for path in inputs {
        let file = Arc::new(path.clone());
        let json = is_json_lines(path);
        let mut reader = open_text(path)?;
        let new_chunk = |first_line| Chunk {
            seq: 0,
            file: file.clone(),
            first_line,
            json,
            lines: Vec::new(),
        };
        let (mut chunk, mut line_no, mut held) = (new_chunk(1), 0u64, 0usize);
        loop {
            let mut line = String::new();
            let read = if json {
                reader.read_line(&mut line)
            } else {
                reader.read_to_string(&mut line)
            };
            let n = read.map_err(|e| {
                DataError::Invalid(format!("{}:{}: {e}", path.display(), line_no + 1))
            })?;
            if n == 0 {
                break;
            }
            line_no += 1;
            held += n;
            chunk.lines.push(line);
            if chunk.lines.len() >= CHUNK_LINES || held >= CHUNK_BYTES {
                held = 0;
                if !send(std::mem::replace(&mut chunk, new_chunk(line_no + 1))) {
                    return Ok(());
                }
            }
        }
        if !chunk.lines.is_empty() && !send(chunk) {
            return Ok(());
        }
    }
    Ok(())
}

/// Tokenizes chunks until the input ends or the writer stops listening.
fn encode_chunks(
    rx: &Mutex<Receiver<Chunk>>,
    tx: &SyncSender<Done>,
    job: &PreprocessJob,
    tokenizer: &TextTokenizer,
) {
    loop {
        let next = rx.lock().expect("no worker panics holding it").recv();
        let Ok(chunk) = next else { return };
        let bytes = chunk.lines.iter().map(|l| l.len() as u64).sum();
        let docs = encode_chunk(&chunk, job, tokenizer);
        if tx
            .send(Done {
                seq: chunk.seq,
                docs,
                bytes,
            })
            .is_err()
        {
            return;
        }
    }
}

fn encode_chunk(
    chunk: &Chunk,
    job: &PreprocessJob,
    tokenizer: &TextTokenizer,
) -> Result<Vec<Encoded>> {
    let mut docs = Vec::with_capacity(chunk.lines.len());
    for (i, line) in chunk.lines.iter().enumerate() {
        let at = || format!("{}:{}", chunk.file.display(), chunk.first_line + i as u64);
        if !chunk.json {
            docs.push(vec![encode_document(&[line.as_str()], job, tokenizer)?]);
            continue;
        }
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| DataError::Invalid(format!("{}: not a JSON line: {e}", at())))?;
        let mut doc = Vec::with_capacity(job.json_keys.len());
        for key in &job.json_keys {
            let sentences = sentences(&value, key)
                .map_err(|why| DataError::Invalid(format!("{}: {why}", at())))?;
            doc.push(encode_document(&sentences, job, tokenizer)?);
        }
        docs.push(doc);
    }
    Ok(docs)
}

/// The text under `key`: a string, or a list of strings (sentences).
fn sentences<'a>(
    value: &'a serde_json::Value,
    key: &str,
) -> std::result::Result<Vec<&'a str>, String> {
    match value.get(key) {
        Some(serde_json::Value::String(s)) => Ok(vec![s.as_str()]),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| format!("key {key:?} holds a list with a non-string"))
            })
            .collect(),
        Some(other) => Err(format!(
            "key {key:?} holds {other}, not a text or a list of texts"
        )),
        None => Err(format!("no key {key:?} in this JSON line")),
    }
}

/// Megatron's `Encoder.encode` for one key: each non-empty sentence a sequence, and the
/// end-of-document token appended to the last one when asked and the document has tokens.
fn encode_document(
    sentences: &[&str],
    job: &PreprocessJob,
    tokenizer: &TextTokenizer,
) -> Result<(Vec<u32>, Vec<usize>)> {
    let (mut ids, mut lengths) = (Vec::new(), Vec::new());
    for s in sentences {
        let sentence = tokenizer.encode(s)?;
        if !sentence.is_empty() {
            lengths.push(sentence.len());
            ids.extend(sentence);
        }
    }
    if let (true, Some(eod), Some(last)) = (job.append_eod, tokenizer.eod(), lengths.last_mut()) {
        ids.push(eod);
        *last += 1;
    }
    Ok((ids, lengths))
}

/// Writes tokenized chunks in input order, as they arrive in any order.
fn write_in_order(
    rx: &Receiver<Done>,
    writers: &mut [IndexedWriter],
    mut progress: impl FnMut(u64, u64),
) -> Result<()> {
    let (mut next, mut waiting) = (0u64, BTreeMap::new());
    for done in rx {
        waiting.insert(done.seq, done);
        while let Some(done) = waiting.remove(&next) {
            let docs = done.docs?;
            for doc in &docs {
                for (w, (ids, lengths)) in writers.iter_mut().zip(doc) {
                    w.add_document(ids, lengths)?;
                }
            }
            progress(docs.len() as u64, done.bytes);
            next += 1;
        }
    }
    Ok(())
}
