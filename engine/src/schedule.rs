//! LR schedules: DeepSpeed 0.19.8's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and
//! LRRangeTest (deepspeed/runtime/lr_schedules.py), as the engine applies them.
//!
//! DeepSpeed's schedulers are stateful: the constructor (`last_batch_iteration = -1`) writes the
//! lr of the first optimizer step into the param groups, and `DeepSpeedEngine._take_model_step`
//! calls `lr_scheduler.step()` after every optimizer step that was not skipped for an fp16
//! overflow. So the lr of the optimizer step taken after `n` applied (non-skipped) steps is
//! `get_lr()` at `last_batch_iteration = n - 1`. `LrSchedule` is the stateless form of that:
//! `lr_at(n)` is that lr, with `n` the number of applied steps so far (skipped steps do not
//! count). All arithmetic is f64 in the order lr_schedules.py does it (Python floats are f64
//! too), so the values match DeepSpeed's bit for bit on the reference fixture.

use ds_config::optim::{OneCycleParams, SchedulerParams};
use ds_config::{ConfigError, LrSchedulerType};

use hf::HfSchedule;
use one_cycle::OneCycle;

/// The beta2 OneCycle writes into the param groups with its cycled beta1: lr_schedules.py
/// builds the betas as `(momentum, 0.99)`, whatever beta2 the optimizer was configured with.
pub const ONE_CYCLE_BETA2: f64 = 0.99;

/// An LR schedule; see the module doc for what a step is.
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    kind: Kind,
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// No `scheduler` section: the optimizer's lr throughout.
    Constant(f64),
    RangeTest(RangeTest),
    OneCycle(OneCycle),
    Warmup(Warmup),
    WarmupCosine(WarmupCosine),
    /// Hugging Face's schedules (the program's, without a `scheduler` section).
    Hf(HfSchedule),
}

impl LrSchedule {
    /// The schedule a `scheduler` section describes, for an optimizer whose lr is `base_lr`
    /// (WarmupLR without `warmup_max_lr` warms up to it; WarmupCosineLR scales it).
    pub fn new(params: &SchedulerParams, base_lr: f64) -> Result<LrSchedule, ConfigError> {
        use SchedulerParams as P;
        let kind = match *params {
            P::LrRangeTest {
                min_lr,
                step_size,
                step_rate,
                staircase,
            } => Kind::RangeTest(RangeTest::new(min_lr, step_size, step_rate, staircase)?),
            P::OneCycle(ref p) => Kind::OneCycle(OneCycle::new(p, 0, None)?),
            P::WarmupLr {
                min_lr,
                max_lr,
                num_steps: num,
                log_warmup: log,
            } => Warmup::kind(min_lr, max_lr.unwrap_or(base_lr), num, log, None)?,
            P::WarmupDecayLr {
                total_steps: total,
                min_lr,
                max_lr,
                num_steps: num,
                log_warmup: log,
            } => Warmup::kind(min_lr, max_lr, num, log, Some(total))?,
            P::WarmupCosineLr {
                total_steps: total,
                min_ratio,
                num_steps: num,
                cos_min_ratio,
                log_warmup: log,
            } => WarmupCosine::kind(base_lr, total, min_ratio, num, cos_min_ratio, log)?,
        };
        Ok(LrSchedule { kind })
    }

    /// Hugging Face's `lr_scheduler_type` schedule over `total` steps with `warmup` steps of
    /// linear warmup, for an optimizer whose lr is `base_lr`.
    pub fn hugging_face(
        kind: LrSchedulerType,
        base_lr: f64,
        warmup: u64,
        total: u64,
    ) -> Result<LrSchedule, ConfigError> {
        Ok(LrSchedule {
            kind: Kind::Hf(HfSchedule::new(kind, base_lr, warmup, total)?),
        })
    }

