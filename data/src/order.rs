//! Which samples a rank reads at each step (what a sample is, is [`super::Samples`]').
//!
//! Step s trains on the global batch of samples `s*GB .. s*GB + GB` (GB = B * GA * DP);
//! data-parallel rank r reads, at micro-step k, samples `s*GB + (r*GA + k)*B + b`, b < B.
//! With GA = 1 that is the peer benchmark's `(s*W + r)*B + b` (shared/bench/gpt.py,
//! TokenBatches), and for any split of GB into (B, GA, DP) a step covers the same samples.

use super::error::{DataError, Result};
use super::{Batch, Samples};
use ds_nn::IGNORE;

/// The sample order of one data-parallel rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleOrder {
    seq: usize,
    micro_batch: usize,
    grad_accum: usize,
    dp_rank: usize,
    dp_size: usize,
    global_batch: u64,
}

impl SampleOrder {
    /// Rank `dp_rank` of `dp_size`, reading `micro_batch` rows of `seq` tokens per micro-step
    /// and `grad_accum` micro-steps per optimizer step.
    pub fn new(
        seq: usize,
        micro_batch: usize,
        grad_accum: usize,
        dp_rank: usize,
        dp_size: usize,
    ) -> Result<SampleOrder> {
        let invalid = |what: String| Err(DataError::Invalid(format!("sample order: {what}")));
        if [seq, micro_batch, grad_accum, dp_size].contains(&0) {
            return invalid(format!(
                "seq {seq}, micro-batch {micro_batch}, gradient accumulation {grad_accum} and \
                 data-parallel size {dp_size} must all be at least 1"
            ));
        }
        if dp_rank >= dp_size {
            return invalid(format!("rank {dp_rank} is not below the size {dp_size}"));
        }
        // One micro-batch of windows and the global batch must be countable without overflow.
        let rows = (seq.checked_add(1)).and_then(|w| w.checked_mul(micro_batch));
        let global = micro_batch
            .checked_mul(grad_accum)
            .and_then(|x| x.checked_mul(dp_size));
        let (Some(_), Some(global_batch)) = (rows, global) else {
            return invalid(format!("seq {seq} or the batch sizes overflow"));
        };
        Ok(SampleOrder {
            seq,
            micro_batch,
            grad_accum,
            dp_rank,
            dp_size,
            global_batch: global_batch as u64,
        })
    }

    pub fn seq(&self) -> usize {
        self.seq
    }
    pub fn micro_batch_size(&self) -> usize {
        self.micro_batch
    }
    pub fn grad_accum(&self) -> usize {
        self.grad_accum
    }
    /// Samples per optimizer step over all ranks: micro-batch x accumulation x dp size.
    pub fn global_batch(&self) -> u64 {
        self.global_batch
    }

    /// The global index of row `b` of micro-step `micro` of `step` on this rank.
    pub fn sample(&self, step: u64, micro: usize, b: usize) -> Result<u64> {
        if micro >= self.grad_accum || b >= self.micro_batch {
            return Err(DataError::Invalid(format!(
                "sample order: micro-step {micro} row {b} outside {} x {}",
                self.grad_accum, self.micro_batch
            )));
        }
        let local = ((self.dp_rank * self.grad_accum + micro) * self.micro_batch + b) as u64;
        step.checked_mul(self.global_batch)
            .and_then(|x| x.checked_add(local))
            .ok_or_else(|| DataError::Invalid(format!("sample order: step {step} overflows")))
    }

