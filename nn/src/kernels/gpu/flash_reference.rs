//! Causal attention in f64 from its definition, the independent reference of the flash
//! kernels' tests (on the emulator here, on a GPU in tests/gpu_kernels.rs), with a bound on
//! each output's error for a kernel that rounds as kernels/flash.cu does.
//!
//! The bounds follow the kernel's roundings. `u` is the storage type's unit roundoff (2^-8
//! bf16, 2^-11 f16); EPS = 1e-5 covers f32 sums of up to a few hundred terms (n 2^-24) and the
//! f32 exp and log.
//! - out: P is rounded before P V, O is divided by the unrounded sum and rounded once:
//!   |err| <= u sum_j P_j |v_j| + u |out|.
//! - D = dO . out reads the kernel's rounded output: |err_D| <= sum_e |dO_e| bound(out_e).
//! - dS = P (dP - D) in f32, rounded: |err_dS| <= P err_D + u |dS| (+ EPS P (|dP| + |D|), and
//!   the f32 recomputation of P, EPS P |dP - D| (1 + |lse| + scale sum|q||k|)).
//! - dV = sum_i P dO (P rounded), dK = scale sum_i dS q, dQ = scale sum_j dS k: the sum of the
//!   terms' errors, and u of the result for its rounding.

use candle_core::{DType, Device, Tensor};

/// A test's shapes: q|k|v `fused` as GPT's projection [B, T, 3, H, hd] (then g = h), or
/// separate q [B, H, T, hd] and k, v [B, G, T, hd] as Llama's; a sliding `window` (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub b: usize,
    pub h: usize,
    pub g: usize,
    pub t: usize,
    pub hd: usize,
    pub window: usize,
    pub fused: bool,
    pub dtype: DType,
}

impl Case {
    pub fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }

    /// A fused [B, T, 3, H, hd] (any float dtype, any device) as three [B, H, T, hd].
    pub fn split_fused(&self, qkv: &Tensor) -> [Tensor; 3] {
        let heads = qkv
            .reshape((self.b, self.t, 3, self.h, self.hd))
            .and_then(|t| t.permute((2, 0, 3, 1, 4)))
            .unwrap();
        [0, 1, 2].map(|i| heads.get(i).and_then(|t| t.contiguous()).unwrap())
    }

    /// The reference for q, k and v [B, H or G, T, hd] and the output's gradient dout
    /// [B, T, H hd], as stored in this case's dtype.
    pub fn reference(&self, [q, k, v]: &[Tensor; 3], dout: &Tensor) -> Reference {
        let u = match self.dtype {
            DType::BF16 => 2f64.powi(-8),
            _ => 2f64.powi(-11),
        };
        let problem = Problem {
            b: self.b,
            h: self.h,
            g: self.g,
            t: self.t,
            hd: self.hd,
            scale: self.scale() as f64,
            window: self.window,
            q: f64s(q),
            k: f64s(k),
            v: f64s(v),
            dout: f64s(dout),
        };
        reference(&problem, u)
    }

    /// `what` and the shape, one word: WHAT_hHgGtThdHD.
    pub fn name(&self, what: &str) -> String {
        let c = self;
        format!("{what}_h{}g{}t{}hd{}", c.h, c.g, c.t, c.hd)
    }
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .and_then(|t| t.to_device(&Device::Cpu))
        .and_then(|t| t.to_dtype(DType::F64))
        .and_then(|t| t.to_vec1())
        .unwrap()
}

/// One call's inputs, as f64: q [B, H, T, hd], k and v [B, G, T, hd], dout [B, T, H, hd].
pub struct Problem {
    pub b: usize,
    pub h: usize,
    pub g: usize,
    pub t: usize,
    pub hd: usize,
    pub scale: f64,
    /// 0: every earlier key; else the last `window` keys.
    pub window: usize,
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub dout: Vec<f64>,
}

/// Reference values and their error bounds, in one layout.
#[derive(Default)]
pub struct Expect {
    pub value: Vec<f64>,
    pub bound: Vec<f64>,
}

impl Expect {
    fn zeros(n: usize) -> Expect {
        Expect {
            value: vec![0.0; n],
            bound: vec![0.0; n],
        }
    }

    /// Panics naming the first element of `got` outside its bound; returns the largest
    /// difference as a fraction of its bound.
    pub fn check(&self, what: &str, got: &[f32]) -> f64 {
        assert_eq!(got.len(), self.value.len(), "{what}: lengths");
        let mut worst = 0f64;
        for (i, ((&g, &w), &b)) in got.iter().zip(&self.value).zip(&self.bound).enumerate() {
            let d = (g as f64 - w).abs();
            assert!(d <= b, "{what}[{i}]: {g} against {w}, bound {b:.3e}");
            worst = worst.max(d / b);
        }
        worst
    }
}

