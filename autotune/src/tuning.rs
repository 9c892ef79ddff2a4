//! The search, DeepSpeed's autotuner in fast mode (autotuning/autotuner.py `tune`,
//! `tune_space`, `run_tuning_micro_batch_sizes`, `get_tuning_micro_batch_size_list`), with one
//! change: the largest micro-batch of a ZeRO stage comes from the memory model (`Trials::fits`)
//! instead of trial runs that may run out of memory, so no trial is launched that the model
//! predicts will not fit.

use serde::Serialize;

/// DeepSpeed's `METRIC_PERCENT_DIFF_CONST`: a smaller micro-batch replaces the largest only
/// when it is this much better.
const BETTER_BY: f64 = 0.05;

/// What the search tries, from the user's config.
#[derive(Debug, Clone)]
pub struct Space {
    /// ZeRO stages: the config's stage, a list of them, or all four for "all".
    pub stages: Vec<u8>,
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
    /// Ranks of a trial, and `mp_size` (model-parallel ranks sharing a sample).
    pub ranks: usize,
    pub mp: usize,
}

/// One trial's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Experiment {
    pub name: String,
    pub stage: u8,
    pub micro_batch: usize,
    pub gas: usize,
    pub train_batch_size: usize,
}

impl Experiment {
    fn new(stage: u8, micro_batch: usize, gas: usize, space: &Space) -> Experiment {
        Experiment {
            name: format!("z{stage}_gas{gas}_tmbspg{micro_batch}"),
            stage,
            micro_batch,
            gas,
            train_batch_size: micro_batch * gas * space.ranks / space.mp.max(1),
        }
    }
}

/// How a trial ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It ran; the metric's value.
    Metric(f64),
    /// It was launched and failed (the reason).
    Failed(String),
    /// The memory model ruled it out; it was never launched.
    Pruned(String),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    pub experiment: Experiment,
    pub outcome: Outcome,
    /// The memory model's predicted peak RSS of the trial's largest rank.
    pub predicted_peak_bytes: u64,
}

/// Where the search's questions are answered: the memory model, and real runs.
pub trait Trials {
    /// The predicted peak bytes of the largest rank at this stage and micro-batch, and
    /// whether that fits the memory per rank.
    fn fits(&mut self, stage: u8, micro_batch: usize) -> anyhow::Result<(bool, u64)>;
    /// Runs one trial (a metric where larger is better: latency comes negated).
    fn run(&mut self, experiment: &Experiment, predicted_peak_bytes: u64) -> Outcome;
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
    let mut records = Vec::new();
    let mut prev_max = 0;
    for &stage in &space.stages {
        if trials.stopped() {
            break;
        }
        let max_fit = largest_fitting(space, stage, trials)?;
        // a higher stage helps only by fitting larger micro-batches (DeepSpeed's rule)
        if space.micro_batches.is_none() && (max_fit == 0 || max_fit < prev_max) {
            let (_, bytes) = trials.fits(stage, space.min_micro_batch.max(1))?;
            let e = Experiment::new(stage, space.min_micro_batch.max(1), space.gas, space);
            let why = match max_fit {
                0 => "does not fit at the smallest micro-batch".to_string(),
                m => format!("fits micro-batches up to {m}, fewer than a lower stage"),
            };
            records.push(Record {
                experiment: e,
                outcome: Outcome::Pruned(why),
                predicted_peak_bytes: bytes,
            });
            continue;
        }
        prev_max = prev_max.max(max_fit);
        tune_stage(space, stage, max_fit, trials, &mut records)?;
    }
    Ok(records)
}

/// The largest micro-batch up to `max_micro_batch` the memory model says fits (0: none).
fn largest_fitting(space: &Space, stage: u8, trials: &mut dyn Trials) -> anyhow::Result<usize> {
    let (mut lo, mut hi) = (0, space.max_micro_batch.max(1));
    // memory grows with the micro-batch: bisect for the last size that fits
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        match trials.fits(stage, mid)?.0 {
            true => lo = mid,
            false => hi = mid - 1,
        }
    }
    Ok(lo)
}

