//! What the engine trains on per micro-step: token batches (`Batch`), or any named tensors
//! (`Inputs`).

use candle_core::{Device, Tensor};

/// A target id that does not count in the loss (Hugging Face's label -100): instruction
/// data's prompt tokens, padding.
pub const IGNORE: u32 = u32::MAX;

/// One micro-batch: `batch` rows of `seq` input tokens and their next-token targets, both
/// row-major `[batch, seq]`. A target of [`IGNORE`] does not count.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
    /// The micro-batch's loss is the mean over its counted targets times this weight. 1 when
    /// every target counts; with ignored targets the data sets it to
    /// `counted here x micro-batches per step / counted in the global batch`, so that the
    /// step's loss is the mean over every counted target of the global batch in any layout.
    pub loss_weight: f32,
}

impl Batch {
    /// A batch from windows of T+1 tokens each: inputs are their first T tokens, targets
    /// their last T.
    pub fn from_windows(windows: &[Vec<u32>]) -> Batch {
        let seq = windows.first().map_or(0, |w| w.len().saturating_sub(1));
        Batch {
            inputs: windows.iter().flat_map(|w| w[..seq].to_vec()).collect(),
            targets: windows.iter().flat_map(|w| w[1..].to_vec()).collect(),
            batch: windows.len(),
            seq,
            loss_weight: 1.0,
        }
    }

    /// Sequence-parallel rank `index` of `sp`'s part (DeepSpeed's
    /// `UlyssesSPDataLoaderAdapter`): positions `index T/sp .. (index+1) T/sp` of every row,
    /// `seq` a multiple of `sp`. Each rank's loss is the mean over its counted targets times
    /// its weight, and the engine averages the ranks' losses; so its weight is the batch's
    /// times `sp x counted here / counted in the batch`, and the group's losses average to
    /// the batch's (the weight is unchanged when every target counts).
    pub fn sequence_shard(&self, index: usize, sp: usize) -> Batch {
        let local = self.seq / sp;
        let part = |v: &[u32]| -> Vec<u32> {
            v.chunks(self.seq.max(1))
                .flat_map(|row| row[index * local..(index + 1) * local].to_vec())
                .collect()
        };
        let mut shard = Batch {
            inputs: part(&self.inputs),
            targets: part(&self.targets),
            batch: self.batch,
            seq: local,
            loss_weight: self.loss_weight,
        };
        let (here, all) = (shard.counted(), self.counted());
        if here * sp != all {
            shard.loss_weight = match all {
                0 => 0.0,
                _ => (f64::from(self.loss_weight) * (here * sp) as f64 / all as f64) as f32,
            };
        }
        shard
    }

    /// The number of targets that count.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
    }

    /// The batch as the engine's inputs on `dev`: its token ids under `input_ids` [batch,
    /// seq], and its targets for a model whose last layer is the loss.
    pub fn to_inputs(&self, dev: &Device) -> candle_core::Result<Inputs> {
        let shape = (self.batch, self.seq);
        let targets = Targets {
            ids: Tensor::from_slice(&self.targets, shape, dev)?,
            weight: self.loss_weight,
            counted: counted_positions(&self.targets, dev)?,
        };
        Ok(Inputs::new()
            .with("input_ids", Tensor::from_slice(&self.inputs, shape, dev)?)
            .with_targets(targets))
    }
}

/// The positions of the targets that count, when some do not (None: all count).
fn counted_positions(targets: &[u32], dev: &Device) -> candle_core::Result<Option<Tensor>> {
    if !targets.contains(&IGNORE) {
        return Ok(None);
    }
    let at: Vec<u32> = (0..targets.len() as u32)
        .filter(|&i| targets[i as usize] != IGNORE)
        .collect();
    let n = at.len();
    Ok(Some(Tensor::from_vec(at, n, dev)?))
}

/// One micro-batch as named tensors of any dtype (token ids, images, masks, labels), each
/// with the micro-batch as its leading dimension. The first is the first layer's input;
/// every layer can read any of them (`Context::input`).
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    named: Vec<(String, Tensor)>,
    /// Next-token targets for a model that ends in a loss layer (the built-in models').
    targets: Option<Targets>,
}

impl Inputs {
    pub const fn new() -> Inputs {
        Inputs {
            named: Vec::new(),
            targets: None,
        }
    }

