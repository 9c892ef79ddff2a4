//! Float64 reference optimizers, written from the textbook formulas (not from the kernels), with
//! a running rounding-error bound for an fp32 implementation of the same update.
//!
//! The bound follows the usual running-error analysis: every fp32 operation rounds with
//! relative error <= u = 2^-24 (= EPS / 2), and a sum's rounding is relative to the sum of the
//! magnitudes of its terms, not to the (possibly cancelled) result. So each quantity `x` gets a
//! magnitude `|x|~` computed with all terms made positive, and per step
//!   * `p` takes <= 2 roundings on its own magnitude (scale and add): EPS * |p|;
//!   * the update `lr * m_hat / (sqrt(v_hat) + eps)` carries the relative error of m (an
//!     exponential average: <= 3u per step, decaying by beta1, so <= 3u / (1 - beta1) = 30u for
//!     beta1 = 0.9), half that of v, and ~8 more roundings (sqrt, scale, eps, div, step size and
//!     the f32 constants): 16 EPS * |update|~ covers this with room to spare.
//!
//! The bound for a trajectory is the sum over steps; tests compare against it, and against twice
//! it when both sides are fp32 implementations (ours and torch's each within their own).

pub const EPS: f64 = f32::EPSILON as f64;

/// Adam hyper-parameters in f64. DeepSpeed's semantics (what ds-rs implements) are those of
/// the betas rounded to f32 first; torch's are those of the betas as given.
#[derive(Clone, Copy)]
pub struct AdamRef {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub adam_w_mode: bool,
}

/// Per-element f64 trajectory: parameters, moments, and the error bound on `p`, `m`, `v`.
#[derive(Clone)]
pub struct Trajectory {
    pub p: Vec<f64>,
    /// The state buffers' names, as torch and our optimizers call them.
    pub names: Vec<&'static str>,
    pub bufs: Vec<Vec<f64>>,
    pub p_bound: Vec<f64>,
    pub buf_bounds: Vec<Vec<f64>>,
}

/// One element's f64 Adam state, with the magnitude of m and the accumulated bound on p.
#[derive(Clone, Copy, Default)]
struct AdamElem {
    p: f64,
    m: f64,
    v: f64,
    m_abs: f64,
    p_bound: f64,
}

impl AdamElem {
    /// Step `t` (from 1) with the textbook formulas: m_hat / (sqrt(v_hat) + eps).
    fn step(&mut self, hp: &AdamRef, g: f64, lr: f64, beta1: f64, t: i32) {
        let (mut g, mut g_abs) = (g, g.abs());
        if hp.adam_w_mode {
            self.p *= 1.0 - lr * hp.weight_decay;
        } else {
            g += hp.weight_decay * self.p;
            g_abs += hp.weight_decay * self.p.abs();
        }
        self.m = beta1 * self.m + (1.0 - beta1) * g;
        self.m_abs = beta1 * self.m_abs + (1.0 - beta1) * g_abs;
        self.v = hp.beta2 * self.v + (1.0 - hp.beta2) * g * g;
        let (bc1, bc2) = (1.0 - beta1.powi(t), 1.0 - hp.beta2.powi(t));
        let denom = (self.v / bc2).sqrt() + hp.eps;
        self.p -= lr * (self.m / bc1) / denom;
        let update_abs = lr * (self.m_abs / bc1) / denom;
        self.p_bound += EPS * self.p.abs() + 16.0 * EPS * update_abs;
    }
}

/// Runs Adam for `grads.len()` steps; `lrs[t]` and `beta1s[t]` (if given) for step t + 1.
pub fn adam(
    hp: AdamRef,
    p0: &[f32],
    grads: &[Vec<f32>],
    lrs: &[f64],
    beta1s: Option<&[f64]>,
) -> Trajectory {
    let init = |&p: &f32| AdamElem {
        p: p as f64,
        ..AdamElem::default()
    };
    let mut elems: Vec<AdamElem> = p0.iter().map(init).collect();
    for (t, g) in grads.iter().enumerate() {
        let beta1 = beta1s.map_or(hp.beta1, |b| b[t]);
        for (e, &g) in elems.iter_mut().zip(g) {
            e.step(&hp, g as f64, lrs[t], beta1, t as i32 + 1);
        }
    }
    let all = |f: fn(&AdamElem) -> f64| elems.iter().map(f).collect::<Vec<f64>>();
    Trajectory {
        p: all(|e| e.p),
        names: vec!["exp_avg", "exp_avg_sq"],
        bufs: vec![all(|e| e.m), all(|e| e.v)],
        p_bound: all(|e| e.p_bound),
        buf_bounds: vec![all(|e| 16.0 * EPS * e.m_abs), all(|e| 16.0 * EPS * e.v)],
    }
}

/// SGD hyper-parameters in f64.
#[derive(Clone, Copy)]
pub struct SgdRef {
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

/// One element's f64 SGD state, with the magnitude of the buffer and the bound on p.
#[derive(Clone, Copy, Default)]
struct SgdElem {
    p: f64,
    b: f64,
    b_abs: f64,
    p_bound: f64,
}

impl SgdElem {
    /// torch's step; `first` when the buffer does not exist yet (it is then set to d).
    fn step(&mut self, hp: &SgdRef, g: f64, lr: f64, mu: f64, first: bool) {
        let d = g + hp.weight_decay * self.p;
        let d_abs = g.abs() + hp.weight_decay * self.p.abs();
        let (mut step, mut step_abs) = (d, d_abs);
        if mu != 0.0 {
            (self.b, self.b_abs) = match first {
                true => (d, d_abs),
                false => {
                    let keep = 1.0 - hp.dampening;
                    (mu * self.b + keep * d, mu * self.b_abs + keep * d_abs)
                }
            };
            (step, step_abs) = match hp.nesterov {
                true => (d + mu * self.b, d_abs + mu * self.b_abs),
                false => (self.b, self.b_abs),
            };
        }
        self.p -= lr * step;
        self.p_bound += EPS * self.p.abs() + 16.0 * EPS * lr * step_abs;
    }
}

/// Runs torch's SGD; `momenta[t]` (if given) overrides the momentum of step t + 1. The
/// momentum buffer is returned (as torch keeps it) once a step ran with momentum != 0.
pub fn sgd(
    hp: SgdRef,
    p0: &[f32],
    grads: &[Vec<f32>],
    lrs: &[f64],
    momenta: Option<&[f64]>,
) -> Trajectory {
    let init = |&p: &f32| SgdElem {
        p: p as f64,
        ..SgdElem::default()
    };
    let mut elems: Vec<SgdElem> = p0.iter().map(init).collect();
    let mut has_buf = false;
    for (t, g) in grads.iter().enumerate() {
        let mu = momenta.map_or(hp.momentum, |m| m[t]);
        for (e, &g) in elems.iter_mut().zip(g) {
            e.step(&hp, g as f64, lrs[t], mu, !has_buf);
        }
        has_buf |= mu != 0.0;
    }
    let all = |f: fn(&SgdElem) -> f64| elems.iter().map(f).collect::<Vec<f64>>();
    let (names, bufs, buf_bounds) = match has_buf {
        true => (
            vec!["momentum_buffer"],
            vec![all(|e| e.b)],
            vec![all(|e| 16.0 * EPS * e.b_abs)],
        ),
        false => (Vec::new(), Vec::new(), Vec::new()),
    };
    Trajectory {
        p: all(|e| e.p),
        names,
        bufs,
        p_bound: all(|e| e.p_bound),
        buf_bounds,
    }
}
