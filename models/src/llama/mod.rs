//! Llama-family decoders (transformers' `LlamaForCausalLM`, `MistralForCausalLM`,
//! `Qwen2ForCausalLM`, and the mixtures of experts `MixtralForCausalLM` and
//! `Qwen3MoeForCausalLM`): RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

mod config;
mod layers;
mod sparse;

#[cfg(test)]
mod tests;

pub use crate::blocks::rope::{Rope, Scaling};
pub use crate::fields::ConfigProblem;
pub use config::{Family, LlamaConfig, SparseMlp};
pub use layers::{build, EMBED};
pub use sparse::top_k;

/// A preset: its name, the config, and the sequence length it trains at by default.
pub struct Preset {
    pub name: &'static str,
    pub config: LlamaConfig,
    pub seq_len: usize,
}

fn sized(
    family: Family,
    [v, d, f, l, h, kv]: [usize; 6],
    max_pos: usize,
    rope: Rope,
    tied: bool,
) -> LlamaConfig {
    LlamaConfig {
        family,
        vocab_size: v,
        hidden_size: d,
        intermediate_size: f,
        num_hidden_layers: l,
        num_attention_heads: h,
        num_key_value_heads: kv,
        head_dim: d / h,
        max_position_embeddings: max_pos,
        rms_norm_eps: if family == Family::Llama { 1e-5 } else { 1e-6 },
        rope,
        qkv_bias: family == Family::Qwen2,
        o_bias: false,
        mlp_bias: false,
        tie_word_embeddings: tied,
        windows: vec![None; l],
        initializer_range: 0.02,
        qk_norm: false,
        moe: None,
    }
}

/// A tiny mixture-of-experts model of `family`: 8 experts of width 344, 2 per token (the
/// tiny dense model's MLP parameters per token), Qwen3's per-head norms for Qwen3-MoE.
fn sparse_tiny(family: Family) -> LlamaConfig {
    let mut c = sized(family, [4096, 256, 688, 4, 4, 2], 128, PLAIN_ROPE, false);
    c.qk_norm = family == Family::Qwen3Moe;
    c.rms_norm_eps = 1e-6;
    if family == Family::Mixtral {
        // Mixtral's intermediate_size is its experts' width
        c.intermediate_size = 344;
    }
    c.moe = Some(SparseMlp {
        num_experts: 8,
        top_k: 2,
        expert_size: 344,
        norm_topk_prob: true,
        sparse_layers: vec![true; 4],
        router_aux_loss_coef: None,
    });
    c
}

const LLAMA3_ROPE: Rope = Rope {
    theta: 500_000.0,
    scaling: Scaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    },
};

const PLAIN_ROPE: Rope = Rope {
    theta: Rope::DEFAULT_THETA,
    scaling: Scaling::Default,
};

/// The presets: tiny and small ones of each family for tests and benchmarks (the built-in
/// GPT's tiny and small sizes), and Llama 3.2 1B and Llama 3.1 8B for `estimate` and
/// `autotune` (their published config.json; trained at 2048 positions by default).
pub fn presets() -> Vec<Preset> {
    let tiny = [4096, 256, 688, 4, 4, 2];
    let small = [8192, 512, 1376, 6, 8, 4];
    let mut mistral_tiny = sized(Family::Mistral, tiny, 128, PLAIN_ROPE, false);
    mistral_tiny.windows = vec![Some(64); 4];
    let llama3_8b = sized(
        Family::Llama,
        [128256, 4096, 14336, 32, 32, 8],
        131072,
        Rope {
            scaling: Scaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            ..LLAMA3_ROPE
        },
        false,
    );
    vec![
        Preset {
            name: "llama-tiny",
            config: sized(Family::Llama, tiny, 128, LLAMA3_ROPE, false),
            seq_len: 128,
        },
        Preset {
            name: "llama-small",
            config: sized(Family::Llama, small, 256, LLAMA3_ROPE, false),
            seq_len: 256,
        },
        Preset {
            name: "qwen2-tiny",
            config: sized(Family::Qwen2, tiny, 128, PLAIN_ROPE, true),
            seq_len: 128,
        },
        Preset {
            name: "mistral-tiny",
            config: mistral_tiny,
            seq_len: 128,
        },
        Preset {
            name: "mixtral-tiny",
            config: sparse_tiny(Family::Mixtral),
            seq_len: 128,
        },
        Preset {
            name: "qwen3-moe-tiny",
            config: sparse_tiny(Family::Qwen3Moe),
            seq_len: 128,
        },
        Preset {
            name: "llama3-1b",
            config: sized(
                Family::Llama,
                [128256, 2048, 8192, 16, 32, 8],
                131072,
                LLAMA3_ROPE,
                true,
            ),
            seq_len: 2048,
        },
        Preset {
            name: "llama3-8b",
            config: llama3_8b,
            seq_len: 2048,
        },
    ]
}
