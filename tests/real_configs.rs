//! Real ds_configs train: every config of the real corpus that DeepSpeed 0.19.8 accepts at
//! world size 2, or rejects only for an unfilled Hugging Face "auto" (the configs HF's
//! Trainer fills before DeepSpeed reads them), trains a small GPT on 2 ranks or is refused
//! with one error line naming the key of a feature README lists as refused. Then the
//! optimizer the program builds, the resolved config, and bad training arguments.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{config, error_lines, losses, read_weights, run, steps, Scratch, SMALL_MODEL};
use serde_json::Value as Json;

const LIMIT: Duration = Duration::from_secs(120);

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tests/fixtures")
}

/// The corpus: DeepSpeed's verdict at world size 2 is ok, or a TypeError (an "auto").
fn corpus() -> Vec<String> {
    let verdicts =
        std::fs::read_to_string(fixtures().join("deepspeed-verdicts/real.ws2.jsonl")).unwrap();
    verdicts
        .lines()
        .map(|l| serde_json::from_str::<Json>(l).unwrap())
        .filter(|v| {
            let d = &v["deepspeed"];
            d["ok"] == Json::Bool(true)
                || d["error"]
                    .as_str()
                    .is_some_and(|e| e.starts_with("TypeError"))
        })
        .map(|v| v["file"].as_str().unwrap().to_string())
        .collect()
}

/// The keys of the refusals README lists (section "Bringing your own ds_config").
const REFUSED_KEYS: [&str; 5] = [
    "optimizer.type", // Lamb, the 1-bit optimizers, names outside torch.optim
    "optimizer.params.max_grad_norm", // DeepSpeed refuses it too
    "optimizer.params.betas", // torch's SGD takes none
    "train_micro_batch_size_per_gpu", // a list: a value for the autotuner
    "bfloat16.enabled", // an "auto" neither HF nor DeepSpeed fills
];

#[test]
fn every_real_config_trains_or_is_refused_by_name() {
    let s = Scratch::new("real-configs");
    let nvme = s.path("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let files = corpus();
    assert_eq!(files.len(), 88);
    // the tests' small GPT: real configs' batches (up to 1024 samples a step) in seconds
    let model = s.write("model.json", common::SMALL_MODEL);
    let (mut trained, mut refused) = (Vec::new(), Vec::new());
    for (i, file) in files.iter().enumerate() {
        let text = std::fs::read_to_string(fixtures().join("real").join(file)).unwrap();
        // offload paths point at the scratch directory
        let text = regex_free_nvme(&text, &nvme);
        let cfg = s.write(&format!("{i}.json"), &text);
        let out = run(
            &format!(
                "launch --nproc_per_node 2 --config {} train --model {} --steps 2 --eval-interval 0 --eval-batches 1 --metrics-dir {}",
                cfg.display(),
                model.display(),
                s.path(&format!("run{i}")).display()
            ),
            LIMIT,
        );
        if out.status.success() {
            assert_eq!(losses(&s.path(&format!("run{i}"))).len(), 2, "{file}");
            trained.push(file.clone());
            continue;
        }
        let text = format!("{}{}", out.stdout, out.stderr);
        let errors = error_lines(&text);
        assert_eq!(errors.len(), 1, "{file}: {text}");
        let named = REFUSED_KEYS
            .iter()
            .find(|k| errors[0].contains(&format!(": {k}")));
        assert!(
            named.is_some(),
            "{file}: refused for another reason: {}",
            errors[0]
        );
        refused.push((file.clone(), named.unwrap().to_string()));
    }
    eprintln!("trained {}, refused {}:", trained.len(), refused.len());
    for (f, k) in &refused {
        eprintln!("  {k}: {f}");
    }
    // Before the training arguments: 15 trained, 73 refused.
    assert_eq!((trained.len(), refused.len()), (73, 15), "{refused:#?}");
}

/// `"nvme_path": "..."` -> the scratch directory.
fn regex_free_nvme(text: &str, dir: &Path) -> String {
    let key = "\"nvme_path\"";
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(key) {
        let after = &rest[at + key.len()..];
        let open = after.find('"').unwrap();
        let close = after[open + 1..].find('"').unwrap();
        out.push_str(&rest[..at + key.len()]);
        out.push_str(&format!(": \"{}\"", dir.display()));
        rest = &after[open + 1 + close + 1..];
    }
    out.push_str(rest);
    out
}

fn train(s: &Scratch, name: &str, config: &str, flags: &str) -> PathBuf {
    let cfg = s.write(&format!("{name}.json"), config);
    let dir = s.path(name);
    let out = run(
        &format!(
            "train --config {} --model tiny --eval-interval 0 --eval-batches 1 --metrics-dir {} --save-weights {} {flags}",
            cfg.display(),
            dir.display(),
            s.path(&format!("{name}.safetensors")).display()
        ),
        LIMIT,
    );
    assert!(out.status.success(), "{name}: {}", out.stderr);
    dir
}

const NO_OPTIMIZER: &str =
    r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}"#;

