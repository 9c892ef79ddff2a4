//! A Hugging Face model directory that cannot be trained: one error line each, naming the
//! file and the field or tensor, a non-zero exit and no backtrace.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(60);

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/tests/fixtures/hf/llama")
}

/// The fixture's config.json, changed by `edit`, written into `dir`.
fn config_with(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    std::fs::create_dir_all(dir).unwrap();
    let text = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut v);
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
}

fn refused(cmd: &str, needles: &[&str]) {
    let f = run(cmd, LIMIT);
    assert!(!f.status.success(), "{cmd} succeeded");
    for n in needles {
        assert!(
            f.stderr.contains(n),
            "{cmd}: expected '{n}' in\n{}",
            f.stderr
        );
    }
    assert!(!f.stderr.contains("panicked"), "{cmd}: {}", f.stderr);
}

#[test]
fn bad_model_directories_are_named() {
    let s = Scratch::new("hf-bad");
    let train = |dir: &Path| format!("train --model {} --seq-len 8 --steps 1", dir.display());

    let missing = s.path("missing-field");
    config_with(&missing, |v| {
        v.as_object_mut().unwrap().remove("intermediate_size");
    });
    refused(
        &train(&missing),
        &["missing-field/config.json", "`intermediate_size`"],
    );

    let bert = s.path("bert");
    config_with(&bert, |v| v["model_type"] = "bert".into());
    refused(
        &train(&bert),
        &["bert/config.json", "\"bert\"", "llama, mistral, qwen2"],
    );

    let shape = s.path("shape");
    config_with(&shape, |v| v["intermediate_size"] = 40.into());
    std::fs::copy(
        fixture().join("model.safetensors"),
        shape.join("model.safetensors"),
    )
    .unwrap();
    refused(
        &train(&shape),
        &[
            "shape/model.safetensors",
            "model.layers.0.mlp.gate_proj.weight",
            "[48, 32]",
        ],
    );

    let shard = s.path("shard");
    config_with(&shard, |_| {});
    let index = r#"{"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}"#;
    std::fs::write(shard.join("model.safetensors.index.json"), index).unwrap();
    refused(
        &train(&shard),
        &[
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "missing",
        ],
    );

    // before any rank starts: the launcher plans the job
    let tp = format!(
        "launch --nproc_per_node 4 train --model {} --tp 4 --steps 1",
        fixture().display()
    );
    refused(
        &tp,
        &["num_key_value_heads = 2", "tensor-parallel degree 4"],
    );

    // a mixture of experts: what ds-rs cannot train yet, or would train otherwise
    let moe = |dir: &Path, edit: &dyn Fn(&mut serde_json::Value)| {
        config_with(dir, |v| {
            v["model_type"] = "mixtral".into();
            v["num_local_experts"] = 4.into();
            v["num_experts_per_tok"] = 2.into();
            edit(v);
        })
    };
    let aux = s.path("router-aux");
    moe(&aux, &|v| v["output_router_logits"] = true.into());
    refused(
        &format!(
            "launch --nproc_per_node 2 train --model {} --pp 2 --steps 1",
            aux.display()
        ),
        &["output_router_logits", "2 pipeline stages is not built yet"],
    );
    let k = s.path("top-k");
    moe(&k, &|v| v["num_experts_per_tok"] = 5.into());
    refused(
        &train(&k),
        &[
            "top-k/config.json",
            "`num_experts_per_tok` (5)",
            "number of experts (4)",
        ],
    );
    let mixtral_tp = s.path("mixtral-tp");
    moe(&mixtral_tp, &|v| v["intermediate_size"] = 47.into());
    refused(
        &format!(
            "launch --nproc_per_node 2 train --model {} --tp 2 --steps 1",
            mixtral_tp.display()
        ),
        &[
            "tensor-parallel degree 2",
            "the experts' intermediate size = 47",
        ],
    );
}

