//! Writing Megatron-LM's indexed datasets (`PREFIX.bin` + `PREFIX.idx`, MMIDIDX version 1)
//! byte for byte as megatron-core's `IndexedDatasetBuilder` does: token ids appended to the
//! `.bin` as documents arrive (a corpus larger than memory streams through), the index (12
//! bytes a sequence, 8 a document) kept in memory and written at the end.
//!
//! Both files are written under temporary names and renamed into place only when the index
//! is complete, so a failed or interrupted run leaves no dataset that looks whole.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::error::{DataError, Result};
use super::indexed::{indexed_paths, Ids, MAGIC};

/// What a finished dataset holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexedSummary {
    pub documents: usize,
    pub sequences: usize,
    pub tokens: u64,
}

/// An indexed dataset being written.
pub struct IndexedWriter {
    bin_path: PathBuf,
    idx_path: PathBuf,
    bin: Option<BufWriter<File>>,
    ids: Ids,
    vocab: usize,
    sequence_lengths: Vec<i32>,
    /// Sequence indices where documents end, after a leading 0 (Megatron's layout).
    document_indices: Vec<i64>,
    tokens: u64,
    finished: bool,
}

/// `path` with `.tmp` appended: where a file is written before it is renamed into place.
fn staging(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".tmp");
    PathBuf::from(p)
}

fn io_error(path: &Path, e: std::io::Error) -> DataError {
    DataError::Open {
        path: path.display().to_string(),
        error: e,
    }
}

impl IndexedWriter {
    /// Starts `prefix.bin` and `prefix.idx` for ids below `vocab`: uint16 below 65500, else
    /// int32, as Megatron's `DType.optimal_dtype` decides.
    pub fn create(prefix: &Path, vocab: usize) -> Result<IndexedWriter> {
        let (idx_path, bin_path) = indexed_paths(prefix);
        let tmp = staging(&bin_path);
        let file = File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        Ok(IndexedWriter {
            bin_path,
            idx_path,
            bin: Some(BufWriter::with_capacity(1 << 20, file)),
            ids: Ids::for_vocab(vocab),
            vocab,
            sequence_lengths: Vec::new(),
            document_indices: vec![0],
            tokens: 0,
            finished: false,
        })
    }

    /// Appends one document: `tokens`, split into sequences of `lengths` (summing to its
    /// length; Megatron's sentences, or one sequence for the whole document). A document
    /// with no sequences is recorded, empty, as Megatron records it.
    pub fn add_document(&mut self, tokens: &[u32], lengths: &[usize]) -> Result<()> {
        let name = self.bin_path.display().to_string();
        if lengths.iter().sum::<usize>() != tokens.len() {
            return Err(DataError::Invalid(format!(
                "{name}: sequence lengths {lengths:?} do not add up to the document's {} tokens",
                tokens.len()
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(DataError::Invalid(format!(
                "{name}: token {bad} is not below the tokenizer's vocabulary of {}",
                self.vocab
            )));
        }
        for &len in lengths {
            let len = i32::try_from(len).map_err(|_| {
                DataError::Invalid(format!(
                    "{name}: a sequence of {len} tokens overflows int32"
                ))
            })?;
            self.sequence_lengths.push(len);
        }
        let bin = self.bin.as_mut().expect("open until finish");
        let written = match self.ids {
            Ids::U16 => tokens
                .iter()
                .try_for_each(|&t| bin.write_all(&(t as u16).to_le_bytes())),
            Ids::I32 => tokens
                .iter()
                .try_for_each(|&t| bin.write_all(&(t as i32).to_le_bytes())),
        };
        written.map_err(|e| io_error(&staging(&self.bin_path), e))?;
        self.tokens += tokens.len() as u64;
        self.document_indices
            .push(self.sequence_lengths.len() as i64);
        Ok(())
    }

    /// Writes the index and moves both files into place.
    pub fn finish(mut self) -> Result<IndexedSummary> {
        let bin_tmp = staging(&self.bin_path);
        let bin = self.bin.take().expect("open until finish");
        bin.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(|e| io_error(&bin_tmp, e))?;
        let idx_tmp = staging(&self.idx_path);
        std::fs::write(&idx_tmp, self.index_bytes()).map_err(|e| io_error(&idx_tmp, e))?;
        std::fs::rename(&bin_tmp, &self.bin_path).map_err(|e| io_error(&self.bin_path, e))?;
        std::fs::rename(&idx_tmp, &self.idx_path).map_err(|e| io_error(&self.idx_path, e))?;
        self.finished = true;
        Ok(IndexedSummary {
            documents: self.document_indices.len() - 1,
            sequences: self.sequence_lengths.len(),
            tokens: self.tokens,
        })
    }

    /// The `.idx`: magic, version 1, dtype code, the sequence and document counts, then the
    /// sequence lengths (int32), their byte offsets in the `.bin` (int64) and the document
    /// boundaries (int64).
    fn index_bytes(&self) -> Vec<u8> {
        let (s, d) = (self.sequence_lengths.len(), self.document_indices.len());
        let mut out = Vec::with_capacity(34 + 12 * s + 8 * d);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&1u64.to_le_bytes());
        out.push(self.ids.code());
        out.extend_from_slice(&(s as u64).to_le_bytes());
        out.extend_from_slice(&(d as u64).to_le_bytes());
        out.extend(self.sequence_lengths.iter().flat_map(|l| l.to_le_bytes()));
        let width = self.ids.bytes() as i64;
        let mut at = 0i64;
        for &len in &self.sequence_lengths {
            out.extend_from_slice(&at.to_le_bytes());
            at += i64::from(len) * width;
        }
        out.extend(self.document_indices.iter().flat_map(|i| i.to_le_bytes()));
        out
    }
}

impl Drop for IndexedWriter {
    /// An unfinished dataset leaves nothing behind.
    fn drop(&mut self) {
        if !self.finished {
            self.bin.take();
            let _ = std::fs::remove_file(staging(&self.bin_path));
            let _ = std::fs::remove_file(staging(&self.idx_path));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::TempDir;
    use super::super::{IndexedDataset, TokenSource};
    use super::*;

    #[test]
    fn what_is_written_reads_back_and_a_dropped_writer_leaves_nothing() {
        let dir = TempDir::new("writer");
        let prefix = dir.0.join("d_text_document");
        let mut w = IndexedWriter::create(&prefix, 70_000).unwrap();
        w.add_document(&[1, 69_999, 3], &[2, 1]).unwrap();
        w.add_document(&[], &[]).unwrap();
        w.add_document(&[5], &[1]).unwrap();
        let bad = w.add_document(&[70_000], &[1]).unwrap_err().to_string();
        assert!(bad.contains("token 70000 is not below"), "{bad}");
        assert!(w.add_document(&[1, 2], &[1]).is_err());
        let s = w.finish().unwrap();
        assert_eq!((s.documents, s.sequences, s.tokens), (3, 3, 4));
        let d = IndexedDataset::open(&prefix, 70_000).unwrap();
        let mut all = vec![0; 4];
        d.read(0, &mut all).unwrap();
        assert_eq!((all, d.documents()), (vec![1, 69_999, 3, 5], 3));

        let other = dir.0.join("gone");
        let mut w = IndexedWriter::create(&other, 10).unwrap();
        w.add_document(&[1], &[1]).unwrap();
        drop(w);
        assert_eq!(
            std::fs::read_dir(&dir.0).unwrap().count(),
            2,
            "only d's two files"
        );
    }
}
