//! Trajectories recorded from torch.optim.{AdamW, Adam, SGD} and DeepSpeed's FusedAdam /
//! DeepSpeedCPUAdam (fixtures/gen_optim_reference.py): the optimizer is built from the case's
//! ds_config section, as the engine builds it. Two checks per case:
//!   * the recorded result is within one fp32 rounding bound of the f64 reference run with the
//!     recorded optimizer's semantics (torch: betas as given; DeepSpeed: betas rounded to f32),
//!     which checks the reference against torch and DeepSpeed;
//!   * ours is within twice that bound of the recorded result (two fp32 implementations, each
//!     within one), plus, for torch's Adam, the modelled semantic gap: the difference between
//!     the f64 references with exact and with f32 betas (ds-rs follows DeepSpeed there).

use serde_json::Value as Json;

use super::reference::{self, AdamRef, SgdRef, Trajectory};
use super::{check, run_and_check, Run};
use crate::optim::build_from_section;
use ds_config::optim::TypedSection;
use ds_partition::Placement;

const FIXTURE: &str = include_str!("../fixtures/optim_reference.json");

fn floats(v: &Json) -> Vec<f64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

fn f32s(v: &Json) -> Vec<f32> {
    floats(v).into_iter().map(|x| x as f32).collect()
}

fn section(case: &Json) -> TypedSection {
    TypedSection {
        type_name: case["config"]["type"].as_str().expect("type").to_string(),
        params: Some(case["config"]["params"].clone()),
    }
}

/// The f64 reference for a case, from the same config the optimizer is built from; with
/// `f32_betas`, Adam's betas are rounded to f32 first (DeepSpeed's semantics).
fn reference_run(
    case: &Json,
    f32_betas: bool,
    p0: &[f32],
    grads: &[Vec<f32>],
    lrs: &[f64],
) -> Trajectory {
    let params = &case["config"]["params"];
    let num = |key: &str, default: f64| params[key].as_f64().unwrap_or(default);
    let momenta = case["momentum"]
        .as_array()
        .map(|_| floats(&case["momentum"]));
    let beta = |b: f64| if f32_betas { b as f32 as f64 } else { b };
    if case["config"]["type"] == "SGD" {
        let hp = SgdRef {
            momentum: num("momentum", 0.0),
            dampening: num("dampening", 0.0),
            weight_decay: num("weight_decay", 0.0),
            nesterov: params["nesterov"].as_bool().unwrap_or(false),
        };
        return reference::sgd(hp, p0, grads, lrs, momenta.as_deref());
    }
    let betas = floats(&params["betas"]);
    let hp = AdamRef {
        beta1: beta(betas[0]),
        beta2: beta(betas[1]),
        eps: num("eps", 1e-8),
        weight_decay: num("weight_decay", 0.0),
        adam_w_mode: params["adam_w_mode"].as_bool().unwrap_or(true),
    };
    reference::adam(hp, p0, grads, lrs, momenta.as_deref())
}

#[test]
fn matches_torch_and_deepspeed_trajectories() {
    let fixture: Json = serde_json::from_str(FIXTURE).expect("fixture JSON");
    let cases = fixture["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 10);
    for case in cases {
        check_case(case);
    }
}

fn check_case(case: &Json) {
    let name = case["name"].as_str().expect("name");
    let p0 = f32s(&case["params0"]);
    let grads: Vec<Vec<f32>> = case["grads"]
        .as_array()
        .expect("grads")
        .iter()
        .map(f32s)
        .collect();
    let lrs = floats(&case["lr"]);
    let theirs = reference_run(case, name.starts_with("ds_"), &p0, &grads, &lrs);
    let ours = reference_run(case, true, &p0, &grads, &lrs);
    let recorded_p = f32s(&case["params"]);
    let what = format!("{name}: recorded vs f64");
    check(&what, &recorded_p, &theirs.p, &theirs.p_bound);
    let recorded = case["state"].as_object().expect("state");
    assert_eq!(recorded.len(), theirs.names.len(), "{name}: recorded state");
    let want = Trajectory {
        p: recorded_p.iter().map(|&x| x as f64).collect(),
        names: theirs.names.clone(),
        bufs: theirs.names.iter().map(|&n| floats(&recorded[n])).collect(),
        p_bound: widen(&theirs.p_bound, &theirs.p, &ours.p),
        buf_bounds: (0..theirs.bufs.len())
            .map(|i| widen(&theirs.buf_bounds[i], &theirs.bufs[i], &ours.bufs[i]))
            .collect(),
    };
    let mut opt = build_from_section(&section(case), p0.len(), &Placement::Host).expect(name);
    let momenta = case["momentum"]
        .as_array()
        .map(|_| floats(&case["momentum"]));
    let run = Run {
        p0: &p0,
        grads: &grads,
        lrs: &lrs,
        momenta: momenta.as_deref(),
    };
    run_and_check(name, &mut *opt, &run, &want);
}

/// Twice the rounding bound plus the gap between the two semantics' f64 references.
fn widen(bound: &[f64], theirs: &[f64], ours: &[f64]) -> Vec<f64> {
    let gaps = theirs.iter().zip(ours).map(|(a, b)| (a - b).abs());
    bound
        .iter()
        .zip(gaps)
        .map(|(b, gap)| 2.0 * b + gap)
        .collect()
}
