//! The search: DeepSpeed's autotuner (autotuning/autotuner.py `tune`, `tune_space`,
//! `run_tuning_micro_batch_sizes`, `get_tuning_micro_batch_size_list`; tuner/*.py), over ZeRO
//! stage, micro-batch, ZeRO's other settings and, beyond DeepSpeed, the tensor- and
//! pipeline-parallel degrees. Two changes:
//! - the largest micro-batch of a stage comes from the memory model (`Trials::fits`) instead of
//!   trial runs that may run out of memory, so no trial is launched that the model predicts
//!   will not fit;
//! - without `fast`, the whole space (micro-batches included) goes to the tuner, and the
//!   model-based tuner ranks it with the time model (time.rs) instead of a cost model learnt
//!   from its first random trials; it stops once no candidate left is predicted to beat the
//!   best by more than the model's own error so far.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use serde_json::Value as Json;

use crate::time::{Fit, StepCost};

/// DeepSpeed's `METRIC_PERCENT_DIFF_CONST`: a smaller micro-batch replaces the largest only
/// when it is this much better.
const BETTER_BY: f64 = 0.05;

/// What a trial is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Samples per second.
    Throughput,
    /// Seconds per step.
    Latency,
    /// Model TFLOP/s.
    Flops,
}

impl Metric {
    pub const NAMES: [&'static str; 3] = ["throughput", "latency", "flops"];

    pub fn parse(name: &str) -> Option<Metric> {
        match name {
            "throughput" => Some(Metric::Throughput),
            "latency" => Some(Metric::Latency),
            "flops" => Some(Metric::Flops),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        Metric::NAMES[self as usize]
    }

    /// The metric of a step of `seconds` doing `cost`'s work, larger is better (latency
    /// comes negated).
    pub fn of(self, seconds: f64, cost: &StepCost) -> f64 {
        match self {
            Metric::Throughput => cost.samples / seconds,
            Metric::Latency => -seconds,
            Metric::Flops => cost.flops / seconds / 1e12,
        }
    }
}

/// `autotuning.tuner_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunerKind {
    GridSearch,
    Random,
    ModelBased,
}

impl TunerKind {
    pub const NAMES: [&'static str; 3] = ["gridsearch", "random", "model_based"];

    pub fn name(self) -> &'static str {
        TunerKind::NAMES[self as usize]
    }

    pub fn parse(name: &str) -> Option<TunerKind> {
        match name {
            "gridsearch" => Some(TunerKind::GridSearch),
            "random" => Some(TunerKind::Random),
            "model_based" => Some(TunerKind::ModelBased),
            _ => None,
        }
    }
}

/// A parallel layout of a trial's ranks: tensor- and pipeline-parallel degrees, and the
/// expert- and sequence-parallel sizes within the data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    pub ep: usize,
    pub sp: usize,
}

/// A ZeRO setting the search varies: its key in `zero_optimization` and the values tried.
#[derive(Debug, Clone, PartialEq)]
pub struct Dimension {
    pub key: String,
    pub values: Vec<Json>,
}

/// What the search tries, from the user's config.
#[derive(Debug, Clone)]
pub struct Space {
    /// ZeRO stages: the config's stage, a list of them, or all four for "all".
    pub stages: Vec<u8>,
    /// Tensor-, pipeline-, expert- and sequence-parallel degrees (lists in
    /// `tensor_parallel.autotp_size`, `pipeline.stages`, `expert_parallel.autoep_size`,
    /// `sequence_parallel_size`).
    pub layouts: Vec<Layout>,
    /// `train_micro_batch_size_per_gpu` as a list: exactly these are tried.
    pub micro_batches: Option<Vec<usize>>,
    /// The smallest micro-batch to start from (the config's integer, else
    /// `min_train_micro_batch_size_per_gpu`).
    pub min_micro_batch: usize,
    /// `max_train_micro_batch_size_per_gpu`.
    pub max_micro_batch: usize,
    /// `num_tuning_micro_batch_sizes`.
    pub num_micro_batches: usize,
    /// The config's gradient accumulation steps (1 if none or not an integer).
    pub gas: usize,
    /// `max_train_batch_size`, if given.
    pub max_train_batch_size: Option<usize>,
    /// Ranks of a trial.
    pub ranks: usize,
    /// `fast`: only stage and micro-batch, DeepSpeed's way; else the tuner over everything.
    pub fast: bool,
    pub tuner: TunerKind,
    pub metric: Metric,
    /// `tuner_num_trials`, `tuner_early_stopping`.
    pub num_trials: usize,
    pub early_stopping: usize,
    /// ZeRO settings to vary at each stage 0-3 (without `fast`): the user's lists, else the
    /// stage's default space.
    pub settings: [Vec<Dimension>; 4],
}

