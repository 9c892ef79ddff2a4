//! Ulysses' promise under a real memory limit (issue 38): a context that 4 ranks cannot hold
//! with whole sequences (sp 1, data parallelism) trains when the 4 ranks split each sequence
//! (sp 4), both at ZeRO-3 with the MLPs and the loss tiled, under the same limit on the whole
//! job (launcher and ranks in one memory cgroup, as tests/memory_limit.rs makes it). Where no
//! memory cgroup can be made (not root, no controller) it prints why and passes without
//! running.
//!
//! The model and context: CI's case is llama-tiny (8.9M parameters) at 16384 positions, one
//! sample per step. A rank holding whole sequences keeps about 0.5 GB of activations (the
//! memory report: 505 MB at ZeRO-1, tiles of 1024), a rank of sp 4 about 160 MB; the limit,
//! 2 GiB for the job, is under 4 ranks of the first and over 4 of the second (measured below).
//! `DS_RS_LONG_CONTEXT=MODEL_DIR:T:LIMIT_MIB` runs the same comparison on another model (a
//! Hugging Face config directory), context and limit: engine/ARCHITECTURE.md records the ~100M model
//! at 32k positions run that way.
//!
//! The sp 1 run is refused by the memory check before it starts (naming `--sp` among the
//! changes that fit); started anyway (`--skip-memory-check`) it must fail because the kernel's
//! OOM killer killed one of its processes (the cgroup's oom_kill counter), not for any other
//! reason; the sp 4 run must see no OOM kill.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::cgroup::{run_in, Cgroup};
use common::*;

const NPROC: usize = 4;
const LIMIT: Duration = Duration::from_secs(1800);
const MIB: u64 = 1 << 20;

fn config() -> String {
    r#"{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3}}"#
        .to_string()
}

fn launch(cfg: &Path, model: &str, seq: usize, sp: usize, dir: &Path) -> Vec<String> {
    words(&format!(
        "launch --nproc_per_node {NPROC} --config {} train --model {model} --seq-len {seq} --steps 1 \
         --sp {sp} --tile 1024 --eval-interval 0 --eval-batches 1 --metrics-dir {}",
        cfg.display(),
        dir.display()
    ))
}

/// (model, positions, limit in bytes): CI's case, or the environment's.
fn case() -> (String, usize, u64) {
    match std::env::var("DS_RS_LONG_CONTEXT") {
        Ok(spec) => {
            let f: Vec<&str> = spec.split(':').collect();
            assert_eq!(
                f.len(),
                3,
                "DS_RS_LONG_CONTEXT=MODEL:T:LIMIT_MIB, got {spec}"
            );
            (
                f[0].into(),
                f[1].parse().unwrap(),
                f[2].parse::<u64>().unwrap() * MIB,
            )
        }
        Err(_) => ("llama-tiny".into(), 16384, 2048 * MIB),
    }
}

#[test]
fn a_context_too_long_for_whole_sequences_trains_split_over_four_ranks() {
    let t0 = Instant::now();
    let (model, seq, limit) = case();
    // Made first, so that a machine without cgroups skips before any training.
    let probe = match Cgroup::new(limit) {
        Ok(cg) => cg,
        Err(why) => {
            println!("skipped: no memory cgroup can be made here: {why}");
            return;
        }
    };
    let version = probe.version;
    drop(probe);
    let s = Scratch::new("long-context");
    let cfg = s.write("z3.json", &config());
    println!(
        "{model} at {seq} positions, 4 ranks, ZeRO-3, tiles of 1024; limit (cgroup {version:?}, \
         launcher + ranks): {} MiB",
        limit / MIB
    );

    // sp 4: each rank a quarter of every sequence
    let cg = Cgroup::new(limit).unwrap();
    let dir4 = s.path("sp4");
    let f = run_in(&cg, &launch(&cfg, &model, seq, 4, &dir4), LIMIT);
    let (kills, hits) = cg.oom_kills();
    assert!(
        cg.wait_empty(Duration::from_secs(10)),
        "sp 4 left processes: {:?}",
        cg.pids()
    );
    assert!(
        f.status.success(),
        "sp 4 under {limit} bytes: {} (oom_kill {kills:?}, failcnt {hits:?})\n{}",
        f.status,
        f.stderr
    );
    assert_eq!(kills.unwrap_or(0), 0, "sp 4 saw an OOM kill");
    let text = std::fs::read_to_string(dir4.join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(summary["layout"]["sp"].as_u64(), Some(4), "{summary}");
    let ranks = summary["ranks"].as_array().unwrap();
    let rss: Vec<String> = ranks
        .iter()
        .map(|r| format!("{:.0}", r["peak_rss_mib"].as_f64().unwrap()))
        .collect();
    let act: Vec<String> = ranks
        .iter()
        .map(|r| {
            format!(
                "{:.0}",
                r["activations_bytes"].as_f64().unwrap() / MIB as f64
            )
        })
        .collect();
    println!(
        "sp 4: exit 0 in {:.1} s, loss {:?}; per rank peak RSS {} MiB, activations {} MiB; cgroup peak {}",
        f.took.as_secs_f64(),
        losses(&dir4),
        rss.join("/"),
        act.join("/"),
        cg.peak().map_or("n/a".into(), |p| format!("{} MiB", p / MIB)),
    );
    drop(cg);

    // sp 1: whole sequences on each rank (data parallelism). Refused first, before any rank
    // starts, the memory check naming Ulysses among the changes that fit.
    let cg = Cgroup::new(limit).unwrap();
    let dir1 = s.path("sp1");
    let f = run_in(&cg, &launch(&cfg, &model, seq, 1, &dir1), LIMIT);
    println!(
        "sp 1 refused in {:.2} s:\n{}",
        f.took.as_secs_f64(),
        f.stderr.trim()
    );
    assert!(!f.status.success(), "sp 1 was not refused");
    assert!(
        f.took < Duration::from_secs(5),
        "the refusal took {:?}",
        f.took
    );
    assert!(f.stderr.contains("would not fit"), "{}", f.stderr);
    assert!(f.stderr.contains("--sp "), "{}", f.stderr);
    assert_eq!(
        cg.oom_kills().0.unwrap_or(0),
        0,
        "the refusal saw an OOM kill"
    );
    drop(cg);
    // started anyway, the kernel's OOM killer ends it
    let cg = Cgroup::new(limit).unwrap();
    let mut anyway = launch(&cfg, &model, seq, 1, &dir1);
    anyway.push("--skip-memory-check".into());
    let f = run_in(&cg, &anyway, LIMIT);
    assert!(
        cg.wait_empty(Duration::from_secs(10)),
        "sp 1 left processes: {:?}",
        cg.pids()
    );
    let (kills, hits) = cg.oom_kills();
    println!(
        "sp 1: {} after {:.1} s; oom_kill {kills:?}, failcnt {hits:?}",
        f.status,
        f.took.as_secs_f64()
    );
    assert!(!f.status.success(), "sp 1 trained under the limit");
    assert!(
        kills.or(hits).unwrap_or(0) > 0,
        "sp 1 failed without an OOM kill: {}\n{}",
        f.status,
        f.stderr
    );
    drop(cg);
    println!("took {:.1} s", t0.elapsed().as_secs_f64());
}
