//! A learnable synthetic source with a known loss floor: a seeded first-order Markov chain.
//!
//! Each token `i` may be followed by `K` tokens: `i + 1 mod V` (so the chain is irreducible
//! and has one stationary distribution) and `K - 1` other distinct tokens drawn at random.
//! Each row's probabilities are a uniform draw from the simplex (normalised exponentials, i.e.
//! Dirichlet(1, .., 1)). The best possible next-token loss is the entropy rate
//! `H = -sum_i pi_i sum_j P_ij ln P_ij` (pi the stationary distribution), about
//! 1/2 + .. + 1/K nats (1.08 for K = 4) against ln V for uniform tokens, so a train job can
//! report how close its loss came to the floor. Everything follows from (seed, V, K, N).
//! The tokens are generated once and held in memory (4 bytes each): the chain is sequential,
//! so token i cannot be computed without the ones before it.

use super::error::{span, DataError, Result};
use super::shuffle::SplitMix64;
use super::TokenSource;

/// Power iteration stops once an iteration moves pi by less than this (L1 norm) ...
const TOLERANCE: f64 = 1e-13;
/// ... or after this many iterations; the random rows make the chain mix in a few hundred
/// (measured: 50 to 1300 for V up to 2^20, K 2 to 64).
const MAX_ITERS: usize = 10_000;
/// Bounds that keep the transition table (12 bytes per entry) under 1 GiB and the row
/// construction cheap; a "small support" is the point of this source.
const MAX_VOCAB: usize = 1 << 20;
const MAX_BRANCHING: usize = 64;

/// Tokens generated from a random sparse Markov chain, held in memory.
#[derive(Debug, Clone)]
pub struct MarkovTokens {
    name: String,
    vocab: usize,
    tokens: Vec<u32>,
    entropy_rate: f64,
}

/// Row `i` of the transition matrix is `next[i*K..][..K]` with probabilities `prob[i*K..][..K]`.
struct Chain {
    k: usize,
    next: Vec<u32>,
    prob: Vec<f64>,
}

impl MarkovTokens {
    /// `len` tokens below `vocab` (2 ..= 2^20), each followed by one of `branching`
    /// (1 ..= min(V, 64)) successors.
    pub fn new(vocab: usize, branching: usize, len: usize, seed: u64) -> Result<MarkovTokens> {
        let name = format!("Markov tokens (V={vocab}, K={branching}, N={len}, seed={seed})");
        if !(2..=MAX_VOCAB).contains(&vocab) || !(1..=vocab.min(MAX_BRANCHING)).contains(&branching)
        {
            return Err(DataError::Invalid(format!(
                "{name}: need 2 <= V <= 2^20 and 1 <= K <= min(V, 64)"
            )));
        }
        let mut rng = SplitMix64::new(seed);
        let chain = Chain::random(vocab, branching, &mut rng);
        let entropy_rate = chain.entropy_rate(&chain.stationary());
        let tokens = chain
            .generate(len, &mut rng)
            .ok_or_else(|| DataError::Invalid(format!("{name}: cannot allocate the tokens")))?;
        Ok(MarkovTokens {
            name,
            vocab,
            tokens,
            entropy_rate,
        })
    }

    /// The chain's entropy rate in nats: the lowest mean cross-entropy any model can reach on
    /// this stream (up to the finite-sample noise of the stream itself).
    pub fn entropy_rate_nats(&self) -> f64 {
        self.entropy_rate
    }
}

impl Chain {
    fn random(vocab: usize, k: usize, rng: &mut SplitMix64) -> Chain {
        let (mut next, mut prob) = (Vec::with_capacity(vocab * k), Vec::with_capacity(vocab * k));
        for i in 0..vocab {
            let row = next.len();
            next.push(((i + 1) % vocab) as u32);
            while next.len() - row < k {
                // Rejection keeps the successors distinct; K <= V, so it ends.
                let j = rng.below(vocab as u64) as u32;
                if !next[row..].contains(&j) {
                    next.push(j);
                }
            }
            let weights: Vec<f64> = (0..k).map(|_| -rng.unit().ln()).collect();
            let total: f64 = weights.iter().sum();
            // A row whose draws are all 1.0 (weights all 0) falls back to uniform.
            prob.extend(weights.iter().map(|w| match total > 0.0 {
                true => w / total,
                false => 1.0 / k as f64,
            }));
        }
        Chain { k, next, prob }
    }

    /// The stationary distribution by power iteration on the lazy chain (I + P) / 2, which
    /// has the same fixed point and converges even if P is periodic.
    fn stationary(&self) -> Vec<f64> {
        let vocab = self.next.len() / self.k;
        let mut pi = vec![1.0 / vocab as f64; vocab];
        let mut step = vec![0.0; vocab];
        for _ in 0..MAX_ITERS {
            step.iter_mut().zip(&pi).for_each(|(s, p)| *s = 0.5 * p);
            for (i, p) in pi.iter().enumerate() {
                let row = i * self.k..(i + 1) * self.k;
                for (j, q) in self.next[row.clone()].iter().zip(&self.prob[row]) {
                    step[*j as usize] += 0.5 * p * q;
                }
            }
            let moved: f64 = step.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
            std::mem::swap(&mut pi, &mut step);
            if moved < TOLERANCE {
                break;
            }
        }
        let total: f64 = pi.iter().sum();
        pi.iter().map(|p| p / total).collect()
    }