/// The AdamW `train` builds without an optimizer section is the explicit AdamW section with
/// the same values (identical losses), and its schedule the argument's on both sides.
#[test]
fn the_programs_adamw_equals_an_explicit_section() {
    let s = Scratch::new("program-adamw");
    let flags = "--steps 3 --learning_rate 3e-3 --adam_beta2 0.95 --adam_epsilon 1e-6 --lr_scheduler_type cosine --warmup_steps 1";
    let program = train(&s, "program", NO_OPTIMIZER, flags);
    let explicit = r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.0}}}"#;
    let section = train(&s, "section", explicit, flags);
    let (a, b) = (losses(&program), losses(&section));
    assert_eq!(a, b);
    // the schedule moved the lr: a constant one would not tell the two apart
    let lrs: Vec<f64> = common::steps(&program)
        .iter()
        .map(|v| v["lr"].as_f64().unwrap())
        .collect();
    assert_eq!(lrs[0], 0.0, "HF's warmup starts at 0");
    assert!(lrs[1] > lrs[2] && lrs[2] > 0.0, "{lrs:?}");
}

/// HF's parameter groups: one step of the program's AdamW (weight decay 0.5) leaves norm
/// weights undecayed where the config's AdamW (which decays every parameter, as DeepSpeed
/// does with a flat parameter list) shrinks them by lr * wd * p (p = 1 at initialisation);
/// biases start at 0, which decay leaves at 0, and every other parameter decays in both runs:
/// those must be bit for bit the same.
#[test]
fn the_programs_adamw_skips_decay_on_biases_and_norms() {
    let s = Scratch::new("program-groups");
    let (lr, wd) = (1e-2f32, 0.5f32);
    let one_step = "--lr_scheduler_type constant --steps 1";
    train(
        &s,
        "program",
        NO_OPTIMIZER,
        &format!("--learning_rate {lr} --weight_decay {wd} {one_step}"),
    );
    let explicit = format!(
        r#"{{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {{"stage": 1}},
        "optimizer": {{"type": "AdamW", "params": {{"lr": {lr}, "weight_decay": {wd}}}}}}}"#
    );
    train(&s, "section", &explicit, one_step);
    let a = read_weights(&s.path("program.safetensors"));
    let b = read_weights(&s.path("section.safetensors"));
    let mut norms = 0;
    for (name, pa) in &a {
        let pb = &b[name];
        let norm_weight = name.contains("ln_") && name.ends_with(".weight");
        for (x, y) in pa.iter().zip(pb) {
            match norm_weight {
                // 1 - lr*u against 1*(1 - lr*wd) - lr*u, each op rounded in f32
                true => assert!(((x - y) - lr * wd).abs() < 1e-6, "{name}: {x} vs {y}"),
                false => assert_eq!(x.to_bits(), y.to_bits(), "{name}"),
            }
        }
        norms += usize::from(norm_weight);
    }
    assert!(norms >= 3, "the tiny GPT's LayerNorms: {norms}");
}