    /// This rank's micro-batch `micro` (< grad_accum) of optimizer step `step`.
    pub fn micro_batch(&self, samples: &dyn Samples, step: u64, micro: usize) -> Result<Batch> {
        if samples.sample_tokens() != self.seq + 1 {
            return Err(DataError::Invalid(format!(
                "{}: samples of {} tokens, the order reads {}",
                samples.name(),
                samples.sample_tokens(),
                self.seq + 1
            )));
        }
        let rows = (0..self.micro_batch)
            .map(|b| {
                let mut row = vec![0u32; self.seq + 1];
                samples.read(self.sample(step, micro, b)?, &mut row)?;
                Ok(row)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut batch = Batch::from_windows(&rows);
        if samples.has_loss_mask() {
            let mut mask = vec![true; self.seq + 1];
            for b in 0..self.micro_batch {
                samples.read_loss_mask(self.sample(step, micro, b)?, &mut mask)?;
                let targets = &mut batch.targets[b * self.seq..(b + 1) * self.seq];
                for (t, counts) in targets.iter_mut().zip(&mask[1..]) {
                    if !counts {
                        *t = IGNORE;
                    }
                }
            }
        }
        Ok(batch)
    }

    /// The targets that count in the whole global batch of `step` (all ranks' samples).
    pub fn global_counted(&self, samples: &dyn Samples, step: u64) -> Result<u64> {
        let first = step
            .checked_mul(self.global_batch)
            .ok_or_else(|| DataError::Invalid(format!("sample order: step {step} overflows")))?;
        let mut mask = vec![true; self.seq + 1];
        let mut counted = 0u64;
        for g in first..first + self.global_batch {
            samples.read_loss_mask(g, &mut mask)?;
            counted += mask[1..].iter().filter(|&&c| c).count() as u64;
        }
        Ok(counted)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::{SyntheticTokens, Windows};
    use super::*;

    /// The tiny preset's stream in windows: V = 4096, N = 2^20, T = 128 (8128 windows).
    fn peer() -> Windows {
        Windows::new(
            Arc::new(SyntheticTokens::new(4096, 1 << 20, 1234).unwrap()),
            128,
        )
        .unwrap()
    }

    fn rows(b: &Batch) -> Vec<(Vec<u32>, Vec<u32>)> {
        let (i, t) = (b.inputs.chunks(b.seq), b.targets.chunks(b.seq));
        i.zip(t).map(|(i, t)| (i.to_vec(), t.to_vec())).collect()
    }

    /// Every row of `step` over all ranks and micro-steps of a (B, GA, DP) layout, in rank
    /// then micro-step order.
    fn step_rows(
        b: usize,
        ga: usize,
        dp: usize,
        shuffle: Option<u64>,
        step: u64,
    ) -> Vec<(Vec<u32>, Vec<u32>)> {
        let mut src =
            Windows::new(Arc::new(SyntheticTokens::new(512, 20_000, 9).unwrap()), 16).unwrap();
        if let Some(seed) = shuffle {
            src = src.shuffled(seed);
        }
        let mut out = Vec::new();
        for r in 0..dp {
            let o = SampleOrder::new(16, b, ga, r, dp).unwrap();
            for k in 0..ga {
                out.extend(rows(&o.micro_batch(&src, step, k).unwrap()));
            }
        }
        out
    }

    #[test]
    fn ga1_reads_the_peer_windows() {
        // The peer's TokenBatches, written out independently: a sequential LCG and
        // g = ((s*W + r)*B + b) mod n_windows.
        let mut x = 1234u64;
        let tokens: Vec<u32> = (0..1 << 20)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % 4096) as u32
            })
            .collect();
        let (t, bsz, w, src) = (128usize, 8usize, 2usize, peer());
        let nwin = tokens.len() / (t + 1);
        for r in 0..w {
            let o = SampleOrder::new(t, bsz, 1, r, w).unwrap();
            for s in [0usize, 1, 507, 508, 1000] {
                let got = o.micro_batch(&src, s as u64, 0).unwrap();
                for (b, (inp, tgt)) in rows(&got).into_iter().enumerate() {
                    let g = ((s * w + r) * bsz + b) % nwin;
                    let win = &tokens[g * (t + 1)..(g + 1) * (t + 1)];
                    assert_eq!(
                        (&inp[..], &tgt[..]),
                        (&win[..t], &win[1..]),
                        "s {s} r {r} b {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_layout_of_a_global_batch_reads_the_same_samples() {
        for shuffle in [None, Some(5)] {
            for step in [0u64, 3, 40] {
                // GB = 8. dp=1 with GA=2 concatenates exactly as dp=2 with GA=1.
                let base = step_rows(4, 2, 1, shuffle, step);
                assert_eq!(base, step_rows(4, 1, 2, shuffle, step));
                assert_eq!(base, step_rows(8, 1, 1, shuffle, step));
                let mut sorted = base.clone();
                sorted.sort();
                for (b, ga, dp) in [(2, 2, 2), (1, 2, 4), (2, 1, 4), (1, 1, 8), (1, 8, 1)] {
                    let mut other = step_rows(b, ga, dp, shuffle, step);
                    other.sort();
                    assert_eq!(sorted, other, "B={b} GA={ga} DP={dp} shuffle {shuffle:?}");
                }
            }
        }
        let o = SampleOrder::new(8, 4, 1, 1, 2).unwrap();
        assert_eq!(o.sample(3, 0, 2).unwrap(), (3 * 2 + 1) * 4 + 2);
        assert_eq!(o.global_batch(), 8);
        // GA = 2, DP = 2, B = 2: a rank's micro-steps are consecutive, ranks follow each other.
        let r0 = SampleOrder::new(8, 2, 2, 0, 2).unwrap();
        let r1 = SampleOrder::new(8, 2, 2, 1, 2).unwrap();
        let at = |o: &SampleOrder, k, b| o.sample(3, k, b).unwrap();
        assert_eq!(
            [at(&r0, 0, 0), at(&r0, 1, 1), at(&r1, 0, 0), at(&r1, 1, 1)],
            [24, 27, 28, 31]
        );
    }

    #[test]
    fn bad_parameters_are_errors() {
        for (t, b, ga, r, w) in [
            (0, 1, 1, 0, 1),
            (8, 0, 1, 0, 1),
            (8, 1, 0, 0, 1),
            (8, 1, 1, 2, 2),
        ] {
            let e = SampleOrder::new(t, b, ga, r, w).unwrap_err();
            assert!(matches!(e, DataError::Invalid(_)), "{e}");
        }
        assert!(SampleOrder::new(8, usize::MAX, 2, 0, 1).is_err());
        assert!(SampleOrder::new(usize::MAX, 1, 1, 0, 1).is_err());
        assert!(SampleOrder::new(usize::MAX / 2, 3, 1, 0, 1).is_err());
        let o = SampleOrder::new(8, 4, 2, 0, 1).unwrap();
        let eight = Windows::new(Arc::new(SyntheticTokens::new(10, 100, 0).unwrap()), 8).unwrap();
        assert!(o.micro_batch(&eight, 0, 1).is_ok());
        assert!(o.micro_batch(&eight, 0, 2).is_err());
        assert!(o.sample(u64::MAX / 4, 0, 0).is_err());
        let other = Windows::new(Arc::new(SyntheticTokens::new(10, 100, 0).unwrap()), 9).unwrap();
        let e = o.micro_batch(&other, 0, 0).unwrap_err().to_string();
        assert!(e.contains("samples of 10 tokens, the order reads 9"), "{e}");
    }
}