    fn entropy_rate(&self, pi: &[f64]) -> f64 {
        let row_entropy = |i: usize| -> f64 {
            let row = &self.prob[i * self.k..(i + 1) * self.k];
            -row.iter()
                .filter(|q| **q > 0.0)
                .map(|q| q * q.ln())
                .sum::<f64>()
        };
        pi.iter().enumerate().map(|(i, p)| p * row_entropy(i)).sum()
    }

    /// `len` tokens: a uniform first token, then draws from each token's row; `None` if
    /// they do not fit in memory.
    fn generate(&self, len: usize, rng: &mut SplitMix64) -> Option<Vec<u32>> {
        let vocab = (self.next.len() / self.k) as u64;
        let mut x = rng.below(vocab) as usize;
        let mut out = Vec::new();
        out.try_reserve_exact(len).ok()?;
        for _ in 0..len {
            out.push(x as u32);
            let row = x * self.k..(x + 1) * self.k;
            let mut u = rng.unit();
            // Rounding can leave u just above the row's sum: the last successor takes it.
            let mut pick = self.next[row.end - 1];
            for (j, q) in self.next[row.clone()].iter().zip(&self.prob[row]) {
                if u <= *q {
                    pick = *j;
                    break;
                }
                u -= q;
            }
            x = pick as usize;
        }
        Some(out)
    }
}

impl TokenSource for MarkovTokens {
    fn name(&self) -> &str {
        &self.name
    }
    fn len(&self) -> usize {
        self.tokens.len()
    }
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let range = span(&self.name, start, out.len(), self.tokens.len())?;
        out.copy_from_slice(&self.tokens[range]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plug-in conditional entropy -sum c(a,b)/n ln(c(a,b)/c(a)) of consecutive pairs.
    fn empirical_entropy(t: &[u32], vocab: usize) -> f64 {
        let mut pairs = vec![0u64; vocab * vocab];
        let mut from = vec![0u64; vocab];
        for w in t.windows(2) {
            pairs[w[0] as usize * vocab + w[1] as usize] += 1;
            from[w[0] as usize] += 1;
        }
        let n = (t.len() - 1) as f64;
        let cell = |(i, c): (usize, &u64)| match *c {
            0 => 0.0,
            c => -(c as f64) / n * (c as f64 / from[i / vocab] as f64).ln(),
        };
        pairs.iter().enumerate().map(cell).sum()
    }

    #[test]
    fn stream_entropy_matches_the_entropy_rate() {
        let (vocab, n) = (256, 2_000_000);
        let m = MarkovTokens::new(vocab, 4, n, 42).unwrap();
        let h = m.entropy_rate_nats();
        // Dirichlet(1) rows of 4 average 1/2 + 1/3 + 1/4 = 1.083 nats, far below ln 256.
        assert!((0.8..1.3).contains(&h), "H = {h}");
        let mut t = vec![0; n];
        m.read(0, &mut t).unwrap();
        assert!(t.iter().all(|x| (*x as usize) < vocab));
        // Sampling noise is about 1e-3 nats for 2M pairs, the plug-in bias -V(K-1)/2n about
        // -2e-4; 0.01 is well above both and well below any error in the chain or sampler.
        let emp = empirical_entropy(&t, vocab);
        assert!((emp - h).abs() < 0.01, "empirical {emp} vs rate {h}");
    }

    #[test]
    fn deterministic_from_its_parameters() {
        let read = |m: &MarkovTokens| {
            let mut t = vec![0; m.len()];
            m.read(0, &mut t).unwrap();
            t
        };
        let a = MarkovTokens::new(64, 3, 1000, 7).unwrap();
        let b = MarkovTokens::new(64, 3, 1000, 7).unwrap();
        assert_eq!(read(&a), read(&b));
        assert_eq!(a.entropy_rate_nats(), b.entropy_rate_nats());
        let c = MarkovTokens::new(64, 3, 1000, 8).unwrap();
        assert_ne!(read(&a), read(&c));
        // K = 1 is the deterministic cycle i -> i + 1: no entropy at all.
        let d = MarkovTokens::new(10, 1, 30, 1).unwrap();
        assert!(d.entropy_rate_nats().abs() < 1e-12);
        let t = read(&d);
        assert!(t.windows(2).all(|w| w[1] == (w[0] + 1) % 10));
    }

    #[test]
    fn bad_parameters_are_errors() {
        for (v, k) in [(1, 1), (0, 0), (10, 0), (10, 11), (1 << 21, 2), (1000, 65)] {
            let e = MarkovTokens::new(v, k, 10, 1).unwrap_err();
            assert!(e.to_string().contains(&format!("V={v}, K={k}")), "{e}");
        }
        let e = MarkovTokens::new(4, 2, usize::MAX, 1).unwrap_err();
        assert!(e.to_string().ends_with("cannot allocate the tokens"), "{e}");
    }
}