/// One trial's configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Experiment {
    pub name: String,
    pub stage: u8,
    pub layout: Layout,
    pub micro_batch: usize,
    pub gas: usize,
    pub train_batch_size: usize,
    /// `zero_optimization` keys and their values beyond the stage.
    pub settings: Vec<(String, Json)>,
}

impl Experiment {
    pub fn new(
        stage: u8,
        layout: Layout,
        micro_batch: usize,
        gas: usize,
        settings: Vec<(String, Json)>,
        space: &Space,
    ) -> Experiment {
        let mut name = format!("z{stage}");
        if space.layouts.iter().any(|l| l.tp > 1 || l.pp > 1) {
            name += &format!("_tp{}_pp{}", layout.tp, layout.pp);
        }
        if space.layouts.iter().any(|l| l.ep > 1) {
            name += &format!("_ep{}", layout.ep);
        }
        if space.layouts.iter().any(|l| l.sp > 1) {
            name += &format!("_sp{}", layout.sp);
        }
        name += &format!("_gas{gas}_tmbspg{micro_batch}");
        for (key, value) in &settings {
            name += &format!("_{}{}", abbreviation(key), compact(value));
        }
        // sequence-parallel ranks share samples
        let dp = (space.ranks / (layout.tp * layout.pp * layout.sp)).max(1);
        Experiment {
            name,
            stage,
            layout,
            micro_batch,
            gas,
            train_batch_size: micro_batch * gas * dp,
            settings,
        }
    }
}

/// DeepSpeed's experiment-name abbreviations: the initials of a key's words.
fn abbreviation(key: &str) -> String {
    key.split('_').filter_map(|w| w.chars().next()).collect()
}

fn compact(v: &Json) -> String {
    match v {
        Json::Number(n) => match n.as_f64() {
            Some(f) if f >= 1e4 && f.fract() == 0.0 => format!("{f:e}"),
            _ => n.to_string(),
        },
        Json::Bool(b) => b.to_string(),
        other => other.to_string(),
    }
}

/// How a trial ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It ran: the metric (larger is better: latency negated) and the measured seconds per
    /// step.
    Ran { metric: f64, step_s: f64 },
    /// It was launched and failed (the reason).
    Failed(String),
    /// The memory model ruled it out; it was never launched.
    Pruned(String),
}

