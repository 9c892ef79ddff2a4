//! Which samples a rank reads at each step.
//!
//! Sample g is the non-overlapping window `tokens[g*(T+1) .. g*(T+1)+T+1]` (g modulo the
//! number of whole windows); inputs are its first T tokens, targets its last T. Step s trains
//! on the global batch of samples s*GB .. s*GB+GB-1; data-parallel rank r reads, at micro-step
//! k, samples s*GB + (r*GA + k)*B + b. With GA = 1 that is the peer benchmark's
//! (s*W + r)*B + b, and for any layout a step covers the same samples.

use super::{Batch, TokenSource};
use crate::{EngineError, Result};

#[derive(Debug, Clone, Copy)]
pub struct SampleOrder {
    seq: usize,
    micro_batch: usize,
    grad_accum: usize,
    dp_rank: usize,
    dp_size: usize,
}

impl SampleOrder {
    pub fn new(
        seq: usize,
        micro_batch: usize,
        grad_accum: usize,
        dp_rank: usize,
        dp_size: usize,
    ) -> SampleOrder {
        SampleOrder {
            seq,
            micro_batch,
            grad_accum,
            dp_rank,
            dp_size,
        }
    }

    /// The global index of row `b` of micro-step `k` of step `step` on this rank.
    pub fn sample(&self, step: u64, k: usize, b: usize) -> u64 {
        let global = (self.micro_batch * self.grad_accum * self.dp_size) as u64;
        let local = (self.dp_rank * self.grad_accum + k) * self.micro_batch + b;
        step * global + local as u64
    }

    pub fn micro_batch(&self, source: &dyn TokenSource, step: u64, k: usize) -> Result<Batch> {
        let t = self.seq;
        let windows = source.len() / (t + 1);
        if windows == 0 {
            return Err(EngineError::Invalid(format!(
                "the data has {} tokens, fewer than one window of T+1 = {}",
                source.len(),
                t + 1
            )));
        }
        let mut window = vec![0u32; t + 1];
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for b in 0..self.micro_batch {
            let g = (self.sample(step, k, b) % windows as u64) as usize;
            source.read(g * (t + 1), &mut window)?;
            inputs.extend_from_slice(&window[..t]);
            targets.extend_from_slice(&window[1..]);
        }
        Ok(Batch {
            inputs,
            targets,
            batch: self.micro_batch,
            seq: t,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ga1_is_the_peer_order_and_every_layout_covers_the_same_samples() {
        // the peer's rule, written independently: g = (s*W + r)*B + b
        let o = SampleOrder::new(8, 4, 1, 1, 2);
        assert_eq!(o.sample(3, 0, 2), (3 * 2 + 1) * 4 + 2);
        for (b, ga, w) in [
            (8usize, 1usize, 1usize),
            (4, 1, 2),
            (2, 2, 2),
            (1, 2, 4),
            (2, 1, 4),
        ] {
            let mut seen: Vec<u64> = (0..w)
                .flat_map(|r| {
                    let o = SampleOrder::new(8, b, ga, r, w);
                    (0..ga).flat_map(move |k| (0..b).map(move |i| o.sample(5, k, i)))
                })
                .collect();
            seen.sort();
            assert_eq!(seen, (40..48).collect::<Vec<u64>>(), "B={b} GA={ga} W={w}");
        }
    }
}
