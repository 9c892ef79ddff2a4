//! ZeRO's promise under a real memory limit: a model whose whole fp32 copy does not fit in a
//! rank's share of the memory trains at ZeRO-3 on 4 ranks, and the same limit kills ZeRO-0.
//!
//! The test makes a memory cgroup (the v1 memory controller where it is mounted, cgroup v2
//! otherwise), puts the launcher in it (so every rank inherits it) and limits the whole job:
//! launcher and 4 ranks together. Where no memory cgroup can be made (not root, no controller),
//! it prints why and passes without running.
//!
//! The arithmetic (Psi parameters, bf16 with SGD without momentum, so no optimizer moments):
//! - ZeRO-0 holds on every rank bf16 parameters (2 Psi bytes) + bf16 gradients (2 Psi) + the
//!   fp32 master copy (4 Psi): 8 Psi per rank, 32 Psi for the job;
//! - ZeRO-3 holds a quarter of each: 2 Psi per rank, 8 Psi for the job, plus one layer gathered
//!   (`stage3_max_live_parameters` 1e6, `stage3_max_reuse_distance` 0, small buckets);
//! - the limit is 4 whole fp32 copies (16 Psi bytes): each rank's share is one fp32 copy and
//!   nothing for the process itself (its fixed cost, measured here with a 1-layer model), so no
//!   rank could hold the whole model in fp32.
//!
//! Measured on the 2-core development machine (cgroup v1): the limit is 777.8 MiB; ZeRO-3 peaks
//! at 167-188 MiB RSS per rank, 649-672 MiB charged to the cgroup, and trains in 14-17 s; ZeRO-0
//! is OOM-killed (oom_kill 1; the launcher exits 137) after 9-13 s.
//!
//! Started plainly, ZeRO-0 is refused by the memory check within seconds, its first suggestion
//! ZeRO-3, which then trains under the same limit with each rank's peak within 15% of the
//! prediction. Started anyway (`--skip-memory-check`), ZeRO-0 must fail because the kernel's OOM
//! killer killed one of its processes (the cgroup's oom_kill counter), not for any other
//! reason; the ZeRO-3 run must see no OOM kill.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::cgroup::{run_in, Cgroup};
use common::*;

/// 50,971,648 parameters, mostly in 16 blocks of 3.15M each (the largest layer ZeRO-3 gathers),
/// with a short sequence and micro-batch 1 so activations are negligible.
const MODEL: (u64, u64, u64, u64, u64) = (512, 16, 512, 8, 16); // V, T, d, H, L
/// A 1-layer model of the same kind: its peak RSS per rank is the process's fixed cost.
const TINY: &str = r#"{"V": 256, "T": 16, "d": 64, "H": 2, "L": 1}"#;
const NPROC: u64 = 4;
const LIMIT: Duration = Duration::from_secs(90);
const MIB: f64 = 1024.0 * 1024.0;

/// The GPT's parameter count: token and position embeddings, L blocks (attention 4 d^2 + 4 d,
/// MLP 8 d^2 + 5 d, two layer norms 4 d), the final norm and the untied head.
fn parameters((v, t, d, _, l): (u64, u64, u64, u64, u64)) -> u64 {
    v * d + t * d + l * (12 * d * d + 13 * d) + 2 * d + d * v
}

fn config(stage: u8) -> String {
    format!(
        r#"{{"train_batch_size": {NPROC}, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
        "bf16": {{"enabled": true}},
        "optimizer": {{"type": "SGD", "params": {{"lr": 1e-3}}}},
        "zero_optimization": {{"stage": {stage}, "stage3_max_live_parameters": 1e6,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1e6,
            "reduce_bucket_size": 1e6, "allgather_bucket_size": 1e6}}}}"#
    )
}

fn launch(s: &Scratch, model: &Path, stage: u8, dir: &Path, extra: &str) -> Vec<String> {
    let cfg = s.write(&format!("z{stage}.json"), &config(stage));
    words(&format!(
        "launch --nproc_per_node {NPROC} --config {} train --model {} --steps 2 --eval-batches 1 --metrics-dir {} {extra}",
        cfg.display(),
        model.display(),
        dir.display()
    ))
}

/// Each rank's peak RSS as `ds-rs estimate --config` predicts it, in MiB.
fn predicted_mib(s: &Scratch, model: &Path, stage: u8) -> Vec<f64> {
    let cfg = s.path(&format!("z{stage}.json"));
    let cmd = format!(
        "estimate --config {} --model {} --world-size {NPROC} --json",
        cfg.display(),
        model.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}", f.stderr);
    let v: serde_json::Value = serde_json::from_str(&f.stdout).unwrap();
    v["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["predicted_peak_bytes"].as_f64().unwrap() / MIB)
        .collect()
}

fn summary(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("summary.json"))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join("summary.json").display()));
    serde_json::from_str(&text).unwrap()
}

fn peak_rss(summary: &serde_json::Value) -> Vec<f64> {
    summary["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peak_rss_mib"].as_f64().unwrap())
        .collect()
}

