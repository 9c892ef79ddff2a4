//! A Llama-family decoder's sizes, read from Hugging Face's `config.json` exactly as
//! transformers' `LlamaConfig`, `MistralConfig` and `Qwen2Config` read it (their defaults
//! for a field left out), or from a preset.

use serde_json::Value;

use super::rope::Rope;
use crate::fields::{problem, ConfigProblem, Fields};

/// Which transformers class the config describes: the same decoder with different
/// projections' biases and attention windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
}

impl Family {
    /// `model_type` values ds-rs trains, as config.json spells them.
    pub const SUPPORTED: [&'static str; 3] = ["llama", "mistral", "qwen2"];

    fn from_model_type(t: &str) -> Option<Family> {
        match t {
            "llama" => Some(Family::Llama),
            "mistral" => Some(Family::Mistral),
            "qwen2" => Some(Family::Qwen2),
            _ => None,
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
        }
    }

    /// transformers' class for the model with its LM head.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }
    }
}

/// The decoder's sizes and options, as transformers computes with them.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// A bias on o_proj (Llama's `attention_bias` puts one on all four).
    pub o_bias: bool,
    /// Biases on gate, up and down.
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
    /// Per layer, the attention window (a query sees the last `w` positions, itself
    /// included), None for full causal attention.
    pub windows: Vec<Option<usize>>,
    /// The standard deviation of the seeded initialisation (HF's `_init_weights`).
    pub initializer_range: f64,
}

