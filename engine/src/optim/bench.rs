//! `ds-rs bench adam`: one AdamW step over a flat fp32 shard, timed as shared/bench/adam_cpu.py
//! times torch's and DeepSpeed's (same hyper-parameters, median of `iters` steps after
//! `warmup`, effective bandwidth counting 28 bytes per parameter).

use std::time::Instant;

use ds_comm::Element;

use super::{scaled_f32, Adam, AdamParams, Optimizer};

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

/// The two conversions of the host step under a 16-bit compute dtype, medians in ms.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertResult {
    pub n_params: usize,
    pub threads: usize,
    /// Reduced gradients to the optimizer's f32 input, times the step's scale (`scaled_f32`).
    pub grads_ms: f64,
    /// The updated master copy rounded into the parameters (`vector::convert_into`).
    pub publish_ms: f64,
    /// The same two through the `half` crate, an element at a time on one thread (the peer:
    /// what the loops were before).
    pub half_grads_ms: f64,
    pub half_publish_ms: f64,
}

/// Times the host step's conversions as the engine runs them, over `n_params` elements of
/// `T`, beside `half`'s (`half_to_f32`, `half_from_f32`: fn items, so inlined as in the loops
/// they replaced) in plain loops.
pub fn bench_convert<T: Element>(
    n_params: usize,
    iters: usize,
    warmup: usize,
    half_to_f32: impl Fn(T) -> f32,
    half_from_f32: impl Fn(f32) -> T,
) -> ConvertResult {
    let master = pseudo_normal(n_params, 1, 0.02);
    let grads: Vec<T> = pseudo_normal(n_params, 2, 1e-3)
        .into_iter()
        .map(T::from_f32)
        .collect();
    // written before timing, so no timed loop pays for first-touch page faults
    let mut fp32 = vec![1f32; n_params];
    let mut params = vec![T::from_f32(1.0); n_params];
    let k = 0.5f32;
    let grads_ms = median_ms(iters, warmup, || scaled_f32(&mut fp32, &grads, k));
    let publish_ms = median_ms(iters, warmup, || {
        ds_partition::vector::convert_into(&mut params, &master)
            .expect("host buffers convert without failing")
    });
    let half_grads_ms = median_ms(iters, warmup, || {
        fp32.iter_mut()
            .zip(&grads)
            .for_each(|(d, g)| *d = half_to_f32(*g) * k);
        std::hint::black_box(&fp32);
    });
    let half_publish_ms = median_ms(iters, warmup, || {
        params
            .iter_mut()
            .zip(&master)
            .for_each(|(d, m)| *d = half_from_f32(*m));
        std::hint::black_box(&params);
    });
    ConvertResult {
        n_params,
        threads: rayon::current_num_threads(),
        grads_ms,
        publish_ms,
        half_grads_ms,
        half_publish_ms,
    }
}

/// The median time of `f` in ms over `iters` runs (at least one) after `warmup`.
fn median_ms(iters: usize, warmup: usize, mut f: impl FnMut()) -> f64 {
    let mut ms = Vec::with_capacity(iters.max(1));
    for i in 0..warmup + iters.max(1) {
        let t0 = Instant::now();
        f();
        if i >= warmup {
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    ms.sort_by(f64::total_cmp);
    median(&ms)
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
