//! Tests of the optimizers against independent references: a float64 implementation of the
//! formulas (`reference`, random data, awkward lengths) and trajectories recorded from torch and
//! DeepSpeed (`fixture`). Plus state round trips, config parsing and errors.

mod fixture;
mod reference;
mod state;

use super::{Adam, AdamParams, Group, GroupHyper, Optimizer, Sgd, SgdParams};
use reference::{AdamRef, SgdRef, Trajectory};

/// Lengths around the chunk (16) and block (65536) sizes, none a multiple of either.
const LENGTHS: [usize; 5] = [0, 1, 7, 1000, 100_003];
const STEPS: usize = 10;

/// Deterministic data: uniform in [-scale, scale), from splitmix64.
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The learning rates of a warm-up: different every step, so a kernel ignoring `lr` fails.
fn lrs(base: f64) -> Vec<f64> {
    (1..=STEPS)
        .map(|t| base * t as f64 / STEPS as f64)
        .collect()
}

/// Asserts |got - want| <= bound elementwise; returns the largest error / bound.
fn check(what: &str, got: &[f32], want: &[f64], bound: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst: f64 = 0.0;
    for (i, ((&g, &w), &b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= b,
            "{what}[{i}]: got {g}, want {w}, |diff| {err:e} > bound {b:e}"
        );
        worst = worst.max(err / b.max(f64::MIN_POSITIVE));
    }
    worst
}

/// The inputs of a trajectory; `momenta[t]`, if given, is set before step t + 1 (OneCycle).
struct Run<'a> {
    p0: &'a [f32],
    grads: &'a [Vec<f32>],
    lrs: &'a [f64],
    momenta: Option<&'a [f64]>,
}

/// Runs an optimizer over the steps and checks params and state against a trajectory.
fn run_and_check(name: &str, opt: &mut dyn Optimizer, run: &Run, want: &Trajectory) {
    let mut p = run.p0.to_vec();
    for (t, (g, &lr)) in run.grads.iter().zip(run.lrs).enumerate() {
        if let Some(m) = run.momenta {
            opt.set_momentum(m[t]);
        }
        opt.step(&mut p, g, lr);
    }
    let mut worst = check(&format!("{name} params"), &p, &want.p, &want.p_bound);
    let state = opt.state();
    assert_eq!(state.step, run.grads.len() as u64);
    let names: Vec<&str> = state.buffers.iter().map(|b| b.0).collect();
    assert_eq!(names, want.names, "{name}: state buffers");
    for (i, (buf_name, buf)) in state.buffers.iter().enumerate() {
        let what = format!("{name} {buf_name}");
        worst = worst.max(check(&what, buf, &want.bufs[i], &want.buf_bounds[i]));
    }
    eprintln!("{name}: largest error / bound = {worst:.3}");
}

fn inputs(n: usize, seed: u64) -> (Vec<f32>, Vec<Vec<f32>>) {
    let p0 = random(n, seed, 1.0);
    let grads = (0..STEPS)
        .map(|t| random(n, seed * 100 + t as u64, 0.5))
        .collect();
    (p0, grads)
}

#[test]
fn adam_matches_f64_reference_at_all_lengths() {
    for (adam_w_mode, beta2) in [(true, 0.95), (false, 0.999)] {
        let hp = AdamParams {
            betas: (0.9, beta2),
            eps: 1e-8,
            weight_decay: 0.1,
            adam_w_mode,
            bias_correction: true,
        };
        // DeepSpeed's semantics: the betas are f32.
        let r = AdamRef {
            beta1: 0.9f32 as f64,
            beta2: beta2 as f32 as f64,
            eps: 1e-8,
            weight_decay: 0.1,
            adam_w_mode,
        };
        for n in LENGTHS {
            let (p0, grads) = inputs(n, 1 + n as u64);
            let lrs = lrs(1e-2);
            let want = reference::adam(r, &p0, &grads, &lrs, None);
            let name = format!("adam w={adam_w_mode} n={n}");
            let run = Run {
                p0: &p0,
                grads: &grads,
                lrs: &lrs,
                momenta: None,
            };
            run_and_check(&name, &mut Adam::new(hp, n), &run, &want);
        }
    }
}

