use ds_nn::parallel::Parallel;
use serde_json::json;

use super::*;

fn small(family: Family, window: Option<usize>) -> LlamaConfig {
    let mut v = json!({
        "model_type": family.model_type(), "vocab_size": 24, "hidden_size": 16,
        "intermediate_size": 20, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 8, "attention_bias": true,
        "mlp_bias": true,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 4}
    });
    if let Some(w) = window {
        v["sliding_window"] = json!(w);
    }
    LlamaConfig::from_hf_json(&v).unwrap()
}

/// Each layer's hand-written backward against candle's autograd of its `forward`: the
/// output, the input gradient and every parameter gradient; GQA (4 heads over 2), every
/// bias, llama3 rope, and a sliding window shorter than the sequence.
#[test]
fn taped_backward_matches_autograd() {
    for c in [
        small(Family::Llama, None),
        small(Family::Qwen2, None),
        small(Family::Mistral, Some(3)),
    ] {
        check_layers(&c);
    }
}

/// From `cpu_flash_attention::MIN_SEQ` positions the attention keeps no probabilities and
/// differentiates blockwise: GQA with and without a sliding window, and Qwen3's per-head
/// norms, against candle's autograd of the attention that holds them.
#[test]
fn long_sequences_take_the_blockwise_attention() {
    let t = ds_nn::kernels::cpu_flash_attention::MIN_SEQ + 30;
    let qwen3 = LlamaConfig::from_hf_json(&json!({
        "model_type": "qwen3_moe", "vocab_size": 24, "hidden_size": 16,
        "intermediate_size": 12, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 10, "head_dim": 6,
    }))
    .unwrap();
    let configs = [
        small(Family::Llama, None),
        small(Family::Mistral, Some(300)),
        qwen3,
    ];
    for c in &configs {
        let model = build(c, &Parallel::none()).unwrap();
        let what = format!("{:?} at {t} positions", c.family);
        crate::taped_check::check_layers(&model, (1, t), c.hidden_size, c.vocab_size, &what);
    }
}

/// The same for the mixtures of experts: Mixtral's renormalised top-2 of 4 experts, and
/// Qwen3-MoE's top-3 without renormalising, its per-head q/k norms and a dense layer; 21
/// tokens, so that every expert gets some and routes meet in an expert.
#[test]
fn taped_experts_match_autograd() {
    let moe = |family: Family, extra: serde_json::Value| {
        let mut v = json!({
            "model_type": family.model_type(), "vocab_size": 24, "hidden_size": 16,
            "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 8, "num_local_experts": 4,
        });
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        LlamaConfig::from_hf_json(&v).unwrap()
    };
    let mixtral = moe(Family::Mixtral, json!({"num_experts_per_tok": 2}));
    let qwen = moe(
        Family::Qwen3Moe,
        json!({"num_experts_per_tok": 3, "moe_intermediate_size": 10, "mlp_only_layers": [1],
               "head_dim": 6, "norm_topk_prob": false}),
    );
    for c in [mixtral, qwen] {
        check_layers(&c);
    }
}

fn check_layers(c: &LlamaConfig) {
    let model = build(c, &Parallel::none()).unwrap();
    let what = format!("{:?}", c.family);
    crate::taped_check::check_layers(&model, (3, 7), c.hidden_size, c.vocab_size, &what);
}

#[test]
fn parameter_counts_follow_the_declared_tensors() {
    for p in presets() {
        let declared: usize = build(&p.config, &Parallel::none())
            .unwrap()
            .params()
            .iter()
            .filter(|s| s.tied.is_none())
            .map(|s| s.numel())
            .sum();
        assert_eq!(declared, p.config.n_params(), "{}", p.name);
    }
    // Llama 3.2 1B's published count (1.24B, tied)
    let one_b = presets()
        .into_iter()
        .find(|p| p.name == "llama3-1b")
        .unwrap();
    assert_eq!(one_b.config.n_params(), 1_235_814_400);
}

