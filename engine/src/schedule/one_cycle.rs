//! OneCycle (lr_schedules.py's `OneCycle`): one triangular cycle of lr, and inversely of beta1,
//! then an optional decay, with DeepSpeed's staircase variant.

use ds_config::optim::OneCycleParams;
use ds_config::ConfigError;

use super::positive;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct OneCycle {
    min_lr: f64,
    max_lr: f64,
    first_step_size: f64,
    second_step_size: f64,
    total_size: f64,
    step_ratio: f64,
    first_stair_count: u64,
    second_stair_count: u64,
    decay_step_size: f64,
    /// None when decay_step_size or decay_lr_rate is 0: the lr stays at cycle_min_lr.
    decay_lr_rate: Option<f64>,
    momentum: Option<CycleMomentum>,
}

#[derive(Debug, Clone, PartialEq)]
struct CycleMomentum {
    min_mom: f64,
    max_mom: f64,
    /// None when decay_step_size or decay_mom_rate is 0: beta1 stays at cycle_max_mom.
    decay_mom_rate: Option<f64>,
}

impl OneCycle {
    pub(super) fn new(
        p: &OneCycleParams,
        first_stairs: u64,
        second_stairs: Option<u64>,
    ) -> Result<Self, ConfigError> {
        let first = positive("cycle_first_step_size", p.first_step_size)? as f64;
        let second = p.second_step_size.map_or(first, |s| s as f64);
        let decays = p.decay_step_size != 0;
        let rate = |r: f64| (decays && r != 0.0).then_some(r);
        Ok(OneCycle {
            min_lr: p.min_lr,
            max_lr: p.max_lr,
            first_step_size: first,
            second_step_size: second,
            total_size: first + second,
            step_ratio: first / (first + second),
            first_stair_count: first_stairs,
            second_stair_count: second_stairs.unwrap_or(first_stairs),
            decay_step_size: p.decay_step_size as f64,
            decay_lr_rate: rate(p.decay_lr_rate),
            momentum: p.cycle_momentum.then(|| CycleMomentum {
                min_mom: p.min_mom,
                max_mom: p.max_mom,
                decay_mom_rate: rate(p.decay_mom_rate),
            }),
        })
    }

    pub(super) fn lr(&self, last: i64) -> f64 {
        if last < 0 {
            return self.min_lr;
        }
        if (last as f64) < self.total_size {
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale_factor(last);
        }
        match self.decay_lr_rate {
            None => self.min_lr,
            Some(rate) => self.min_lr / (1.0 + rate * self.decay_interval(last)),
        }
    }

    pub(super) fn momentum(&self, last: i64) -> Option<f64> {
        let m = self.momentum.as_ref()?;
        // The constructor writes cycle_min_mom, although the cycle formula at -1 would give
        // cycle_max_mom: the first step's beta1 is the minimum, the second's near the maximum.
        if last < 0 {
            return Some(m.min_mom);
        }
        if (last as f64) < self.total_size {
            return Some(m.max_mom - (m.max_mom - m.min_mom) * self.scale_factor(last));
        }
        Some(match m.decay_mom_rate {
            None => m.max_mom,
            Some(rate) => m.max_mom * (1.0 + rate * self.decay_interval(last)),
        })
    }

    /// `decay_batch_iteration / decay_step_size`, counted from the end of the cycle.
    fn decay_interval(&self, last: i64) -> f64 {
        (last as f64 - self.total_size + 1.0) / self.decay_step_size
    }

    /// Where in the cycle the batch after `last` sits: 0 at cycle_min_lr, 1 at the peak.
    fn scale_factor(&self, last: i64) -> f64 {
        let batch_iteration = (last + 1) as f64;
        let cycle = (1.0 + batch_iteration / self.total_size).floor();
        let x = 1.0 + batch_iteration / self.total_size - cycle;
        let (scale_factor, stair_count) = if x <= self.step_ratio {
            (x / self.step_ratio, self.first_stair_count)
        } else {
            ((x - 1.0) / (self.step_ratio - 1.0), self.second_stair_count)
        };
        if stair_count == 0 {
            return scale_factor;
        }
        // DeepSpeed quantises from the integer offset in the cycle, not from scale_factor.
        let stairs = stair_count as f64;
        let cycle_iteration = batch_iteration % self.total_size;
        let position = if cycle_iteration <= self.first_step_size {
            cycle_iteration * stairs / self.first_step_size
        } else {
            (self.total_size - cycle_iteration) * stairs / self.second_step_size
        };
        position.floor() / stairs
    }
}