fn tune_stage(
    space: &Space,
    stage: u8,
    max_fit: usize,
    trials: &mut dyn Trials,
    records: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let run = |m: usize, gas: usize, trials: &mut dyn Trials, records: &mut Vec<Record>| {
        let e = Experiment::new(stage, m, gas, space);
        let (fits, bytes) = trials.fits(stage, m)?;
        let outcome = match fits {
            true => trials.run(&e, bytes),
            false => Outcome::Pruned(format!(
                "predicted peak {} MiB exceeds the memory per rank",
                bytes >> 20
            )),
        };
        records.push(Record {
            experiment: e,
            outcome: outcome.clone(),
            predicted_peak_bytes: bytes,
        });
        anyhow::Ok(outcome)
    };
    if let Some(list) = &space.micro_batches {
        let mut list = list.clone();
        list.sort_unstable();
        for m in list {
            if trials.stopped() {
                break;
            }
            run(m, space.gas, trials, records)?;
        }
        return Ok(());
    }
    let per_rank = match space.max_train_batch_size {
        Some(b) => b * space.mp / space.ranks.max(1),
        None => max_fit * space.gas / space.mp.max(1),
    };
    let min = space.min_micro_batch.max(1).min(max_fit);
    let list = micro_batch_list(min, max_fit, space.num_micro_batches, per_rank.max(1));
    let mut at_max = None;
    for &m in &list {
        if trials.stopped() {
            return Ok(());
        }
        let outcome = run(m, (per_rank / m).max(1), trials, records)?;
        if m == max_fit {
            at_max = Some(outcome);
        }
    }
    // the largest size runs close to the memory limit: walk down while a smaller one with the
    // same accumulation is clearly better
    let Some(Outcome::Metric(mut best)) = at_max else {
        return Ok(());
    };
    let low = match list.len() {
        1 => min,
        n => list[n - 2] + 1,
    };
    let stride = ((max_fit - low.min(max_fit)) / 3).max(1);
    for m in (low..max_fit).step_by(stride).rev() {
        if trials.stopped() {
            break;
        }
        match run(m, (per_rank / m).max(1), trials, records)? {
            Outcome::Metric(v) if v > best * (1.0 + BETTER_BY) => best = v,
            _ => break,
        }
    }
    Ok(())
}

/// The best record: the largest metric among the trials that ran.
pub fn best(records: &[Record]) -> Option<&Record> {
    records
        .iter()
        .filter_map(|r| match r.outcome {
            Outcome::Metric(v) => Some((r, v)),
            _ => None,
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(r, _)| r)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A model of memory (fits below `limit`) and speed (peaks at `best_mbs`).
    struct Fake {
        limit: usize,
        best_mbs: usize,
        ran: Vec<String>,
    }

    impl Trials for Fake {
        fn fits(&mut self, stage: u8, m: usize) -> anyhow::Result<(bool, u64)> {
            let per = 10 - 2 * stage as usize; // higher stages need less
            Ok((m * per <= self.limit, (m * per) as u64))
        }
        fn run(&mut self, e: &Experiment, _: u64) -> Outcome {
            self.ran.push(e.name.clone());
            let d = e.micro_batch.abs_diff(self.best_mbs) as f64;
            Outcome::Metric(100.0 - d * d)
        }
        fn stopped(&self) -> bool {
            false
        }
    }

    fn space(stages: Vec<u8>) -> Space {
        Space {
            stages,
            micro_batches: None,
            min_micro_batch: 1,
            max_micro_batch: 1024,
            num_micro_batches: 3,
            gas: 1,
            max_train_batch_size: None,
            ranks: 2,
            mp: 1,
        }
    }

    #[test]
    fn no_trial_runs_beyond_the_memory_model_and_the_best_is_found() {
        let mut f = Fake {
            limit: 100,
            best_mbs: 9,
            ran: Vec::new(),
        };
        let records = tune(&space(vec![0, 1, 2, 3]), &mut f).unwrap();
        for r in &records {
            if matches!(r.outcome, Outcome::Metric(_)) {
                assert!(r.predicted_peak_bytes <= 100, "{r:?}");
            }
        }
        // stage 0 fits 10, stage 1 12, stage 2 16, stage 3 25
        assert!(f.ran.iter().any(|n| n.starts_with("z3_")), "{:?}", f.ran);
        let b = best(&records).unwrap();
        assert_eq!(b.experiment.micro_batch, 9, "{records:?}");
    }

    #[test]
    fn a_user_list_is_tried_as_given_and_what_cannot_fit_is_pruned() {
        let mut f = Fake {
            limit: 40,
            best_mbs: 2,
            ran: Vec::new(),
        };
        let mut s = space(vec![0]);
        s.micro_batches = Some(vec![8, 2, 4]);
        let records = tune(&s, &mut f).unwrap();
        assert_eq!(f.ran, vec!["z0_gas1_tmbspg2", "z0_gas1_tmbspg4"]);
        assert!(
            matches!(records[2].outcome, Outcome::Pruned(_)),
            "{records:?}"
        );
    }
}
