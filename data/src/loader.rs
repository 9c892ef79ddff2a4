//! Samples bound to one rank's sample order, checked once up front: what a training loop
//! holds to ask for micro-batches by (step, micro-step).

use std::sync::{Arc, Mutex};

use super::error::{DataError, Result};
use super::{Batch, SampleOrder, Samples};

/// One rank's micro-batches from shared samples.
#[derive(Clone)]
pub struct DataLoader {
    samples: Arc<dyn Samples>,
    order: SampleOrder,
    /// (step, counted targets in its global batch), for data with a loss mask.
    counted: Arc<Mutex<Option<(u64, u64)>>>,
    /// (this rank's index, the group's size) when sequence-parallel ranks split the samples'
    /// positions.
    shard: Option<(usize, usize)>,
}

impl DataLoader {
    /// Binds `samples` to `order` for a model with `model_vocab` embedding rows. Fails, naming
    /// the data, if its samples are not seq + 1 tokens long or hold ids the model cannot
    /// embed, so a bad setup stops before step 0 rather than inside it.
    pub fn new(
        samples: Arc<dyn Samples>,
        order: SampleOrder,
        model_vocab: usize,
    ) -> Result<DataLoader> {
        if samples.sample_tokens() != order.seq() + 1 {
            return Err(DataError::Invalid(format!(
                "{}: samples of {} tokens, the order reads seq + 1 = {}",
                samples.name(),
                samples.sample_tokens(),
                order.seq() + 1
            )));
        }
        if samples.vocab() > model_vocab {
            return Err(DataError::VocabMismatch {
                name: samples.name().to_string(),
                vocab: samples.vocab(),
                model: model_vocab,
            });
        }
        Ok(DataLoader {
            samples,
            order,
            counted: Arc::default(),
            shard: None,
        })
    }

    /// Each micro-batch as sequence-parallel rank `index` of `sp` reads it: its slice of
    /// every sample's positions (`Batch::sequence_shard`, DeepSpeed's
    /// `UlyssesSPDataLoaderAdapter`). The order's rank and world are the replica's: the
    /// group's ranks read the same samples.
    pub fn with_sequence_shard(mut self, index: usize, sp: usize) -> Result<DataLoader> {
        let seq = self.order.seq();
        if sp == 0 || index >= sp || !seq.is_multiple_of(sp) {
            return Err(DataError::Invalid(format!(
                "{}: a sequence of {seq} positions does not split over {sp} sequence-parallel ranks",
                self.samples.name()
            )));
        }
        self.shard = (sp > 1).then_some((index, sp));
        Ok(self)
    }

    /// This rank's micro-batch `micro` (< grad_accum) of optimizer step `step`. Where some
    /// targets do not count, its loss weight makes the step's loss the mean over the counted
    /// targets of the whole global batch, whatever the layout: the engine averages the
    /// micro-batches' losses (each a mean over its own counted targets), so micro-batch m
    /// weighs `counted_m x micro-batches per step / counted in the global batch`.
    pub fn micro_batch(&self, step: u64, micro: usize) -> Result<Batch> {
        let mut batch = self.order.micro_batch(self.samples.as_ref(), step, micro)?;
        if self.samples.has_loss_mask() {
            let global = self.global_counted(step)?;
            let per_step = self.order.global_batch() / self.order.micro_batch_size() as u64;
            batch.loss_weight = match global {
                0 => 0.0,
                n => (batch.counted() as f64 * per_step as f64 / n as f64) as f32,
            };
        }
        Ok(match self.shard {
            Some((index, sp)) => batch.sequence_shard(index, sp),
            None => batch,
        })
    }

    /// The counted targets of `step`'s global batch, computed once per step.
    fn global_counted(&self, step: u64) -> Result<u64> {
        let mut cached = self.counted.lock().expect("no reader panics holding it");
        if let Some((s, n)) = *cached {
            if s == step {
                return Ok(n);
            }
        }
        let n = self.order.global_counted(self.samples.as_ref(), step)?;
        *cached = Some((step, n));
        Ok(n)
    }