/// An "auto" config and its ds_config.resolved.json train the same run (same arguments).
#[test]
fn an_auto_config_and_its_resolved_file_train_alike() {
    let s = Scratch::new("resolved");
    let real =
        std::fs::read_to_string(fixtures().join("real/haotian-liu__LLaVA__scripts__zero2.json"))
            .unwrap();
    let flags = "--steps 3 --gradient_accumulation_steps 2 --per_device_train_batch_size 2 --learning_rate 1e-3";
    let auto = train(&s, "auto", &real, flags);
    let resolved = std::fs::read_to_string(auto.join("ds_config.resolved.json")).unwrap();
    assert!(!resolved.contains("\"auto\""), "{resolved}");
    let again = train(&s, "again", &resolved, flags);
    assert_eq!(losses(&auto), losses(&again));
}

/// The program's AdamW and its groups in other layouts (ZeRO-3 and ZeRO-2 with the optimizer
/// on NVMe over 2 ranks, tensor and pipeline parallelism): the losses of one rank.
#[test]
fn the_programs_adamw_is_the_same_in_every_layout() {
    let s = Scratch::new("program-layout");
    let flags = "--steps 4 --learning_rate 3e-3 --weight_decay 0.1 --warmup_steps 2";
    let batch = r#""train_batch_size": 8, "train_micro_batch_size_per_gpu": 2"#;
    let one = train(&s, "one", &format!("{{{batch}}}"), flags);
    let nvme = s.path("swap");
    std::fs::create_dir_all(&nvme).unwrap();
    let layouts = [
        ("z3", r#""zero_optimization": {"stage": 3}"#.to_string(), ""),
        (
            "z2-nvme",
            format!(
                r#""zero_optimization": {{"stage": 2, "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}}"#,
                nvme.display()
            ),
            "",
        ),
        (
            "tp2",
            r#""zero_optimization": {"stage": 1}"#.to_string(),
            "--tp 2",
        ),
        (
            "pp2",
            r#""zero_optimization": {"stage": 1}"#.to_string(),
            "--pp 2",
        ),
    ];
    for (name, zero, layout) in layouts {
        let cfg = s.write(&format!("{name}.json"), &format!("{{{batch}, {zero}}}"));
        let dir = s.path(name);
        let out = run(
            &format!(
                "launch --nproc_per_node 2 --config {} train --model tiny --eval-interval 0 --eval-batches 1 --metrics-dir {} {flags} {layout}",
                cfg.display(),
                dir.display()
            ),
            LIMIT,
        );
        assert!(out.status.success(), "{name}: {}", out.stderr);
        // the reduction order of two ranks against one (the equality tests' bound)
        common::assert_same_losses(&losses(&dir), &losses(&one), 1e-5, name);
    }
}

/// Bad training arguments: one error line naming what is wrong, exit 1, nothing started.
#[test]
fn bad_training_arguments_are_one_error_and_nothing_starts() {
    let s = Scratch::new("bad-args");
    let real = fixtures().join("real");
    let clip = s.write(
        "clip.json",
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5}"#,
    );
    let bf16 = real.join("huggingface__transformers__tests__deepspeed__ds_config_zero3_bf16.json");
    let cases = [
        (clip.clone(), "--max_grad_norm 1.0", "gradient_clipping = 0.5 in the config vs 1.0 from --max_grad_norm"),
        (bf16, "", "bfloat16.enabled: found \"auto\", expected a value: Hugging Face's Trainer does not fill this key and DeepSpeed would take its default, false"),
        (clip.clone(), "--per_device_train_batch_size 0", "--per_device_train_batch_size: found 0, expected a positive integer"),
        (clip.clone(), "--lr_scheduler_type cosin", "--lr_scheduler_type: found 'cosin', expected one of linear, cosine"),
        (clip, "--max_steps 3", "--steps 2 and --max_steps 3 disagree"),
    ];
    for (i, (cfg, flags, want)) in cases.iter().enumerate() {
        let dir = s.path(&format!("run{i}"));
        let out = run(
            &format!(
                "launch --nproc_per_node 2 --config {} train --model tiny --steps 2 --metrics-dir {} {flags}",
                cfg.display(),
                dir.display()
            ),
            LIMIT,
        );
        assert_eq!(out.status.code(), Some(1), "{flags}: {}", out.stderr);
        let text = format!("{}{}", out.stdout, out.stderr);
        let errors = error_lines(&text);
        assert_eq!(errors.len(), 1, "{flags}: {text}");
        assert!(errors[0].contains(want), "{flags}: {}", errors[0]);
        assert!(!dir.exists(), "{flags}: a rank started");
    }
}

