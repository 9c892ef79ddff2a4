//! The schedules against DeepSpeed's own scheduler classes (fixtures/lr_reference.json, made by
//! fixtures/gen_lr_reference.py) and against endpoint values worked out by hand.

use super::*;
use ds_config::optim::{read_typed, TypedSection};
use serde_json::{json, Value as Json};

/// Both sides are f64 evaluations of the same expressions in the same order; 1e-12 leaves
/// room only for a libm that rounds ln/cos differently in the last bit.
const REL_TOL: f64 = 1e-12;

fn section(scheduler: &Json) -> TypedSection {
    let text = json!({ "scheduler": scheduler }).to_string();
    let root = ds_config::hjson::parse(&text).unwrap();
    read_typed(root.as_dict().unwrap(), "scheduler")
        .unwrap()
        .unwrap()
}

fn schedule(scheduler: &Json, base_lr: f64) -> LrSchedule {
    LrSchedule::new(
        &SchedulerParams::parse(&section(scheduler)).unwrap(),
        base_lr,
    )
    .unwrap()
}

/// serde_json's default float parsing can be 1 ulp off; ds-config's parser rounds correctly.
fn exact_json(text: &str) -> Json {
    ds_config::hjson::parse(text).unwrap().to_json()
}

fn close(got: f64, want: f64) -> bool {
    got == want || (got - want).abs() <= REL_TOL * got.abs().max(want.abs())
}

/// The stair counts ds-config drops go through `LrSchedule::one_cycle`.
fn fixture_schedule(case: &Json) -> LrSchedule {
    let scheduler = &case["scheduler"];
    let params = &scheduler["params"];
    let base_lr = case["optimizer_lr"].as_f64().unwrap();
    let Some(first) = params["cycle_first_stair_count"].as_u64() else {
        return schedule(scheduler, base_lr);
    };
    let SchedulerParams::OneCycle(p) = SchedulerParams::parse(&section(scheduler)).unwrap() else {
        panic!("stair counts belong to OneCycle")
    };
    LrSchedule::one_cycle(&p, first, params["cycle_second_stair_count"].as_u64()).unwrap()
}

#[test]
fn matches_deepspeed_schedulers_driven_like_the_engine() {
    let fixture = exact_json(include_str!("../fixtures/lr_reference.json"));
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 13);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let s = fixture_schedule(case);
        let skipped: Vec<u64> = serde_json::from_value(case["overflow_steps"].clone()).unwrap();
        let lrs = case["lr"].as_array().unwrap();
        let mut applied = 0;
        for (step, want) in lrs.iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = s.lr_at(applied);
            assert!(close(got, want), "{name} step {step}: lr {got} != {want}");
            let beta1 = case["beta1"][step].as_f64();
            let got = s.momentum_at(applied);
            assert!(
                got.zip(beta1).map_or(got == beta1, |(g, w)| close(g, w)),
                "{name} step {step}: beta1 {got:?} != {beta1:?}"
            );
            if let Some(beta2) = case["beta2"][step].as_f64() {
                assert_eq!(beta2, ONE_CYCLE_BETA2, "{name} step {step}");
            }
            // DeepSpeed steps the scheduler only after an applied optimizer step.
            if !skipped.contains(&(step as u64)) {
                applied += 1;
            }
        }
        assert_eq!(lrs.len(), 200, "{name}");
    }
}

#[test]
fn warmup_lr_repeats_min_then_holds_max() {
    let p = json!({"warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 10,
                   "warmup_type": "linear"});
    let s = schedule(&json!({"type": "WarmupLR", "params": p}), 5.0);
    // Constructor (-1) and first step (0) both give min_lr.
    assert_eq!((s.lr_at(0), s.lr_at(1)), (0.1, 0.1));
    assert!(close(s.lr_at(6), 0.1 + 1.0 * 5.0 / 10.0));
    assert!(close(s.lr_at(11), 1.1));
    assert!(close(s.lr_at(1000), 1.1));
    // Without warmup_max_lr the ramp ends at the optimizer's lr; log warmup by default.
    let s = schedule(
        &json!({"type": "WarmupLR", "params": {"warmup_num_steps": 8}}),
        3e-4,
    );
    assert_eq!(s.lr_at(1), 0.0);
    assert!(close(s.lr_at(4), 3e-4 * 4f64.ln() / 8f64.ln()));
    assert!(close(s.lr_at(9), 3e-4));
    assert_eq!(s.momentum_at(5), None);
}

