//! The built-in GPT: exactly the model of the peer benchmark (../shared/bench/gpt.py), with
//! its parameter names, so ds-rs and PyTorch/DeepSpeed train the same function from the same
//! weights. Pre-LayerNorm blocks, fused q|k|v projection, causal attention, tanh-GELU MLP,
//! untied lm_head, mean cross-entropy.

use std::path::Path;

use candle_core::{Module, Result, Tensor, D};
use candle_nn::{Embedding, VarBuilder};
use serde::Deserialize;

use super::nn::{cross_entropy, LayerNorm, Linear};
use super::ops::{causal_softmax, gelu};
use super::{Context, Init, Layer, Model, ParamSpec};

const LN_EPS: f64 = 1e-5;
const WEIGHT_INIT: Init = Init::Normal {
    mean: 0.0,
    std: 0.02,
};

/// The architecture's sizes, named as in the peer benchmark's README.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(non_snake_case)]
pub struct GptConfig {
    /// Vocabulary size.
    pub V: usize,
    /// Sequence length (context).
    pub T: usize,
    /// Model width.
    pub d: usize,
    /// Attention heads.
    pub H: usize,
    /// Blocks.
    pub L: usize,
}

/// The presets of ../shared/bench/gpt.py.
pub const PRESETS: [(&str, GptConfig); 3] = [
    (
        "tiny",
        GptConfig {
            V: 4096,
            T: 128,
            d: 256,
            H: 4,
            L: 4,
        },
    ),
    (
        "small",
        GptConfig {
            V: 8192,
            T: 256,
            d: 512,
            H: 8,
            L: 6,
        },
    ),
    (
        "gpt2",
        GptConfig {
            V: 50304,
            T: 1024,
            d: 768,
            H: 12,
            L: 12,
        },
    ),
];

impl GptConfig {
    pub fn preset(name: &str) -> Option<GptConfig> {
        PRESETS.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
    }

    /// A model JSON: `{"V": .., "T": .., "d": .., "H": .., "L": ..}`.
    pub fn from_json_file(path: &Path) -> crate::Result<GptConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| crate::EngineError::file(path, e))?;
        let cfg: GptConfig =
            serde_json::from_str(&text).map_err(|e| crate::EngineError::file(path, e))?;
        cfg.validate()
            .map_err(|e| crate::EngineError::file(path, e))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        let GptConfig { V, T, d, H, L } = *self;
        if [V, T, d, H, L].contains(&0) {
            return Err(format!("every size must be positive, got {self:?}"));
        }
        if d % H != 0 {
            return Err(format!("d ({d}) must be a multiple of H ({H})"));
        }
        Ok(())
    }

    /// Parameter count: embeddings, L blocks of 12d^2 + 13d, final LayerNorm, lm_head.
    pub fn n_params(&self) -> usize {
        let GptConfig { V, T, d, L, .. } = *self;
        V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d + V * d
    }

    /// The model as layers: embeddings, the blocks, ln_f + lm_head, the loss.
    pub fn build(&self) -> Model {
        let mut m = Model::new().layer("", Embeddings(*self));
        for i in 0..self.L {
            m = m.layer(&format!("h.{i}"), Block(*self));
        }
        m.layer("", Head(*self)).layer("", CrossEntropyLoss)
    }
}

/// `wte` + `wpe`: token ids [B, T] to activations [B, T, d].
struct Embeddings(GptConfig);

impl Layer for Embeddings {
    fn params(&self) -> Vec<ParamSpec> {
        let c = self.0;
        vec![
            ParamSpec::new("wte.weight", &[c.V, c.d], WEIGHT_INIT),
            ParamSpec::new("wpe.weight", &[c.T, c.d], WEIGHT_INIT),
        ]
    }

    fn forward(&self, vb: &VarBuilder, ids: &Tensor, _: &Context) -> Result<Tensor> {
        let c = self.0;
        let (_, t) = ids.dims2()?;
        if t > c.T {
            candle_core::bail!(
                "sequence of {t} tokens is longer than the model's T = {}",
                c.T
            );
        }
        let wte = Embedding::new(vb.get((c.V, c.d), "wte.weight")?, c.d);
        let wpe = vb.get((c.T, c.d), "wpe.weight")?.narrow(0, 0, t)?;
        wte.forward(ids)?.broadcast_add(&wpe)
    }

    /// The lookup is free; adding the positions costs one operation per element.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        Some((rows(shape) * self.0.d) as u64)
    }
}

/// One pre-LayerNorm transformer block.
struct Block(GptConfig);

