//! Adam / AdamW as DeepSpeed's CPU Adam (`cpu_adam` and the CPU `fused_adam` op) computes it:
//! bias correction always on, `denom = sqrt(v) / sqrt(1 - beta2^t) + eps`,
//! `p -= lr / (1 - beta1^t) * m / denom`; weight decay either decoupled (`adam_w_mode`,
//! `p *= 1 - lr * wd`, torch's AdamW) or L2 (`g += wd * p`, torch's Adam).

use ds_partition::{FlatBuf, Placement};
use rayon::prelude::*;

use super::{check_len, Group, GroupHyper, OptimError, Optimizer, OptimizerState, BLOCK, LANES};

/// Adam's hyper-parameters other than the learning rate (which comes with every step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// Decoupled weight decay (AdamW, DeepSpeed's default) rather than L2 added to the gradient.
    pub adam_w_mode: bool,
    /// Divide by `1 - beta^t` (DeepSpeed's `bias_correction`, on by default); off, the step
    /// is `lr * m / (sqrt(v) + eps)`.
    pub bias_correction: bool,
}

/// Adam over one shard: first and second moments in fp32, as DeepSpeed keeps them.
#[derive(Debug)]
pub struct Adam {
    hp: AdamParams,
    step: u64,
    exp_avg: FlatBuf<f32>,
    exp_avg_sq: FlatBuf<f32>,
    /// The parameter groups' settings (`Optimizer::set_groups`; one group: Adam's own).
    groups: Vec<GroupHyper>,
    /// The scalars of the step begun last, one set per group.
    consts: Vec<Consts>,
}

/// The per-step scalars, as DeepSpeed's Adam kernels (CPU and CUDA) have them: the betas are
/// C++ floats, so `1 - beta` is taken from the f32 beta (for beta2 = 0.999 that is 1.3e-5 off
/// torch's double `1 - beta2`), and the bias corrections are powers of the f32 betas computed in
/// double. Each scalar is rounded to f32 once; the inner loop is pure f32 mul/add/sqrt/div.
#[derive(Debug, Clone, Copy)]
#[repr(C)] // kernels/adam.cu takes it as its `Consts`, field for field
pub(super) struct Consts {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// 1 / sqrt(1 - beta2^t)
    inv_sqrt_bc2: f32,
    eps: f32,
    /// L2 mode: added to the gradient as `wd * p`; 0 in AdamW mode.
    l2: f32,
    /// AdamW mode: `1 - lr * wd`; 1 in L2 mode.
    decay: f32,
    /// -lr / (1 - beta1^t)
    neg_step_size: f32,
}

impl Consts {
    fn new(hp: &AdamParams, step: u64, lr: f64, weight_decay: f64) -> Consts {
        let (b1, b2) = (hp.betas.0 as f32, hp.betas.1 as f32);
        // powi takes i32; beyond that beta^t has long been 0 for any beta < 1.
        let t = i32::try_from(step).unwrap_or(i32::MAX);
        let (bc1, bc2) = match hp.bias_correction {
            true => (1.0 - f64::from(b1).powi(t), 1.0 - f64::from(b2).powi(t)),
            false => (1.0, 1.0),
        };
        let (l2, decay) = match hp.adam_w_mode {
            true => (0.0, 1.0 - lr * weight_decay),
            false => (weight_decay, 1.0),
        };
        Consts {
            beta1: b1,
            one_minus_beta1: 1.0 - b1,
            beta2: b2,
            one_minus_beta2: 1.0 - b2,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            eps: hp.eps as f32,
            l2: l2 as f32,
            decay: decay as f32,
            neg_step_size: (-lr / bc1) as f32,
        }
    }
}

impl Adam {
    /// Zeroed moments in host memory for a shard of `shard_len` elements.
    pub fn new(hp: AdamParams, shard_len: usize) -> Adam {
        Adam::placed(hp, shard_len, &Placement::Host).expect("host memory")
    }

