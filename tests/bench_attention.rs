//! `ds-rs bench attention` as a user runs it: a row per path on the CPU, and a clear refusal of
//! a head grouping that cannot be.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ds-rs"))
        .args(["bench", "attention", "--batch", "1", "--seq-len", "40"])
        .args(["--head-dim", "32", "--iters", "1", "--warmup", "0"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn times_both_paths_on_the_cpu() {
    let out = bench(&["--heads", "4", "--kv-heads", "2", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let paths: Vec<&str> = rows.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["flash", "matmul"]);
    for r in &rows {
        assert!(r["median_ms"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(r["kv_heads"], 2);
    }
}

#[test]
fn refuses_key_value_heads_that_do_not_divide_the_heads() {
    let out = bench(&["--heads", "12", "--kv-heads", "5"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--kv-heads 5 must divide --heads 12"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