impl Layer for Block {
    fn params(&self) -> Vec<ParamSpec> {
        let d = self.0.d;
        let ln = |n: &str| {
            [
                ParamSpec::new(&format!("{n}.weight"), &[d], Init::Ones),
                ParamSpec::new(&format!("{n}.bias"), &[d], Init::Zeros),
            ]
        };
        let lin = |n: &str, out: usize, inp: usize| {
            [
                ParamSpec::new(&format!("{n}.weight"), &[out, inp], WEIGHT_INIT),
                ParamSpec::new(&format!("{n}.bias"), &[out], Init::Zeros),
            ]
        };
        [
            ln("ln_1"),
            lin("attn.c_attn", 3 * d, d),
            lin("attn.c_proj", d, d),
            ln("ln_2"),
            lin("mlp.c_fc", 4 * d, d),
            lin("mlp.c_proj", d, 4 * d),
        ]
        .concat()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, _: &Context) -> Result<Tensor> {
        let d = self.0.d;
        let ln_1 = LayerNorm::new(d, LN_EPS, vb.pp("ln_1"))?;
        let x = (x + attention(self.0, &ln_1.forward(x)?, &vb.pp("attn"))?)?;
        let ln_2 = LayerNorm::new(d, LN_EPS, vb.pp("ln_2"))?;
        let c_fc = Linear::new(d, 4 * d, vb.pp("mlp.c_fc"))?;
        let c_proj = Linear::new(4 * d, d, vb.pp("mlp.c_proj"))?;
        let h = gelu(&c_fc.forward(&ln_2.forward(&x)?)?)?;
        x + c_proj.forward(&h)?
    }

    /// The matrix products, as DeepSpeed's profiler counts them: q|k|v, attention projection
    /// and MLP (12 d^2 multiply-adds per token), plus scores and their weighted sum over the
    /// sequence (2 T d per token). Normalisation and activations are left out.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        let (d, seq) = (self.0.d as u64, *shape.get(1)? as u64);
        Some(2 * rows(shape) as u64 * (12 * d * d + 2 * seq * d))
    }
}

/// Causal self-attention with the fused q|k|v projection.
fn attention(c: GptConfig, x: &Tensor, vb: &VarBuilder) -> Result<Tensor> {
    let (b, t, d) = x.dims3()?;
    let hd = d / c.H;
    let qkv = Linear::new(d, 3 * d, vb.pp("c_attn"))?.forward(x)?;
    // [b, t, 3, H, hd] -> [3, b, H, t, hd] in one copy; q, k, v are views of it.
    let heads = qkv
        .reshape((b, t, 3, c.H, hd))?
        .permute((2, 0, 3, 1, 4))?
        .contiguous()?;
    let (q, k, v) = (heads.get(0)?, heads.get(1)?, heads.get(2)?);
    let scores = q.matmul(&k.t()?)?;
    let y = causal_softmax(&scores, 1.0 / (hd as f64).sqrt())?.matmul(&v)?;
    let y = y.transpose(1, 2)?.reshape((b, t, d))?;
    Linear::new(d, d, vb.pp("c_proj"))?.forward(&y)
}

/// Final LayerNorm and the untied lm_head: [B, T, d] to logits [B, T, V].
struct Head(GptConfig);

impl Layer for Head {
    fn params(&self) -> Vec<ParamSpec> {
        let c = self.0;
        vec![
            ParamSpec::new("ln_f.weight", &[c.d], Init::Ones),
            ParamSpec::new("ln_f.bias", &[c.d], Init::Zeros),
            ParamSpec::new("lm_head.weight", &[c.V, c.d], WEIGHT_INIT),
        ]
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, _: &Context) -> Result<Tensor> {
        let c = self.0;
        let ln_f = LayerNorm::new(c.d, LN_EPS, vb.pp("ln_f"))?;
        Linear::no_bias(c.d, c.V, vb.pp("lm_head"))?.forward(&ln_f.forward(x)?)
    }

    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        Some(2 * (rows(shape) * self.0.d * self.0.V) as u64)
    }
}

/// Token positions in an input of `shape` ([B, T] ids or [B, T, d] activations).
fn rows(shape: &[usize]) -> usize {
    shape.iter().take(2).product()
}

/// Mean cross-entropy of the logits against the next tokens, over all B*T positions.
pub struct CrossEntropyLoss;

impl Layer for CrossEntropyLoss {
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    fn forward(&self, _: &VarBuilder, logits: &Tensor, cx: &Context) -> Result<Tensor> {
        let v = logits.dim(D::Minus1)?;
        cross_entropy(&logits.reshape(((), v))?, &cx.targets.flatten_all()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_peer_benchmark() {
        // figures printed by `python ../shared/bench/gpt.py` (README's preset table)
        assert_eq!(GptConfig::preset("tiny").unwrap().n_params(), 5_289_472);
        assert_eq!(GptConfig::preset("small").unwrap().n_params(), 27_435_008);
        for (_, c) in PRESETS {
            let declared: usize = c.build().params().iter().map(|p| p.numel()).sum();
            assert_eq!(declared, c.n_params());
        }
    }

    #[test]
    fn names_follow_the_pytorch_state_dict() {
        let names: Vec<String> = GptConfig::preset("tiny")
            .unwrap()
            .build()
            .params()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names[0], "wte.weight");
        assert_eq!(names[2], "h.0.ln_1.weight");
        assert!(names.contains(&"h.3.mlp.c_proj.bias".to_string()));
        assert_eq!(names.last().unwrap(), "lm_head.weight");
        assert_eq!(names.len(), 2 + 4 * 12 + 3);
    }
}
