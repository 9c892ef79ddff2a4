//! Where a rank's initial parameter values come from: (seed, name) or a weights file, for any
//! flat range, so that each rank produces only what it keeps (DeepSpeed's zero.Init).

use std::ops::Range;

use ds_partition::FlatIndex;

use crate::model::weights::WeightsFile;
use crate::model::{fill_values, ParamSpec};
use crate::Result;

/// The source of initial values.
pub(crate) enum Source {
    /// Drawn from (run seed, parameter name) on the logical tensor.
    Seed(u64),
    /// Read from a safetensors file under the parameter names (`--init`).
    File(WeightsFile),
}

/// Initial values of any flat range of a model.
pub(crate) struct InitialValues<'a> {
    pub specs: &'a [ParamSpec],
    pub index: &'a FlatIndex,
    pub source: Source,
}

impl InitialValues<'_> {
    /// Writes the values of flat `range` into `dst`, parameter part by parameter part.
    pub fn fill(&self, range: Range<usize>, dst: &mut [f32]) -> Result<()> {
        let entries = self.index.entries();
        // entries are sorted by offset: the first that ends after range.start
        let first = entries.partition_point(|e| e.range().end <= range.start);
        for (i, e) in entries.iter().enumerate().skip(first) {
            let p = e.range();
            if p.start >= range.end {
                break;
            }
            let (a, b) = (p.start.max(range.start), p.end.min(range.end));
            let out = &mut dst[a - range.start..b - range.start];
            match &self.source {
                Source::Seed(seed) => fill_values(&self.specs[i], *seed, a - p.start, out),
                Source::File(file) => file.read(i, a - p.start, out)?,
            }
        }
        Ok(())
    }
}
