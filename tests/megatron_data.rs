//! `--data PREFIX` with Megatron-LM's indexed datasets (data/tests/fixtures/megatron, written
//! by megatron-core): `train` and `eval` read them; the uint16 and int32 files of the same
//! documents give the same losses; a damaged index is one error line naming it.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

fn prefix(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data/tests/fixtures/megatron")
        .join(format!("{name}_text_document"))
}

fn eval_loss(model: &std::path::Path, data: &std::path::Path) -> f64 {
    let cmd = format!(
        "eval --model {} --data {} --seq-len 16",
        model.display(),
        data.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}\n{}", f.stderr);
    let v: serde_json::Value = serde_json::from_str(f.stdout.trim()).unwrap();
    v["eval_loss"].as_f64().unwrap()
}

#[test]
fn train_and_eval_read_indexed_datasets() {
    let s = Scratch::new("megatron-data");
    // ids up to 50000 need the model's vocabulary to cover them
    let model = s.write(
        "model.json",
        r#"{"V": 50304, "T": 16, "d": 32, "H": 2, "L": 1}"#,
    );
    let cmd = format!(
        "train --model {} --data {} --steps 2 --eval-interval 0 --eval-batches 1 --metrics-dir {}",
        model.display(),
        prefix("u16").display(),
        s.path("m").display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}\n{}", f.stderr);
    assert_eq!(losses(&s.path("m")).len(), 2);
    let (u16, i32) = (
        eval_loss(&model, &prefix("u16")),
        eval_loss(&model, &prefix("i32")),
    );
    assert_eq!(u16, i32, "the same documents in both encodings");

    let bad = s.path("bad_text_document");
    let mut idx = std::fs::read(prefix("u16").with_extension("idx")).unwrap();
    idx[17] = 7; // float32
    std::fs::write(bad.with_extension("idx"), idx).unwrap();
    std::fs::copy(
        prefix("u16").with_extension("bin"),
        bad.with_extension("bin"),
    )
    .unwrap();
    let f = run(
        &format!("eval --model {} --data {}", model.display(), bad.display()),
        LIMIT,
    );
    assert!(!f.status.success());
    assert!(
        f.stderr.contains("bad_text_document.idx") && f.stderr.contains("dtype code 7"),
        "{}",
        f.stderr
    );
    assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
}
