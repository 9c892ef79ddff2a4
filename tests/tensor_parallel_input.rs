//! A tensor-parallel layout that cannot work is one clear error line before anything starts:
//! `ds-rs launch` plans `train` once for the job (`--tp`, else the config's
//! `tensor_parallel.autotp_size`, checked against the world size and the model), so no rank
//! runs, no rank log and no metrics directory is written, and the exit status is 1.

mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(30);

/// A config that trains any model here, with `extra` keys.
fn with(extra: &str) -> String {
    format!(
        r#"{{"train_batch_size": 12, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}{extra}}}"#
    )
}

/// Exit status 1 and exactly one `error:` line, containing every one of `names`.
fn assert_one_error(f: &Finished, names: &[&str], what: &str) {
    assert_eq!(f.status.code(), Some(1), "{what}: {}", f.stderr);
    let errors = error_lines(&f.stderr);
    assert_eq!(errors.len(), 1, "{what}: {}", f.stderr);
    for name in names {
        assert!(
            errors[0].contains(name),
            "{what}: {:?} should name {name:?}",
            errors[0]
        );
    }
    assert!(!f.stderr.contains("panicked"), "{what}: {}", f.stderr);
}

/// `launch --nproc_per_node N [--config CFG] train --model MODEL --steps 1 [--tp T]`, with a
/// log directory for the ranks, refused before any rank started.
fn refused_launch(nproc: usize, config: &str, model: &str, tp: Option<usize>, names: &[&str]) {
    let s = Scratch::new(&format!("tp-input-{nproc}-{}", tp.unwrap_or(0)));
    let cfg = s.write("cfg.json", &with(config));
    let model = match model.starts_with('{') {
        true => s.write("model.json", model).display().to_string(),
        false => model.to_string(),
    };
    let (dir, logs) = (s.path("metrics"), s.path("logs"));
    let tp = tp.map_or(String::new(), |t| format!("--tp {t}"));
    let cmd = format!(
        "launch --nproc_per_node {nproc} --log_dir {} --config {} train --model {model} \
         --steps 1 --metrics-dir {} {tp}",
        logs.display(),
        cfg.display(),
        dir.display()
    );
    let f = run(&cmd, LIMIT);
    assert_one_error(&f, names, &cmd);
    assert!(!dir.exists(), "{cmd}: a rank wrote {}", dir.display());
    assert!(!logs.exists(), "{cmd}: a rank log was opened");
    // A rank's output is prefixed `[rankN]`: none may have run.
    assert!(!f.stderr.contains("[rank"), "{cmd}: {}", f.stderr);
    assert!(!f.stdout.contains("[rank"), "{cmd}: {}", f.stdout);
}

#[test]
fn tp_that_does_not_divide_the_world_size_is_refused_by_the_launcher() {
    refused_launch(3, "", "tiny", Some(2), &["world size 3", "tp * pp = 2"]);
}

#[test]
fn tp_that_does_not_divide_the_heads_is_refused_by_the_launcher() {
    let model = r#"{"V": 64, "T": 8, "d": 24, "H": 3, "L": 1}"#;
    refused_launch(2, "", model, Some(2), &["degree 2", "heads H = 3"]);
}

#[test]
fn tp_that_does_not_divide_the_vocabulary_is_refused_by_the_launcher() {
    let model = r#"{"V": 64, "T": 8, "d": 24, "H": 3, "L": 1}"#;
    refused_launch(3, "", model, Some(3), &["degree 3", "vocabulary V = 64"]);
}

#[test]
fn autotp_size_that_does_not_divide_the_world_size_is_refused_by_the_launcher() {
    let config = r#", "tensor_parallel": {"autotp_size": 4}"#;
    refused_launch(2, config, "tiny", None, &["world size 2", "tp * pp = 4"]);
}

#[test]
fn train_alone_refuses_tp_larger_than_its_one_rank() {
    let s = Scratch::new("tp-input-alone");
    let dir = s.path("metrics");
    let cmd = format!(
        "train --model tiny --steps 1 --tp 2 --metrics-dir {}",
        dir.display()
    );
    let f = run(&cmd, LIMIT);
    assert_one_error(&f, &["world size 1", "tp * pp = 2"], &cmd);
    assert!(!dir.exists(), "{cmd}: wrote {}", dir.display());
}
