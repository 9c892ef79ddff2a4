//! The peer benchmark's synthetic token stream (`shared/bench/make_tokens.py`), bit for bit.
//!
//! Generator: `x_0 = seed`; `x_{i+1} = x_i * A + C mod 2^64`; token `i` = `(x_{i+1} >> 33) % V`.
//! Nothing is stored: token `i` is computed by jumping the LCG `i` steps ahead in O(log i)
//! (composing the affine map with itself), so any N costs no memory and a window costs
//! O(log start + len).

use super::error::{span, DataError, Result};
use super::TokenSource;

/// The multiplier and increment of Knuth's MMIX LCG (also PCG's), as in make_tokens.py.
const MUL: u64 = 6364136223846793005;
const INC: u64 = 1442695040888963407;

/// The uniform pseudo-random tokens of the peer benchmark.
#[derive(Debug, Clone)]
pub struct SyntheticTokens {
    name: String,
    vocab: usize,
    len: usize,
    seed: u64,
}

impl SyntheticTokens {
    /// The peer benchmark's stream length (make_tokens.py's default N = 2^20).
    pub const PEER_LEN: usize = 1 << 20;
    /// The peer benchmark's seed.
    pub const PEER_SEED: u64 = 1234;

    /// `len` tokens below `vocab` from `seed`; the peer's stream is
    /// `new(V, SyntheticTokens::PEER_LEN, SyntheticTokens::PEER_SEED)`.
    pub fn new(vocab: usize, len: usize, seed: u64) -> Result<SyntheticTokens> {
        if vocab == 0 {
            return Err(DataError::Invalid(
                "synthetic tokens: the vocabulary size must be at least 1".into(),
            ));
        }
        let name = format!("synthetic tokens (V={vocab}, N={len}, seed={seed})");
        Ok(SyntheticTokens {
            name,
            vocab,
            len,
            seed,
        })
    }
}

/// The LCG state `k` steps after `x`. The map x -> A*x + C applied 2^i times is again affine,
/// (a, c) -> (a*a, (a+1)*c); the bits of `k` pick which powers to compose (Brown, 1994).
fn jump(x: u64, mut k: u64) -> u64 {
    let (mut a, mut c) = (MUL, INC);
    let (mut acc_a, mut acc_c) = (1u64, 0u64);
    while k > 0 {
        if k & 1 == 1 {
            acc_a = acc_a.wrapping_mul(a);
            acc_c = acc_c.wrapping_mul(a).wrapping_add(c);
        }
        c = a.wrapping_add(1).wrapping_mul(c);
        a = a.wrapping_mul(a);
        k >>= 1;
    }
    acc_a.wrapping_mul(x).wrapping_add(acc_c)
}

impl TokenSource for SyntheticTokens {
    fn name(&self) -> &str {
        &self.name
    }
    fn len(&self) -> usize {
        self.len
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        span(&self.name, start, out.len(), self.len)?;
        // The state before token `start` is x_start; each token advances it first.
        let mut x = jump(self.seed, start as u64);
        for o in out.iter_mut() {
            x = x.wrapping_mul(MUL).wrapping_add(INC);
            // (x >> 33) < 2^31 and the remainder is no larger, so it fits a u32.
            *o = ((x >> 33) % self.vocab as u64) as u32;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(vocab: usize) -> Vec<u32> {
        let s = SyntheticTokens::new(vocab, SyntheticTokens::PEER_LEN, 1234).unwrap();
        let mut out = vec![0; s.len()];
        s.read(0, &mut out).unwrap();
        out
    }

    fn sum(t: &[u32]) -> u32 {
        t.iter().fold(0u32, |s, v| s.wrapping_add(*v))
    }

    #[test]
    fn matches_the_peer_check_values() {
        // shared/bench/README.md, "Token data"
        let t = all(4096);
        assert_eq!(t[..8], [3821, 1406, 3006, 3056, 1447, 2549, 3229, 2885]);
        assert_eq!(sum(&t), 2148886286);
        let t = all(8192);
        assert_eq!(t[..8], [7917, 5502, 3006, 7152, 1447, 6645, 3229, 2885]);
        assert_eq!(sum(&t), 1025806);
    }

    #[test]
    fn reads_at_any_offset_equal_the_sequential_stream() {
        let (vocab, n) = (1000usize, 5000usize);
        let mut x = 99u64;
        let seq: Vec<u32> = (0..n)
            .map(|_| {
                x = x.wrapping_mul(MUL).wrapping_add(INC);
                ((x >> 33) % vocab as u64) as u32
            })
            .collect();
        let s = SyntheticTokens::new(vocab, n, 99).unwrap();
        for (start, len) in [
            (0, 1),
            (1, 7),
            (129, 129),
            (4095, 905),
            (4999, 1),
            (5000, 0),
        ] {
            let mut out = vec![0; len];
            s.read(start, &mut out).unwrap();
            assert_eq!(out, seq[start..start + len], "start {start}");
        }
    }

    #[test]
    fn bad_parameters_and_reads_are_errors() {
        assert!(matches!(
            SyntheticTokens::new(0, 10, 1),
            Err(DataError::Invalid(_))
        ));
        let s = SyntheticTokens::new(16, 10, 1).unwrap();
        let e = s.read(8, &mut [0; 3]).unwrap_err();
        assert!(
            matches!(
                e,
                DataError::OutOfBounds {
                    end: 11,
                    len: 10,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("V=16, N=10, seed=1"), "{e}");
        assert!(s.read(usize::MAX, &mut [0; 2]).is_err());
    }
}