/// Expert parallelism that cannot be laid out is one error before any rank starts: an `--ep`
/// that does not divide the data-parallel ranks, experts that do not split evenly, a model
/// with no experts.
#[test]
fn bad_expert_parallel_layouts_are_refused_before_any_rank_starts() {
    let launch = |n: usize, args: &str| {
        format!("launch --nproc_per_node {n} train --model mixtral-tiny --steps 1 {args}")
    };
    refused(
        &launch(2, "--ep 2 --tp 2"),
        &["--ep 2", "does not divide the data-parallel size 1"],
    );
    refused(
        &launch(6, "--ep 3"),
        &[
            "--model mixtral-tiny",
            "8 experts do not split evenly over expert-parallel size 3",
        ],
    );
    refused(
        &launch(2, "--ep 2").replace("mixtral-tiny", "llama-tiny"),
        &["LlamaForCausalLM has no experts"],
    );
    // DeepSpeed's AutoEP section: a preset ds-rs does not train (the known ones listed), one
    // that is not the model's, a size that disagrees with --ep, folding over tensor lanes
    let s = Scratch::new("autoep-bad");
    let with = |name: &str, section: &str| {
        let cfg = format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "optimizer": {{"type": "AdamW"}},
            "expert_parallel": {{"enabled": true, {section}}}}}"#
        );
        let path = s.write(name, &cfg);
        format!(
            "launch --nproc_per_node 2 --config {} train --model mixtral-tiny --steps 1",
            path.display()
        )
    };
    refused(
        &with(
            "deepseek.json",
            r#""autoep_size": 2, "preset_model": "deepseek_v3""#,
        ),
        &[
            "expert_parallel.preset_model",
            "deepseek_v3",
            "mixtral, qwen3_moe",
        ],
    );
    refused(
        &with(
            "qwen.json",
            r#""autoep_size": 2, "preset_model": "qwen3_moe""#,
        ),
        &["\"qwen3_moe\" is not this model's family, \"mixtral\""],
    );
    refused(
        &(with("size.json", r#""autoep_size": 2"#) + " --ep 1"),
        &["--ep 1", "expert_parallel.autoep_size 2 disagree"],
    );
    refused(
        &(with("tp.json", r#""autoep_size": 2"#)
            .replace("--nproc_per_node 2", "--nproc_per_node 4")
            + " --tp 2"),
        &[
            "expert_parallel.autoep_size",
            "folded over the tensor-parallel lanes",
        ],
    );
}

/// DeepSpeed-MoE's GPT from a model JSON: a top-k above the expert count, arguments of
/// DeepSpeed's layer ds-rs does not reproduce (random token selection, noisy gates), a
/// misspelt key, experts that do not split over --ep, each one error naming the file or flag
/// before any rank starts.
#[test]
fn bad_moe_gpt_models_are_refused_before_any_rank_starts() {
    let s = Scratch::new("moe-gpt-bad");
    let model = |name: &str, moe: &str| {
        let json = format!(r#"{{"V": 64, "T": 8, "d": 16, "H": 2, "L": 2, "moe": {{{moe}}}}}"#);
        s.write(name, &json).display().to_string()
    };
    let launch = |n: usize, model: &str, args: &str| {
        format!("launch --nproc_per_node {n} train --model {model} --steps 1 {args}")
    };
    let k9 = model("k9.json", r#""num_experts": 8, "k": 9"#);
    refused(
        &launch(1, &k9, ""),
        &[
            "k9.json",
            "top-k 9 must lie between 1 and the number of experts, 8",
        ],
    );
    let rts = model("rts.json", r#""num_experts": 8, "use_rts": true"#);
    refused(&launch(1, &rts, ""), &["rts.json", "moe.use_rts true"]);
    let noisy = model(
        "noisy.json",
        r#""num_experts": 8, "noisy_gate_policy": "Jitter""#,
    );
    refused(
        &launch(1, &noisy, ""),
        &["noisy.json", "moe.noisy_gate_policy Jitter"],
    );
    let typo = model("typo.json", r#""num_expert": 8"#);
    refused(
        &launch(1, &typo, ""),
        &["typo.json", "unknown field `num_expert`"],
    );
    let six = model("six.json", r#""num_experts": 6"#);
    refused(
        &launch(4, &six, "--ep 4"),
        &["6 experts do not split evenly over expert-parallel size 4"],
    );
    refused(
        &launch(2, "tiny", "--ep 2"),
        &["expert-parallel size 2: the GPT has no experts"],
    );
}