#[test]
fn warmup_decay_lr_reaches_min_at_total_steps() {
    let p = json!({"total_num_steps": 100, "warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                   "warmup_num_steps": 20, "warmup_type": "linear"});
    let s = schedule(&json!({"type": "WarmupDecayLR", "params": p}), 0.5);
    assert_eq!(s.lr_at(0), 1e-5);
    assert!(close(s.lr_at(21), 1e-3), "peak right after warmup");
    assert!(
        close(s.lr_at(61), 1e-5 + (1e-3 - 1e-5) * 0.5),
        "half way down"
    );
    assert_eq!(
        s.lr_at(101),
        1e-5,
        "last_batch_iteration == total_num_steps"
    );
    assert_eq!(s.lr_at(500), 1e-5);
}

#[test]
fn warmup_cosine_lr_starts_at_zero_and_ends_at_cos_min_ratio() {
    let p = json!({"total_num_steps": 50, "warmup_min_ratio": 0.2, "warmup_num_steps": 10,
                   "cos_min_ratio": 0.1, "warmup_type": "linear"});
    let s = schedule(&json!({"type": "WarmupCosineLR", "params": p}), 2.0);
    assert_eq!(
        s.lr_at(0),
        0.0,
        "the constructor's lr, before warmup_min_ratio applies"
    );
    assert!(close(s.lr_at(1), 0.4));
    assert!(close(s.lr_at(10), 2.0 * (0.2 + 0.9 * 0.8)));
    // last_batch_iteration 29: 20 of the 40 decay steps, half way along the cosine.
    assert!(close(s.lr_at(30), 2.0 * (0.1 + 0.9 * 0.5)));
    assert!(close(s.lr_at(50), 0.2));
    assert!(close(s.lr_at(5000), 0.2), "clamped, no second cosine wave");
}

#[test]
fn one_cycle_peaks_after_first_step_size_and_cycles_momentum_inversely() {
    let p = json!({"cycle_min_lr": 0.1, "cycle_max_lr": 1.1, "cycle_first_step_size": 10,
                   "cycle_second_step_size": 20, "decay_lr_rate": 1.0, "decay_step_size": 5,
                   "cycle_min_mom": 0.8, "cycle_max_mom": 0.9});
    let s = schedule(&json!({"type": "OneCycle", "params": p}), 7.0);
    assert_eq!((s.lr_at(0), s.momentum_at(0)), (0.1, Some(0.8)));
    assert!(close(s.lr_at(1), 0.2));
    assert!(close(s.momentum_at(1).unwrap(), 0.89));
    assert!(close(s.lr_at(10), 1.1));
    assert!(close(s.momentum_at(10).unwrap(), 0.8));
    assert!(
        close(s.lr_at(20), 0.6),
        "half way down the 20-step second half"
    );
    // last_batch_iteration 29 ends the cycle (batch 30 is its start again: cycle_min_lr).
    assert!(close(s.lr_at(30), 0.1));
    // Decay: 5 steps past the cycle is one decay interval, lr = min / (1 + rate * 1).
    assert!(close(s.lr_at(35), 0.05));
    assert_eq!(
        s.momentum_at(35),
        Some(0.9),
        "decay_mom_rate 0: beta1 stays at max"
    );
}

#[test]
fn one_cycle_stairs_hold_the_lr_flat() {
    let p = json!({"cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 8});
    let SchedulerParams::OneCycle(p) =
        SchedulerParams::parse(&section(&json!({"type": "OneCycle", "params": p}))).unwrap()
    else {
        panic!("OneCycle expected")
    };
    let s = LrSchedule::one_cycle(&p, 2, None).unwrap();
    let lrs: Vec<f64> = (0..17).map(|n| s.lr_at(n)).collect();
    let want = [
        0., 0., 0., 0., 0.5, 0.5, 0.5, 0.5, 1., 0.5, 0.5, 0.5, 0.5, 0., 0., 0., 0.,
    ];
    assert_eq!(lrs, want);
}

#[test]
fn lr_range_test_grows_linearly_or_in_stairs() {
    let p = json!({"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4,
                   "lr_range_test_step_rate": 3.0});
    let s = schedule(&json!({"type": "LRRangeTest", "params": p}), 1.0);
    assert_eq!(s.lr_at(0), 0.01);
    assert!(close(s.lr_at(2), 0.01 * (1.0 + 3.0 * 0.5)));
    let p = json!({"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4,
                   "lr_range_test_step_rate": 3.0, "lr_range_test_staircase": true});
    let s = schedule(&json!({"type": "LRRangeTest", "params": p}), 1.0);
    assert_eq!((s.lr_at(3), s.lr_at(4)), (0.01, 0.04));
    assert!(close(s.lr_at(8), 0.07));
}

#[test]
fn constant_and_checkpoint_counters() {
    assert_eq!(LrSchedule::constant(3e-4).lr_at(12345), 3e-4);
    assert_eq!(last_batch_iteration(0), -1);
    assert_eq!(last_batch_iteration(7), 6);
    assert_eq!(applied_steps(6), 7);
    assert_eq!(applied_steps(-1), 0);
    assert_eq!(applied_steps(-5), 0);
    assert_eq!(last_batch_iteration(u64::MAX), i64::MAX - 1);
}

#[test]
fn zero_step_sizes_are_errors_naming_the_param() {
    for (scheduler, path) in [
        (
            json!({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                                  "cycle_first_step_size": 0}}),
            "scheduler.params.cycle_first_step_size",
        ),
        (
            json!({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}}),
            "scheduler.params.lr_range_test_step_size",
        ),
    ] {
        let params = SchedulerParams::parse(&section(&scheduler)).unwrap();
        let err = LrSchedule::new(&params, 1e-3).unwrap_err();
        assert_eq!(err.path(), Some(path), "{err}");
    }
    // Out of ds-config's reach (its integers are i64) but not of a hand-built SchedulerParams.
    let params = SchedulerParams::WarmupDecayLr {
        total_steps: u64::MAX,
        min_lr: 0.0,
        max_lr: 1e-3,
        num_steps: 10,
        log_warmup: true,
    };
    let err = LrSchedule::new(&params, 1e-3).unwrap_err();
    assert_eq!(
        err.path(),
        Some("scheduler.params.total_num_steps"),
        "{err}"
    );
}

/// Hugging Face's schedules against transformers' own `get_scheduler` driven like its Trainer
/// (fixtures/hf_lr_reference.json, made by fixtures/gen_hf_lr_reference.py).
#[test]
fn matches_hugging_face_schedules() {
    let fixture = exact_json(include_str!("../fixtures/hf_lr_reference.json"));
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let kind = LrSchedulerType::parse(case["lr_scheduler_type"].as_str().unwrap()).unwrap();
        let base = case["base_lr"].as_f64().unwrap();
        let warmup = case["warmup_steps"].as_u64().unwrap();
        let total = case["total_steps"].as_u64().unwrap();
        let s = LrSchedule::hugging_face(kind, base, warmup, total).unwrap();
        let lrs = case["lr"].as_array().unwrap();
        assert_eq!(lrs.len() as u64, total + 10, "{name}");
        for (step, want) in lrs.iter().enumerate() {
            let (got, want) = (s.lr_at(step as u64), want.as_f64().unwrap());
            assert!(close(got, want), "{name} step {step}: lr {got} != {want}");
        }
    }
}
