//! Checkpoint state round trips, state sizes, building from config sections, and the errors.

use serde_json::json;

use super::{inputs, Adam, AdamParams, Optimizer, Sgd, SgdParams};
use crate::optim::{build_from_section, OptimError, OptimizerState};
use ds_config::optim::TypedSection;
use ds_config::ConfigError;
use ds_partition::Placement;

const ADAMW: AdamParams = AdamParams {
    betas: (0.9, 0.95),
    eps: 1e-8,
    weight_decay: 0.1,
    adam_w_mode: true,
    bias_correction: true,
};

fn sgd_hp(momentum: f64) -> SgdParams {
    SgdParams {
        lr: 0.1,
        momentum,
        dampening: 0.0,
        weight_decay: 1e-4,
        nesterov: true,
    }
}

/// Saving after 3 steps and loading into a fresh optimizer continues bit for bit the same.
fn round_trip(make: &dyn Fn(usize) -> Box<dyn Optimizer>, n: usize) {
    let (p0, grads) = inputs(n, 11);
    let (mut a, mut b) = (make(n), make(n));
    let mut pa = p0.clone();
    grads[..3].iter().for_each(|g| a.step(&mut pa, g, 1e-2));
    let saved: Vec<(String, Vec<f32>)> = a
        .state()
        .buffers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_vec()))
        .collect();
    let buffers = saved.iter().map(|(k, v)| (k.as_str(), &v[..])).collect();
    b.load_state(&OptimizerState {
        step: a.state().step,
        buffers,
    })
    .expect("load");
    let mut pb = pa.clone();
    for g in &grads[3..] {
        a.step(&mut pa, g, 1e-2);
        b.step(&mut pb, g, 1e-2);
    }
    assert_eq!(pa, pb, "params after reload, n={n}");
    assert_eq!(a.state(), b.state(), "state after reload, n={n}");
}

#[test]
fn state_round_trips() {
    for n in super::LENGTHS {
        round_trip(&|n| Box::new(Adam::new(ADAMW, n)), n);
        round_trip(&|n| Box::new(Sgd::new(sgd_hp(0.9), n)), n);
        round_trip(&|n| Box::new(Sgd::new(sgd_hp(0.0), n)), n);
    }
}

#[test]
fn load_errors_name_the_buffer() {
    let mut adam = Adam::new(ADAMW, 5);
    let (short, ok) = (vec![0.0; 4], vec![0.0; 5]);
    let state = |buffers| OptimizerState { step: 1, buffers };
    let err = adam.load_state(&state(vec![
        ("exp_avg", &ok[..]),
        ("exp_avg_sq", &short[..]),
    ]));
    let want = OptimError::StateLength {
        name: "exp_avg_sq".into(),
        expected: 5,
        found: 4,
    };
    assert_eq!(err, Err(want));
    let err = adam.load_state(&state(vec![("exp_avg", &ok[..])]));
    assert_eq!(err, Err(OptimError::MissingState { name: "exp_avg_sq" }));
    let err = adam
        .load_state(&state(vec![("momentum_buffer", &ok[..])]))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "optimizer state 'momentum_buffer': not a buffer of Adam"
    );
    let mut sgd = Sgd::new(sgd_hp(0.9), 5);
    let err = sgd
        .load_state(&state(vec![("momentum_buffer", &short[..])]))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("'momentum_buffer': 4 values, expected 5"),
        "{err}"
    );
}

#[test]
fn state_bytes_count_the_moments() {
    assert_eq!(Adam::new(ADAMW, 1000).state_bytes(), 8000);
    assert_eq!(Sgd::new(sgd_hp(0.9), 1000).state_bytes(), 4000);
    let mut plain = Sgd::new(sgd_hp(0.0), 1000);
    assert_eq!(plain.state_bytes(), 0);
    assert!(plain.state().buffers.is_empty());
    // OneCycle raising the momentum from 0 brings the buffer into being, as in torch.
    plain.set_momentum(0.9);
    plain.step(&mut vec![0.0; 1000], &vec![1.0; 1000], 0.1);
    assert_eq!(plain.state_bytes(), 4000);
    assert_eq!(plain.state().buffers[0].1, &vec![1.0; 1000][..]);
}

fn section(type_name: &str, params: serde_json::Value) -> TypedSection {
    TypedSection {
        type_name: type_name.into(),
        params: Some(params),
    }
}

fn config_err(type_name: &str, params: serde_json::Value) -> ConfigError {
    match build_from_section(&section(type_name, params), 3, &Placement::Host) {
        Err(OptimError::Config(e)) => e,
        Err(other) => panic!("not a config error: {other}"),
        Ok(_) => panic!("{type_name} built"),
    }
}

#[test]
fn sgd_params_parse_with_torch_defaults() {
    let hp = SgdParams::parse(Some(&json!({}))).expect("empty params");
    let want = SgdParams {
        lr: 1e-3,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    assert_eq!(hp, want);
    assert_eq!(SgdParams::parse(None), Ok(want));
    let given = json!({"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": true});
    assert_eq!(SgdParams::parse(Some(&given)), Ok(sgd_hp(0.9)));
    let built =
        build_from_section(&section("SGD", given), 3, &Placement::Host).expect("SGD builds");
    assert_eq!(built.state_bytes(), 12);
}

#[test]
fn config_errors_name_the_key() {
    let path = |e: ConfigError| e.path().map(str::to_string);
    let at = |key: &str| Some(format!("optimizer.params.{key}"));
    assert_eq!(
        path(config_err("SGD", json!({"momentum": "0.9"}))),
        at("momentum")
    );
    assert_eq!(path(config_err("SGD", json!({"lr": -1.0}))), at("lr"));
    assert_eq!(
        path(config_err("SGD", json!({"nesterov": 1}))),
        at("nesterov")
    );
    let nesterov = json!({"momentum": 0.9, "dampening": 0.1, "nesterov": true});
    assert_eq!(path(config_err("SGD", nesterov)), at("nesterov"));
    assert_eq!(
        path(config_err("SGD", json!({"maximize": true}))),
        at("maximize")
    );
    let typo = config_err("SGD", json!({"momentun": 0.9}));
    assert_eq!(path(typo.clone()), at("momentun"));
    assert!(typo.to_string().contains("momentum"), "{typo}");
    assert_eq!(
        path(config_err("SGD", json!([0.1]))).as_deref(),
        Some("optimizer.params")
    );
    assert_eq!(
        path(config_err("lamb", json!({}))).as_deref(),
        Some("optimizer.type")
    );
    assert_eq!(path(config_err("adamw", json!({"eps": "x"}))), at("eps"));
}