    pub fn samples(&self) -> &dyn Samples {
        self.samples.as_ref()
    }

    pub fn order(&self) -> &SampleOrder {
        &self.order
    }

    /// Epochs completed after `steps` optimizer steps (samples seen / samples in an epoch).
    pub fn epochs(&self, steps: u64) -> f64 {
        steps as f64 * self.order.global_batch() as f64 / self.samples.len() as f64
    }
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("samples", &self.samples.name())
            .field("order", &self.order)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::TempDir;
    use super::super::{SyntheticTokens, TokenFile, TokenSource, TokenWidth, Windows};
    use super::*;

    /// A u16 file holding the tokens 0..8 (vocabulary 8), its path and the open source.
    fn eight_tokens(dir: &TempDir) -> (String, Arc<dyn TokenSource>) {
        let bytes: Vec<u8> = (0u16..8).flat_map(|v| v.to_le_bytes()).collect();
        let path = dir.file("short.bin", &bytes);
        let file = TokenFile::open(&path, TokenWidth::U16, 8).unwrap();
        (path.display().to_string(), Arc::new(file))
    }

    #[test]
    fn one_window_is_enough_and_wraps() {
        let dir = TempDir::new("loader-fits");
        let (_, file) = eight_tokens(&dir);
        // seq 7: the file is exactly one window, so every sample of every step is that one.
        let samples = Arc::new(Windows::new(file, 7).unwrap());
        let l = DataLoader::new(samples, SampleOrder::new(7, 2, 1, 0, 1).unwrap(), 8).unwrap();
        let row: Vec<u32> = (0..7).collect();
        let want = Batch {
            inputs: [row.clone(), row.clone()].concat(),
            targets: [&row[1..], &[7], &row[1..], &[7]].concat(),
            batch: 2,
            seq: 7,
            loss_weight: 1.0,
        };
        assert_eq!(l.micro_batch(3, 0).unwrap(), want);
        assert_eq!(l.epochs(3), 6.0);
        assert!(matches!(l.micro_batch(0, 1), Err(DataError::Invalid(_))));
    }

    #[test]
    fn a_written_peer_file_reads_as_the_generator() {
        let dir = TempDir::new("loader-peer");
        let synth = SyntheticTokens::new(4096, 50_000, 1234).unwrap();
        let mut tokens = vec![0; synth.len()];
        synth.read(0, &mut tokens).unwrap();
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|v| (*v as u16).to_le_bytes())
            .collect();
        let path = dir.file("peer.bin", &bytes);
        let file = TokenFile::open(&path, TokenWidth::U16, 4096).unwrap();
        let order = SampleOrder::new(128, 8, 2, 1, 2).unwrap();
        let from_synth = Windows::new(Arc::new(synth), 128).unwrap().shuffled(3);
        let from_file = Windows::new(Arc::new(file), 128).unwrap().shuffled(3);
        for step in [0, 5, 100] {
            for k in 0..2 {
                let want = order.micro_batch(&from_synth, step, k).unwrap();
                assert_eq!(order.micro_batch(&from_file, step, k).unwrap(), want);
            }
        }
    }

    #[test]
    fn mismatched_and_too_wide_samples_are_refused_up_front() {
        let dir = TempDir::new("loader-bad");
        let (path, file) = eight_tokens(&dir);
        let samples = Arc::new(Windows::new(file, 7).unwrap());
        let other = SampleOrder::new(6, 2, 1, 0, 1).unwrap();
        let e = DataLoader::new(samples.clone(), other, 8).unwrap_err();
        let why = "samples of 8 tokens, the order reads seq + 1 = 7";
        assert_eq!(e.to_string(), format!("{path}: {why}"));
        let fits = SampleOrder::new(7, 2, 1, 0, 1).unwrap();
        let e = DataLoader::new(samples, fits, 7).unwrap_err();
        let why = "vocabulary of 8 is larger than the model's 7";
        assert_eq!(e.to_string(), format!("{path}: {why}"));
    }
}
