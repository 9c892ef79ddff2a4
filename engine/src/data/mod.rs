//! Training data: one micro-batch of token windows.

/// One micro-batch: `batch` rows of `seq` input tokens and their next-token targets.
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch: usize,
    pub seq: usize,
}
