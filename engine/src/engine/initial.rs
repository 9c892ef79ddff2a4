//! Where a rank's initial parameter values come from: (seed, name) or a weights file, for any
//! flat range, so that each rank produces only what it keeps (DeepSpeed's zero.Init).

use std::ops::Range;

use ds_partition::{runs_within, FlatIndex, Run};

use crate::model::weights::WeightsFile;
use crate::model::{fill_values, ParamSpec};
use crate::Result;

/// The source of initial values.
pub(crate) enum Source {
    /// Drawn from (run seed, parameter name) on the logical tensor.
    Seed(u64),
    /// Read from a safetensors file under the parameter names (`--init`); adapters the file
    /// does not hold (a base model's file) are drawn from the seed.
    File(WeightsFile, u64),
}

/// Initial values of any flat range of a model (this rank's tensor-parallel slices).
pub(crate) struct InitialValues<'a> {
    specs: &'a [ParamSpec],
    index: &'a FlatIndex,
    source: Source,
    /// Per parameter: its slice as runs of logical elements.
    runs: Vec<Vec<Run>>,
}

impl InitialValues<'_> {
    pub fn new<'a>(
        specs: &'a [ParamSpec],
        index: &'a FlatIndex,
        source: Source,
    ) -> InitialValues<'a> {
        let runs = (0..index.len())
            .map(|i| index.runs(ds_partition::ParamId(i)))
            .collect();
        InitialValues {
            specs,
            index,
            source,
            runs,
        }
    }

    /// Writes the values of flat `range` into `dst`, run of logical elements by run: element
    /// i of a logical tensor gets the same value whatever slice holds it.
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
            let mut failed = Ok(());
            runs_within(&self.runs[i], a - p.start..b - p.start, |r| {
                let out = &mut out[r.local..r.local + r.len];
                match &self.source {
                    Source::Seed(seed) => fill_values(&self.specs[i], *seed, r.logical, out),
                    Source::File(file, seed) if !file.holds(i) => {
                        fill_values(&self.specs[i], *seed, r.logical, out)
                    }
                    Source::File(file, _) => {
                        if failed.is_ok() {
                            failed = file.read(i, r.logical, out);
                        }
                    }
                }
            });
            failed?;
        }
        Ok(())
    }
}
