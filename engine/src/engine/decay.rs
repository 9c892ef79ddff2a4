//! Parameter groups by weight decay: which parts of a rank's shard the optimizer leaves
//! without decay (HF's Trainer and Megatron put biases and norm weights in a group with
//! `weight_decay: 0.0`), cut out of the flat layout once at initialisation.

use std::ops::Range;

use ds_partition::FlatIndex;

use crate::model::ParamSpec;
use crate::optim::WeightDecay;

/// Whether the optimizer decays every parameter (a config's optimizer section, as DeepSpeed
/// applies it to a flat parameter list) or HF's groups (the optimizer `train` builds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecayGroups {
    All,
    /// transformers' `get_decay_parameter_names`: no decay for the parameters of norm layers
    /// and for names matching `bias`, `layernorm`, `rmsnorm`, `(^|.)norm($|.)`, `_norm($|.)`.
    ExceptBiasesAndNorms,
}

impl DecayGroups {
    pub fn decays(self, spec: &ParamSpec) -> bool {
        match self {
            DecayGroups::All => true,
            DecayGroups::ExceptBiasesAndNorms => !spec.norm && !hf_no_decay_name(&spec.name),
        }
    }
}

/// transformers' forbidden name patterns, searched in the lower-cased name.
fn hf_no_decay_name(name: &str) -> bool {
    let name = name.to_lowercase();
    if ["bias", "layernorm", "rmsnorm"]
        .iter()
        .any(|p| name.contains(p))
    {
        return true;
    }
    // `(?:^|\.)norm(?:$|\.)` and `_norm(?:$|\.)`
    name.match_indices("norm").any(|(at, _)| {
        let before = name[..at].chars().last();
        let after = name[at + 4..].chars().next();
        let ends = matches!(after, None | Some('.'));
        ends && matches!(before, None | Some('.') | Some('_'))
    })
}

/// The parts of one shard without weight decay, relative to the shard's start, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecayPlan {
    skip: Vec<Range<usize>>,
}

impl DecayPlan {
    /// The plan of the shard `owned` of the flat buffer `index` (this rank's parameters
    /// `specs`, in flat order).
    pub fn new(
        groups: DecayGroups,
        specs: &[ParamSpec],
        index: &FlatIndex,
        owned: &Range<usize>,
    ) -> DecayPlan {
        let mut skip: Vec<Range<usize>> = Vec::new();
        for (spec, entry) in specs.iter().zip(index.entries()) {
            if groups.decays(spec) {
                continue;
            }
            let r = entry.range();
            let (start, end) = (r.start.max(owned.start), r.end.min(owned.end));
            if start >= end {
                continue;
            }
            let part = start - owned.start..end - owned.start;
            match skip.last_mut() {
                Some(last) if last.end == part.start => last.end = part.end,
                _ => skip.push(part),
            }
        }
        DecayPlan { skip }
    }

    /// `range` (of the shard) cut where the decay changes, each part with its decay.
    pub fn segments(&self, range: Range<usize>) -> Vec<(Range<usize>, WeightDecay)> {
        let mut out = Vec::new();
        let mut at = range.start;
        for s in &self.skip {
            let (start, end) = (s.start.max(at), s.end.min(range.end));
            if start >= end {
                continue;
            }
            if at < start {
                out.push((at..start, WeightDecay::Apply));
            }
            out.push((start..end, WeightDecay::Skip));
            at = end;
        }
        if at < range.end {
            out.push((at..range.end, WeightDecay::Apply));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_without_decay() {
        for n in [
            "h.0.attn.c_attn.bias",
            "model.norm.weight",
            "layers.0.input_layernorm.weight",
            "q_norm.weight",
            "norm",
        ] {
            assert!(hf_no_decay_name(n), "{n}");
        }
        for n in [
            "h.0.attn.c_attn.weight",
            "wte.weight",
            "normal.weight",
            "h.0.ln_1.weight",
        ] {
            assert!(!hf_no_decay_name(n), "{n}");
        }
    }

    #[test]
    fn segments_cover_the_range_in_order() {
        let plan = DecayPlan {
            skip: vec![2..4, 6..7],
        };
        let got = plan.segments(1..8);
        let want = [
            (1..2, WeightDecay::Apply),
            (2..4, WeightDecay::Skip),
            (4..6, WeightDecay::Apply),
            (6..7, WeightDecay::Skip),
            (7..8, WeightDecay::Apply),
        ];
        assert_eq!(got, want);
        assert_eq!(
            plan.segments(3..5),
            [(3..4, WeightDecay::Skip), (4..5, WeightDecay::Apply)]
        );
        assert_eq!(
            DecayPlan::default().segments(0..3),
            [(0..3, WeightDecay::Apply)]
        );
    }
}
