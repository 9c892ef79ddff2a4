//! A Llama-family decoder's sizes, read from Hugging Face's `config.json` exactly as
//! transformers' `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `MixtralConfig` and
//! `Qwen3MoeConfig` read it (their defaults for a field left out), or from a preset.

use serde_json::Value;

use crate::blocks::rope::Rope;
use crate::fields::{problem, ConfigProblem, Fields};

/// Which transformers class the config describes: the same decoder with different
/// projections' biases and attention windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    /// Mistral's attention with a sparse mixture of experts in every layer.
    Mixtral,
    /// Qwen3's attention (RMSNorm on each query and key head) with a sparse mixture of
    /// experts in some layers.
    Qwen3Moe,
}

impl Family {
    /// `model_type` values ds-rs trains, as config.json spells them.
    pub const SUPPORTED: [&'static str; 5] = ["llama", "mistral", "qwen2", "mixtral", "qwen3_moe"];

    fn from_model_type(t: &str) -> Option<Family> {
        match t {
            "llama" => Some(Family::Llama),
            "mistral" => Some(Family::Mistral),
            "qwen2" => Some(Family::Qwen2),
            "mixtral" => Some(Family::Mixtral),
            "qwen3_moe" => Some(Family::Qwen3Moe),
            _ => None,
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    /// transformers' class for the model with its LM head.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The sparse block's module name and its experts' (gate, up, down) projections, as the
    /// checkpoints on the Hugging Face hub name them (save_pretrained writes them so too).
    pub fn expert_names(self) -> (&'static str, [&'static str; 3]) {
        match self {
            Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }
}

/// The mixture of experts that replaces the MLP in some layers (transformers'
/// `MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`): a linear router, softmax over the
/// experts, the top `top_k` kept per token, each a SwiGLU MLP of width `expert_size`.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseMlp {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_size: usize,
    /// The kept probabilities renormalised to sum to one per token (Mixtral always,
    /// Qwen3-MoE's `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Per layer: a mixture of experts, or the dense MLP of width `intermediate_size`
    /// (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    pub sparse_layers: Vec<bool>,
    /// The router's load-balancing loss joins the loss with this coefficient
    /// (`output_router_logits`, `router_aux_loss_coef`).
    pub router_aux_loss_coef: Option<f64>,
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
    /// RMSNorm over each query and key head before the rotation (Qwen3's `q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// The experts, for the mixture-of-experts families.
    pub moe: Option<SparseMlp>,
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
            Family::Mistral | Family::Mixtral => 8,
            Family::Qwen3Moe => 4,
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
                Family::Mistral | Family::Mixtral => 4096 * 32,
                Family::Qwen2 | Family::Qwen3Moe => 32768,
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
            Family::Llama | Family::Qwen3Moe => (attention_bias, attention_bias),
            Family::Mistral | Family::Mixtral => (false, false),
            Family::Qwen2 => (true, false),
        };
        let mlp_bias = family == Family::Llama && f.bool("mlp_bias", false)?;
        let windows = windows(family, &f, layers)?;
        let cfg = LlamaConfig {
            family,
            vocab_size: f.usize(
                "vocab_size",
                Some(match family {
                    Family::Qwen2 | Family::Qwen3Moe => 151936,
                    _ => 32000,
                }),
            )?,
            hidden_size: hidden,
            intermediate_size: f.usize(
                "intermediate_size",
                match family {
                    Family::Mixtral => Some(14336),
                    Family::Qwen3Moe => Some(6144),
                    _ => None,
                },
            )?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            max_position_embeddings: max_pos,
            rms_norm_eps: f.f64(
                "rms_norm_eps",
                match family {
                    Family::Mixtral => 1e-5,
                    _ => 1e-6,
                },
            )?,
            rope: Rope::from_hf(o, max_pos, default_theta(family)).map_err(problem)?,
            qkv_bias,
            o_bias,
            mlp_bias,
            tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
            windows,
            initializer_range: f.f64("initializer_range", 0.02)?,
            qk_norm: family == Family::Qwen3Moe,
            moe: sparse_mlp(family, &f, layers)?,
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
            Family::Mistral | Family::Mixtral => {
                v["sliding_window"] = self.windows.first().copied().flatten().into()
            }
            Family::Qwen3Moe => {
                let window = self.windows.first().copied().flatten();
                v["use_sliding_window"] = window.is_some().into();
                v["sliding_window"] = window.into();
                v["attention_bias"] = self.qkv_bias.into();
            }
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
        if let Some(m) = &self.moe {
            v["num_local_experts"] = m.num_experts.into();
            v["num_experts_per_tok"] = m.top_k.into();
            v["output_router_logits"] = m.router_aux_loss_coef.is_some().into();
            if let Some(coef) = m.router_aux_loss_coef {
                v["router_aux_loss_coef"] = coef.into();
            }
            if self.family == Family::Qwen3Moe {
                v["moe_intermediate_size"] = m.expert_size.into();
                v["norm_topk_prob"] = m.norm_topk_prob.into();
                v["decoder_sparse_step"] = 1.into();
                let dense: Vec<usize> = (0..self.num_hidden_layers)
                    .filter(|i| !m.sparse_layers[*i])
                    .collect();
                v["mlp_only_layers"] = dense.into();
            }
        }
        v
    }

    /// Layer `i`'s mixture of experts, None where its MLP is dense.
    pub fn sparse_layer(&self, i: usize) -> Option<&SparseMlp> {
        self.moe.as_ref().filter(|m| m.sparse_layers[i])
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
        if let Some(m) = &self.moe {
            if self.family == Family::Mixtral && m.expert_size != self.intermediate_size {
                return Err(format!(
                    "Mixtral's experts are `intermediate_size` ({}) wide, not {}",
                    self.intermediate_size, m.expert_size
                ));
            }
            if m.sparse_layers.len() != self.num_hidden_layers {
                return Err(format!(
                    "{} layers are marked sparse or dense for {} layers",
                    m.sparse_layers.len(),
                    self.num_hidden_layers
                ));
            }
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

    /// Parameters of attention and the two norms in one decoder layer.
    fn attention_params(&self) -> usize {
        let d = self.hidden_size;
        let (q, kv) = (self.q_width(), self.kv_width());
        let attn = d * q + 2 * d * kv + q * d;
        let attn_bias =
            if self.qkv_bias { q + 2 * kv } else { 0 } + if self.o_bias { d } else { 0 };
        let qk_norm = if self.qk_norm { 2 * self.head_dim } else { 0 };
        attn + attn_bias + qk_norm + 2 * d
    }

    /// Parameters of layer `i`'s MLP: the dense one, or the router and every expert.
    fn mlp_params(&self, i: usize) -> usize {
        let d = self.hidden_size;
        match self.sparse_layer(i) {
            Some(m) => m.num_experts * (d + 3 * d * m.expert_size),
            None => {
                let f = self.intermediate_size;
                3 * d * f + if self.mlp_bias { 2 * f + d } else { 0 }
            }
        }
    }

    /// Parameters of layer `i`'s MLP one token runs through: the router and its `top_k`
    /// experts in a sparse layer.
    fn active_mlp_params(&self, i: usize) -> usize {
        let d = self.hidden_size;
        match self.sparse_layer(i) {
            Some(m) => m.num_experts * d + m.top_k * 3 * d * m.expert_size,
            None => self.mlp_params(i),
        }
    }

    /// Every parameter, counted once (a tied head is the embedding).
    pub fn n_params(&self) -> usize {
        let (v, d) = (self.vocab_size, self.hidden_size);
        let head = if self.tie_word_embeddings { 0 } else { v * d };
        let layers: usize = (0..self.num_hidden_layers)
            .map(|i| self.attention_params() + self.mlp_params(i))
            .sum();
        v * d + layers + d + head
    }

    /// The parameters one token runs through: all of a dense model's, the router and the
    /// kept experts of a sparse layer (Mixtral 8x7B's "13B active").
    pub fn active_params(&self) -> usize {
        let experts: usize = (0..self.num_hidden_layers)
            .map(|i| self.mlp_params(i) - self.active_mlp_params(i))
            .sum();
        self.n_params() - experts
    }

    /// Model FLOPs per trained token at sequence length `seq` (forward + backward): 6 per
    /// matrix parameter a token runs through (the embedding lookup is free, the head is a
    /// product; in a sparse layer the router and its `top_k` experts) and 12 per layer,
    /// position and query width for attention's scores and weighted sums (the PaLM
    /// paper's count).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let products = self.active_params() - self.vocab_size * self.hidden_size
            + if self.tie_word_embeddings {
                self.vocab_size * self.hidden_size
            } else {
                0
            };
        6.0 * products as f64 + 12.0 * (self.num_hidden_layers * seq * self.q_width()) as f64
    }

    /// Whether the experts split evenly over the expert-parallel ranks `ep`; a dense model
    /// takes no expert parallelism.
    pub fn check_ep(&self, ep: usize) -> Result<(), String> {
        match &self.moe {
            Some(m) => crate::moe::check_ep_divides(m.num_experts, ep),
            None if ep > 1 => Err(format!(
                "expert-parallel size {ep}: {} has no experts",
                self.family.architecture()
            )),
            _ => Ok(()),
        }
    }

    /// Whether sequence parallelism of size `sp` (Ulysses) can split the model at tensor
    /// parallelism `tp`: each rank's query heads split again over sp; its key/value heads too,
    /// or, fewer than sp, copied so that each rank gets one (DeepSpeed's rule); no mixture
    /// (its load-balancing loss counts the tokens of one rank).
    pub fn check_sp(&self, sp: usize, tp: usize) -> Result<(), String> {
        if sp == 1 {
            return Ok(());
        }
        if self.moe.is_some() {
            return Err(format!(
                "sequence-parallel size {sp}: {}'s experts do not combine with sequence parallelism",
                self.family.architecture()
            ));
        }
        crate::check_sp_divides(sp, tp, &[("num_attention_heads", self.num_attention_heads)])?;
        let kv = self.num_key_value_heads / tp;
        match kv.is_multiple_of(sp) || sp.is_multiple_of(kv) {
            true => Ok(()),
            false => Err(format!(
                "sequence-parallel size {sp}: the {kv} key/value heads of each tensor-parallel rank neither split over it nor divide it (num_key_value_heads = {})",
                self.num_key_value_heads
            )),
        }
    }

    /// Copies of each key/value head a tensor-parallel rank makes before Ulysses' exchange
    /// (Note [ulysses]) at sequence-parallel size `sp`: 1 when sp splits the rank's kv heads,
    /// else sp / kv (DeepSpeed repeats them so that each rank has the one its queries read).
    pub fn kv_copies(&self, tp: usize, sp: usize) -> usize {
        let kv = self.num_key_value_heads / tp;
        match kv.is_multiple_of(sp) {
            true => 1,
            false => sp / kv,
        }
    }

    /// Whether tensor parallelism of degree `tp` can split the model: whole query and key/value
    /// heads per rank, the MLP width and the vocabulary in equal parts.
    pub fn check_tp(&self, tp: usize) -> Result<(), String> {
        let mut sizes = vec![
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
        ];
        if (0..self.num_hidden_layers).any(|i| self.sparse_layer(i).is_none()) {
            sizes.push(("intermediate_size", self.intermediate_size));
        }
        if let Some(m) = &self.moe {
            sizes.push(("the experts' intermediate size", m.expert_size));
        }
        crate::check_tp_divides(tp, &sizes)
    }
}

/// transformers' RoPE base where config.json gives none (`MixtralConfig.default_theta`).
fn default_theta(family: Family) -> f64 {
    match family {
        Family::Mixtral => 1_000_000.0,
        _ => Rope::DEFAULT_THETA,
    }
}

/// The experts of a mixture-of-experts family, None for the dense ones. Settings that would
/// make ds-rs train another function than transformers are refused, naming the field.
fn sparse_mlp(
    family: Family,
    f: &Fields,
    layers: usize,
) -> Result<Option<SparseMlp>, ConfigProblem> {
    let (experts, top_k, expert_size, norm, sparse_layers) = match family {
        Family::Mixtral => {
            let jitter = f.f64("router_jitter_noise", 0.0)?;
            if jitter != 0.0 {
                return Err(problem(format!(
                    "`router_jitter_noise` {jitter}: ds-rs does not draw the router's noise, so it would train another function; set it to 0.0"
                )));
            }
            (
                f.usize("num_local_experts", Some(8))?,
                f.usize("num_experts_per_tok", Some(2))?,
                f.usize("intermediate_size", Some(14336))?,
                true,
                vec![true; layers],
            )
        }
        Family::Qwen3Moe => {
            // `num_experts` is the attribute, `num_local_experts` what save_pretrained writes
            let experts = match f.get("num_experts") {
                Some(_) => f.usize("num_experts", None)?,
                None => f.usize("num_local_experts", Some(128))?,
            };
            let step = f.usize("decoder_sparse_step", Some(1))?;
            let dense = mlp_only_layers(f)?;
            let sparse = (0..layers)
                .map(|i| !dense.contains(&i) && experts > 0 && step > 0 && (i + 1) % step == 0)
                .collect();
            (
                experts,
                f.usize("num_experts_per_tok", Some(8))?,
                f.usize("moe_intermediate_size", Some(768))?,
                f.bool("norm_topk_prob", false)?,
                sparse,
            )
        }
        _ => return Ok(None),
    };
    let router_aux_loss_coef = match f.bool("output_router_logits", false)? {
        true => Some(f.f64("router_aux_loss_coef", 0.001)?),
        false => None,
    };
    if experts == 0 || top_k == 0 || top_k > experts {
        return Err(problem(format!(
            "`num_experts_per_tok` ({top_k}) must lie between 1 and the number of experts ({experts})"
        )));
    }
    if expert_size == 0 {
        return Err(problem("the experts' intermediate size must be positive"));
    }
    Ok(Some(SparseMlp {
        num_experts: experts,
        top_k,
        expert_size,
        norm_topk_prob: norm,
        sparse_layers,
        router_aux_loss_coef,
    }))
}

fn mlp_only_layers(f: &Fields) -> Result<Vec<usize>, ConfigProblem> {
    match f.get("mlp_only_layers") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|i| i.as_u64().map(|i| i as usize)).collect())
            .ok_or_else(|| {
                problem(format!(
                    "`mlp_only_layers` must be a list of layer indices, got {v}"
                ))
            }),
    }
}

/// Per layer, the window of Mistral, Mixtral and Qwen3-MoE (every layer) or Qwen2's (`use_sliding_window`,
/// from layer `max_window_layers` on, or `layer_types`).
fn windows(family: Family, f: &Fields, layers: usize) -> Result<Vec<Option<usize>>, ConfigProblem> {
    let window = match family {
        Family::Llama => None,
        Family::Mistral => f.usize_opt("sliding_window", Some(4096))?,
        Family::Mixtral => f.usize_opt("sliding_window", None)?,
        Family::Qwen2 | Family::Qwen3Moe => match f.bool("use_sliding_window", false)? {
            true => f.usize_opt("sliding_window", Some(4096))?,
            false => None,
        },
    };
    let Some(w) = window else {
        return Ok(vec![None; layers]);
    };
    if family != Family::Qwen2 {
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
