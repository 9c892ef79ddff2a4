//! Parameter groups: which parts of a rank's shard the optimizer updates with other settings
//! than its own (HF's Trainer and Megatron put biases and norm weights in a group with
//! `weight_decay: 0.0`; a program may add groups of its own, as torch's `param_groups`), cut
//! out of the flat layout once at initialisation.

use std::ops::Range;

use ds_partition::FlatIndex;
use regex::Regex;

use crate::model::ParamSpec;
use crate::optim::{Group, GroupHyper};
use crate::{EngineError, Result};
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

/// A group of parameters the program names, with its own settings (an entry of torch's
/// `param_groups`): `ParamGroup::names(".*embed.*")?.lr_scale(0.1)`.
#[derive(Debug, Clone)]
pub struct ParamGroup {
    select: Select,
    hyper: GroupHyper,
}

#[derive(Debug, Clone)]
enum Select {
    /// Full parameter names matching, as Python's `re.search`.
    Names(Regex),
    /// transformers' no-decay parameters (`DecayGroups::ExceptBiasesAndNorms`).
    HfNoDecay,
}

impl ParamGroup {
    /// The parameters whose full names match `pattern` (a regular expression, searched in the
    /// name), at first with the optimizer's own settings.
    pub fn names(pattern: &str) -> Result<ParamGroup> {
        let re = Regex::new(pattern).map_err(|e| {
            EngineError::Setting(format!("parameter group pattern {pattern:?}: {e}"))
        })?;
        Ok(ParamGroup {
            select: Select::Names(re),
            hyper: GroupHyper::DEFAULT,
        })
    }

    /// HF's Trainer's second group: biases and norm weights without weight decay.
    pub fn hf_no_decay() -> ParamGroup {
        ParamGroup {
            select: Select::HfNoDecay,
            hyper: GroupHyper::NO_DECAY,
        }
    }

    /// This group's weight decay in place of the optimizer's.
    pub fn weight_decay(mut self, weight_decay: f64) -> ParamGroup {
        self.hyper.weight_decay = Some(weight_decay);
        self
    }

    /// This group's learning rate as a multiple of the scheduled one.
    pub fn lr_scale(mut self, scale: f64) -> ParamGroup {
        self.hyper.lr_scale = scale;
        self
    }

    fn matches(&self, spec: &ParamSpec) -> bool {
        match &self.select {
            Select::Names(re) => re.is_match(&spec.name),
            Select::HfNoDecay => !DecayGroups::ExceptBiasesAndNorms.decays(spec),
        }
    }

    fn describe(&self) -> String {
        match &self.select {
            Select::Names(re) => format!("parameter group {:?}", re.as_str()),
            Select::HfNoDecay => "the HF no-decay parameter group".into(),
        }
    }
}

/// The run's groups: the program's rule for weight decay, then the program's own groups
/// (the first that names a parameter takes it).
pub struct GroupRules<'a> {
    pub decay: DecayGroups,
    pub named: &'a [ParamGroup],
}

impl GroupRules<'_> {
    /// The optimizer's groups, in `Group` order: its own settings, no decay, then each named
    /// group.
    pub fn hypers(&self) -> Vec<GroupHyper> {
        let named = self.named.iter().map(|g| g.hyper);
        [GroupHyper::DEFAULT, GroupHyper::NO_DECAY]
            .into_iter()
            .chain(named)
            .collect()
    }

    fn group_of(&self, spec: &ParamSpec) -> Group {
        match self.named.iter().position(|g| g.matches(spec)) {
            Some(i) => Group(2 + i),
            None if self.decay.decays(spec) => Group::DEFAULT,
            None => Group(1),
        }
    }

    /// Each named group must name a parameter of the model and have sane settings.
    pub fn check(&self, specs: &[ParamSpec]) -> Result<()> {
        for g in self.named {
            let bad = |what: String| EngineError::Setting(format!("{}: {what}", g.describe()));
            if !(g.hyper.lr_scale.is_finite() && g.hyper.lr_scale >= 0.0) {
                return Err(bad(format!(
                    "lr_scale {} is not a non-negative number",
                    g.hyper.lr_scale
                )));
            }
            if let Some(wd) = g
                .hyper
                .weight_decay
                .filter(|w| !(w.is_finite() && *w >= 0.0))
            {
                return Err(bad(format!(
                    "weight_decay {wd} is not a non-negative number"
                )));
            }
            if !specs.iter().any(|s| g.matches(s)) {
                let some: Vec<&str> = specs.iter().take(4).map(|s| s.name.as_str()).collect();
                return Err(bad(format!(
                    "matches no parameter of the model (its names look like {some:?})"
                )));
            }
        }
        Ok(())
    }
}

/// The parts of one shard outside the optimizer's own group, relative to the shard's start,
/// in order, each with its group.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupPlan {
    parts: Vec<(Range<usize>, Group)>,
}

impl GroupPlan {
    /// The plan of the shard `owned` of the flat buffer `index` (this rank's parameters
    /// `specs`, in flat order).
    pub fn new(
        groups: &GroupRules,
        specs: &[ParamSpec],
        index: &FlatIndex,
        owned: &Range<usize>,
    ) -> GroupPlan {
        let mut parts: Vec<(Range<usize>, Group)> = Vec::new();
        for (spec, entry) in specs.iter().zip(index.entries()) {
            let group = groups.group_of(spec);
            if group == Group::DEFAULT {
                continue;
            }
            let r = entry.range();
            let (start, end) = (r.start.max(owned.start), r.end.min(owned.end));
            if start >= end {
                continue;
            }
            let part = start - owned.start..end - owned.start;
            match parts.last_mut() {
                Some((last, g)) if last.end == part.start && *g == group => last.end = part.end,
                _ => parts.push((part, group)),
            }
        }
        GroupPlan { parts }
    }

    /// `range` (of the shard) cut where the group changes, each part with its group.
    pub fn segments(&self, range: Range<usize>) -> Vec<(Range<usize>, Group)> {
        let mut out = Vec::new();
        let mut at = range.start;
        for (s, group) in &self.parts {
            let (start, end) = (s.start.max(at), s.end.min(range.end));
            if start >= end {
                continue;
            }
            if at < start {
                out.push((at..start, Group::DEFAULT));
            }
            out.push((start..end, *group));
            at = end;
        }
        if at < range.end {
            out.push((at..range.end, Group::DEFAULT));
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
        let plan = GroupPlan {
            parts: vec![(2..4, Group(1)), (6..7, Group(2))],
        };
        let got = plan.segments(1..8);
        let want = [
            (1..2, Group(0)),
            (2..4, Group(1)),
            (4..6, Group(0)),
            (6..7, Group(2)),
            (7..8, Group(0)),
        ];
        assert_eq!(got, want);
        assert_eq!(plan.segments(3..5), [(3..4, Group(1)), (4..5, Group(0))]);
        assert_eq!(GroupPlan::default().segments(0..3), [(0..3, Group(0))]);
    }
}
