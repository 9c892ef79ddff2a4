//! Samples: what a training step reads, `seq + 1` tokens each (inputs are the first `seq`,
//! targets the last `seq`), addressed by a global sample index that runs on across epochs.
//!
//! [`Windows`] packs a token stream (documents back to back, as Megatron's GPT dataset does)
//! into non-overlapping windows: sample g of epoch `e = g / n` is window `perm_e(g mod n)`, a
//! permutation that depends on (seed, epoch) only, so every epoch is read in another order
//! and every rank and layout agrees on it. [`super::Blend`] mixes several of them by weight.

use std::sync::Arc;

use super::error::{DataError, Result};
use super::shuffle::permute;
use super::TokenSource;

/// A dataset of samples of `seq + 1` tokens. Any index is valid: epochs wrap around.
pub trait Samples: Send + Sync {
    /// What the samples are, for logs and errors.
    fn name(&self) -> &str;
    /// Samples in one epoch (at least one).
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens per sample: seq + 1.
    fn sample_tokens(&self) -> usize;
    /// Every token id is below this.
    fn vocab(&self) -> usize;
    /// Sample `g` into `out` (`sample_tokens()` long).
    fn read(&self, g: u64, out: &mut [u32]) -> Result<()>;
    /// Whether some tokens do not count as targets.
    fn has_loss_mask(&self) -> bool {
        false
    }
    /// For each token of sample `g`, whether it counts as a target.
    fn read_loss_mask(&self, _g: u64, out: &mut [bool]) -> Result<()> {
        out.fill(true);
        Ok(())
    }
}

/// A token stream cut into windows of `seq + 1` tokens.
pub struct Windows {
    source: Arc<dyn TokenSource>,
    window: usize,
    count: u64,
    shuffle: Option<u64>,
}

impl Windows {
    /// The windows of `source` in stream order; at least one, or an error naming it.
    pub fn new(source: Arc<dyn TokenSource>, seq: usize) -> Result<Windows> {
        let window = seq
            .checked_add(1)
            .ok_or_else(|| DataError::Invalid(format!("seq {seq} overflows")))?;
        let count = (source.len() / window) as u64;
        if count == 0 {
            return Err(DataError::TooShort {
                name: source.name().to_string(),
                tokens: source.len(),
                needed: window,
            });
        }
        Ok(Windows {
            source,
            window,
            count,
            shuffle: None,
        })
    }

    /// The same windows, each epoch in the order of a permutation keyed by (`seed`, epoch).
    pub fn shuffled(self, seed: u64) -> Windows {
        Windows {
            shuffle: Some(seed),
            ..self
        }
    }

    /// The window sample `g` reads.
    fn window(&self, g: u64) -> u64 {
        let pos = g % self.count;
        match self.shuffle {
            Some(seed) => permute(seed, g / self.count, pos, self.count),
            None => pos,
        }
    }
}

impl Samples for Windows {
    fn name(&self) -> &str {
        self.source.name()
    }
    fn len(&self) -> u64 {
        self.count
    }
    fn sample_tokens(&self) -> usize {
        self.window
    }
    fn vocab(&self) -> usize {
        self.source.vocab()
    }
    fn read(&self, g: u64, out: &mut [u32]) -> Result<()> {
        // window < count <= len / window, so the start fits a usize.
        self.source.read(self.window(g) as usize * self.window, out)
    }
    fn has_loss_mask(&self) -> bool {
        self.source.has_loss_mask()
    }
    fn read_loss_mask(&self, g: u64, out: &mut [bool]) -> Result<()> {
        self.source
            .read_loss_mask(self.window(g) as usize * self.window, out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::SyntheticTokens;
    use super::*;

    #[test]
    fn shuffling_permutes_each_epoch_differently() {
        let src: Arc<dyn TokenSource> = Arc::new(SyntheticTokens::new(4096, 1 << 20, 1).unwrap());
        let plain = Windows::new(src.clone(), 128).unwrap();
        let n = plain.len();
        assert_eq!(n, 8128);
        let epoch = |w: &Windows, e: u64| -> Vec<u64> {
            (e * n..(e + 1) * n).map(|g| w.window(g)).collect()
        };
        assert_eq!(epoch(&plain, 2), (0..n).collect::<Vec<_>>());
        let a = Windows::new(src.clone(), 128).unwrap().shuffled(1);
        let (e0, e1) = (epoch(&a, 0), epoch(&a, 1));
        for e in [&e0, &e1] {
            let mut s = e.clone();
            s.sort_unstable();
            assert_eq!(s, (0..n).collect::<Vec<_>>());
        }
        assert_ne!(e0, e1);
        assert_ne!(e0, epoch(&Windows::new(src, 128).unwrap().shuffled(2), 0));
        assert_ne!(e0, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn a_source_shorter_than_a_window_is_named() {
        let tiny: Arc<dyn TokenSource> = Arc::new(SyntheticTokens::new(10, 8, 0).unwrap());
        let e = Windows::new(tiny, 8).err().unwrap();
        assert!(
            matches!(
                e,
                DataError::TooShort {
                    tokens: 8,
                    needed: 9,
                    ..
                }
            ),
            "{e}"
        );
    }
}
