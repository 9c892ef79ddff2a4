//! The scalers against DeepSpeed's own `DynamicLossScaler`, `LossScaler` and
//! `FP16_Optimizer._update_scale` (fixtures/loss_scale_reference.json, made by
//! fixtures/gen_loss_scale_reference.py), and a few cases worked out by hand.

use super::*;
use ds_config::ParallelDims;
use serde_json::{json, Value as Json};

/// The `fp16` section as ds-config resolves it from a whole ds_config.
fn fp16(section: Json) -> Fp16Config {
    let text = json!({"train_batch_size": 1, "fp16": section}).to_string();
    let doc = ds_config::hjson::parse(&text).unwrap();
    let dims = ParallelDims {
        world_size: 1,
        tp: 1,
        pp: 1,
        ep: 1,
        sp: 1,
    };
    ds_config::resolve(&doc, &dims).unwrap().fp16
}

fn expected_log(lines: Option<&Json>) -> Vec<LogLine> {
    let Some(lines) = lines else {
        return Vec::new();
    };
    let line = |l: &Json| LogLine {
        level: match l[0].as_str() {
            Some("warning") => LogLevel::Warning,
            _ => LogLevel::Info,
        },
        text: l[1].as_str().unwrap().to_string(),
    };
    lines.as_array().unwrap().iter().map(line).collect()
}

/// Replays one fixture case; returns how many updates succeeded.
fn replay(case: &Json) -> usize {
    let name = case["name"].as_str().unwrap();
    let stage = match case["owner"].as_str() {
        Some("zero") => ZeroStage::OptimizerStates,
        _ => ZeroStage::Disabled,
    };
    let mut scaler = LossScaler::new(&fp16(case["fp16"].clone()), stage).unwrap();
    let error_at = case["error"]["iteration"].as_u64().map(|i| i as usize);
    for (i, flag) in case["overflow"].as_str().unwrap().chars().enumerate() {
        let overflow = flag == '1';
        if error_at == Some(i) {
            let before = scaler.state();
            let err = scaler.update(overflow).unwrap_err();
            assert_eq!(err.to_string(), case["error"]["message"].as_str().unwrap());
            assert_eq!(
                scaler.state(),
                before,
                "{name}: an error leaves the state alone"
            );
            return i;
        }
        let outcome = scaler.update(overflow).unwrap();
        // Scales are powers of two or the integer min_loss_scale: exact on both sides.
        assert_eq!(
            scaler.scale(),
            case["scale"][i].as_f64().unwrap(),
            "{name} iteration {i}"
        );
        assert_eq!(outcome.skipped, overflow, "{name} iteration {i}");
        if let Some(h) = case["hysteresis"][i].as_i64() {
            assert_eq!(scaler.state().cur_hysteresis, h, "{name} iteration {i}");
        }
        let log = expected_log(case["log"].get(i.to_string()));
        assert_eq!(outcome.log, log, "{name} iteration {i}");
        assert_eq!(scaler.state().cur_iter, i as u64 + 1);
    }
    case["overflow"].as_str().unwrap().len()
}

#[test]
fn matches_deepspeed_over_fixed_overflow_patterns() {
    // Read with ds-config's parser, whose floats round correctly (serde_json's default may not).
    let text = include_str!("../fixtures/loss_scale_reference.json");
    let fixture = ds_config::hjson::parse(text).unwrap().to_json();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 11);
    let mut errors = 0;
    for case in cases {
        let done = replay(case);
        assert_eq!(done, case["scale"].as_array().unwrap().len());
        errors += usize::from(!case["error"].is_null());
    }
    assert_eq!(errors, 2, "two cases run into min_loss_scale under ZeRO");
}

#[test]
fn one_overflow_at_the_initial_scale_halves_it_and_skips_the_step() {
    let cfg = fp16(json!({"enabled": true, "hysteresis": 1}));
    let mut scaler = LossScaler::new(&cfg, ZeroStage::Gradients).unwrap();
    assert_eq!(scaler.scale(), 65536.0);
    let outcome = scaler.update(true).unwrap();
    assert!(outcome.skipped);
    assert_eq!(scaler.scale(), 32768.0);
    assert_eq!(
        outcome.log[0].text,
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768"
    );
    let outcome = scaler.update(false).unwrap();
    assert!(!outcome.skipped && outcome.log.is_empty());
    assert_eq!(scaler.scale(), 32768.0);
    // With DeepSpeed's default hysteresis of 2 the first overflow only uses up hysteresis.
    let mut scaler = LossScaler::new(&fp16(json!({"enabled": true})), ZeroStage::Weights).unwrap();
    assert!(scaler.update(true).unwrap().skipped);
    assert_eq!(
        (scaler.scale(), scaler.state().cur_hysteresis),
        (65536.0, 1)
    );
    assert!(scaler.update(true).unwrap().skipped);
    assert_eq!(scaler.scale(), 32768.0);
}