impl Outcome {
    pub fn metric(&self) -> Option<f64> {
        match self {
            Outcome::Ran { metric, .. } => Some(*metric),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    pub experiment: Experiment,
    pub outcome: Outcome,
    /// The memory model's predicted peak RSS of the trial's largest rank.
    pub predicted_peak_bytes: u64,
    /// The time model's step seconds, as predicted before the trial ran (with the fit to the
    /// trials before it).
    pub predicted_step_s: f64,
}

/// Where the search's questions are answered: the memory and time models, and real runs.
pub trait Trials {
    /// The predicted peak bytes of the trial's largest rank, and whether that fits.
    fn fits(&mut self, e: &Experiment) -> anyhow::Result<(bool, u64)>;
    /// The time model's cost of a step at the measured rates.
    fn cost(&mut self, e: &Experiment) -> anyhow::Result<StepCost>;
    /// Runs trials, side by side where the cluster has room; one outcome each.
    fn run(&mut self, batch: &[(Experiment, u64)]) -> Vec<Outcome>;
    /// How many trials fit side by side.
    fn side_by_side(&self) -> usize;
    /// The user asked to stop (Ctrl-C): no more trials.
    fn stopped(&self) -> bool;
}

/// DeepSpeed's `get_tuning_micro_batch_size_list`: up to `num` sizes from half the largest
/// (or `min`) to `max` with a constant stride, skipping sizes whose accumulation steps equal
/// the largest's; and the samples per rank per step that every size's accumulation keeps.
pub fn micro_batch_list(min: usize, max: usize, num: usize, per_rank: usize) -> Vec<usize> {
    if min == 0 || max == 0 {
        return Vec::new();
    }
    let min = min.max(max / 2);
    let stride = ((max - min.min(max)) / num.max(1)).max(1);
    let min_gas = per_rank / max;
    let mut list: Vec<usize> = (min..max)
        .step_by(stride)
        .filter(|&m| per_rank / m != min_gas)
        .collect();
    list.push(max);
    list
}

/// The whole search; every trial's record, in the order they ran (or were pruned).
pub fn tune(space: &Space, trials: &mut dyn Trials) -> anyhow::Result<Vec<Record>> {
    let mut search = Search {
        space,
        trials,
        records: Vec::new(),
        observed: Vec::new(),
        errors: Vec::new(),
    };
    match space.fast {
        true => search.fast()?,
        false => search.full()?,
    }
    Ok(search.records)
}

/// A candidate with its models' answers.
struct Candidate {
    experiment: Experiment,
    fits: bool,
    peak: u64,
    cost: StepCost,
    /// Why the configuration cannot run at all (the config's or the engine's refusal).
    invalid: Option<String>,
}

struct Search<'a> {
    space: &'a Space,
    trials: &'a mut dyn Trials,
    records: Vec<Record>,
    /// The time model's cost and the measured seconds of every trial that ran.
    observed: Vec<(StepCost, f64)>,
    /// The relative error of each prediction made with a fit (after a first trial).
    errors: Vec<f64>,
}

impl Search<'_> {
    /// The models' answers; a configuration the models refuse (ZeRO-2 with a pipeline, a
    /// layout the model cannot split) is a candidate that never runs, with the reason.
    fn candidate(&mut self, e: Experiment) -> anyhow::Result<Candidate> {
        let answers = self
            .trials
            .fits(&e)
            .and_then(|fit| Ok((fit, self.trials.cost(&e)?)));
        Ok(match answers {
            Ok(((fits, peak), cost)) => Candidate {
                experiment: e,
                fits,
                peak,
                cost,
                invalid: None,
            },
            Err(why) => Candidate {
                experiment: e,
                fits: false,
                peak: 0,
                cost: StepCost::default(),
                invalid: Some(format!("{why:#}")),
            },
        })
    }

    fn fit(&self) -> Fit {
        Fit::to(&self.observed)
    }

    fn prune(&mut self, c: Candidate, why: String) {
        let predicted_step_s = self.fit().predict(&c.cost);
        self.records.push(Record {
            experiment: c.experiment,
            outcome: Outcome::Pruned(why),
            predicted_peak_bytes: c.peak,
            predicted_step_s,
        });
    }

    /// Runs the candidates that fit (pruning the others), side by side in groups the cluster
    /// holds; their outcomes in order.
    fn run(&mut self, batch: Vec<Candidate>) -> Vec<Outcome> {
        let mut out = Vec::new();
        let mut runnable = Vec::new();
        for c in batch {
            if c.fits {
                runnable.push(c);
                continue;
            }
            let why = c.invalid.clone().unwrap_or_else(|| {
                format!(
                    "predicted peak {} MiB exceeds the memory per rank",
                    c.peak >> 20
                )
            });
            out.push(Outcome::Pruned(why.clone()));
            self.prune(c, why);
        }
        for group in runnable.chunks(self.trials.side_by_side().max(1)) {
            if self.trials.stopped() {
                break;
            }
            let (fit, fitted) = (self.fit(), !self.observed.is_empty());
            let jobs: Vec<(Experiment, u64)> = group
                .iter()
                .map(|c| (c.experiment.clone(), c.peak))
                .collect();
            let outcomes = self.trials.run(&jobs);
            for (c, o) in group.iter().zip(outcomes) {
                let predicted_step_s = fit.predict(&c.cost);
                if let Outcome::Ran { step_s, .. } = o {
                    self.observed.push((c.cost, step_s));
                    if fitted {
                        self.errors.push((predicted_step_s - step_s).abs() / step_s);
                    }
                }
                self.records.push(Record {
                    experiment: c.experiment.clone(),
                    outcome: o.clone(),
                    predicted_peak_bytes: c.peak,
                    predicted_step_s,
                });
                out.push(o);
            }
        }
        out
    }