#[test]
fn zero3_trains_under_a_limit_that_kills_zero0() {
    let t0 = Instant::now();
    let psi = parameters(MODEL);
    let fp32_copy = 4 * psi;
    let limit = NPROC * fp32_copy;
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

    let s = Scratch::new("memory-limit");
    let (v, t, d, h, l) = MODEL;
    let model = s.write(
        "model.json",
        &format!(r#"{{"V": {v}, "T": {t}, "d": {d}, "H": {h}, "L": {l}}}"#),
    );

    // The process's fixed cost: a 1-layer model's peak RSS per rank, same settings, no limit.
    let tiny = s.write("tiny.json", TINY);
    let tiny_dir = s.path("tiny");
    let f = finish(start_args(&launch(&s, &tiny, 3, &tiny_dir, "")), LIMIT);
    assert!(f.status.success(), "tiny model: {}", f.stderr);
    let fixed = peak_rss(&summary(&tiny_dir))
        .into_iter()
        .fold(0.0, f64::max);
    let share = limit as f64 / NPROC as f64 / MIB;
    println!(
        "model V={v} T={t} d={d} H={h} L={l}: {psi} parameters; one fp32 copy {:.1} MiB",
        fp32_copy as f64 / MIB
    );
    println!(
        "limit (cgroup {version:?}, launcher + {NPROC} ranks): {limit} bytes = {:.1} MiB, {share:.1} MiB \
         per rank; a rank holding a whole fp32 copy needs {:.1} + {fixed:.1} (the process's fixed \
         cost: the 1-layer model's peak RSS) = {:.1} MiB",
        limit as f64 / MIB,
        fp32_copy as f64 / MIB,
        fp32_copy as f64 / MIB + fixed
    );
    assert!(
        share < fp32_copy as f64 / MIB + fixed,
        "the limit must leave no rank room for a whole fp32 copy"
    );

    // ZeRO-0 is refused before any rank starts, the memory check naming ZeRO-3 first.
    let cg = Cgroup::new(limit).unwrap();
    let f = run_in(&cg, &launch(&s, &model, 0, &s.path("refused"), ""), LIMIT);
    let errors = error_lines(&f.stderr);
    println!(
        "ZeRO-0 refused in {:.2} s: {}",
        f.took.as_secs_f64(),
        f.stderr.trim()
    );
    assert!(!f.status.success(), "ZeRO-0 was not refused");
    assert!(
        f.took < Duration::from_secs(5),
        "the refusal took {:?}",
        f.took
    );
    assert_eq!(errors.len(), 1, "{}", f.stderr);
    assert!(errors[0].contains("would not fit"), "{}", errors[0]);
    let first = f.stderr.lines().find(|l| l.trim_start().starts_with("- "));
    assert!(first.is_some_and(|l| l.contains("ZeRO-3")), "{}", f.stderr);
    assert_eq!(
        cg.oom_kills().0.unwrap_or(0),
        0,
        "the refusal saw an OOM kill"
    );
    drop(cg);

    // The first suggestion, ZeRO-3, trains within the limit.
    let cg = Cgroup::new(limit).unwrap();
    let dir3 = s.path("zero3");
    let f = run_in(&cg, &launch(&s, &model, 3, &dir3, ""), LIMIT);
    let (kills, hits) = cg.oom_kills();
    assert!(
        cg.wait_empty(Duration::from_secs(10)),
        "ZeRO-3 left processes: {:?}",
        cg.pids()
    );
    assert!(
        f.status.success(),
        "ZeRO-3 under {limit} bytes: {} (oom_kill {kills:?}, failcnt {hits:?})\n{}",
        f.status,
        f.stderr
    );
    assert_eq!(kills.unwrap_or(0), 0, "ZeRO-3 saw an OOM kill");
    let sum3 = summary(&dir3);
    assert_eq!(sum3["model"]["parameters"].as_u64(), Some(psi));
    assert_eq!(sum3["layout"]["world_size"].as_u64(), Some(NPROC));
    let rss = peak_rss(&sum3);
    assert_eq!(rss.len(), NPROC as usize, "{sum3}");
    let total: f64 = rss.iter().sum();
    println!(
        "ZeRO-3: exit 0 in {:.1} s; peak RSS per rank {} MiB (sum {total:.0} MiB); cgroup peak {}; \
         failcnt {hits:?}, oom_kill {kills:?}",
        f.took.as_secs_f64(),
        rss.iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join("/"),
        cg.peak()
            .map_or("n/a".into(), |p| format!("{:.0} MiB", p as f64 / MIB)),
    );
    drop(cg);
    // the memory model's prediction beside the measured peaks (its own tests hold it to
    // -10..+7%; here the bound the check may rely on)
    let predicted = predicted_mib(&s, &model, 3);
    for (p, m) in predicted.iter().zip(&rss) {
        println!("ZeRO-3 rank peak: predicted {p:.0} MiB, measured {m:.0} MiB");
        assert!(
            (p / m - 1.0).abs() <= 0.15,
            "predicted {p:.0} MiB, measured {m:.0} MiB"
        );
    }

    // ZeRO-0 needs 8 Psi bytes per rank: started anyway, the OOM killer ends it.
    let cg = Cgroup::new(limit).unwrap();
    let dir0 = s.path("zero0");
    let f = run_in(
        &cg,
        &launch(&s, &model, 0, &dir0, "--skip-memory-check"),
        LIMIT,
    );
    assert!(
        cg.wait_empty(Duration::from_secs(10)),
        "ZeRO-0 left processes: {:?}",
        cg.pids()
    );
    let (kills, hits) = cg.oom_kills();
    let why = f
        .stderr
        .lines()
        .filter(|l| l.contains("killed") || l.starts_with("error"))
        .collect::<Vec<_>>()
        .join(" | ");
    println!(
        "ZeRO-0: {} after {:.1} s; oom_kill {kills:?}, failcnt {hits:?}; launcher: {why}",
        f.status,
        f.took.as_secs_f64()
    );
    assert!(!f.status.success(), "ZeRO-0 trained under the limit");
    // The OOM killer, not another failure (failcnt only where the kernel has no oom_kill count).
    assert!(
        kills.or(hits).unwrap_or(0) > 0,
        "ZeRO-0 failed without an OOM kill: {}\n{}",
        f.status,
        f.stderr
    );
    drop(cg);
    println!("took {:.1} s", t0.elapsed().as_secs_f64());
}