    /// Zeroed moments at `place` (beside the master copy they update).
    pub fn placed(hp: AdamParams, shard_len: usize, place: &Placement) -> Result<Adam, OptimError> {
        let zeroed =
            || FlatBuf::zeroed(place, shard_len).map_err(|e| OptimError::Device(e.to_string()));
        Ok(Adam {
            hp,
            step: 0,
            exp_avg: zeroed()?,
            exp_avg_sq: zeroed()?,
            groups: vec![GroupHyper::DEFAULT],
            consts: Vec::new(),
        })
    }
}

impl Optimizer for Adam {
    fn set_groups(&mut self, groups: Vec<GroupHyper>) {
        self.groups = groups;
    }

    fn begin(&mut self, lr: f64) {
        self.step += 1;
        let (hp, step) = (&self.hp, self.step);
        self.consts = self
            .groups
            .iter()
            .map(|g| {
                let wd = g.weight_decay.unwrap_or(hp.weight_decay);
                Consts::new(hp, step, lr * g.lr_scale, wd)
            })
            .collect();
    }

    fn update(&mut self, at: usize, params: &mut [f32], grads: &[f32], group: Group) {
        let n = params.len();
        assert_eq!(
            grads.len(),
            n,
            "Adam::update: grads length != params length"
        );
        let k = *self
            .consts
            .get(group.0)
            .expect("Adam::update: begin() first, with the part's group");
        let m = &mut self.exp_avg[at..at + n];
        let v = &mut self.exp_avg_sq[at..at + n];
        if n <= BLOCK {
            return dispatch_block(&k, params, grads, m, v);
        }
        params
            .par_chunks_mut(BLOCK)
            .zip(grads.par_chunks(BLOCK))
            .zip(m.par_chunks_mut(BLOCK))
            .zip(v.par_chunks_mut(BLOCK))
            .for_each(|(((p, g), m), v)| dispatch_block(&k, p, g, m, v));
    }

    #[cfg(feature = "cuda")]
    fn update_on_gpu(
        &mut self,
        at: usize,
        params: &mut [f32],
        grads: super::TypedGrads<'_>,
        k: f32,
        group: Group,
    ) -> Result<bool, OptimError> {
        let consts = *self
            .consts
            .get(group.0)
            .expect("Adam::update_on_gpu: begin() first, with the part's group");
        let n = params.len();
        super::gpu::adam(
            params,
            grads,
            &mut self.exp_avg[at..at + n],
            &mut self.exp_avg_sq[at..at + n],
            k,
            consts,
        )
    }

    fn shard_len(&self) -> usize {
        self.exp_avg.len()
    }

    fn state_bytes(&self) -> usize {
        self.exp_avg.bytes() + self.exp_avg_sq.bytes()
    }

    fn state(&self) -> OptimizerState<'_> {
        OptimizerState {
            step: self.step,
            buffers: vec![
                ("exp_avg", &*self.exp_avg),
                ("exp_avg_sq", &*self.exp_avg_sq),
            ],
        }
    }

    fn state_names(&self) -> Vec<&'static str> {
        vec!["exp_avg", "exp_avg_sq"]
    }

    fn state_mut(&mut self) -> Vec<&mut [f32]> {
        vec![&mut *self.exp_avg, &mut *self.exp_avg_sq]
    }

    fn load_state(&mut self, state: &OptimizerState<'_>) -> Result<(), OptimError> {
        let n = self.exp_avg.len();
        let (mut m, mut v) = (None, None);
        for &(name, buf) in &state.buffers {
            let slot = match name {
                "exp_avg" => &mut m,
                "exp_avg_sq" => &mut v,
                _ => return Err(unknown(name)),
            };
            check_len(name, buf, n)?;
            *slot = Some(buf);
        }
        let m = m.ok_or(OptimError::MissingState { name: "exp_avg" })?;
        let v = v.ok_or(OptimError::MissingState { name: "exp_avg_sq" })?;
        self.exp_avg.copy_from_slice(m);
        self.exp_avg_sq.copy_from_slice(v);
        self.step = state.step;
        Ok(())
    }

    /// OneCycle's momentum is Adam's beta1; bias correction then uses the new beta1^t, as torch
    /// and DeepSpeed's `IncrementStep` do.
    fn set_momentum(&mut self, momentum: f64) {
        self.hp.betas.0 = momentum;
    }
}

fn unknown(name: &str) -> OptimError {
    OptimError::UnknownState {
        name: name.to_string(),
        optimizer: "Adam",
    }
}

