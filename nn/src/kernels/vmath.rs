//! Elementwise math the compiler can vectorise, and the AVX2 dispatch that lets it.
//!
//! libm's `expf` is a call per element, so a loop over it stays scalar; `exp` here is plain
//! arithmetic (Cephes' expf: range reduction by ln 2 and a degree-6 polynomial, within 2 ulp
//! of the exact value), so an 8-wide loop over it becomes AVX2 code. Reductions keep `LANES`
//! partial results so they vectorise too (a different, fixed, summation order).

/// Elements per vector step: an AVX2 register of f32.
pub const LANES: usize = 8;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so that n * LN2_HI is exact for the n that occur.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding and subtracting 1.5 * 2^23 rounds to the nearest integer with plain adds.
const ROUND: f32 = 12_582_912.0;
/// e^x is normal in f32 for x in this range; outside it the result saturates to the bound's.
const EXP_LO: f32 = -87.336_54;
const EXP_HI: f32 = 88.376_26;

/// e^x, for x in [-87.3, 88.4] (clamped there; e^-87.3 is f32's smallest normal).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_LO, EXP_HI);
    // t's low mantissa bits hold n itself: integer SIMD gets it without a float-to-int cast
    // (Rust's saturating `as i32` does not vectorise)
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let n_int = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    er * f32::from_bits((n_int.wrapping_add(127) as u32) << 23)
}

/// tanh through one `exp`; |u| > 9 is +-1 in f32 anyway, and keeps exp in range.
#[inline(always)]
pub fn tanh(u: f32) -> f32 {
    let e = exp(2.0 * u.clamp(-9.0, 9.0));
    (e - 1.0) / (e + 1.0)
}

/// `f` of each element of `a`, vectorised. Pass an `#[inline(always)]` fn, so that it is
/// compiled into the AVX2 loop.
pub fn map1<F: Fn(f32) -> f32 + Copy>(a: &[f32], f: F) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { map1_avx2(a, f) };
    }
    map1_body(a, f)
}

/// `f` of each pair of elements of `a` and `b` (same length), vectorised (as `map1`).
pub fn map2<F: Fn(f32, f32) -> f32 + Copy>(a: &[f32], b: &[f32], f: F) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { map2_avx2(a, b, f) };
    }
    map2_body(a, b, f)
}

/// `row[i] = exp(scale * row[i] - max)` with `max` the row's largest `scale * row[i]` (so
/// nothing overflows); returns `(max, sum of the new row)`.
pub fn exp_shifted(row: &mut [f32], scale: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { exp_shifted_avx2(row, scale) };
    }
    exp_shifted_body(row, scale)
}

/// `row[i] = exp(scale * row[i] - shift)`, vectorised.
pub fn exp_affine(row: &mut [f32], scale: f32, shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { exp_affine_avx2(row, scale, shift) };
    }
    exp_affine_body(row, scale, shift)
}

/// The sum of `a`'s elements.
pub fn sum(a: &[f32]) -> f32 {
    lanes_sum(a, a, |x, _| x)
}

/// The sum of `a[i] * b[i]` (same length).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    lanes_sum(a, b, |x, y| x * y)
}

/// The sum of `(a[i] - mean)^2`.
pub fn sum_sq_dev(a: &[f32], mean: f32) -> f32 {
    lanes_sum(a, a, |x, _| (x - mean) * (x - mean))
}

/// The sum of `f(a[i], b[i])` over `LANES` running partial sums.
#[inline(always)]
fn lanes_sum<F: Fn(f32, f32) -> f32 + Copy>(a: &[f32], b: &[f32], f: F) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { lanes_sum_avx2(a, b, f) };
    }
    lanes_sum_body(a, b, f)
}

