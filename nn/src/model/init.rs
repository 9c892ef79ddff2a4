//! Initial parameter values from (run seed, parameter name) alone.
//!
//! Every rank computes the same logical tensor whatever the layout (ARCHITECTURE.md invariant 3).
//! The generator is written out here (SplitMix64 and Box-Muller, a few lines) rather than
//! taken from a crate so that the stream can never change under a dependency update: initial
//! weights, and so every equality test and resumed run, depend on it.

use super::{Init, ParamSpec};

/// The values of `spec`, row-major over its logical shape.
pub fn init_values(spec: &ParamSpec, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; spec.numel()];
    fill_values(spec, seed, 0, &mut v);
    v
}

/// Elements `start..start + dst.len()` of `spec`'s values, the same as those of
/// `init_values`: the generator jumps to element `start` (SplitMix64's state after k draws is
/// seed + k * gamma), so a rank generates only the part it owns (DeepSpeed's zero.Init).
pub fn fill_values(spec: &ParamSpec, seed: u64, start: usize, dst: &mut [f32]) {
    match spec.init {
        Init::Zeros => dst.fill(0.0),
        Init::Ones => dst.fill(1.0),
        Init::Const(c) => dst.fill(c as f32),
        Init::Normal { mean, std } => {
            // two draws per element (Box-Muller's pair)
            let mut rng =
                SplitMix64::at(seed ^ fnv1a(spec.value_name().as_bytes()), 2 * start as u64);
            dst.iter_mut()
                .for_each(|v| *v = (mean + std * rng.normal()) as f32);
        }
        Init::Uniform { lo, hi } => {
            let mut rng = SplitMix64::at(seed ^ fnv1a(spec.value_name().as_bytes()), start as u64);
            dst.iter_mut()
                .for_each(|v| *v = (lo + (hi - lo) * rng.uniform()) as f32);
        }
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

struct SplitMix64(u64);

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl SplitMix64 {
    /// The generator of `seed` after `draws` draws.
    fn at(seed: u64, draws: u64) -> SplitMix64 {
        SplitMix64(seed.wrapping_add(draws.wrapping_mul(GAMMA)))
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
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

    /// Reference: the stream drawn from its start, one draw after another, then sliced.
    fn drawn_from_start(spec: &ParamSpec, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::at(seed ^ fnv1a(spec.name.as_bytes()), 0);
        (0..spec.numel())
            .map(|_| match spec.init {
                Init::Normal { mean, std } => (mean + std * rng.normal()) as f32,
                Init::Uniform { lo, hi } => (lo + (hi - lo) * rng.uniform()) as f32,
                _ => unreachable!("only random inits here"),
            })
            .collect()
    }

    #[test]
    fn any_part_is_the_same_slice_of_the_whole_stream() {
        for init in [Init::normal(0.02), Init::Uniform { lo: -1.0, hi: 2.0 }] {
            let s = spec("h.3.mlp.c_fc.weight", 1000, init);
            let whole = drawn_from_start(&s, 11);
            assert_eq!(init_values(&s, 11), whole);
            for (a, b) in [(0, 1), (1, 2), (7, 500), (499, 1000), (333, 334), (0, 1000)] {
                let mut part = vec![f32::NAN; b - a];
                fill_values(&s, 11, a, &mut part);
                assert_eq!(part, whole[a..b], "{init:?} {a}..{b}");
            }
        }
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