#[test]
fn stage0_ignores_hysteresis_and_floors_at_min_scale() {
    let cfg = fp16(json!({"enabled": true, "initial_scale_power": 2, "min_loss_scale": 2}));
    let mut scaler = LossScaler::new(&cfg, ZeroStage::Disabled).unwrap();
    let texts = |o: StepOutcome| o.log.into_iter().map(|l| l.text).collect::<Vec<_>>();
    assert_eq!(
        texts(scaler.update(true).unwrap()),
        [
            "\nGrad overflow on iteration 0",
            "Reducing dynamic loss scale from 4 to 2.0"
        ]
    );
    // 2.0 / 2 < 2: Python's max picks the int min_loss_scale, and the text shows it.
    assert_eq!(
        texts(scaler.update(true).unwrap())[1],
        "Reducing dynamic loss scale from 2.0 to 2"
    );
    assert_eq!(scaler.scale(), 2.0);
}

#[test]
fn static_and_unscaled_never_change_but_still_skip() {
    let mut scaler = LossScaler::new(
        &fp16(json!({"enabled": true, "loss_scale": 64})),
        ZeroStage::OptimizerStates,
    )
    .unwrap();
    assert!(!scaler.dynamic());
    let outcome = scaler.update(true).unwrap();
    assert!(outcome.skipped);
    assert_eq!(outcome.log[0].level, LogLevel::Warning);
    assert_eq!(scaler.scale(), 64.0);
    let mut off = LossScaler::new(&fp16(json!({"enabled": false})), ZeroStage::Disabled).unwrap();
    assert_eq!(off.scale(), 1.0);
    let outcome = off.update(true).unwrap();
    assert!(outcome.skipped && outcome.log.is_empty());
}

#[test]
fn state_round_trips_through_a_checkpoint() {
    let cfg = fp16(json!({"enabled": true, "loss_scale_window": 2}));
    let mut scaler = LossScaler::new(&cfg, ZeroStage::OptimizerStates).unwrap();
    for overflow in [false, false, false, true, true, false] {
        scaler.update(overflow).unwrap();
    }
    let text = serde_json::to_string(&scaler.state()).unwrap();
    let state: LossScaleState = serde_json::from_str(&text).unwrap();
    let mut resumed = LossScaler::from_state(&cfg, ZeroStage::OptimizerStates, state).unwrap();
    assert_eq!(resumed.state(), scaler.state());
    for overflow in [false, false, true, false, false, false] {
        resumed.update(overflow).unwrap();
        scaler.update(overflow).unwrap();
        assert_eq!(resumed.state(), scaler.state());
    }
}

#[test]
fn out_of_range_settings_are_errors_naming_the_key() {
    let mut cfg = fp16(json!({"enabled": true}));
    cfg.loss_scale_window = 0;
    let err = LossScaler::new(&cfg, ZeroStage::Disabled).unwrap_err();
    assert_eq!(err.path(), Some("fp16.loss_scale_window"));
    cfg.loss_scale_window = 10;
    cfg.min_loss_scale = -1;
    let err = LossScaler::new(&cfg, ZeroStage::Disabled).unwrap_err();
    assert_eq!(err.path(), Some("fp16.min_loss_scale"));
}

#[test]
fn python_number_formatting() {
    assert_eq!(py_int(65536.0), "65536");
    assert_eq!(py_int(2f64.powi(70)), "1180591620717411303424");
    assert_eq!(py_float(65536.0), "65536.0");
    assert_eq!(py_float(2f64.powi(60)), "1.152921504606847e+18");
    assert_eq!(py_float(1e16), "1e+16");
    assert_eq!(py_float(0.25), "0.25");
    assert_eq!(py_float(1.5e-5), "1.5e-05");
}