impl LlamaConfig {
    /// Reads a parsed config.json.
    pub fn from_hf_json(v: &Value) -> Result<LlamaConfig, ConfigProblem> {
        let o = v
            .as_object()
            .ok_or_else(|| problem("expected a JSON object"))?;
        let model_type = o
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| problem("field `model_type` is missing"))?;
        let family = Family::from_model_type(model_type).ok_or_else(|| {
            problem(format!(
                "`model_type` \"{model_type}\" is not supported; supported: {}",
                Family::SUPPORTED.join(", ")
            ))
        })?;
        let f = Fields(o);
        let heads = f.usize("num_attention_heads", None)?;
        let hidden = f.usize("hidden_size", None)?;
        let default_kv = match family {
            Family::Mistral => 8,
            _ => heads,
        };
        let kv = f.usize_or_null("num_key_value_heads", default_kv)?;
        let layers = f.usize("num_hidden_layers", None)?;
        let head_dim = f.usize_or_null("head_dim", hidden / heads.max(1))?;
        let act = f.str("hidden_act", "silu")?;
        if act != "silu" {
            return Err(problem(format!(
                "`hidden_act` \"{act}\": ds-rs's {} MLP is SwiGLU with silu only",
                family.architecture()
            )));
        }
        let max_pos = f.usize(
            "max_position_embeddings",
            Some(match family {
                Family::Llama => 2048,
                Family::Mistral => 4096 * 32,
                Family::Qwen2 => 32768,
            }),
        )?;
        let dropout = f.f64("attention_dropout", 0.0)?;
        if dropout != 0.0 {
            return Err(problem(format!(
                "`attention_dropout` {dropout}: ds-rs has no dropout, so it would train another function; set it to 0.0"
            )));
        }
        let attention_bias = f.bool("attention_bias", false)?;
        let (qkv_bias, o_bias) = match family {
            Family::Llama => (attention_bias, attention_bias),
            Family::Mistral => (false, false),
            Family::Qwen2 => (true, false),
        };
        let mlp_bias = family == Family::Llama && f.bool("mlp_bias", false)?;
        let windows = windows(family, &f, layers)?;
        let cfg = LlamaConfig {
            family,
            vocab_size: f.usize(
                "vocab_size",
                Some(match family {
                    Family::Qwen2 => 151936,
                    _ => 32000,
                }),
            )?,
            hidden_size: hidden,
            intermediate_size: f.usize("intermediate_size", None)?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            max_position_embeddings: max_pos,
            rms_norm_eps: f.f64("rms_norm_eps", 1e-6)?,
            rope: Rope::from_hf(o, max_pos).map_err(problem)?,
            qkv_bias,
            o_bias,
            mlp_bias,
            tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
            windows,
            initializer_range: f.f64("initializer_range", 0.02)?,
        };
        cfg.validate().map_err(problem)?;
        Ok(cfg)
    }

    /// config.json for transformers (5's spelling of RoPE, `rope_parameters`), which
    /// `from_hf_json` reads back to this config.
    pub fn to_hf_json(&self) -> Value {
        let mut v = serde_json::json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": self.rope.to_hf_json(),
        });
        match self.family {
            Family::Llama => {
                v["attention_bias"] = self.qkv_bias.into();
                v["mlp_bias"] = self.mlp_bias.into();
            }
            Family::Mistral => v["sliding_window"] = self.windows.first().copied().flatten().into(),
            Family::Qwen2 => {
                let window = self.windows.iter().flatten().next().copied();
                v["use_sliding_window"] = window.is_some().into();
                v["sliding_window"] = window.into();
                let types: Vec<&str> = self
                    .windows
                    .iter()
                    .map(|w| match w {
                        Some(_) => "sliding_attention",
                        None => "full_attention",
                    })
                    .collect();
                v["layer_types"] = types.into();
            }
        }
        v
    }

    /// The sizes agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Err(format!("`{name}` must be positive"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "`head_dim` ({}) must be even for rotary embeddings",
                self.head_dim
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(format!(
                "`rms_norm_eps` must be positive, got {}",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// Query heads' width (`num_attention_heads * head_dim`), which need not be hidden_size.
    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Key and value heads' width.
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Parameters of one decoder layer.
    pub fn layer_params(&self) -> usize {
        let (d, f) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (self.q_width(), self.kv_width());
        let attn = d * q + 2 * d * kv + q * d;
        let attn_bias =
            if self.qkv_bias { q + 2 * kv } else { 0 } + if self.o_bias { d } else { 0 };
        let mlp = 3 * d * f + if self.mlp_bias { 2 * f + d } else { 0 };
        attn + attn_bias + mlp + 2 * d
    }

    /// Every parameter, counted once (a tied head is the embedding).
    pub fn n_params(&self) -> usize {
        let (v, d) = (self.vocab_size, self.hidden_size);
        let head = if self.tie_word_embeddings { 0 } else { v * d };
        v * d + self.num_hidden_layers * self.layer_params() + d + head
    }

    /// Model FLOPs per trained token at sequence length `seq` (forward + backward): 6 per
    /// matrix parameter touched (the embedding lookup is free, the head is a product) and 12
    /// per layer, position and query width for attention's scores and weighted sums (the
    /// PaLM paper's count).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let products = self.n_params() - self.vocab_size * self.hidden_size
            + if self.tie_word_embeddings {
                self.vocab_size * self.hidden_size
            } else {
                0
            };
        6.0 * products as f64 + 12.0 * (self.num_hidden_layers * seq * self.q_width()) as f64
    }

    /// Whether tensor parallelism of degree `tp` can split the model: whole query and key/value
    /// heads per rank, the MLP width and the vocabulary in equal parts.
    pub fn check_tp(&self, tp: usize) -> Result<(), String> {
        crate::check_tp_divides(
            tp,
            &[
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_key_value_heads),
                ("intermediate_size", self.intermediate_size),
                ("vocab_size", self.vocab_size),
            ],
        )
    }
}

/// Per layer, Mistral's `sliding_window` (every layer) or Qwen2's (`use_sliding_window`,
/// from layer `max_window_layers` on, or `layer_types`).
fn windows(family: Family, f: &Fields, layers: usize) -> Result<Vec<Option<usize>>, ConfigProblem> {
    let window = match family {
        Family::Llama => None,
        Family::Mistral => f.usize_opt("sliding_window", Some(4096))?,
        Family::Qwen2 => match f.bool("use_sliding_window", false)? {
            true => f.usize_opt("sliding_window", Some(4096))?,
            false => None,
        },
    };
    let Some(w) = window else {
        return Ok(vec![None; layers]);
    };
    if family == Family::Mistral {
        return Ok(vec![Some(w); layers]);
    }
    if let Some(types) = f.get("layer_types").filter(|v| !v.is_null()) {
        let types = types
            .as_array()
            .filter(|a| a.len() == layers)
            .ok_or_else(|| problem(format!("`layer_types` must list {layers} layer types")))?;
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(Some(w)),
                Some("full_attention") => Ok(None),
                _ => Err(problem(format!(
                    "`layer_types`: {t} is neither \"full_attention\" nor \"sliding_attention\""
                ))),
            })
            .collect();
    }
    let from = f.usize("max_window_layers", Some(28))?;
    Ok((0..layers).map(|i| (i >= from).then_some(w)).collect())
}
