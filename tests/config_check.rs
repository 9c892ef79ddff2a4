//! End-to-end: the real `ds-rs` binary on config files, as a user or a tool runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as Json;

fn ds_rs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ds-rs"))
        .args(args)
        .output()
        .expect("ds-rs runs")
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file under the temp dir, removed when dropped (also when the test fails).
struct TempFile(PathBuf);

impl std::ops::Deref for TempFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn temp_file(name: &str, contents: &[u8]) -> TempFile {
    let path = std::env::temp_dir().join(format!("ds-rs-test-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).expect("write temp file");
    TempFile(path)
}

/// Runs `config check --json` and returns (exit code, the one JSON object printed).
fn check_json(file: &Path, extra: &[&str]) -> (i32, Json) {
    let mut args = vec![
        "config",
        "check",
        file.to_str().expect("utf-8 path"),
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = ds_rs(&args);
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("panicked"),
        "panic on {}: {stderr}",
        file.display()
    );
    assert_eq!(
        stdout.lines().count(),
        1,
        "exactly one line of JSON: {stdout}"
    );
    let json = serde_json::from_str(&stdout).expect("stdout is one JSON object");
    (out.status.code().expect("exit code"), json)
}

const CONTRACT_KEYS: [&str; 20] = [
    "ok",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_stage",
    "zero_offload_optimizer",
    "zero_offload_param",
    "fp16",
    "bf16",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "steps_per_print",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "warnings",
    "auto_filled",
    "ds_config",
];

#[test]
fn every_example_config_is_accepted_with_the_contract_keys() {
    let examples = repo().join("configs/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&examples).expect("configs/examples") {
        let file = entry.expect("dir entry").path();
        for n in ["1", "2", "8"] {
            let (code, json) = check_json(&file, &["--world-size", n]);
            assert_eq!(
                (code, &json["ok"]),
                (0, &Json::Bool(true)),
                "{} at {n}: {json}",
                file.display()
            );
            let keys: Vec<&str> = json
                .as_object()
                .expect("object")
                .keys()
                .map(String::as_str)
                .collect();
            assert_eq!(keys, CONTRACT_KEYS, "{}", file.display());
            let (t, m, g) = (
                &json["train_batch_size"],
                &json["train_micro_batch_size_per_gpu"],
                &json["gradient_accumulation_steps"],
            );
            let dp: i64 = n.parse().expect("number");
            assert_eq!(
                t.as_i64(),
                Some(m.as_i64().unwrap() * g.as_i64().unwrap() * dp),
                "{}: batch rule",
                file.display()
            );
        }
        seen += 1;
    }
    assert!(
        seen >= 8,
        "the examples cover ZeRO 0-3, offload, bf16, fp16 and pipeline"
    );
}

#[test]
fn pipeline_example_resolves_for_a_pipeline_layout() {
    let file = repo().join("configs/examples/pipeline.json");
    // 8 ranks as pp=2 x tp=2 leave dp=2: 64 = micro 4 * accumulation 8 * dp 2.
    let (code, json) = check_json(&file, &["--world-size", "8", "--tp", "2", "--pp", "2"]);
    assert_eq!(code, 0, "{json}");
    assert_eq!(json["train_micro_batch_size_per_gpu"], 4);
}

#[test]
fn an_invalid_config_gives_one_json_error_naming_the_path() {
    let file = temp_file(
        "stage4.json",
        br#"{"train_batch_size": 8, "zero_optimization": {"stage": 4}}"#,
    );
    let (code, json) = check_json(&file, &[]);
    assert_eq!(code, 1);
    assert_eq!(json["ok"], false);
    assert_eq!(
        json.as_object().map(|o| o.len()),
        Some(3),
        "only ok, error and paths: {json}"
    );
    assert_eq!(
        json["paths"],
        serde_json::json!(["zero_optimization.stage"])
    );
    assert!(
        json["error"]
            .as_str()
            .unwrap()
            .contains("zero_optimization.stage"),
        "{json}"
    );
}

#[test]
fn human_output_says_what_is_wrong_without_a_backtrace() {
    let file = temp_file(
        "both.json",
        br#"{"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}}"#,
    );
    let out = ds_rs(&["config", "check", file.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.starts_with("error: ") && stderr.contains("bf16.enabled"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
}

#[test]
fn malformed_files_are_errors_never_panics() {
    let deep_list = "[".repeat(10 << 20);
    let deep_object = "{\"a\":".repeat(2 << 20);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("not_json.json", b"this is { not json".to_vec()),
        ("truncated.json", br#"{"train_batch_size": 8, "zero_optimization": {"stage": 2"#.to_vec()),
        ("wrong_types.json", br#"{"train_batch_size": 8, "zero_optimization": {"stage": "two", "overlap_comm": [1]}}"#.to_vec()),
        ("duplicate.json", br#"{"train_batch_size": 8, "train_batch_size": 16}"#.to_vec()),
        ("not_utf8.json", b"{\"train_batch_size\": 8, \"x\": \"\xff\xfe\"}".to_vec()),
        ("deep_list.json", deep_list.into_bytes()),
        ("deep_object.json", deep_object.into_bytes()),
        ("list_root.json", b"[1, 2]".to_vec()),
    ];
    for (name, bytes) in cases {
        let file = temp_file(name, &bytes);
        let (code, json) = check_json(&file, &[]);
        assert_eq!(
            (code, &json["ok"]),
            (1, &Json::Bool(false)),
            "{name}: {json}"
        );
        assert!(
            !json["error"].as_str().unwrap_or_default().is_empty(),
            "{name}"
        );
    }
}

#[test]
fn unknown_top_level_key_is_a_warning_with_a_suggestion() {
    let file = temp_file(
        "typo.json",
        br#"{"train_batch_size": 8, "gradient_clipings": 1.0}"#,
    );
    let (code, json) = check_json(&file, &[]);
    assert_eq!(code, 0, "DeepSpeed ignores unknown top-level keys: {json}");
    let warnings = json["warnings"].to_string();
    assert!(
        warnings.contains("gradient_clipings")
            && warnings.contains("did you mean `gradient_clipping`"),
        "{warnings}"
    );
}

#[test]
fn auto_values_are_filled_from_the_training_arguments() {
    let file = temp_file(
        "auto.json",
        br#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}"#,
    );
    // without arguments, HF's defaults fill them as `train` would: micro-batch 8, accumulation 1
    let (code, json) = check_json(&file, &["--world-size", "2"]);
    assert_eq!(code, 0, "{json}");
    assert_eq!(json["train_batch_size"], 16, "{json}");
    assert_eq!(
        json["ds_config"]["train_micro_batch_size_per_gpu"], 8,
        "{json}"
    );
    let args = [
        "--world-size",
        "2",
        "--micro-batch",
        "4",
        "--grad-accum",
        "3",
        "--hidden-size",
        "512",
    ];
    let (code, json) = check_json(&file, &args);
    assert_eq!(code, 0, "{json}");
    assert_eq!(json["train_batch_size"], 24);
    assert_eq!(
        json["auto_filled"]["zero_optimization.reduce_bucket_size"],
        512 * 512
    );
    assert_eq!(json["reduce_bucket_size"], 512 * 512);
}

#[test]
fn bad_layout_is_an_error() {
    let file = repo().join("configs/examples/zero1.json");
    let (code, json) = check_json(&file, &["--world-size", "6", "--tp", "4"]);
    assert_eq!(code, 1);
    assert!(
        json["error"].as_str().unwrap().contains("tp * pp"),
        "{json}"
    );
}

#[test]
fn tp_defaults_to_the_configs_autotp_size_as_train_decides_it() {
    let file = temp_file(
        "autotp.json",
        br#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "tensor_parallel": {"autotp_size": 2}}"#,
    );
    // dp = world / tp: 8 = 2 x gas x dp
    for (extra, gas) in [
        (&[][..], 2),
        (&["--tp", "1"][..], 1),
        (&["--tp", "4"][..], 4),
    ] {
        let args = [&["--world-size", "4"][..], extra].concat();
        let (code, json) = check_json(&file, &args);
        assert_eq!(code, 0, "{args:?}: {json}");
        assert_eq!(json["gradient_accumulation_steps"], gas, "{args:?}: {json}");
    }
    let (code, json) = check_json(&file, &["--world-size", "3"]);
    assert_eq!(code, 1, "{json}");
    let error = json["error"].as_str().unwrap();
    assert!(
        error.contains("world size 3") && error.contains("tp * pp = 2"),
        "{json}"
    );
}
