//! Memory-mapped token files: nanoGPT's flat little-endian `.bin` ([`TokenFile`], uint16 or
//! uint32, no header), llm.c's `.bin` (a header of 256 int32s: magic 20240520 with uint16
//! tokens, 20240801 with uint32, then the token count) and plain text read as bytes
//! ([`TextBytes`], vocabulary 256).
//!
//! Token ids are checked against the vocabulary as windows are read, not by a scan at open:
//! a scan would read a multi-gigabyte corpus before the first step (and leave it resident,
//! inflating every rank's RSS), while the per-window check costs one compare per token read,
//! still stops every bad id before it reaches an embedding lookup, and names its exact index.

use std::fs::File;
use std::path::Path;
use std::str::FromStr;

use memmap2::Mmap;

use super::error::{span, DataError, Result};
use super::TokenSource;

/// The on-disk integer type of a token file (`--data-dtype u16|u32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenWidth {
    U16,
    U32,
}

impl TokenWidth {
    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

impl FromStr for TokenWidth {
    type Err = DataError;
    fn from_str(s: &str) -> Result<TokenWidth> {
        match s {
            "u16" | "uint16" => Ok(TokenWidth::U16),
            "u32" | "uint32" => Ok(TokenWidth::U32),
            _ => Err(DataError::Invalid(format!(
                "token dtype {s:?}: expected u16 or u32"
            ))),
        }
    }
}

/// A read-only file mapping and the path it came from.
#[derive(Debug)]
struct Mapped {
    name: String,
    map: Mmap,
}

impl Mapped {
    /// Maps `path`, whose size must be a whole number of `width`-byte tokens.
    fn open(path: &Path, width: usize) -> Result<Mapped> {
        let name = path.display().to_string();
        let open_error = |error| DataError::Open {
            path: name.clone(),
            error,
        };
        let file = File::open(path).map_err(open_error)?;
        // SAFETY: the map is read-only and private to this process. A file truncated or
        // rewritten under a running job is undefined behaviour (SIGBUS at worst), as with every
        // memory-mapped dataset (numpy.memmap in nanoGPT); training data is not edited live.
        let map = unsafe { Mmap::map(&file) }.map_err(open_error)?;
        if map.len() % width != 0 {
            return Err(DataError::Length {
                path: name,
                bytes: map.len(),
                width,
            });
        }
        Ok(Mapped { name, map })
    }
}

/// A flat little-endian token file without header, memory-mapped.
#[derive(Debug)]
pub struct TokenFile {
    file: Mapped,
    width: TokenWidth,
    vocab: usize,
    /// The first token's byte (after llm.c's header) and the number of tokens.
    start: usize,
    len: usize,
}

/// llm.c's header: 256 little-endian int32s, [magic, version, token count, 0...].
const LLMC_HEADER: usize = 256 * 4;

/// The token type and count an llm.c header gives, if the file starts with one.
fn llmc_header(name: &str, map: &[u8]) -> Result<Option<(TokenWidth, usize)>> {
    if map.len() < LLMC_HEADER {
        return Ok(None);
    }
    let int = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let (width, version) = match int(0) {
        20240520 => (TokenWidth::U16, 1),
        20240801 => (TokenWidth::U32, 7),
        _ => return Ok(None),
    };
    let bad = |what: String| DataError::Invalid(format!("{name}: llm.c header: {what}"));
    if int(1) != version {
        return Err(bad(format!(
            "magic {} with version {}, expected version {version}",
            int(0),
            int(1)
        )));
    }
    let count = usize::try_from(int(2)).map_err(|_| bad(format!("token count {}", int(2))))?;
    let want = LLMC_HEADER + count * width.bytes();
    if map.len() != want {
        return Err(bad(format!(
            "{count} tokens of {} bytes make {want} bytes with the header; the file has {}",
            width.bytes(),
            map.len()
        )));
    }
    Ok(Some((width, count)))
}

impl TokenFile {
    /// Opens `path` as `width`-byte tokens that must be below `vocab` (the model's V).
    pub fn open(path: &Path, width: TokenWidth, vocab: usize) -> Result<TokenFile> {
        if vocab == 0 {
            return Err(DataError::Invalid(format!(
                "{}: the vocabulary size must be at least 1",
                path.display()
            )));
        }
        let file = Mapped::open(path, 1)?;
        // llm.c's files say their token type; nanoGPT's are `width` tokens from the start
        if let Some((width, len)) = llmc_header(&file.name, &file.map)? {
            return Ok(TokenFile {
                file,
                width,
                vocab,
                start: LLMC_HEADER,
                len,
            });
        }
        if file.map.len() % width.bytes() != 0 {
            return Err(DataError::Length {
                path: file.name,
                bytes: file.map.len(),
                width: width.bytes(),
            });
        }
        let len = file.map.len() / width.bytes();
        Ok(TokenFile {
            file,
            width,
            vocab,
            start: 0,
            len,
        })
    }