    /// No schedule: every step uses the optimizer's lr.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule {
            kind: Kind::Constant(lr),
        }
    }

    /// OneCycle with staircase counts. `cycle_first_stair_count` / `cycle_second_stair_count`
    /// are accepted by ds-config but not carried in `OneCycleParams`; a second count of `None`
    /// takes the first, as DeepSpeed does. Counts of 0 give the continuous cycle of `new`.
    pub fn one_cycle(
        params: &OneCycleParams,
        cycle_first_stair_count: u64,
        cycle_second_stair_count: Option<u64>,
    ) -> Result<LrSchedule, ConfigError> {
        let cycle = OneCycle::new(params, cycle_first_stair_count, cycle_second_stair_count)?;
        Ok(LrSchedule {
            kind: Kind::OneCycle(cycle),
        })
    }

    /// The lr of the optimizer step taken after `step` applied (non-skipped) steps.
    pub fn lr_at(&self, step: u64) -> f64 {
        let last = last_batch_iteration(step);
        match &self.kind {
            Kind::Constant(lr) => *lr,
            Kind::RangeTest(s) => s.lr(last),
            Kind::OneCycle(s) => s.lr(last),
            Kind::Warmup(s) => s.lr(last),
            Kind::WarmupCosine(s) => s.lr(last),
            Kind::Hf(s) => s.lr(step),
        }
    }

    /// OneCycle with `cycle_momentum`: the beta1 of that step (beta2 is `ONE_CYCLE_BETA2`).
    /// DeepSpeed turns cycle_momentum off, with a warning, for an optimizer without `betas`
    /// (Adagrad); the engine must ignore this value there.
    pub fn momentum_at(&self, step: u64) -> Option<f64> {
        match &self.kind {
            Kind::OneCycle(s) => s.momentum(last_batch_iteration(step)),
            _ => None,
        }
    }
}

/// `last_batch_iteration` of DeepSpeed's scheduler (its whole `state_dict`) once `step`
/// optimizer steps have been applied: -1 before the first.
pub fn last_batch_iteration(step: u64) -> i64 {
    i64::try_from(step).unwrap_or(i64::MAX) - 1
}

/// The applied-step count a checkpoint's `last_batch_iteration` stands for (inverse of
/// `last_batch_iteration`; values below -1 are treated as -1).
pub fn applied_steps(last_batch_iteration: i64) -> u64 {
    u64::try_from(last_batch_iteration.saturating_add(1)).unwrap_or(0)
}

/// A step count DeepSpeed compares with the (signed) `last_batch_iteration`.
fn steps(key: &str, value: u64) -> Result<i64, ConfigError> {
    i64::try_from(value).map_err(|_| {
        ConfigError::invalid(
            &format!("scheduler.params.{key}"),
            value,
            "a step count below 2^63",
        )
    })
}

fn positive(key: &str, value: u64) -> Result<u64, ConfigError> {
    if value == 0 {
        return Err(ConfigError::invalid(
            &format!("scheduler.params.{key}"),
            0,
            "a positive integer",
        ));
    }
    Ok(value)
}

/// The warmup ramp shared by WarmupLR, WarmupDecayLR and WarmupCosineLR.
#[derive(Debug, Clone, PartialEq)]
struct Ramp {
    /// `max(2, warmup_num_steps)`: DeepSpeed never warms up over fewer than 2 steps.
    num_steps: i64,
    log: bool,
    inverse_log_warm_up: f64,
}

impl Ramp {
    fn new(warmup_num_steps: u64, log: bool) -> Result<Ramp, ConfigError> {
        let num_steps = steps(
            "warmup_num_steps",
            positive("warmup_num_steps", warmup_num_steps)?,
        )?
        .max(2);
        Ok(Ramp {
            num_steps,
            log,
            inverse_log_warm_up: 1.0 / (num_steps as f64).ln(),
        })
    }

