//! Hugging Face's GPT-2 (`GPT2LMHeadModel`): the built-in GPT's layers (pre-LayerNorm
//! blocks, fused q|k|v, tanh GELU, learned positions) under transformers' names, with its
//! `n_inner`, `layer_norm_epsilon` and tied head, and its `Conv1D` weights read and written
//! through the transpose ([in, out] in its files).

use crate::gpt::{GptConfig, GptVariant};
use serde_json::Value;

use crate::fields::{problem, ConfigProblem, Fields};

/// GPT-2's sizes: the GPT's, and the variant that names and widens it as transformers does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Config {
    pub gpt: GptConfig,
    pub variant: GptVariant,
    pub initializer_range: f64,
}

impl Gpt2Config {
    /// Reads a parsed config.json of `model_type` "gpt2".
    pub fn from_hf_json(v: &Value) -> Result<Gpt2Config, ConfigProblem> {
        let o = v
            .as_object()
            .ok_or_else(|| problem("expected a JSON object"))?;
        let f = Fields(o);
        let d = f.usize("n_embd", Some(768))?;
        let act = f.str("activation_function", "gelu_new")?;
        if !["gelu_new", "gelu_pytorch_tanh"].contains(&act.as_str()) {
            return Err(problem(format!(
                "`activation_function` \"{act}\": ds-rs's GPT-2 MLP is the tanh GELU (gelu_new, gelu_pytorch_tanh)"
            )));
        }
        for key in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
            let p = f.f64(key, 0.1)?;
            if p != 0.0 {
                return Err(problem(format!(
                    "`{key}` {p}: ds-rs has no dropout, so it would train another function; set resid_pdrop, embd_pdrop and attn_pdrop to 0.0"
                )));
            }
        }
        if !f.bool("scale_attn_weights", true)?
            || f.bool("scale_attn_by_inverse_layer_idx", false)?
        {
            return Err(problem(
                "`scale_attn_weights` false or `scale_attn_by_inverse_layer_idx` true: ds-rs scales attention scores by 1/sqrt(head size) only",
            ));
        }
        if f.bool("add_cross_attention", false)? {
            return Err(problem(
                "`add_cross_attention` true: ds-rs's GPT-2 is a decoder without cross-attention",
            ));
        }
        let gpt = GptConfig {
            vocab_size: f.usize("vocab_size", Some(50257))?,
            seq_len: f.usize("n_positions", Some(1024))?,
            hidden: d,
            heads: f.usize("n_head", Some(12))?,
            layers: f.usize("n_layer", Some(12))?,
            tie_embeddings: f.bool("tie_word_embeddings", true)?,
            moe: None,
        };
        gpt.validate().map_err(problem)?;
        let variant = GptVariant {
            mlp: f.usize_or_null("n_inner", 4 * d)?,
            ln_eps: f.f64("layer_norm_epsilon", 1e-5)?,
            hf_names: true,
        };
        if variant.mlp == 0 || variant.ln_eps.is_nan() || variant.ln_eps <= 0.0 {
            return Err(problem(
                "`n_inner` and `layer_norm_epsilon` must be positive",
            ));
        }
        Ok(Gpt2Config {
            gpt,
            variant,
            initializer_range: f.f64("initializer_range", 0.02)?,
        })
    }

    /// config.json for transformers, which `from_hf_json` reads back to this config.
    pub fn to_hf_json(&self) -> Value {
        let c = &self.gpt;
        serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab_size,
            "n_positions": c.seq_len,
            "n_embd": c.hidden,
            "n_head": c.heads,
            "n_layer": c.layers,
            "n_inner": self.variant.mlp,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.variant.ln_eps,
            "initializer_range": self.initializer_range,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": c.tie_embeddings,
        })
    }
}

/// GPT-2 presets: a tiny one for tests and benchmarks (the built-in GPT's tiny sizes, tied),
/// and the published 124M model's config.
pub fn presets() -> Vec<(&'static str, Gpt2Config)> {
    let make = |v, t, d, h, l| Gpt2Config {
        gpt: GptConfig {
            vocab_size: v,
            seq_len: t,
            hidden: d,
            heads: h,
            layers: l,
            tie_embeddings: true,
            moe: None,
        },
        variant: GptVariant {
            mlp: 4 * d,
            ln_eps: 1e-5,
            hf_names: true,
        },
        initializer_range: 0.02,
    };
    vec![
        ("gpt2-tiny", make(4096, 128, 256, 4, 4)),
        ("gpt2-124m", make(50257, 1024, 768, 12, 12)),
    ]
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_published_gpt2_has_124m_parameters() {
        let (_, c) = presets()
            .into_iter()
            .find(|(n, _)| *n == "gpt2-124m")
            .unwrap();
        // transformers' GPT2LMHeadModel.num_parameters() for the "gpt2" config
        assert_eq!(c.gpt.n_params_of(&c.variant), 124_439_808);
        let declared: usize = c
            .gpt
            .build_variant(&ds_nn::parallel::Tp::none(), &c.variant)
            .unwrap()
            .params()
            .iter()
            .filter(|p| p.tied.is_none())
            .map(|p| p.numel())
            .sum();
        assert_eq!(declared, 124_439_808);
    }

    #[test]
    fn hub_configs_read_and_dropout_is_refused() {
        let hub = json!({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2,
            "vocab_size": 100, "n_positions": 32});
        let e = Gpt2Config::from_hf_json(&hub).unwrap_err().to_string();
        assert!(e.contains("resid_pdrop") && e.contains("0.0"), "{e}");
        let mut ok = hub.clone();
        for k in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
            ok[k] = json!(0.0);
        }
        let c = Gpt2Config::from_hf_json(&ok).unwrap();
        assert_eq!((c.variant.mlp, c.gpt.tie_embeddings), (256, true));
        assert_eq!(Gpt2Config::from_hf_json(&c.to_hf_json()).unwrap(), c);
        let mut relu = ok.clone();
        relu["activation_function"] = json!("relu");
        let e = Gpt2Config::from_hf_json(&relu).unwrap_err().to_string();
        assert!(e.contains("activation_function"), "{e}");
    }
}