    /// The on-disk token type.
    pub fn width(&self) -> TokenWidth {
        self.width
    }
}

impl TokenSource for TokenFile {
    fn name(&self) -> &str {
        &self.file.name
    }
    fn len(&self) -> usize {
        self.len
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let range = span(&self.file.name, start, out.len(), self.len())?;
        let size = self.width.bytes();
        let bytes = &self.file.map[self.start + range.start * size..self.start + range.end * size];
        // Chunks are exactly `size` bytes, so the indexing below is in bounds.
        let decode: fn(&[u8]) -> u32 = match self.width {
            TokenWidth::U16 => |b| u32::from(u16::from_le_bytes([b[0], b[1]])),
            TokenWidth::U32 => |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        };
        for (i, (o, b)) in out.iter_mut().zip(bytes.chunks_exact(size)).enumerate() {
            *o = decode(b);
            if *o as usize >= self.vocab {
                return Err(DataError::TokenOutOfRange {
                    name: self.file.name.clone(),
                    token: *o,
                    index: start + i,
                    byte: self.start + (start + i) * size,
                    vocab: self.vocab,
                });
            }
        }
        Ok(())
    }
}

/// A text file read as bytes: token = byte, vocabulary 256, memory-mapped.
#[derive(Debug)]
pub struct TextBytes {
    file: Mapped,
}

impl TextBytes {
    pub fn open(path: &Path) -> Result<TextBytes> {
        Ok(TextBytes {
            file: Mapped::open(path, 1)?,
        })
    }
}

impl TokenSource for TextBytes {
    fn name(&self) -> &str {
        &self.file.name
    }
    fn len(&self) -> usize {
        self.file.map.len()
    }
    fn vocab(&self) -> usize {
        256
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let range = span(&self.file.name, start, out.len(), self.len())?;
        for (o, b) in out.iter_mut().zip(&self.file.map[range]) {
            *o = u32::from(*b);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::TempDir;
    use super::*;

    fn read_all(s: &dyn TokenSource) -> Result<Vec<u32>> {
        let mut out = vec![0; s.len()];
        s.read(0, &mut out)?;
        Ok(out)
    }

    #[test]
    fn u16_u32_and_text_files_read_back() {
        let dir = TempDir::new("read");
        let vals: Vec<u32> = vec![0, 1, 300, 65535, 7, 4096];
        let b16: Vec<u8> = vals
            .iter()
            .flat_map(|v| (*v as u16).to_le_bytes())
            .collect();
        let b32: Vec<u8> = vals.iter().flat_map(|v| (v * 1000).to_le_bytes()).collect();
        let f16 = TokenFile::open(&dir.file("a.bin", &b16), TokenWidth::U16, 1 << 16).unwrap();
        assert_eq!((f16.len(), read_all(&f16).unwrap()), (6, vals.clone()));
        let f32 = TokenFile::open(&dir.file("b.bin", &b32), TokenWidth::U32, 1 << 26).unwrap();
        let want: Vec<u32> = vals.iter().map(|v| v * 1000).collect();
        assert_eq!(read_all(&f32).unwrap(), want);
        let mut mid = [0; 2];
        f32.read(3, &mut mid).unwrap();
        assert_eq!(mid, [65_535_000, 7000]);
        let text = TextBytes::open(&dir.file("t.txt", "hé\n".as_bytes())).unwrap();
        assert_eq!(read_all(&text).unwrap(), [104, 0xc3, 0xa9, 10]);
        assert_eq!((text.vocab(), f16.width()), (256, TokenWidth::U16));
    }

    #[test]
    fn missing_and_ragged_files_are_errors_that_name_them() {
        let dir = TempDir::new("bad");
        let missing = dir.0.join("missing.bin");
        let e = TokenFile::open(&missing, TokenWidth::U16, 10).unwrap_err();
        assert!(matches!(&e, DataError::Open { path, .. } if path.ends_with("missing.bin")));
        assert!(matches!(
            TextBytes::open(&dir.0),
            Err(DataError::Open { .. })
        ));
        let odd = dir.file("odd.bin", &[1, 2, 3]);
        let e = TokenFile::open(&odd, TokenWidth::U16, 10).unwrap_err();
        let why = "3 bytes is not a whole number of 2-byte tokens (wrong dtype?)";
        assert_eq!(e.to_string(), format!("{}: {why}", odd.display()));
        let six = dir.file("six.bin", &[0; 6]);
        let e = TokenFile::open(&six, TokenWidth::U32, 10).unwrap_err();
        let why = "6 bytes is not a whole number of 4-byte tokens (wrong dtype?)";
        assert_eq!(e.to_string(), format!("{}: {why}", six.display()));
        assert!(TextBytes::open(&dir.file("empty.txt", b""))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_token_beyond_the_vocabulary_is_named_when_read() {
        let dir = TempDir::new("range");
        // Token 1000 sits at index 2 (byte 4) of a file for a model with V = 1000.
        let bytes: Vec<u8> = [5u16, 999, 1000, 3]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let path = dir.file("big.bin", &bytes);
        let f = TokenFile::open(&path, TokenWidth::U16, 1000).unwrap();
        assert_eq!(
            read_all(&f).err().map(|e| e.to_string()),
            Some(format!(
                "{}: token 1000 at index 2 (byte 4) is not below the vocabulary size 1000",
                path.display()
            ))
        );
        let mut two = [0; 2];
        f.read(0, &mut two).unwrap();
        assert_eq!(two, [5, 999]);
        assert!(matches!(
            f.read(3, &mut two),
            Err(DataError::OutOfBounds { .. })
        ));
        assert!(TokenFile::open(&path, TokenWidth::U16, 0).is_err());
    }

    #[test]
    fn dtype_parses_from_the_command_line_spelling() {
        assert_eq!("u16".parse::<TokenWidth>().unwrap(), TokenWidth::U16);
        assert_eq!("u32".parse::<TokenWidth>().unwrap(), TokenWidth::U32);
        assert!("u8".parse::<TokenWidth>().is_err());
    }
}

#[cfg(test)]
mod llmc_tests {
    use super::super::testing::TempDir;
    use super::*;

    /// An llm.c file: the 256-int32 header [magic, version, count], then the tokens.
    fn llmc(magic: i32, version: i32, count: i32, tokens: &[u8]) -> Vec<u8> {
        let mut header = vec![0i32; 256];
        header[..3].copy_from_slice(&[magic, version, count]);
        let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.extend_from_slice(tokens);
        bytes
    }

    #[test]
    fn llmc_files_read_after_their_header() {
        let dir = TempDir::new("llmc");
        let ids: Vec<u32> = vec![50256, 464, 3290, 7, 0, 1];
        let u16s: Vec<u8> = ids.iter().flat_map(|v| (*v as u16).to_le_bytes()).collect();
        let gpt2 = dir.file("gpt2.bin", &llmc(20240520, 1, 6, &u16s));
        // the header decides the width, whatever --token-width says
        let f = TokenFile::open(&gpt2, TokenWidth::U32, 50257).unwrap();
        let mut out = vec![0; f.len()];
        f.read(0, &mut out).unwrap();
        assert_eq!((f.width(), out), (TokenWidth::U16, ids.clone()));
        let big: Vec<u32> = vec![128000, 9906, 1917, 0];
        let u32s: Vec<u8> = big.iter().flat_map(|v| v.to_le_bytes()).collect();
        let llama = dir.file("llama.bin", &llmc(20240801, 7, 4, &u32s));
        let f = TokenFile::open(&llama, TokenWidth::U16, 128256).unwrap();
        let mut out = vec![0; 4];
        f.read(0, &mut out).unwrap();
        assert_eq!(out, big);
        for (name, bytes, needle) in [
            ("version", llmc(20240520, 3, 6, &u16s), "version 3"),
            ("count", llmc(20240520, 1, 7, &u16s), "7 tokens"),
        ] {
            let e = TokenFile::open(&dir.file(name, &bytes), TokenWidth::U16, 50257)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle) && e.contains(name), "{name}: {e}");
        }
    }
}
