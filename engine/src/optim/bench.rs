//! `ds-rs bench adam`: one AdamW step over a flat fp32 shard, timed as shared/bench/adam_cpu.py
//! times torch's and DeepSpeed's (same hyper-parameters, median of `iters` steps after
//! `warmup`, effective bandwidth counting 28 bytes per parameter).

use std::time::Instant;

use super::{Adam, AdamParams, Optimizer};

/// Bytes each step moves per parameter: param, grad, m, v read (16) + param, m, v written (12).
pub const BYTES_PER_PARAM: usize = 28;

/// Timing of `iters` steps; the rayon pool's size (RAYON_NUM_THREADS) is the thread count.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchResult {
    pub n_params: usize,
    pub threads: usize,
    pub iters: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// 28 bytes per parameter / median step time, in 1e9 bytes per second.
    pub effective_gbs: f64,
}

/// Times AdamW (lr 3e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1, as adam_cpu.py) on `n_params`
/// parameters ~ N(0, 0.02^2) with gradients ~ N(0, 1e-3^2). At least one step is timed.
pub fn bench_adam(n_params: usize, iters: usize, warmup: usize) -> BenchResult {
    let hp = AdamParams {
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
        adam_w_mode: true,
        bias_correction: true,
    };
    let mut params = pseudo_normal(n_params, 1, 0.02);
    let grads = pseudo_normal(n_params, 2, 1e-3);
    let mut opt = Adam::new(hp, n_params);
    let iters = iters.max(1);
    let mut ms = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        opt.step(&mut params, &grads, 3e-4);
        if i >= warmup {
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    ms.sort_by(f64::total_cmp);
    let median_ms = median(&ms);
    BenchResult {
        n_params,
        threads: rayon::current_num_threads(),
        iters,
        median_ms,
        min_ms: ms[0],
        max_ms: ms[ms.len() - 1],
        effective_gbs: (BYTES_PER_PARAM * n_params) as f64 / (median_ms * 1e-3) / 1e9,
    }
}

/// Median of a sorted, non-empty slice (mean of the middle two, as Python's statistics.median).
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n % 2 {
        1 => sorted[n / 2],
        _ => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

/// Deterministic roughly normal values (sum of four uniforms, scaled): the timing does not
/// depend on the distribution, only on avoiding subnormals, and this needs no rand crate.
fn pseudo_normal(n: usize, seed: u64, std: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        // xorshift64*: plenty for benchmark data.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32
    };
    // Four U(0,1) sum to mean 2, variance 1/3: centre and scale to unit variance.
    let scale = std * 3f32.sqrt();
    (0..n)
        .map(|_| (uniform() + uniform() + uniform() + uniform() - 2.0) * scale)
        .collect()
}
