//! Text given to `train --data` with a tokenizer is tokenized once, into an indexed dataset
//! beside the text (`F.ds-rs-HASH_text_document.bin/.idx`; instruction records also get
//! `F.ds-rs-HASH_mask_document`), and read from there, memory-mapped, by every later run.
//! The name's hash covers what decides the tokens (the file's size and modification time,
//! the tokenizer.json's and tokenizer_config.json's bytes, the end-of-document token, the
//! kind of data), so changed text or another tokenizer makes a new cache rather than
//! reading a stale one.
//!
//! Ranks that share the file system take an exclusive lock on `F.ds-rs-HASH.lock`: the first
//! tokenizes, the others wait for it (bounded), then open what it wrote. The OS releases the
//! lock when a process dies, so a killed run leaves no lock that blocks the next.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::error::{DataError, Result};
use super::{input_files, is_indexed, output_prefix, preprocess, PreprocessJob, TextTokenizer};

/// How long a rank waits for another to tokenize the text.
const WAIT: Duration = Duration::from_secs(4 * 3600);
const POLL: Duration = Duration::from_millis(200);

/// The indexed dataset of `text` tokenized by `tokenizer` (with end-of-document tokens when
/// it has one), made now if no run made it before.
pub fn tokenized(text: &Path, tokenizer: &TextTokenizer, workers: usize) -> Result<PathBuf> {
    let stem = cache_stem(text, tokenizer, "text")?;
    let prefix = output_prefix(&stem, "text");
    once(&stem, &prefix, || {
        let job = PreprocessJob {
            inputs: input_files(text)?,
            json_keys: vec!["text".into()],
            output_prefix: stem.clone(),
            append_eod: tokenizer.eod().is_some(),
            workers,
        };
        preprocess(&job, tokenizer, |_, _| {}).map(drop)
    })?;
    Ok(prefix)
}

/// The cache stem of instruction records of `path` (`STEM_text_document` holds the ids,
/// `STEM_mask_document` 1 where a token counts), made by `build(stem)` if no run made it.
pub fn instructions_cached(
    path: &Path,
    tokenizer: &TextTokenizer,
    build: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let stem = cache_stem(path, tokenizer, "instructions")?;
    once(&stem, &output_prefix(&stem, "mask"), || build(&stem))?;
    Ok(stem)
}

/// Runs `build` unless `done` (an indexed dataset, written last) exists, under the stem's
/// lock: of several ranks, one builds and the others wait, then find it built.
fn once(stem: &Path, done: &Path, build: impl FnOnce() -> Result<()>) -> Result<()> {
    if is_indexed(done) {
        return Ok(());
    }
    let mut lock_path = stem.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let lock = File::create(&lock_path).map_err(|error| DataError::Open {
        path: lock_path.display().to_string(),
        error,
    })?;
    let deadline = Instant::now() + WAIT;
    loop {
        match lock.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(POLL)
            }
            Err(e) => {
                return Err(DataError::Invalid(format!(
                    "{}: no lock on the tokenization cache within {} s: {e}",
                    lock_path.display(),
                    WAIT.as_secs()
                )))
            }
        }
    }
    // Another rank may have finished while this one waited.
    let built = match is_indexed(done) {
        true => Ok(()),
        false => build(),
    };
    let _ = std::fs::remove_file(&lock_path);
    built
}

/// `F.ds-rs-HASH`: beside the text, named by what decides its tokens.
fn cache_stem(text: &Path, tokenizer: &TextTokenizer, kind: &str) -> Result<PathBuf> {
    let open = |path: &Path, error| DataError::Open {
        path: path.display().to_string(),
        error,
    };
    let meta = std::fs::metadata(text).map_err(|e| open(text, e))?;
    if meta.is_dir() {
        return Err(DataError::Invalid(format!(
            "{}: a directory; tokenize it with `ds-rs data preprocess` and give the prefix",
            text.display()
        )));
    }
    let json = std::fs::read(tokenizer.path()).map_err(|e| open(tokenizer.path(), e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    let mut h = Fnv1a::default();
    h.write(&meta.len().to_le_bytes());
    h.write(&mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
    h.write(&json);
    // the chat template and special tokens live there
    let config = tokenizer.path().with_file_name("tokenizer_config.json");
    h.write(&std::fs::read(config).unwrap_or_default());
    h.write(&tokenizer.eod().map_or(u64::MAX, u64::from).to_le_bytes());
    h.write(kind.as_bytes());
    let mut name = text.as_os_str().to_owned();
    name.push(format!(".ds-rs-{:016x}", h.0));
    Ok(PathBuf::from(name))
}

/// 64-bit FNV-1a: a name that stays the same across Rust versions (std's hasher may not).
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}
