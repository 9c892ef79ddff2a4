//! Initial parameter values from (run seed, parameter name) alone.
//!
//! Every rank computes the same logical tensor whatever the layout (DESIGN.md invariant 3).
//! The generator is written out here (SplitMix64 and Box-Muller, a few lines) rather than
//! taken from a crate so that the stream can never change under a dependency update: initial
//! weights, and so every equality test and resumed run, depend on it.

use super::{Init, ParamSpec};

/// The values of `spec`, row-major over its logical shape.
pub fn init_values(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let n = spec.numel();
    match spec.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Const(c) => vec![c as f32; n],
        Init::Normal { mean, std } => {
            let mut rng = SplitMix64::new(seed ^ fnv1a(spec.name.as_bytes()));
            (0..n).map(|_| (mean + std * rng.normal()) as f32).collect()
        }
        Init::Uniform { lo, hi } => {
            let mut rng = SplitMix64::new(seed ^ fnv1a(spec.name.as_bytes()));
            (0..n)
                .map(|_| (lo + (hi - lo) * rng.uniform()) as f32)
                .collect()
        }
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1): 53 random bits, never 0 (Box-Muller takes its log).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    /// Standard normal (one Box-Muller draw; the sine half is dropped for simplicity).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, n: usize, init: Init) -> ParamSpec {
        ParamSpec::new(name, &[n], init)
    }

    #[test]
    fn same_name_same_values_other_name_other_values() {
        let n = Init::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let a = init_values(&spec("h.0.attn.c_attn.weight", 64, n), 7);
        assert_eq!(a, init_values(&spec("h.0.attn.c_attn.weight", 64, n), 7));
        assert_ne!(a, init_values(&spec("h.1.attn.c_attn.weight", 64, n), 7));
        assert_ne!(a, init_values(&spec("h.0.attn.c_attn.weight", 64, n), 8));
    }

    #[test]
    fn normal_draws_have_the_requested_moments() {
        let v = init_values(
            &spec(
                "w",
                200_000,
                Init::Normal {
                    mean: 0.5,
                    std: 0.02,
                },
            ),
            1,
        );
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        // standard errors: 0.02/sqrt(2e5) = 4.5e-5 for the mean, about 0.3% for the std
        assert!((mean - 0.5).abs() < 3e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
    }
}