#[test]
fn sgd_matches_f64_reference_at_all_lengths() {
    let cases = [
        (0.9, 0.1, 1e-3, false),
        (0.9, 0.0, 1e-3, true),
        (0.0, 0.0, 0.0, false),
    ];
    for (momentum, dampening, weight_decay, nesterov) in cases {
        let hp = SgdParams {
            lr: 0.1,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        let r = SgdRef {
            momentum,
            dampening,
            weight_decay,
            nesterov,
        };
        for n in LENGTHS {
            let (p0, grads) = inputs(n, 7 + n as u64);
            let lrs = lrs(0.05);
            let want = reference::sgd(r, &p0, &grads, &lrs, None);
            let name = format!("sgd mu={momentum} nesterov={nesterov} n={n}");
            let run = Run {
                p0: &p0,
                grads: &grads,
                lrs: &lrs,
                momenta: None,
            };
            run_and_check(&name, &mut Sgd::new(hp, n), &run, &want);
        }
    }
}

/// Elements come out the same whether they fall in a SIMD chunk, the scalar tail or another
/// rayon block: a prefix run alone must equal the same prefix of a long run, bit for bit.
#[test]
fn results_do_not_depend_on_position_or_length() {
    let hp = AdamParams {
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
        adam_w_mode: true,
        bias_correction: true,
    };
    let n = 100_003;
    let (p0, grads) = inputs(n, 3);
    let mut long = p0.clone();
    let mut opt = Adam::new(hp, n);
    grads.iter().for_each(|g| opt.step(&mut long, g, 1e-3));
    for len in [1, 7, 1000, 65_537] {
        let mut short = p0[..len].to_vec();
        let mut opt = Adam::new(hp, len);
        grads
            .iter()
            .for_each(|g| opt.step(&mut short, &g[..len], 1e-3));
        assert!(
            short
                .iter()
                .zip(&long)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "len {len}"
        );
    }
}

/// A step applied part by part (`begin`, then `update` on consecutive parts, as the engine
/// does to avoid a whole-shard fp32 gradient) equals the whole-shard step, bit for bit.
#[test]
fn a_step_in_parts_equals_the_whole_step() {
    let n = 100_003;
    let (p0, grads) = inputs(n, 5);
    let adam = AdamParams {
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.01,
        adam_w_mode: true,
        bias_correction: true,
    };
    let sgd = SgdParams {
        lr: 1e-3,
        momentum: 0.9,
        dampening: 0.1,
        weight_decay: 0.01,
        nesterov: false,
    };
    type Maker = fn(AdamParams, SgdParams, usize) -> Box<dyn Optimizer>;
    let makers: [(&str, Maker); 2] = [
        ("adam", |a, _, n| Box::new(Adam::new(a, n))),
        ("sgd", |_, s, n| Box::new(Sgd::new(s, n))),
    ];
    for (name, make) in makers {
        let (mut whole, mut parts) = (p0.clone(), p0.clone());
        let (mut a, mut b) = (make(adam, sgd, n), make(adam, sgd, n));
        for g in &grads {
            a.step(&mut whole, g, 1e-3);
            b.begin(1e-3);
            for (at, end) in [(0, 1), (1, 999), (999, 70_000), (70_000, n)] {
                b.update(at, &mut parts[at..end], &g[at..end], Group::DEFAULT);
            }
        }
        let same = whole
            .iter()
            .zip(&parts)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{name}: the step in parts differs");
    }
}

#[test]
fn bench_runs_and_reports() {
    let r = super::bench_adam(10_000, 3, 1);
    assert_eq!((r.n_params, r.iters), (10_000, 3));
    assert!(r.min_ms <= r.median_ms && r.median_ms <= r.max_ms);
    assert!(r.effective_gbs > 0.0 && r.effective_gbs.is_finite());
    let c = super::bench_convert::<half::f16>(10_000, 3, 1, half::f16::to_f32, half::f16::from_f32);
    assert_eq!(c.n_params, 10_000);
    let times = [c.grads_ms, c.publish_ms, c.half_grads_ms, c.half_publish_ms];
    assert!(times.iter().all(|t| *t >= 0.0 && t.is_finite()), "{c:?}");
}

/// `bias_correction: false` (FusedAdam's and DeepSpeedCPUAdam's switch): the first step is
/// `lr * m / (sqrt(v) + eps)` with the raw moments, against float64; and a part without
/// weight decay (`GroupHyper::NO_DECAY`) takes no decay, and one of another group takes that
/// group's decay at its learning rate, while the rest takes the optimizer's.
#[test]
fn bias_correction_off_and_parts_in_other_groups() {
    let (lr, b1, b2, eps, wd) = (1e-2f64, 0.9f64, 0.99f64, 1e-8f64, 0.5f64);
    let hp = AdamParams {
        betas: (b1, b2),
        eps,
        weight_decay: wd,
        adam_w_mode: true,
        bias_correction: false,
    };
    let p0 = [1.0f32, -2.0, 0.5, 3.0];
    let g = [0.3f32, -0.1, 0.2, 0.05];
    let mut adam = Adam::new(hp, 4);
    let slow = GroupHyper {
        weight_decay: Some(0.1),
        lr_scale: 0.25,
    };
    adam.set_groups(vec![GroupHyper::DEFAULT, GroupHyper::NO_DECAY, slow]);
    let mut p = p0;
    adam.begin(lr);
    adam.update(0, &mut p[..2], &g[..2], Group::DEFAULT);
    adam.update(2, &mut p[2..3], &g[2..3], Group(1));
    adam.update(3, &mut p[3..], &g[3..], Group(2));
    for i in 0..4 {
        let (x, gi) = (f64::from(p0[i]), f64::from(g[i]));
        let (m, v) = ((1.0 - b1) * gi, (1.0 - b2) * gi * gi);
        let (lr, wd) = match i {
            0 | 1 => (lr, wd),
            2 => (lr, 0.0),
            _ => (lr * 0.25, 0.1),
        };
        let want = x * (1.0 - lr * wd) - lr * m / (v.sqrt() + eps);
        // f32 arithmetic of a handful of operations on values near 1
        assert!(
            (f64::from(p[i]) - want).abs() < 1e-6,
            "{i}: {} vs {want}",
            p[i]
        );
    }
}