    /// The largest micro-batch up to `max_micro_batch` the memory model says fits (0: none).
    fn largest_fitting(&mut self, stage: u8, layout: Layout) -> anyhow::Result<usize> {
        let s = self.space;
        let (mut lo, mut hi) = (0, s.max_micro_batch.max(1));
        // memory grows with the micro-batch: bisect for the last size that fits
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            let e = Experiment::new(stage, layout, mid, s.gas, Vec::new(), s);
            // a configuration the models refuse fits at no size (skip_stage says why)
            match self.trials.fits(&e).is_ok_and(|(fits, _)| fits) {
                true => lo = mid,
                false => hi = mid - 1,
            }
        }
        Ok(lo)
    }

    /// The micro-batches to try at a stage that fits up to `max_fit`, each with its
    /// accumulation steps: the user's list, else DeepSpeed's list.
    fn micro_batches(&self, max_fit: usize) -> Vec<(usize, usize)> {
        let s = self.space;
        if let Some(list) = &s.micro_batches {
            let mut list = list.clone();
            list.sort_unstable();
            return list.into_iter().map(|m| (m, s.gas)).collect();
        }
        let per_rank = self.per_rank(max_fit);
        let min = s.min_micro_batch.max(1).min(max_fit);
        micro_batch_list(min, max_fit, s.num_micro_batches, per_rank)
            .into_iter()
            .map(|m| (m, (per_rank / m).max(1)))
            .collect()
    }

    /// Samples per data-parallel rank per step that the accumulation keeps constant.
    fn per_rank(&self, max_fit: usize) -> usize {
        let s = self.space;
        match s.max_train_batch_size {
            Some(b) => (b / s.ranks.max(1)).max(1),
            None => (max_fit * s.gas).max(1),
        }
    }

    /// Records a stage that is not tuned, with why.
    fn skip_stage(&mut self, stage: u8, layout: Layout, max_fit: usize) -> anyhow::Result<()> {
        let s = self.space;
        let m = s.min_micro_batch.max(1);
        let c = self.candidate(Experiment::new(stage, layout, m, s.gas, Vec::new(), s))?;
        let why = match (&c.invalid, max_fit) {
            (Some(why), _) => why.clone(),
            (None, 0) => "does not fit at the smallest micro-batch".to_string(),
            (None, m) => format!("fits micro-batches up to {m}, fewer than a lower stage"),
        };
        self.prune(c, why);
        Ok(())
    }

    /// DeepSpeed's fast mode, per layout: per stage the micro-batch list side by side, then the
    /// walk down from the largest.
    fn fast(&mut self) -> anyhow::Result<()> {
        for &layout in &self.space.layouts {
            let mut prev_max = 0;
            for &stage in &self.space.stages {
                if self.trials.stopped() {
                    return Ok(());
                }
                let max_fit = self.largest_fitting(stage, layout)?;
                // a higher stage helps only by fitting larger micro-batches (DeepSpeed's rule)
                if self.space.micro_batches.is_none() && (max_fit == 0 || max_fit < prev_max) {
                    self.skip_stage(stage, layout, max_fit)?;
                    continue;
                }
                prev_max = prev_max.max(max_fit);
                self.fast_stage(stage, layout, max_fit)?;
            }
        }
        Ok(())
    }

    fn fast_stage(&mut self, stage: u8, layout: Layout, max_fit: usize) -> anyhow::Result<()> {
        let s = self.space;
        let list = self.micro_batches(max_fit);
        let batch = list
            .iter()
            .map(|&(m, gas)| self.candidate(Experiment::new(stage, layout, m, gas, Vec::new(), s)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let outcomes = self.run(batch);
        if s.micro_batches.is_some() {
            return Ok(());
        }
        // the largest size runs close to the memory limit: walk down while a smaller one with
        // the same accumulation is clearly better
        let Some(mut best) = outcomes.last().and_then(Outcome::metric) else {
            return Ok(());
        };
        let per_rank = self.per_rank(max_fit);
        let low = match list.len() {
            1 => s.min_micro_batch.max(1).min(max_fit),
            n => list[n - 2].0 + 1,
        };
        let stride = ((max_fit - low.min(max_fit)) / 3).max(1);
        for m in (low..max_fit).step_by(stride).rev() {
            if self.trials.stopped() {
                break;
            }
            let gas = (per_rank / m).max(1);
            let c = self.candidate(Experiment::new(stage, layout, m, gas, Vec::new(), s))?;
            match self.run(vec![c]).pop().and_then(|o| o.metric()) {
                Some(v) if v > best * (1.0 + BETTER_BY) => best = v,
                _ => break,
            }
        }
        Ok(())
    }

    /// Every candidate of the space: layouts x stages x micro-batches x ZeRO settings.
    fn grid(&mut self) -> anyhow::Result<Vec<Candidate>> {
        let s = self.space;
        let mut out = Vec::new();
        for &layout in &s.layouts {
            for &stage in &s.stages {
                let max_fit = self.largest_fitting(stage, layout)?;
                if max_fit == 0 {
                    self.skip_stage(stage, layout, 0)?;
                    continue;
                }
                for (m, gas) in self.micro_batches(max_fit) {
                    for settings in combinations(&s.settings[stage as usize]) {
                        let e = Experiment::new(stage, layout, m, gas, settings, s);
                        out.push(self.candidate(e)?);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Without `fast`: the tuner over the whole space, DeepSpeed's `BaseTuner.tune` loop
    /// (batches as wide as the cluster holds, `tuner_num_trials`, `tuner_early_stopping`).
    fn full(&mut self) -> anyhow::Result<()> {
        let s = self.space;
        let (fitting, too_big): (Vec<_>, Vec<_>) = self.grid()?.into_iter().partition(|c| c.fits);
        self.run(too_big);
        let mut left = fitting;
        if s.tuner == TunerKind::Random {
            left.shuffle(&mut rand::rngs::StdRng::seed_from_u64(0));
        }
        let (mut tried, mut best_at, mut best) = (0, 0, f64::NEG_INFINITY);
        while !left.is_empty() && tried < s.num_trials && !self.trials.stopped() {
            if s.tuner == TunerKind::ModelBased {
                let fit = self.fit();
                let predicted = |c: &Candidate| s.metric.of(fit.predict(&c.cost), &c.cost);
                left.sort_by(|a, b| predicted(b).total_cmp(&predicted(a)));
                // DeepSpeed's model-based tuner also starts from two measured trials
                if tried >= 2 && !self.may_beat(best, left.first().map(predicted)) {
                    break;
                }
            }
            let n = self.trials.side_by_side().max(1).min(s.num_trials - tried);
            let batch: Vec<Candidate> = left.drain(..n.min(left.len())).collect();
            for o in self.run(batch) {
                tried += 1;
                if let Some(v) = o.metric().filter(|&v| v > best) {
                    (best, best_at) = (v, tried);
                }
            }
            if s.early_stopping > 0 && tried >= best_at + s.early_stopping {
                break;
            }
        }
        Ok(())
    }

    /// Whether the best candidate left, predicted at `next`, may still beat `best` given the
    /// largest error of the fitted model's predictions so far (at least `BETTER_BY`).
    fn may_beat(&self, best: f64, next: Option<f64>) -> bool {
        let Some(next) = next else { return false };
        let error = self.errors.iter().copied().fold(BETTER_BY, f64::max);
        // a larger metric is better; the prediction may be off by `error` either way
        next + next.abs() * error > best
    }
}

/// Every combination of the dimensions' values (one empty combination for none).
fn combinations(dims: &[Dimension]) -> Vec<Vec<(String, Json)>> {
    let mut out = vec![Vec::new()];
    for d in dims {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                d.values.iter().map(move |v| {
                    let mut c = prefix.clone();
                    c.push((d.key.clone(), v.clone()));
                    c
                })
            })
            .collect();
    }
    out
}

/// The best record: the largest metric among the trials that ran.
pub fn best(records: &[Record]) -> Option<&Record> {
    records
        .iter()
        .filter_map(|r| r.outcome.metric().map(|v| (r, v)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(r, _)| r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// DeepSpeed's list for (min, max, num, per_rank), as DeepSpeed 0.19.8's
    /// `Autotuner.get_tuning_micro_batch_size_list` returned them (per_rank = max x gas).
    #[test]
    fn micro_batch_list_follows_deepspeed() {
        assert_eq!(micro_batch_list(1, 16, 3, 16), vec![8, 16]);
        assert_eq!(micro_batch_list(2, 8, 3, 32), vec![4, 5, 6, 8]);
        assert_eq!(micro_batch_list(1, 1, 3, 1), vec![1]);
        assert_eq!(micro_batch_list(3, 40, 4, 80), vec![20, 25, 40]);
        assert_eq!(micro_batch_list(5, 100, 3, 100), vec![50, 100]);
        assert!(micro_batch_list(0, 4, 3, 4).is_empty());
    }

    /// A cluster whose memory fits `m x (10 - 2 stage) <= limit` and whose micro-batch m
    /// takes `overhead + m / 4` seconds, stage 3 paying `stage3` more: the true throughput is
    /// then known here independently of the search.
    struct Fake {
        limit: usize,
        overhead: f64,
        stage3: f64,
        ran: Vec<String>,
        width: usize,
        batches: Vec<usize>,
        /// A stage the models refuse (as ZeRO-2 with a pipeline).
        refused: Option<u8>,
    }

    impl Fake {
        fn seconds(&self, e: &Experiment) -> f64 {
            let extra = if e.stage == 3 { self.stage3 } else { 0.0 };
            e.gas as f64 * (self.overhead + e.micro_batch as f64 / 4.0 + extra)
        }
    }

    impl Trials for Fake {
        fn fits(&mut self, e: &Experiment) -> anyhow::Result<(bool, u64)> {
            if self.refused == Some(e.stage) {
                anyhow::bail!("stage {} is refused here", e.stage);
            }
            let per = 10 - 2 * e.stage as usize; // higher stages need less
            let bytes = e.micro_batch * per;
            Ok((bytes <= self.limit, bytes as u64))
        }
        fn cost(&mut self, e: &Experiment) -> anyhow::Result<StepCost> {
            // the model knows the shape (compute grows with m, a fixed rest) but not the
            // factors: the fit must find them
            Ok(StepCost {
                compute_s: (e.micro_batch * e.gas) as f64,
                comm_s: e.gas as f64 * if e.stage == 3 { 2.0 } else { 1.0 },
                optimizer_s: 0.0,
                samples: (e.micro_batch * e.gas) as f64,
                flops: 0.0,
            })
        }
        fn run(&mut self, batch: &[(Experiment, u64)]) -> Vec<Outcome> {
            self.batches.push(batch.len());
            batch
                .iter()
                .map(|(e, _)| {
                    self.ran.push(e.name.clone());
                    let t = self.seconds(e);
                    Outcome::Ran {
                        metric: (e.micro_batch * e.gas) as f64 / t,
                        step_s: t,
                    }
                })
                .collect()
        }
        fn side_by_side(&self) -> usize {
            self.width
        }
        fn stopped(&self) -> bool {
            false
        }
    }

    fn fake(limit: usize) -> Fake {
        Fake {
            limit,
            overhead: 2.0,
            stage3: 0.0,
            ran: Vec::new(),
            width: 1,
            batches: Vec::new(),
            refused: None,
        }
    }

    fn space(stages: Vec<u8>) -> Space {
        Space {
            stages,
            layouts: vec![Layout {
                tp: 1,
                pp: 1,
                ep: 1,
                sp: 1,
            }],
            micro_batches: None,
            min_micro_batch: 1,
            max_micro_batch: 1024,
            num_micro_batches: 3,
            gas: 1,
            max_train_batch_size: None,
            ranks: 2,
            fast: true,
            tuner: TunerKind::GridSearch,
            metric: Metric::Throughput,
            num_trials: 50,
            early_stopping: 0,
            settings: Default::default(),
        }
    }

    #[test]
    fn no_trial_runs_beyond_the_memory_model_and_larger_stages_are_tuned() {
        let mut f = fake(100);
        let records = tune(&space(vec![0, 1, 2, 3]), &mut f).unwrap();
        for r in &records {
            if r.outcome.metric().is_some() {
                assert!(r.predicted_peak_bytes <= 100, "{r:?}");
            }
        }
        // stage 0 fits 10, stage 1 12, stage 2 16, stage 3 25; throughput grows with m
        assert!(f.ran.iter().any(|n| n.starts_with("z3_")), "{:?}", f.ran);
        let b = best(&records).unwrap();
        assert_eq!(b.experiment.micro_batch, 25, "{records:?}");
    }

    #[test]
    fn a_user_list_is_tried_as_given_and_what_cannot_fit_is_pruned() {
        let mut f = fake(40);
        let mut s = space(vec![0]);
        s.micro_batches = Some(vec![8, 2, 4]);
        let records = tune(&s, &mut f).unwrap();
        assert_eq!(f.ran, vec!["z0_gas1_tmbspg2", "z0_gas1_tmbspg4"]);
        let pruned: Vec<&str> = records
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Pruned(_)))
            .map(|r| r.experiment.name.as_str())
            .collect();
        assert_eq!(pruned, vec!["z0_gas1_tmbspg8"]);
    }

    fn full(tuner: TunerKind) -> Space {
        let mut s = space(vec![0, 1, 2, 3]);
        s.fast = false;
        s.tuner = tuner;
        s.micro_batches = Some(vec![1, 2, 4, 6, 8, 12, 16]);
        s
    }

    /// The best by the fake's own formula over every candidate the memory allows.
    fn true_best(f: &Fake, s: &Space) -> f64 {
        let mut best = 0.0f64;
        for &stage in &s.stages {
            for &m in s.micro_batches.as_ref().unwrap() {
                let e = Experiment::new(stage, s.layouts[0], m, 1, Vec::new(), s);
                if m * (10 - 2 * stage as usize) <= f.limit {
                    best = best.max(m as f64 / f.seconds(&e));
                }
            }
        }
        best
    }

    #[test]
    fn the_model_based_tuner_finds_the_grids_best_in_fewer_trials() {
        let mut grid = fake(64);
        grid.stage3 = 3.0;
        let records = tune(&full(TunerKind::GridSearch), &mut grid).unwrap();
        let grid_best = best(&records).unwrap().outcome.metric().unwrap();
        assert!((grid_best - true_best(&grid, &full(TunerKind::GridSearch))).abs() < 1e-12);
        let mut model = fake(64);
        model.stage3 = 3.0;
        let records = tune(&full(TunerKind::ModelBased), &mut model).unwrap();
        let model_best = best(&records).unwrap().outcome.metric().unwrap();
        assert_eq!(model_best, grid_best, "{records:#?}");
        assert!(
            model.ran.len() < grid.ran.len(),
            "model-based {:?} vs grid {:?}",
            model.ran,
            grid.ran
        );
    }

    #[test]
    fn random_and_grid_respect_the_trial_budget_and_run_side_by_side() {
        for tuner in [TunerKind::Random, TunerKind::GridSearch] {
            let mut f = fake(64);
            f.width = 2;
            let mut s = full(tuner);
            s.num_trials = 5;
            tune(&s, &mut f).unwrap();
            assert_eq!(f.ran.len(), 5, "{tuner:?}: {:?}", f.ran);
            assert_eq!(f.batches, vec![2, 2, 1], "{tuner:?}");
        }
    }

    #[test]
    fn zero_settings_become_dimensions_with_deepspeed_names() {
        let mut f = fake(1000);
        let mut s = full(TunerKind::GridSearch);
        s.stages = vec![2];
        s.micro_batches = Some(vec![1]);
        s.settings[2] = vec![Dimension {
            key: "reduce_bucket_size".into(),
            values: vec![json!(5e7), json!(5e8)],
        }];
        tune(&s, &mut f).unwrap();
        assert_eq!(
            f.ran,
            vec!["z2_gas1_tmbspg1_rbs5e7", "z2_gas1_tmbspg1_rbs5e8"]
        );
    }

    #[test]
    fn a_configuration_the_models_refuse_is_pruned_with_the_reason() {
        for fast in [true, false] {
            let mut f = fake(64);
            f.refused = Some(2);
            let mut s = full(TunerKind::GridSearch);
            s.fast = fast;
            let records = tune(&s, &mut f).unwrap();
            assert!(!f.ran.iter().any(|n| n.starts_with("z2_")), "{:?}", f.ran);
            assert!(f.ran.iter().any(|n| n.starts_with("z3_")), "{:?}", f.ran);
            let z2: Vec<&Record> = records.iter().filter(|r| r.experiment.stage == 2).collect();
            assert!(!z2.is_empty());
            for r in z2 {
                assert_eq!(
                    r.outcome,
                    Outcome::Pruned("stage 2 is refused here".into()),
                    "fast {fast}"
                );
            }
        }
    }
}
