//! What the engine trains on per micro-step.

/// One micro-batch: `batch` rows of `seq` input tokens and their next-token targets, both
/// row-major `[batch, seq]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
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
        }
    }
}