/// `--max_steps` is the run's length, as in transformers (it once set only the schedule's
/// total, and the run trained its default 300 steps).
#[test]
fn max_steps_is_the_runs_length() {
    let s = Scratch::new("max-steps");
    let cfg = s.write("c.json", &config(1, ""));
    let model = s.write("model.json", SMALL_MODEL);
    let dir = s.path("m");
    let out = run(
        &format!(
            "launch --nproc_per_node 2 --config {} train --model {} --max_steps 3 --eval-batches 1 --metrics-dir {}",
            cfg.display(),
            model.display(),
            dir.display()
        ),
        LIMIT,
    );
    assert!(out.status.success(), "{}", out.stderr);
    assert_eq!(steps(&dir).len(), 3);
}

/// The autotuner on real configs with Adam's betas: trials run, and the optimal config keeps
/// the optimizer section as written.
#[test]
fn the_autotuner_tunes_real_configs_with_betas() {
    let s = Scratch::new("tune-real");
    let files = [
        // HF "auto" at ZeRO-3, betas "auto"
        "huggingface__transformers__tests__deepspeed__ds_config_zero3.json",
        // explicit Adam with betas (Megatron-DeepSpeed's betas configs also carry
        // max_grad_norm, which DeepSpeed 0.19.8 refuses)
        "microsoft__DeepSpeedExamples__training__cifar__ds_config.json",
        "microsoft__DeepSpeedExamples__training__pipeline_parallelism__ds_config.json",
        // Megatron-DeepSpeed's explicit optimizer (its configs with betas all carry
        // max_grad_norm, refused by DeepSpeed): the Megatron-LM scripts of DeepSpeedExamples
        "microsoft__DeepSpeedExamples__Megatron-LM__scripts__ds_zero2_config.json",
    ];
    for (i, file) in files.iter().enumerate() {
        let path = fixtures().join("real").join(file);
        let mut cfg: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let optimizer = cfg["optimizer"].clone();
        cfg["autotuning"] = serde_json::json!({
            "enabled": true, "start_profile_step": 1, "end_profile_step": 2,
            "max_train_micro_batch_size_per_gpu": 2, "num_tuning_micro_batch_sizes": 1,
            "results_dir": s.path(&format!("results{i}")), "exps_dir": s.path(&format!("exps{i}"))
        });
        let c = s.write(&format!("{i}.json"), &cfg.to_string());
        // the first also runs the best: a batch flag of the user's (3, no trial's micro-batch)
        // gives way to the batch each trial and the best run set through their configs
        let (mode, extra) = match i {
            0 => (
                "run",
                format!(
                    "--per_device_train_batch_size 3 --steps 2 --metrics-dir {}",
                    s.path("best").display()
                ),
            ),
            _ => ("tune", String::new()),
        };
        let out = run(
            &format!(
                "launch --autotuning {mode} --nproc_per_node 1 --memory_per_rank 1G --config {} train --model tiny {extra}",
                c.display()
            ),
            Duration::from_secs(300),
        );
        assert!(out.status.success(), "{file}: {}{}", out.stdout, out.stderr);
        let text = std::fs::read_to_string(
            s.path(&format!("results{i}"))
                .join("ds_config_optimal.json"),
        )
        .unwrap();
        let optimal: Json = serde_json::from_str(&text).unwrap();
        let megatron = file.contains("Megatron");
        assert!(
            megatron || optimizer["params"].get("betas").is_some(),
            "{file}"
        );
        assert_eq!(optimal["optimizer"], optimizer, "{file}");
    }
    assert_eq!(
        losses(&s.path("best")).len(),
        2,
        "the best configuration trained"
    );
}
