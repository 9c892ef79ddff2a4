//! Beyond memory: under a cgroup memory limit smaller than a model's states, ZeRO-3 with the
//! optimizer and the parameters on NVMe trains; the same job without offload is refused by the
//! memory check before it starts (naming NVMe offload as what fits) and, started anyway, killed
//! by the kernel's OOM killer (the cgroup's oom_kill count), named by the launcher. The test makes
//! its own memory cgroup (tests/common/cgroup.rs) and removes it; it is skipped, saying why,
//! where it cannot (not root, no memory controller).

mod common;

use std::path::Path;
use std::time::Duration;

use common::cgroup::{run_in, Cgroup};
use common::*;

const LIMIT: Duration = Duration::from_secs(300);
const STEPS: u64 = 4;

/// 16 blocks of d = 512: 50.9M parameters, 20 bytes each (fp32 parameters and gradients,
/// master copy, Adam's two moments): 1018 MB of model states, 509 MB per rank at ZeRO-3.
const MODEL: &str = r#"{"V": 512, "T": 64, "d": 512, "H": 8, "L": 16}"#;

/// The group's limit, for both ranks together: below the states of either rank alone plus the
/// other's (1018 MB), above what offload leaves resident (two ranks of ~200 MB: the gradient
/// shard, one gathered block, the streamed chunks and the process itself).
const GROUP_LIMIT: u64 = 700 << 20;

fn config(offload: &str) -> String {
    format!(
        r#"{{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 3e-4}}}},
        "zero_optimization": {{"stage": 3, "stage3_max_live_parameters": 4000000,
            "stage3_prefetch_bucket_size": 4000000{offload}}}}}"#
    )
}

#[test]
fn a_model_whose_states_exceed_the_memory_limit_trains_only_with_offload() {
    let s = Scratch::new("offload-cgroup");
    let group = match Cgroup::new(GROUP_LIMIT) {
        Ok(g) => g,
        Err(why) => {
            println!("skipped: no memory cgroup can be made here: {why}");
            return;
        }
    };
    drop(group);
    let model = s.write("model.json", MODEL);
    let nvme = s.path("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let offload = format!(
        r#", "offload_optimizer": {{"device": "nvme", "nvme_path": "{0}"}},
        "offload_param": {{"device": "nvme", "nvme_path": "{0}"}}"#,
        nvme.display()
    );
    let job = |cfg: &Path, dir: &Path| {
        words(&format!(
            "launch --nproc_per_node 2 --config {} {}",
            cfg.display(),
            train(&model, STEPS, dir)
        ))
    };

    let cg = Cgroup::new(GROUP_LIMIT).unwrap();
    let with = s.path("with");
    let cfg = s.write("offload.json", &config(&offload));
    let f = run_in(&cg, &job(&cfg, &with), LIMIT);
    let (kills, _) = cg.oom_kills();
    assert!(f.status.success(), "with offload: {}", f.stderr);
    assert_eq!(kills.unwrap_or(0), 0, "with offload: an OOM kill");
    let losses = losses(&with);
    assert_eq!(losses.len(), STEPS as usize, "{}", f.stdout);
    assert!(
        losses[losses.len() - 1] < losses[0],
        "the loss does not fall: {losses:?}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(with.join("summary.json")).unwrap()).unwrap();
    for m in summary["ranks"].as_array().unwrap() {
        println!(
            "with offload, rank {}: peak RSS {:.0} MiB, {:.0} MiB on disk, under a group limit of {} MiB",
            m["rank"],
            m["peak_rss_mib"].as_f64().unwrap(),
            m["offloaded_bytes"].as_f64().unwrap() / (1u64 << 20) as f64,
            GROUP_LIMIT >> 20
        );
    }
    drop(cg);

    // without offload: refused before any rank starts, NVMe offload named as what fits
    let cg = Cgroup::new(GROUP_LIMIT).unwrap();
    let without = s.path("without");
    let cfg = s.write("plain.json", &config(""));
    let f = run_in(&cg, &job(&cfg, &without), LIMIT);
    println!(
        "without offload, refused in {:.2} s: {}",
        f.took.as_secs_f64(),
        f.stderr.trim()
    );
    assert!(!f.status.success(), "without offload it was not refused");
    assert!(
        f.took < Duration::from_secs(5),
        "the refusal took {:?}",
        f.took
    );
    assert!(
        f.stderr.contains("would not fit") && f.stderr.contains("\"nvme\""),
        "{}",
        f.stderr
    );
    drop(cg);
    // started anyway, the kernel's OOM killer ends it
    let cg = Cgroup::new(GROUP_LIMIT).unwrap();
    let mut anyway = job(&cfg, &without);
    anyway.push("--skip-memory-check".into());
    let f = run_in(&cg, &anyway, LIMIT);
    let (kills, hits) = cg.oom_kills();
    assert!(!f.status.success(), "without offload it fit: {}", f.stdout);
    // the OOM killer, not another failure (failcnt where the kernel has no oom_kill count)
    assert!(
        kills.or(hits).unwrap_or(0) > 0 && f.stderr.contains("SIGKILL"),
        "without offload: not the OOM killer (oom_kill {kills:?}): {}",
        f.stderr
    );
    drop(cg);
    assert!(is_empty_dir(&nvme), "swap files left behind");
}