// The AVX2 copies: the same bodies compiled with AVX2 enabled, so LLVM makes their loops 8
// wide (baseline x86-64 code is SSE2, 4 wide). Both perform the same IEEE operations (no FMA
// contraction), so results do not depend on the CPU.
// Safety of each: the CPU must support AVX2.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn map1_avx2<F: Fn(f32) -> f32 + Copy>(a: &[f32], f: F) -> Vec<f32> {
    map1_body(a, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn map2_avx2<F: Fn(f32, f32) -> f32 + Copy>(a: &[f32], b: &[f32], f: F) -> Vec<f32> {
    map2_body(a, b, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_avx2(row: &mut [f32], scale: f32) -> (f32, f32) {
    exp_shifted_body(row, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_affine_avx2(row: &mut [f32], scale: f32, shift: f32) {
    exp_affine_body(row, scale, shift)
}

#[inline(always)]
fn exp_affine_body(row: &mut [f32], scale: f32, shift: f32) {
    for x in row {
        *x = exp(*x * scale - shift);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lanes_sum_avx2<F: Fn(f32, f32) -> f32 + Copy>(a: &[f32], b: &[f32], f: F) -> f32 {
    lanes_sum_body(a, b, f)
}

#[inline(always)]
fn lanes_sum_body<F: Fn(f32, f32) -> f32 + Copy>(a: &[f32], b: &[f32], f: F) -> f32 {
    let mut sums = [0f32; LANES];
    let (mut x, mut y) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut x).zip(&mut y) {
        for i in 0..LANES {
            sums[i] += f(x[i], y[i]);
        }
    }
    let tail = x.remainder().iter().zip(y.remainder());
    sums.iter().sum::<f32>() + tail.map(|(x, y)| f(*x, *y)).sum::<f32>()
}

#[inline(always)]
fn map1_body<F: Fn(f32) -> f32 + Copy>(a: &[f32], f: F) -> Vec<f32> {
    let mut out = Vec::with_capacity(a.len());
    let mut x = a.chunks_exact(LANES);
    for x in &mut x {
        let mut o = [0f32; LANES];
        for i in 0..LANES {
            o[i] = f(x[i]);
        }
        out.extend_from_slice(&o);
    }
    out.extend(x.remainder().iter().map(|v| f(*v)));
    out
}

#[inline(always)]
fn map2_body<F: Fn(f32, f32) -> f32 + Copy>(a: &[f32], b: &[f32], f: F) -> Vec<f32> {
    let mut out = Vec::with_capacity(a.len());
    let (mut x, mut y) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut x).zip(&mut y) {
        let mut o = [0f32; LANES];
        for i in 0..LANES {
            o[i] = f(x[i], y[i]);
        }
        out.extend_from_slice(&o);
    }
    let tail = x.remainder().iter().zip(y.remainder());
    out.extend(tail.map(|(x, y)| f(*x, *y)));
    out
}

#[inline(always)]
fn exp_shifted_body(row: &mut [f32], scale: f32) -> (f32, f32) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            lanes[i] = lanes[i].max(c[i] * scale);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .fold(fold_max(lanes), |m, v| m.max(v * scale));
    let mut sums = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            c[i] = exp(c[i] * scale - max);
            sums[i] += c[i];
        }
    }
    let mut sum: f32 = sums.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp(*v * scale - max);
        sum += *v;
    }
    (max, sum)
}

fn fold_max(lanes: [f32; LANES]) -> f32 {
    lanes.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64's exp, over the range softmax and GELU use, every 2^-10.
    #[test]
    fn exp_is_within_two_ulp() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = f32::EPSILON as f64 * want;
            assert!(
                (got - want).abs() <= 2.0 * ulp,
                "exp({x}) = {got}, want {want}"
            );
            x += 1.0 / 1024.0;
        }
        assert_eq!(exp(0.0), 1.0);
        let floor = exp(-1000.0);
        assert!(
            floor.is_normal() && floor < 1.001 * f32::MIN_POSITIVE,
            "{floor}"
        );
    }

    #[test]
    fn tanh_matches_f64() {
        for i in -2000..2000 {
            let u = i as f32 / 100.0;
            let want = (u as f64).tanh();
            assert!((tanh(u) as f64 - want).abs() <= 4e-7, "tanh({u})");
        }
    }

    #[test]
    fn lane_sums_match_f64() {
        for len in [0usize, 1, 7, 8, 9, 257] {
            let a: Vec<f32> = (0..len)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0)
                .collect();
            let b: Vec<f32> = (0..len)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let f64sum = |f: &dyn Fn(usize) -> f64| (0..len).map(f).sum::<f64>();
            let close = |got: f32, want: f64| {
                assert!((got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()))
            };
            close(sum(&a), f64sum(&|i| a[i] as f64));
            close(dot(&a, &b), f64sum(&|i| a[i] as f64 * b[i] as f64));
            close(
                sum_sq_dev(&a, 0.3),
                f64sum(&|i| (a[i] as f64 - 0.3).powi(2)),
            );
        }
    }

    #[test]
    fn exp_shifted_matches_the_scalar_formula() {
        for len in [0usize, 1, 7, 8, 9, 100] {
            let row: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
                .collect();
            let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(v * 0.5)) as f64;
            let want: Vec<f64> = row.iter().map(|v| (*v as f64 * 0.5 - max).exp()).collect();
            let mut got = row.clone();
            let (m, sum) = exp_shifted(&mut got, 0.5);
            if len > 0 {
                assert_eq!(m as f64, max);
                let s: f64 = want.iter().sum();
                assert!((sum as f64 - s).abs() <= 1e-6 * s);
            }
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= 3e-7 * w);
            }
        }
    }
}
