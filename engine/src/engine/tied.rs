//! Tied parameters (DeepSpeed's TiedLayerSpec): a parameter two layers use, such as an LM
//! head reading the token embedding. Each use keeps its own slot, with the same initial
//! values; before every optimizer step the two gradients are summed into both slots
//! (DeepSpeed's ReduceTiedGrads), so the two updates, and the two copies, stay bit-identical.
//! When the two layers sit on different pipeline stages, the sum is an exchange between the
//! two stages' ranks; on one stage it is a local sum, or at ZeRO 2-3, where each rank holds a
//! shard of the gradients, one all-reduce assembling the pair's pieces. The copy's gradient is
//! left out of the gradient norm, which counts the parameter once.

use std::ops::Range;

use ds_comm::{Element, Group};
use ds_partition::{FlatIndex, Zero};

use crate::model::ParamSpec;
use crate::{EngineError, Result};

/// One tied pair as this stage sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tie {
    /// Both uses on this stage: the flat ranges of the original and the copy.
    Local {
        owner: Range<usize>,
        copy: Range<usize>,
    },
    /// The other use lives on another stage, whose rank is `peer` (global): this stage's
    /// flat range, and whether it is the copy.
    Remote {
        range: Range<usize>,
        peer: usize,
        is_copy: bool,
    },
}

impl Tie {
    /// The flat range of this stage's copy, if it holds one.
    pub fn copy_range(&self) -> Option<Range<usize>> {
        match self {
            Tie::Local { copy, .. } => Some(copy.clone()),
            Tie::Remote {
                range,
                is_copy: true,
                ..
            } => Some(range.clone()),
            Tie::Remote { .. } => None,
        }
    }
}

/// The ties this stage takes part in. `all` is the whole model's parameters, `stage_of`
/// the stage holding each, `index` this stage's flat buffer and `rank_of(stage)` a stage's
/// global rank in this rank's pipeline.
pub(crate) fn ties(
    all: &[ParamSpec],
    stage_of: &[usize],
    my_stage: usize,
    index: &FlatIndex,
    rank_of: impl Fn(usize) -> usize,
) -> Result<Vec<Tie>> {
    let range = |name: &str| {
        index
            .entries()
            .iter()
            .find(|e| e.name == name)
            .map(|e| e.range())
            .expect("invariant: the stage's parameters are in its index")
    };
    let mut out = Vec::new();
    for (c, copy) in all.iter().enumerate() {
        let Some(owner_name) = &copy.tied else {
            continue;
        };
        let o = all
            .iter()
            .position(|p| &p.name == owner_name)
            .ok_or_else(|| {
                EngineError::Model(format!(
                    "parameter {} is tied to {owner_name}, which the model does not have",
                    copy.name
                ))
            })?;
        let owner = &all[o];
        if (&owner.shape, owner.split) != (&copy.shape, copy.split) || owner.tied.is_some() {
            return Err(EngineError::Model(format!(
                "parameter {} is tied to {owner_name}, which has another shape or split, or is itself tied",
                copy.name
            )));
        }
        let (so, sc) = (stage_of[o], stage_of[c]);
        out.extend(match (so == my_stage, sc == my_stage) {
            (true, true) => Some(Tie::Local {
                owner: range(&owner.name),
                copy: range(&copy.name),
            }),
            (false, true) => Some(Tie::Remote {
                range: range(&copy.name),
                peer: rank_of(so),
                is_copy: true,
            }),
            (true, false) => Some(Tie::Remote {
                range: range(&owner.name),
                peer: rank_of(sc),
                is_copy: false,
            }),
            (false, false) => None,
        });
    }
    Ok(out)
}

/// Sums each tied pair's gradients into both slots of `grads` (the whole reduced buffer);
/// `pp` reaches the other stage of a remote pair. The sum is taken in f32 and is the same
/// bits on both sides (addition of two numbers commutes).
pub(crate) fn reduce_tied<T: Element>(
    ties: &[Tie],
    grads: &mut [T],
    pp: Option<&Group>,
) -> Result<()> {
    let sum = |a: T, b: T| T::from_f32(a.to_f32() + b.to_f32());
    for tie in ties {
        match tie {
            Tie::Local { owner, copy } => {
                for (o, c) in owner.clone().zip(copy.clone()) {
                    let s = sum(grads[o], grads[c]);
                    (grads[o], grads[c]) = (s, s);
                }
            }
            Tie::Remote { range, peer, .. } => {
                let pp = pp.expect("invariant: a remote tie has a pipeline");
                let mine: Vec<T> = grads[range.clone()].to_vec();
                let mut theirs = vec![T::default(); mine.len()];
                pp.send_recv(
                    &[(*peer, bytemuck::cast_slice(&mine))],
                    &mut [(*peer, bytemuck::cast_slice_mut(&mut theirs))],
                )
                .map_err(|e| EngineError::Comm(e.during("pipeline: ReduceTiedGrads")))?;
                for ((g, m), t) in grads[range.clone()].iter_mut().zip(&mine).zip(&theirs) {
                    *g = sum(*m, *t);
                }
            }
        }
    }
    Ok(())
}

/// Sums each tied pair's gradients into both slots where the gradients are sharded over the
/// data-parallel group (ZeRO 2-3; `Zero::sum_sharded_pair`). Such a pair is on one stage:
/// pipeline parallelism combines with ZeRO 0-1 only.
pub(crate) fn reduce_tied_sharded<T: Element>(ties: &[Tie], zero: &mut Zero<T>) -> Result<()> {
    for tie in ties {
        match tie {
            Tie::Local { owner, copy } => zero.sum_sharded_pair(owner.clone(), copy.clone())?,
            Tie::Remote { .. } => {
                return Err(EngineError::NotBuilt(
                    "a tie across pipeline stages needs whole gradients (ZeRO 0 or 1)".into(),
                ))
            }
        }
    }
    Ok(())
}
