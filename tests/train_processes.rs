//! Training across separate processes: the real `ds-rs` binary as 2 ranks under ZeRO-3 trains
//! like one process with the same global batch (every step's loss within 1e-5 relative, the
//! tolerance of the in-process equality test), and starts from weights it wrote itself.

use std::path::PathBuf;
use std::process::Command;

fn config(dir: &std::path::Path, name: &str, micro: usize, stage: u8) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": {micro}, "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}}}}}"#
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn losses(nproc: usize, config: &PathBuf, init: &str, init_path: &PathBuf) -> Vec<f64> {
    let out = Command::new(env!("CARGO_BIN_EXE_ds-rs"))
        .args([
            "bench", "train", "--preset", "tiny", "--steps", "3", "--warmup", "0", "--json",
        ])
        .args(["--nproc", &nproc.to_string(), "--config"])
        .arg(config)
        .arg(init)
        .arg(init_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    row["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

#[test]
fn two_processes_under_zero3_train_like_one() {
    let dir = std::env::temp_dir().join(format!("ds-rs-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let init = dir.join("init.safetensors");
    let one = losses(1, &config(&dir, "one.json", 16, 0), "--save-init", &init);
    let two = losses(2, &config(&dir, "two.json", 8, 3), "--init", &init);
    assert_eq!(one.len(), 3);
    for (s, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!(
            ((a - b) / a).abs() < 1e-5,
            "step {s}: 2 ranks {b} vs 1 rank {a}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
