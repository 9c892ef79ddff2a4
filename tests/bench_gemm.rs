//! `ds-rs bench gemm`: the instruction sets it reports are the ones the kernel lists for this
//! CPU (/proc/cpuinfo's flags, an independent source), and it times every linear layer's
//! product of the model's step.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn the_ceiling_names_this_cpus_instruction_sets_and_times_each_shape() {
    let f = run(
        "bench gemm --model tiny --iters 1 --json",
        Duration::from_secs(120),
    );
    assert!(f.status.success(), "{}", f.stderr);
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    let isa: Vec<&str> = v["isa"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = info
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .map_or(vec![], |f| f.split_whitespace().collect());
    // the kernel's names for the same extensions
    for (ours, kernel) in [
        ("avx2", "avx2"),
        ("fma", "fma"),
        ("avx512f", "avx512f"),
        ("avx512bf16", "avx512_bf16"),
        ("amx_tile", "amx_tile"),
    ] {
        if !flags.is_empty() {
            assert_eq!(
                isa.contains(&ours),
                flags.contains(&kernel),
                "{ours}: {isa:?}"
            );
        }
    }
    let shapes = v["shapes"].as_array().unwrap();
    let secs = v["ds_rs_seconds"].as_array().unwrap();
    assert_eq!(shapes.len(), 5);
    assert_eq!(secs.len(), shapes.len());
    assert!(secs.iter().all(|s| s.as_f64().unwrap() > 0.0));
    assert!(v["torch_gflops"].is_null(), "no --peer, no PyTorch figure");
}