/// out [B, T, H, hd], lse [B, H, T]; dq [B, H, T, hd]; dk, dv [B, G, T, hd].
pub struct Reference {
    pub out: Expect,
    pub lse: Expect,
    pub dq: Expect,
    pub dk: Expect,
    pub dv: Expect,
}

const EPS: f64 = 1e-5;

impl Problem {
    fn seen(&self, i: usize, j: usize) -> bool {
        j <= i && (self.window == 0 || j + self.window > i)
    }
    fn q_row(&self, b: usize, h: usize, i: usize) -> &[f64] {
        let at = ((b * self.h + h) * self.t + i) * self.hd;
        &self.q[at..at + self.hd]
    }
    fn kv_at(&self, b: usize, g: usize, j: usize) -> usize {
        ((b * self.g + g) * self.t + j) * self.hd
    }
    fn out_at(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.t + i) * self.h + h) * self.hd
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
fn abs_dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum()
}

/// The reference for storage with unit roundoff `u`.
pub fn reference(p: &Problem, u: f64) -> Reference {
    let (hd, t) = (p.hd, p.t);
    let mut r = Reference {
        out: Expect::zeros(p.b * t * p.h * hd),
        lse: Expect::zeros(p.b * p.h * t),
        dq: Expect::zeros(p.q.len()),
        dk: Expect::zeros(p.k.len()),
        dv: Expect::zeros(p.v.len()),
    };
    for b in 0..p.b {
        for h in 0..p.h {
            let g = h / (p.h / p.g);
            for i in 0..t {
                row(p, u, (b, h, g, i), &mut r);
            }
        }
    }
    for x in [&mut r.dq, &mut r.dk, &mut r.dv] {
        for (bound, value) in x.bound.iter_mut().zip(&x.value) {
            *bound += u * value.abs();
        }
    }
    r
}

/// Query row i of head h: its output and log-sum-exp, and its terms of dq, dk and dv.
fn row(p: &Problem, u: f64, (b, h, g, i): (usize, usize, usize, usize), r: &mut Reference) {
    let (hd, scale) = (p.hd, p.scale);
    let qi = p.q_row(b, h, i);
    let keys: Vec<usize> = (0..=i).filter(|&j| p.seen(i, j)).collect();
    let s: Vec<f64> = keys
        .iter()
        .map(|&j| scale * dot(qi, &p.k[p.kv_at(b, g, j)..][..hd]))
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
    let lse = m + sum.ln();
    let probs: Vec<f64> = s.iter().map(|x| (x - lse).exp()).collect();
    let li = (b * p.h + h) * p.t + i;
    r.lse.value[li] = lse;
    r.lse.bound[li] = EPS * (1.0 + lse.abs());

    let oa = p.out_at(b, h, i);
    for e in 0..hd {
        let (mut o, mut a) = (0.0, 0.0);
        for (&j, &pj) in keys.iter().zip(&probs) {
            let vj = p.v[p.kv_at(b, g, j) + e];
            o += pj * vj;
            a += pj * vj.abs();
        }
        r.out.value[oa + e] = o;
        r.out.bound[oa + e] = (u + EPS) * a + u * o.abs();
    }
    let dout = &p.dout[oa..oa + hd];
    let out = &r.out.value[oa..oa + hd];
    let d = dot(dout, out);
    let err_d = abs_dot(dout, &r.out.bound[oa..oa + hd]) + EPS * abs_dot(dout, out);

    let qa = ((b * p.h + h) * p.t + i) * hd;
    for (&j, &pj) in keys.iter().zip(&probs) {
        let ka = p.kv_at(b, g, j);
        let (kj, vj) = (&p.k[ka..ka + hd], &p.v[ka..ka + hd]);
        let dp = dot(dout, vj);
        let ds = pj * (dp - d);
        // P's f32 recomputation from the f32 log-sum-exp and scores
        let p_rel = EPS * (1.0 + lse.abs() + scale * abs_dot(qi, kj));
        let err_ds = pj * err_d
            + u * ds.abs()
            + EPS * pj * (abs_dot(dout, vj) + d.abs())
            + p_rel * pj * (dp - d).abs();
        for e in 0..hd {
            r.dv.value[ka + e] += pj * dout[e];
            r.dv.bound[ka + e] += (u + p_rel + EPS) * pj * dout[e].abs();
            r.dk.value[ka + e] += scale * ds * qi[e];
            r.dk.bound[ka + e] += scale * (err_ds + EPS * ds.abs()) * qi[e].abs();
            r.dq.value[qa + e] += scale * ds * kj[e];
            r.dq.bound[qa + e] += scale * (err_ds + EPS * ds.abs()) * kj[e].abs();
        }
    }
}
