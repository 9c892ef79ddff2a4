//! Tensor-parallel slices of logical tensors: which elements of a parameter a tensor-parallel
//! rank holds, and where they sit in the logical (unsharded) tensor.
//!
//! A rank's flat buffer holds its slice of every parameter, in its local shape; initial
//! values, checkpoints and whole-model files speak logical elements. `runs` is the bridge:
//! the slice as runs of consecutive logical elements, in local order.

/// How a parameter is split over the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Split {
    /// Every tensor-parallel rank holds the whole tensor (LayerNorms, position embedding, the
    /// bias of a row-parallel linear): its values and gradients are the same on each.
    #[default]
    Replicated,
    /// Dimension `dim` is cut into `blocks` equal blocks and each block into `tp` equal parts;
    /// a rank holds its part of every block, blocks in order. `blocks` > 1 is for fused
    /// tensors such as q|k|v, where each rank owns whole heads of q, of k and of v.
    Dim { dim: usize, blocks: usize },
}

impl Split {
    /// Split along `dim` in one block.
    pub fn dim(dim: usize) -> Split {
        Split::Dim { dim, blocks: 1 }
    }

    pub fn is_replicated(self) -> bool {
        self == Split::Replicated
    }
}

/// One rank's place in the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub size: usize,
}

impl TpRank {
    /// No tensor parallelism: one rank holding everything.
    pub const WHOLE: TpRank = TpRank { rank: 0, size: 1 };
}

impl Default for TpRank {
    fn default() -> TpRank {
        TpRank::WHOLE
    }
}

/// A run of `len` logical elements starting at `logical`, held at `local` in the slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub local: usize,
    pub logical: usize,
    pub len: usize,
}

/// The shape `tp` holds of a tensor of logical `shape`; an error names the dimension that
/// does not divide.
pub fn local_shape(shape: &[usize], split: Split, tp: TpRank) -> Result<Vec<usize>, String> {
    match split {
        _ if tp.size == 1 => Ok(shape.to_vec()),
        Split::Replicated => Ok(shape.to_vec()),
        Split::Dim { dim, blocks } => {
            let Some(&n) = shape.get(dim) else {
                return Err(format!("shape {shape:?} has no dimension {dim} to split"));
            };
            if blocks == 0 || !n.is_multiple_of(blocks * tp.size) {
                return Err(format!(
                    "dimension {dim} of shape {shape:?} ({n}) is not a multiple of {blocks} block(s) x tp {}",
                    tp.size
                ));
            }
            let mut local = shape.to_vec();
            local[dim] = n / tp.size;
            Ok(local)
        }
    }
}

/// The slice `tp` holds of a tensor of logical `shape`, as runs in local order (adjacent
/// runs merged). `local_shape` must have accepted the split.
pub fn runs(shape: &[usize], split: Split, tp: TpRank) -> Vec<Run> {
    let numel: usize = shape.iter().product();
    let (dim, blocks) = match split {
        Split::Dim { dim, blocks } if tp.size > 1 => (dim, blocks),
        _ => {
            return vec![Run {
                local: 0,
                logical: 0,
                len: numel,
            }]
        }
    };
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let block = shape[dim] / blocks;
    let part = block / tp.size;
    let mut out: Vec<Run> = Vec::with_capacity(outer * blocks);
    let mut local = 0;
    for o in 0..outer {
        for b in 0..blocks {
            let logical = (o * shape[dim] + b * block + tp.rank * part) * inner;
            let len = part * inner;
            match out.last_mut() {
                Some(r) if r.logical + r.len == logical => r.len += len,
                _ => out.push(Run {
                    local,
                    logical,
                    len,
                }),
            }
            local += len;
        }
    }
    out
}

/// Calls `f(run)` for the runs of the slice that fall in local elements `range`, clipped to
/// it (a run's `local` is then relative to `range.start`).
pub fn runs_within(runs: &[Run], range: std::ops::Range<usize>, mut f: impl FnMut(Run)) {
    let first = runs.partition_point(|r| r.local + r.len <= range.start);
    for r in &runs[first..] {
        if r.local >= range.end {
            break;
        }
        let (a, b) = (r.local.max(range.start), (r.local + r.len).min(range.end));
        f(Run {
            local: a - range.start,
            logical: r.logical + (a - r.local),
            len: b - a,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slice by brute force: every logical index, row-major, kept when its coordinate on
    /// `dim` falls in the rank's part of its block.
    fn brute(shape: &[usize], dim: usize, blocks: usize, tp: TpRank) -> Vec<usize> {
        let numel: usize = shape.iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let block = shape[dim] / blocks;
        let part = block / tp.size;
        let mut kept: Vec<(usize, usize, usize)> = (0..numel)
            .filter_map(|i| {
                let c = (i / inner) % shape[dim];
                let (b, within) = (c / block, c % block);
                let outer = i / (inner * shape[dim]);
                (within / part == tp.rank).then_some((outer, b * part + within % part, i))
            })
            .collect();
        // local order: outer index, then the local coordinate, then the inner elements
        kept.sort();
        kept.into_iter().map(|(_, _, i)| i).collect()
    }

    fn expand(runs: &[Run]) -> Vec<usize> {
        let mut out = Vec::new();
        for r in runs {
            assert_eq!(r.local, out.len(), "runs are in local order, back to back");
            out.extend(r.logical..r.logical + r.len);
        }
        out
    }

    #[test]
    fn runs_list_the_slice_in_local_order() {
        for (shape, dim, blocks) in [
            (vec![12, 4], 0, 1),
            (vec![12, 4], 0, 3),
            (vec![4, 12], 1, 1),
            (vec![2, 12, 3], 1, 2),
            (vec![24], 0, 3),
        ] {
            for size in [1, 2, 4] {
                for rank in 0..size {
                    let tp = TpRank { rank, size };
                    let split = Split::Dim { dim, blocks };
                    let Ok(local) = local_shape(&shape, split, tp) else {
                        // a degree that does not divide (its error is tested below)
                        assert!(!shape[dim].is_multiple_of(blocks * size));
                        continue;
                    };
                    let got = expand(&runs(&shape, split, tp));
                    assert_eq!(
                        got,
                        brute(&shape, dim, blocks, tp),
                        "{shape:?} {split:?} {tp:?}"
                    );
                    assert_eq!(got.len(), local.iter().product::<usize>());
                }
            }
        }
    }

    #[test]
    fn a_dimension_that_does_not_divide_is_named() {
        let tp = TpRank { rank: 0, size: 4 };
        let e = local_shape(&[6, 2], Split::dim(0), tp).unwrap_err();
        assert!(e.contains("dimension 0") && e.contains("(6)"), "{e}");
        assert!(local_shape(&[12, 2], Split::Dim { dim: 0, blocks: 3 }, tp).is_ok());
        assert!(local_shape(&[12, 2], Split::Dim { dim: 0, blocks: 2 }, tp).is_err());
    }

    #[test]
    fn runs_within_clips_to_the_range() {
        let r = runs(&[4, 6], Split::dim(1), TpRank { rank: 1, size: 2 });
        let mut got = Vec::new();
        runs_within(&r, 2..8, |run| got.push(run));
        // local elements 2..8 are logical 5, then 9..12, then 15..16
        let want = [(0, 5, 1), (1, 9, 3), (4, 15, 2)];
        let got: Vec<_> = got.iter().map(|r| (r.local, r.logical, r.len)).collect();
        assert_eq!(got, want);
    }
}
