//! What the engine trains on per micro-step.

use candle_core::Tensor;

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

    /// The number of targets that count.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE).count()
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
