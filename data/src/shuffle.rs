//! Deterministic randomness for the data module: SplitMix64 (Steele, Lea and Flood 2014), and
//! the per-epoch shuffle of window indices.
//!
//! The shuffle is a keyed pseudo-random permutation of `0..n`: a balanced Feistel network on
//! the smallest even number of bits covering `n`, with cycle walking to stay below `n`.
//! Unlike a Fisher-Yates table it needs no memory and no per-epoch state, so any sample of any
//! epoch is computed on its own from (seed, epoch, position): a loader is immutable, resuming
//! at step s costs nothing, and the order cannot depend on the parallel layout.

/// Rounds of the Feistel network; 4 suffice for a pseudo-random permutation given a
/// pseudo-random round function (Luby-Rackoff), 6 leave a margin for a cheap one.
const ROUNDS: u64 = 6;
/// The golden-ratio increment of SplitMix64.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a bijective 64-bit mixer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small counter-based generator: the stream of a seed is fixed across platforms.
pub(super) struct SplitMix64(u64);

impl SplitMix64 {
    pub(super) fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix(self.0)
    }

    /// Uniform in `0..n` (n > 0) by the multiply-high method; the bias, below n / 2^64, is
    /// far under anything a training run could notice.
    pub(super) fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in (0, 1]: 53 random bits, never 0 so that `ln` of it is finite.
    pub(super) fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// Position `pos` (< n) of epoch `epoch`'s permutation of `0..n`, keyed by `seed`.
pub(super) fn permute(seed: u64, epoch: u64, pos: u64, n: u64) -> u64 {
    if n <= 1 {
        return pos;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2);
    let key = mix(seed ^ mix(epoch.wrapping_add(GOLDEN)));
    // The network permutes 0..2^(2*half) (< 4n); walking its cycle from `pos` until it lands
    // below n again restricts it to a permutation of 0..n, in under 4 steps on average.
    let mut x = pos;
    loop {
        x = feistel(x, key, half);
        if x < n {
            return x;
        }
    }
}

/// One pass of the Feistel network over `2 * half` bits.
fn feistel(x: u64, key: u64, half: u32) -> u64 {
    let mask = (1u64 << half) - 1;
    let (mut left, mut right) = (x >> half, x & mask);
    for round in 0..ROUNDS {
        let f = mix(right ^ mix(key.wrapping_add(round.wrapping_mul(GOLDEN)))) & mask;
        (left, right) = (right, left ^ f);
    }
    (left << half) | right
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perm(seed: u64, epoch: u64, n: u64) -> Vec<u64> {
        (0..n).map(|p| permute(seed, epoch, p, n)).collect()
    }

    #[test]
    fn is_a_permutation_for_any_size() {
        for n in [1u64, 2, 3, 4, 5, 7, 64, 100, 8128, 65537] {
            let mut p = perm(7, 3, n);
            p.sort_unstable();
            assert_eq!(p, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
        // The top of the range: 2 * half = 64 bits, no shift overflows.
        let x = permute(1, 1, u64::MAX - 5, u64::MAX);
        assert!(x < u64::MAX);
    }

    #[test]
    fn differs_between_epochs_and_seeds_and_looks_random() {
        let n = 8128; // the tiny preset's windows: 2^20 / 129
        let base = perm(1234, 0, n);
        assert_ne!(base, perm(1234, 1, n));
        assert_ne!(base, perm(1235, 0, n));
        assert_ne!(perm(1234, 1, n), perm(1235, 1, n));
        // A uniform random permutation has about 1 fixed point, and both |p(i) - i| and
        // |p(i+1) - p(i)| average about n/3; a weak mixer (the identity, or a single Feistel
        // round, which keeps neighbours close) misses one of them.
        let fixed = base
            .iter()
            .enumerate()
            .filter(|(i, p)| *i as u64 == **p)
            .count();
        assert!(fixed < 8, "{fixed} fixed points");
        let mean_gap = |pairs: Vec<(u64, u64)>| {
            let total: f64 = pairs
                .iter()
                .map(|(a, b)| (*a as f64 - *b as f64).abs())
                .sum();
            total / pairs.len() as f64 / (n as f64 / 3.0)
        };
        let moved = mean_gap(
            base.iter()
                .enumerate()
                .map(|(i, p)| (i as u64, *p))
                .collect(),
        );
        let spread = mean_gap(base.windows(2).map(|w| (w[0], w[1])).collect());
        assert!((moved - 1.0).abs() < 0.05, "displacement {moved} x n/3");
        assert!((spread - 1.0).abs() < 0.05, "neighbour gap {spread} x n/3");
    }

    #[test]
    fn splitmix_matches_the_reference_stream() {
        // The first outputs of the reference SplitMix64 seeded with 0.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        let mut r = SplitMix64::new(5);
        assert!((0..1000).all(|_| r.below(10) < 10 && r.unit() > 0.0 && r.unit() <= 1.0));
    }
}