    /// The warmup fraction at `last`, or None once warmup is over.
    fn gamma(&self, last: i64) -> Option<f64> {
        if last >= self.num_steps {
            return None;
        }
        Some(if self.log {
            self.inverse_log_warm_up * ((last + 1) as f64).ln()
        } else {
            last as f64 / self.num_steps as f64
        })
    }
}

/// WarmupLR (`total_num_steps: None`) and WarmupDecayLR.
#[derive(Debug, Clone, PartialEq)]
struct Warmup {
    min_lr: f64,
    delta_lr: f64,
    ramp: Ramp,
    total_num_steps: Option<i64>,
}

impl Warmup {
    fn kind(
        min: f64,
        max: f64,
        num: u64,
        log: bool,
        total: Option<u64>,
    ) -> Result<Kind, ConfigError> {
        Ok(Kind::Warmup(Warmup {
            min_lr: min,
            delta_lr: max - min,
            ramp: Ramp::new(num, log)?,
            total_num_steps: total.map(|t| steps("total_num_steps", t)).transpose()?,
        }))
    }

    fn lr(&self, last: i64) -> f64 {
        // The constructor's get_lr() at -1 returns min_lr itself.
        if last < 0 {
            return self.min_lr;
        }
        let gamma = match (self.ramp.gamma(last), self.total_num_steps) {
            (Some(g), _) => g,
            (None, None) => 1.0,
            (None, Some(total)) => {
                let span = ((total - self.ramp.num_steps) as f64).max(1.0);
                ((total - last) as f64 / span).max(0.0)
            }
        };
        self.min_lr + self.delta_lr * gamma
    }
}

#[derive(Debug, Clone, PartialEq)]
struct WarmupCosine {
    org_lr: f64,
    total_num_steps: i64,
    warmup_min_ratio: f64,
    cos_min_ratio: f64,
    ramp: Ramp,
}

impl WarmupCosine {
    fn kind(
        org_lr: f64,
        total: u64,
        warmup_min_ratio: f64,
        num: u64,
        cos_min_ratio: f64,
        log: bool,
    ) -> Result<Kind, ConfigError> {
        Ok(Kind::WarmupCosine(WarmupCosine {
            org_lr,
            total_num_steps: steps("total_num_steps", total)?,
            warmup_min_ratio,
            cos_min_ratio,
            ramp: Ramp::new(num, log)?,
        }))
    }

    fn lr(&self, last: i64) -> f64 {
        // The constructor's get_lr() at -1 gives 0.0, not warmup_min_ratio * lr: the first
        // optimizer step of a WarmupCosineLR run has lr 0.
        if last < 0 {
            return 0.0;
        }
        self.org_lr * self.ratio(last)
    }

    fn ratio(&self, last: i64) -> f64 {
        if let Some(ratio) = self.ramp.gamma(last) {
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio);
        }
        let real_last_step = last - self.ramp.num_steps + 1;
        let real_total_steps = (self.total_num_steps - self.ramp.num_steps).max(1);
        let progress = (real_last_step as f64 / real_total_steps as f64).min(1.0);
        let ratio = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
        (self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio).max(0.0)
    }
}

#[derive(Debug, Clone, PartialEq)]
struct RangeTest {
    min_lr: f64,
    step_size: f64,
    step_rate: f64,
    staircase: bool,
}

impl RangeTest {
    fn new(min_lr: f64, step_size: u64, rate: f64, staircase: bool) -> Result<Self, ConfigError> {
        Ok(RangeTest {
            min_lr,
            step_size: positive("lr_range_test_step_size", step_size)? as f64,
            step_rate: rate,
            staircase,
        })
    }

    fn lr(&self, last: i64) -> f64 {
        if last < 0 {
            return self.min_lr;
        }
        let interval = (last + 1) as f64 / self.step_size;
        let interval = if self.staircase {
            interval.floor()
        } else {
            interval
        };
        self.min_lr * (1.0 + self.step_rate * interval)
    }
}

mod hf;
mod one_cycle;

#[cfg(test)]
mod tests;
