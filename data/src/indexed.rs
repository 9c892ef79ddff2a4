//! Megatron-LM's indexed datasets (`PREFIX.bin` + `PREFIX.idx`, format MMIDIDX version 1,
//! what Megatron-LM's, Megatron-DeepSpeed's and GPT-NeoX's `preprocess_data.py` write), read
//! memory-mapped as one token stream: the sequences in index order, documents one after
//! another, which is how Megatron's GPT dataset packs samples across documents.
//!
//! The index is checked whole at open (it is small: 12 bytes a sequence): its magic, version
//! and dtype, that its arrays fit in the file, that the sequences lie back to back from the
//! start of the `.bin` and inside it, and that the document boundaries are sequence indices
//! in order. Token ids are checked against the vocabulary as windows are read, as for
//! [`super::TokenFile`].

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::{span, DataError, Result};
use super::TokenSource;

/// The first bytes of every index file.
pub(crate) const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// magic, version (u64), dtype code (u8), sequence and document counts (u64 each).
const HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// The token types Megatron writes for token ids: uint16 below a vocabulary of 65500, else
/// int32 (its dtype codes 8 and 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ids {
    U16,
    I32,
}

impl Ids {
    /// What Megatron picks for a vocabulary (`DType.optimal_dtype`).
    pub(crate) fn for_vocab(vocab: usize) -> Ids {
        if vocab < 65500 {
            Ids::U16
        } else {
            Ids::I32
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Ids::U16 => 8,
            Ids::I32 => 4,
        }
    }

    fn from_code(code: u8) -> std::result::Result<Ids, String> {
        let name = match code {
            8 => return Ok(Ids::U16),
            4 => return Ok(Ids::I32),
            1 => "uint8",
            2 => "int8",
            3 => "int16",
            5 => "int64",
            6 => "float64",
            7 => "float32",
            _ => "unknown",
        };
        Err(format!(
            "dtype code {code} ({name}): token ids are uint16 (code 8) or int32 (code 4)"
        ))
    }

    pub(crate) fn bytes(self) -> usize {
        match self {
            Ids::U16 => 2,
            Ids::I32 => 4,
        }
    }
}

/// A Megatron indexed dataset as a token stream.
#[derive(Debug)]
pub struct IndexedDataset {
    name: String,
    bin: Mmap,
    ids: Ids,
    /// Tokens in all sequences.
    tokens: usize,
    /// The token offset of each document's start, and the total (documents + 1 entries).
    document_starts: Vec<usize>,
    vocab: usize,
}

/// The `.idx` and `.bin` of a prefix, or of a path to either file.
pub fn indexed_paths(spec: &Path) -> (PathBuf, PathBuf) {
    let prefix = match spec.extension().and_then(|e| e.to_str()) {
        Some("bin") | Some("idx") => spec.with_extension(""),
        _ => spec.to_path_buf(),
    };
    let with = |ext: &str| {
        let mut p = prefix.clone().into_os_string();
        p.push(ext);
        PathBuf::from(p)
    };
    (with(".idx"), with(".bin"))
}

/// Whether `spec` names an indexed dataset (its `.idx` exists).
pub fn is_indexed(spec: &Path) -> bool {
    indexed_paths(spec).0.is_file()
}

fn map(path: &Path) -> Result<Mmap> {
    let open_error = |error| DataError::Open {
        path: path.display().to_string(),
        error,
    };
    let file = File::open(path).map_err(open_error)?;
    // SAFETY: read-only and private, as for every token file (see file.rs).
    unsafe { Mmap::map(&file) }.map_err(open_error)
}

impl IndexedDataset {
    /// Opens the dataset `spec` names (a prefix, or its `.bin` or `.idx`), with ids below
    /// `vocab`.
    pub fn open(spec: &Path, vocab: usize) -> Result<IndexedDataset> {
        let (idx_path, bin_path) = indexed_paths(spec);
        let idx = map(&idx_path)?;
        let bin = map(&bin_path)?;
        let bad = |what: String| DataError::Invalid(format!("{}: {what}", idx_path.display()));
        let index = Index::parse(&idx).map_err(bad)?;
        let tokens = index
            .check_sequences(bin.len())
            .map_err(|e| DataError::Invalid(format!("{}: {e}", idx_path.display())))?;
        Ok(IndexedDataset {
            name: bin_path.display().to_string(),
            bin,
            ids: index.ids,
            tokens,
            document_starts: index.document_starts(tokens),
            vocab,
        })
    }

