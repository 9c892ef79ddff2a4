use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use ds_engine::model::Context;
use ds_engine::parallel::Tp;
use serde_json::json;

use super::*;

/// Values in [-1, 1) from a fixed linear congruential sequence.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

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

fn check_layers(c: &LlamaConfig) {
    let dev = Device::Cpu;
    let (b, t) = (3, 7);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % c.vocab_size) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), &dev).unwrap();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 5 % c.vocab_size) as u32).collect();
    let targets = Tensor::from_vec(targets, (b, t), &dev).unwrap();
    let cx = Context { targets: &targets };
    let model = build(c, &Tp::none()).unwrap();
    for (li, layer) in model.layers().iter().enumerate() {
        let specs = layer.layer.params();
        let vars: Vec<Var> = specs
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let offset = if p.norm { 1.0 } else { 0.0 };
                let v: Vec<f32> = values(p.numel(), (li * 100 + k) as u64)
                    .into_iter()
                    .map(|x| x * 0.5 + offset)
                    .collect();
                Var::from_vec(v, p.shape.as_slice(), &dev).unwrap()
            })
            .collect();
        let vb = |tracked: bool| {
            let map: HashMap<String, Tensor> = specs
                .iter()
                .zip(&vars)
                .map(|(p, v)| {
                    let t = v.as_tensor();
                    (p.name.clone(), if tracked { t.clone() } else { t.detach() })
                })
                .collect();
            VarBuilder::from_tensors(map, DType::F32, &dev)
        };
        let d = c.hidden_size;
        let input = match li {
            0 => Var::from_tensor(&ids).unwrap(),
            1 | 2 => Var::from_vec(values(b * t * d, 7 + li as u64), (b, t, d), &dev).unwrap(),
            _ => {
                Var::from_vec(values(b * t * c.vocab_size, 9), (b, t, c.vocab_size), &dev).unwrap()
            }
        };
        let y = layer
            .layer
            .forward(&vb(true), input.as_tensor(), &cx)
            .unwrap();
        let dy = match y.rank() {
            0 => Tensor::new(3.0f32, &dev).unwrap(),
            _ => Tensor::from_vec(values(y.elem_count(), 11), y.shape(), &dev).unwrap(),
        };
        let reference = (&y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
        let taped = layer
            .layer
            .forward_taped(&vb(false), &input.as_tensor().detach(), &cx)
            .unwrap()
            .expect("the Llama's layers are taped");
        let grads = taped.tape.backward(&dy, &vb(false)).unwrap();
        let mut pairs = vec![("output".to_string(), flat(&taped.output), flat(&y))];
        if li > 0 {
            let dx = grads.input.as_ref().expect("an input gradient");
            pairs.push((
                "input".into(),
                flat(dx),
                flat(reference.get(&input).unwrap()),
            ));
        }
        assert_eq!(grads.params.len(), specs.len());
        for ((p, v), g) in specs.iter().zip(&vars).zip(&grads.params) {
            pairs.push((p.name.clone(), flat(g), flat(reference.get(v).unwrap())));
        }
        for (name, got, want) in pairs {
            assert_eq!(got.len(), want.len(), "{:?} layer {li} {name}", c.family);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                // two f32 evaluations of the same derivative in different orders
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + scale),
                    "{:?} layer {li} {name}: {g} vs {w}",
                    c.family
                );
            }
        }
    }
}

#[test]
fn parameter_counts_follow_the_declared_tensors() {
    for p in presets() {
        let declared: usize = build(&p.config, &Tp::none())
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
