//! Where tokens come from. Every source is a flat sequence of token ids below its vocabulary.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{EngineError, Result};

/// A flat sequence of token ids.
pub trait TokenSource: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens `start .. start + out.len()` into `out`; an error names a token out of range.
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()>;
}

/// The peer benchmark's generator (../shared/bench/make_tokens.py), bit for bit: a 64-bit LCG
/// whose state advances before each token, emitting `(x >> 33) % V`.
pub struct SyntheticTokens {
    tokens: Vec<u32>,
}

impl SyntheticTokens {
    pub fn new(vocab: usize, n: usize, seed: u64) -> SyntheticTokens {
        let mut x = seed;
        let tokens = (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % vocab as u64) as u32
            })
            .collect();
        SyntheticTokens { tokens }
    }
}

impl TokenSource for SyntheticTokens {
    fn len(&self) -> usize {
        self.tokens.len()
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        out.copy_from_slice(&self.tokens[start..start + out.len()]);
        Ok(())
    }
}

/// Bytes per token of a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    U16,
    U32,
}

/// A memory-mapped flat little-endian token file without header (nanoGPT's .bin).
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    width: TokenWidth,
    vocab: usize,
}

impl TokenFile {
    /// Opens `path`; tokens must be below `vocab` (checked as windows are read, so opening a
    /// large file costs nothing; the error names the file and the token's position).
    pub fn open(path: &Path, width: TokenWidth, vocab: usize) -> Result<TokenFile> {
        let file = File::open(path).map_err(|e| EngineError::file(path, e))?;
        // SAFETY: the map is read-only; a file truncated under a running job is the user's
        // doing, as with every memory-mapped dataset (numpy.memmap, nanoGPT).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::file(path, e))?;
        let size = bytes_per_token(width);
        if map.len() % size != 0 {
            return Err(EngineError::file(
                path,
                format!(
                    "{} bytes is not a whole number of {size}-byte tokens",
                    map.len()
                ),
            ));
        }
        Ok(TokenFile {
            path: path.to_path_buf(),
            map,
            width,
            vocab,
        })
    }
}

fn bytes_per_token(w: TokenWidth) -> usize {
    match w {
        TokenWidth::U16 => 2,
        TokenWidth::U32 => 4,
    }
}

impl TokenSource for TokenFile {
    fn len(&self) -> usize {
        self.map.len() / bytes_per_token(self.width)
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let size = bytes_per_token(self.width);
        let bytes = &self.map[start * size..(start + out.len()) * size];
        for (i, (o, b)) in out.iter_mut().zip(bytes.chunks_exact(size)).enumerate() {
            *o = match self.width {
                TokenWidth::U16 => u16::from_le_bytes([b[0], b[1]]) as u32,
                TokenWidth::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            };
            if *o as usize >= self.vocab {
                return Err(EngineError::file(
                    &self.path,
                    format!(
                        "token {} at position {} is not below the vocabulary size {}",
                        o,
                        start + i,
                        self.vocab
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A text file read as bytes: a vocabulary of 256.
pub struct TextBytes {
    map: Mmap,
}

impl TextBytes {
    pub fn open(path: &Path) -> Result<TextBytes> {
        let file = File::open(path).map_err(|e| EngineError::file(path, e))?;
        // SAFETY: read-only map, as for TokenFile.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::file(path, e))?;
        Ok(TextBytes { map })
    }
}

impl TokenSource for TextBytes {
    fn len(&self) -> usize {
        self.map.len()
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let n = out.len();
        out.iter_mut()
            .zip(&self.map[start..start + n])
            .for_each(|(o, b)| *o = *b as u32);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_stream_matches_the_peer_check_values() {
        // ../shared/bench/README.md, "Token data"
        let n = 1_048_576;
        let t = SyntheticTokens::new(4096, n, 1234);
        assert_eq!(
            &t.tokens[..8],
            &[3821, 1406, 3006, 3056, 1447, 2549, 3229, 2885]
        );
        let sum = t.tokens.iter().fold(0u32, |s, v| s.wrapping_add(*v));
        assert_eq!(sum, 2148886286);
        let t = SyntheticTokens::new(8192, n, 1234);
        assert_eq!(
            &t.tokens[..8],
            &[7917, 5502, 3006, 7152, 1447, 6645, 3229, 2885]
        );
        assert_eq!(
            t.tokens.iter().fold(0u32, |s, v| s.wrapping_add(*v)),
            1025806
        );
    }

    fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ds-rs-data-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn token_files_read_back_and_bad_ones_are_named() {
        let vals: [u32; 4] = [1, 300, 65535, 7];
        let p16 = temp_file(
            "u16.bin",
            &vals
                .iter()
                .flat_map(|v| (*v as u16).to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let p32 = temp_file(
            "u32.bin",
            &vals
                .iter()
                .flat_map(|v| (v * 3).to_le_bytes())
                .collect::<Vec<_>>(),
        );
        let mut out = [0u32; 4];
        TokenFile::open(&p16, TokenWidth::U16, 1 << 16)
            .unwrap()
            .read(0, &mut out)
            .unwrap();
        assert_eq!(out, vals);
        TokenFile::open(&p32, TokenWidth::U32, 1 << 20)
            .unwrap()
            .read(0, &mut out)
            .unwrap();
        assert_eq!(out, vals.map(|v| v * 3));
        let e = TokenFile::open(&p16, TokenWidth::U16, 1000)
            .unwrap()
            .read(0, &mut out)
            .unwrap_err();
        assert!(
            e.to_string().contains("u16.bin") && e.to_string().contains("position 2"),
            "{e}"
        );
        let odd = temp_file("odd.bin", &[1, 2, 3]);
        let e = TokenFile::open(&odd, TokenWidth::U16, 10).err().unwrap();
        assert!(
            e.to_string().contains("odd.bin") && e.to_string().contains("3 bytes"),
            "{e}"
        );
        for p in [p16, p32, odd] {
            std::fs::remove_file(p).unwrap();
        }
    }
}