#[test]
fn both_rope_spellings_read_the_same() {
    let base = json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64});
    let mut v4 = base.clone();
    v4["rope_theta"] = json!(500000.0);
    v4["rope_scaling"] = json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32});
    let mut v5 = base.clone();
    v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0,
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32});
    let (a, b) = (
        LlamaConfig::from_hf_json(&v4).unwrap(),
        LlamaConfig::from_hf_json(&v5).unwrap(),
    );
    assert_eq!(a.rope, b.rope);
    assert_eq!(a.rope.theta, 500000.0);
    let plain = LlamaConfig::from_hf_json(&base).unwrap();
    assert_eq!(plain.rope.scaling, Scaling::Default);
    assert_eq!(plain.rope.theta, Rope::DEFAULT_THETA);
    assert_eq!(plain.num_key_value_heads, 4);
    assert_eq!(plain.head_dim, 16);
}

#[test]
fn bad_configs_name_the_field() {
    let base = json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4});
    let mut missing = base.clone();
    missing.as_object_mut().unwrap().remove("intermediate_size");
    let e = LlamaConfig::from_hf_json(&missing).unwrap_err().to_string();
    assert!(e.contains("`intermediate_size`"), "{e}");
    let mut other = base.clone();
    other["model_type"] = json!("bert");
    let e = LlamaConfig::from_hf_json(&other).unwrap_err().to_string();
    assert!(
        e.contains("bert") && e.contains("llama, mistral, qwen2"),
        "{e}"
    );
    let mut kv = base.clone();
    kv["num_key_value_heads"] = json!(3);
    let e = LlamaConfig::from_hf_json(&kv).unwrap_err().to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    let c = LlamaConfig::from_hf_json(&json!({"model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}))
    .unwrap();
    let e = c.check_tp(4).unwrap_err();
    assert!(e.contains("num_key_value_heads = 2"), "{e}");
}

#[test]
fn qwen2_windows_start_at_max_window_layers() {
    let c = LlamaConfig::from_hf_json(&json!({"model_type": "qwen2", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 1}))
    .unwrap();
    assert_eq!(c.windows, vec![None, Some(16), Some(16)]);
    assert!(c.qkv_bias && !c.o_bias);
}

#[test]
fn a_partial_rotary_factor_is_refused() {
    let c = json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "partial_rotary_factor": 0.5});
    let e = LlamaConfig::from_hf_json(&c).unwrap_err().to_string();
    assert!(e.contains("partial_rotary_factor"), "{e}");
}

/// Every preset's config.json (what `--save-hf` writes) reads back to the same config:
/// transformers builds the same model from it (a Mixtral preset whose experts were not
/// `intermediate_size` wide once wrote a file transformers could not load).
#[test]
fn presets_round_trip_through_config_json() {
    for p in presets() {
        p.config.validate().unwrap();
        let back = LlamaConfig::from_hf_json(&p.config.to_hf_json()).unwrap();
        assert_eq!(back, p.config, "{}", p.name);
    }
}

/// Ulysses splits each tensor-parallel rank's query heads over sp, and its key/value heads
/// too, or copies them when there are fewer than sp that divide it (DeepSpeed's rule).
#[test]
fn sequence_parallelism_needs_heads_that_split() {
    let mut c = presets()
        .into_iter()
        .find(|p| p.name == "llama-tiny")
        .unwrap()
        .config;
    (c.num_attention_heads, c.num_key_value_heads) = (12, 6);
    assert!(c.check_sp(2, 1).is_ok(), "6 kv heads split over 2");
    assert!(c.check_sp(3, 2).is_ok(), "3 kv heads a rank split over 3");
    assert!(c.check_sp(6, 2).is_ok(), "3 kv heads a rank, copied to 6");
    let e = c.check_sp(4, 1).unwrap_err();
    assert!(e.contains("6 key/value heads"), "{e}");
    let e = c.check_sp(8, 1).unwrap_err();
    assert!(e.contains("num_attention_heads = 12"), "{e}");
}