    /// Documents in the dataset.
    pub fn documents(&self) -> usize {
        self.document_starts.len().saturating_sub(1)
    }
}

/// The parsed header and arrays of an index file.
struct Index<'a> {
    ids: Ids,
    sequence_count: usize,
    document_count: usize,
    lengths: &'a [u8],
    pointers: &'a [u8],
    documents: &'a [u8],
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl<'a> Index<'a> {
    /// The token offset where each document boundary falls (checked sequences only).
    fn document_starts(&self, tokens: usize) -> Vec<usize> {
        let width = self.ids.bytes() as u64;
        (0..self.document_count)
            .map(|k| match u64_at(self.documents, 8 * k) as usize {
                s if s < self.sequence_count => (u64_at(self.pointers, 8 * s) / width) as usize,
                _ => tokens,
            })
            .collect()
    }

    fn parse(b: &'a [u8]) -> std::result::Result<Index<'a>, String> {
        if b.len() < HEADER || &b[..9] != MAGIC {
            return Err("not a Megatron index: it does not start with MMIDIDX".into());
        }
        let version = u64_at(b, 9);
        if version != 1 {
            return Err(format!("index version {version}: ds-rs reads version 1"));
        }
        let ids = Ids::from_code(b[17])?;
        let (s, d) = (u64_at(b, 18), u64_at(b, 26));
        let need = (s as u128) * 12 + (d as u128) * 8 + HEADER as u128;
        if need > b.len() as u128 {
            return Err(format!(
                "{s} sequences and {d} documents need {need} bytes; the file has {}",
                b.len()
            ));
        }
        let (s, d) = (s as usize, d as usize);
        let at = HEADER;
        Ok(Index {
            ids,
            sequence_count: s,
            document_count: d,
            lengths: &b[at..at + 4 * s],
            pointers: &b[at + 4 * s..at + 12 * s],
            documents: &b[at + 12 * s..at + 12 * s + 8 * d],
        })
    }

    /// Checks that the sequences lie back to back from the start of a `.bin` of `bin_len`
    /// bytes and that the document boundaries are in order; returns the tokens in all.
    fn check_sequences(&self, bin_len: usize) -> std::result::Result<usize, String> {
        let width = self.ids.bytes() as u64;
        let mut next = 0u64;
        for i in 0..self.sequence_count {
            let len = i32::from_le_bytes(self.lengths[4 * i..4 * i + 4].try_into().expect("4"));
            let ptr = u64_at(self.pointers, 8 * i);
            if len < 0 || ptr != next {
                return Err(format!(
                    "sequence {i}: length {len} at byte {ptr}, expected a length >= 0 at byte {next} (sequences back to back)"
                ));
            }
            next += len as u64 * width;
            if next > bin_len as u64 {
                return Err(format!(
                    "sequence {i} ends at byte {next}, past the end of the .bin ({bin_len} bytes)"
                ));
            }
        }
        let mut last = 0u64;
        for k in 0..self.document_count {
            let at = u64_at(self.documents, 8 * k);
            if at < last || at > self.sequence_count as u64 || (k == 0 && at != 0) {
                return Err(format!(
                    "document boundary {k} is sequence {at}: boundaries start at 0 and rise to the sequence count {}",
                    self.sequence_count
                ));
            }
            last = at;
        }
        Ok((next / width) as usize)
    }
}

impl TokenSource for IndexedDataset {
    fn name(&self) -> &str {
        &self.name
    }
    fn document_starts(&self) -> Option<&[usize]> {
        Some(&self.document_starts)
    }
    fn len(&self) -> usize {
        self.tokens
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let range = span(&self.name, start, out.len(), self.tokens)?;
        let size = self.ids.bytes();
        let bytes = &self.bin[range.start * size..range.end * size];
        for (i, (o, b)) in out.iter_mut().zip(bytes.chunks_exact(size)).enumerate() {
            let id = match self.ids {
                Ids::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
                Ids::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            };
            if id < 0 {
                return Err(DataError::Invalid(format!(
                    "{}: token {id} at index {} is negative",
                    self.name,
                    start + i
                )));
            }
            if id as usize >= self.vocab {
                return Err(DataError::TokenOutOfRange {
                    name: self.name.clone(),
                    token: id as u32,
                    index: start + i,
                    byte: (start + i) * size,
                    vocab: self.vocab,
                });
            }
            *o = id as u32;
        }
        Ok(())
    }
}