    /// These inputs and `tensor` under `name` (replacing one of that name).
    pub fn with(mut self, name: &str, tensor: Tensor) -> Inputs {
        self.named.retain(|(n, _)| n != name);
        self.named.push((name.to_string(), tensor));
        self
    }

    /// These inputs with next-token targets for a loss layer.
    pub fn with_targets(mut self, targets: Targets) -> Inputs {
        self.targets = Some(targets);
        self
    }

    /// Only targets: a pipeline's last stage, whose input is the activation it received.
    pub fn targets_only(targets: Option<Targets>) -> Inputs {
        Inputs {
            named: Vec::new(),
            targets,
        }
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.named.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The first layer's input: the first tensor added.
    pub fn first(&self) -> Option<&Tensor> {
        self.named.first().map(|(_, t)| t)
    }

    pub fn targets(&self) -> Option<&Targets> {
        self.targets.as_ref()
    }

    /// Each named tensor, in the order added.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.named.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The same inputs on `dev` (no copy where they are there already).
    pub fn to_device(&self, dev: &Device) -> candle_core::Result<Inputs> {
        let named = self
            .named
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.to_device(dev)?)))
            .collect::<candle_core::Result<_>>()?;
        let targets = match &self.targets {
            None => None,
            Some(t) => Some(Targets {
                ids: t.ids.to_device(dev)?,
                weight: t.weight,
                counted: t.counted.as_ref().map(|c| c.to_device(dev)).transpose()?,
            }),
        };
        Ok(Inputs { named, targets })
    }

    /// The name of a tensor (or "targets") whose leading dimension is not `rows`.
    pub fn not_leading(&self, rows: usize) -> Option<(String, Vec<usize>)> {
        let named = self.named.iter().map(|(n, t)| (n.as_str(), t));
        let targets = self.targets.iter().map(|t| ("targets", &t.ids));
        named
            .chain(targets)
            .find(|(_, t)| t.dims().first() != Some(&rows))
            .map(|(n, t)| (n.to_string(), t.dims().to_vec()))
    }
}

/// A micro-batch's targets on the device, with its loss weight (see [`Batch::loss_weight`]).
#[derive(Debug, Clone)]
pub struct Targets {
    /// [batch, seq] u32, [`IGNORE`] where a target does not count.
    pub ids: Tensor,
    pub weight: f32,
    /// When some targets do not count: the positions (u32, row-major) of those that do,
    /// found on the host as the batch is loaded, so the loss needs no device round trip.
    pub counted: Option<Tensor>,
}

impl Targets {
    /// Targets that all count, at weight 1.
    pub fn all(ids: Tensor) -> Targets {
        Targets {
            ids,
            weight: 1.0,
            counted: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two rows of four positions over two ranks: each gets its half of every row, and the
    /// two losses (mean over counted targets times weight) average to the mean over all five
    /// counted targets: 1 x 0.4 and 4 x 1.6 / 4 targets' worth, i.e. each target weighs 1/5.
    #[test]
    fn a_shard_holds_its_positions_of_every_row_and_weighs_its_counted_targets() {
        let batch = Batch {
            inputs: vec![10, 11, 12, 13, 20, 21, 22, 23],
            targets: vec![1, IGNORE, 2, 3, IGNORE, IGNORE, 4, 5],
            batch: 2,
            seq: 4,
            loss_weight: 1.0,
        };
        let first = batch.sequence_shard(0, 2);
        assert_eq!(first.inputs, [10, 11, 20, 21]);
        assert_eq!(first.targets, [1, IGNORE, IGNORE, IGNORE]);
        assert_eq!((first.batch, first.seq), (2, 2));
        let second = batch.sequence_shard(1, 2);
        assert_eq!(second.inputs, [12, 13, 22, 23]);
        assert_eq!(second.targets, [2, 3, 4, 5]);
        assert!(
            (first.loss_weight - 0.4).abs() < 1e-7,
            "{}",
            first.loss_weight
        );
        assert!(
            (second.loss_weight - 1.6).abs() < 1e-7,
            "{}",
            second.loss_weight
        );
        let whole = Batch::from_windows(&[vec![1, 2, 3, 4, 5]]);
        assert_eq!(whole.sequence_shard(1, 2).loss_weight, 1.0);
        assert_eq!(whole.sequence_shard(1, 2).inputs, [3, 4]);
    }
}