/// One block through the widest kernel this CPU runs. Baseline x86-64 code is SSE2 only, and
/// with 4-wide sqrt and div one thread is compute-bound, slower than DeepSpeed's AVX2 build (see
/// NOTES.md); the AVX2 copy of the same code closes that. Both copies perform the same IEEE
/// operations (no FMA contraction), so results are bitwise identical across CPUs.
fn dispatch_block(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { update_block_avx2(k, p, g, m, v) };
    }
    update_block(k, p, g, m, v)
}

/// `update_block` compiled with AVX2 enabled (it is inlined here, so LLVM uses 8-wide ops).
///
/// # Safety
/// The CPU must support AVX2. (An `unsafe fn` rather than a safe `#[target_feature]` fn, which
/// needs Rust 1.86; the workspace's rust-version is 1.80.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn update_block_avx2(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    update_block(k, p, g, m, v)
}

/// The fused update of one block: a short head up to a 32-byte boundary of `p`, LANES-wide
/// chunks the vectoriser turns into SIMD, then the (< LANES) tail. Head and tail go through the
/// same element function, so results do not depend on position. The head matters because
/// malloc returns 16 mod 64 aligned buffers: without it every other 32-byte access in the
/// AVX2 loop splits a cache line.
#[inline(always)]
fn update_block(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let head = p.as_ptr().align_offset(32).min(p.len());
    let (p_head, p) = p.split_at_mut(head);
    let (m_head, m) = m.split_at_mut(head);
    let (v_head, v) = v.split_at_mut(head);
    let (g_head, g) = g.split_at(head);
    elementwise(k, p_head, g_head, m_head, v_head);
    let mut pc = p.chunks_exact_mut(LANES);
    let mut gc = g.chunks_exact(LANES);
    let mut mc = m.chunks_exact_mut(LANES);
    let mut vc = v.chunks_exact_mut(LANES);
    for (((p, g), m), v) in (&mut pc).zip(&mut gc).zip(&mut mc).zip(&mut vc) {
        for i in 0..LANES {
            update(k, &mut p[i], g[i], &mut m[i], &mut v[i]);
        }
    }
    let (p, g) = (pc.into_remainder(), gc.remainder());
    elementwise(k, p, g, mc.into_remainder(), vc.into_remainder());
}

/// Element by element, for the head and tail of a block.
#[inline(always)]
fn elementwise(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let all = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
    for (((p, g), m), v) in all {
        update(k, p, *g, m, v);
    }
}

/// One element, in DeepSpeed's order of operations (without its FMAs, which baseline x86-64
/// lacks: each product is rounded, a difference of one rounding per operation).
#[inline(always)]
fn update(k: &Consts, p: &mut f32, g: f32, m: &mut f32, v: &mut f32) {
    let g = g + k.l2 * *p;
    let m_new = k.beta1 * *m + k.one_minus_beta1 * g;
    let v_new = k.beta2 * *v + k.one_minus_beta2 * (g * g);
    let denom = v_new.sqrt() * k.inv_sqrt_bc2 + k.eps;
    *p = *p * k.decay + k.neg_step_size * (m_new / denom);
    *m = m_new;
    *v = v_new;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 copy and the portable code give the same bits (no FMA contraction in either),
    /// so a checkpoint continues identically on CPUs with and without AVX2.
    #[test]
    fn simd_dispatch_matches_portable_code_bitwise() {
        let hp = AdamParams {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.1,
            adam_w_mode: false,
            bias_correction: true,
        };
        let n = 1003;
        let init: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let grad: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 997) as f32 / 997.0 - 0.5)
            .collect();
        let (mut a, mut b) = (
            [init.clone(), vec![0.1; n], vec![0.2; n]],
            [init, vec![0.1; n], vec![0.2; n]],
        );
        for step in 1..=5 {
            let k = Consts::new(&hp, step, 1e-2, hp.weight_decay);
            let [p, m, v] = &mut a;
            update_block(&k, p, &grad, m, v);
            let [p, m, v] = &mut b;
            dispatch_block(&k, p, &grad, m, v);
        }
        let bits = |x: &[Vec<f32>; 3]| x.iter().flatten().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }
}
