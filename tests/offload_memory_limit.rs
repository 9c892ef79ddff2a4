//! Beyond memory: under a cgroup memory limit smaller than a model's states, ZeRO-3 with the
//! optimizer and the parameters on NVMe trains, and the same job without offload is killed by
//! the kernel's OOM killer, named by the launcher. The test makes its own memory cgroup
//! (v1's memory controller, else v2's `memory.max`) under its own, and removes it; it is
//! skipped, saying why, where it cannot (not root, no memory controller).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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

/// A memory cgroup of this test's own, limited to `limit` bytes; removed on drop (any process
/// left in it killed first).
struct MemoryCgroup {
    dir: PathBuf,
}

impl MemoryCgroup {
    fn create(name: &str, limit: u64) -> Result<MemoryCgroup, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        // v1: "N:memory:/path"; v2: "0::/path"
        let v1 = own
            .lines()
            .find_map(|l| l.split_once(":memory:").map(|(_, p)| p));
        let (dir, limit_file) = match v1 {
            Some(p) => {
                let dir = Path::new("/sys/fs/cgroup/memory")
                    .join(p.trim_start_matches('/'))
                    .join(name);
                (dir, "memory.limit_in_bytes")
            }
            None => {
                let p = own
                    .lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .ok_or("no memory controller in /proc/self/cgroup")?;
                let dir = Path::new("/sys/fs/cgroup")
                    .join(p.trim_start_matches('/'))
                    .join(name);
                (dir, "memory.max")
            }
        };
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let group = MemoryCgroup { dir };
        let file = group.dir.join(limit_file);
        std::fs::write(&file, limit.to_string())
            .map_err(|e| format!("writing {}: {e}", file.display()))?;
        Ok(group)
    }

    /// `ds-rs ARGS` started inside the group (a shell joins it, then becomes ds-rs).
    fn command(&self, args: &str) -> Command {
        let procs = self.dir.join("cgroup.procs");
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!(
            "echo $$ > {} && exec {BIN} {args}",
            procs.display()
        ));
        c
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<&str> = procs.split_whitespace().collect();
        if !pids.is_empty() {
            let _ = Command::new("kill").arg("-9").args(&pids).status();
        }
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

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
    let name = format!("ds-rs-test-{}", std::process::id());
    let group = match MemoryCgroup::create(&name, GROUP_LIMIT) {
        Ok(g) => g,
        Err(why) => {
            println!(
                "skipped: cannot make a memory cgroup ({why}); needs root and a memory controller"
            );
            return;
        }
    };
    let model = s.write("model.json", MODEL);
    let nvme = s.path("nvme");
    std::fs::create_dir_all(&nvme).unwrap();
    let offload = format!(
        r#", "offload_optimizer": {{"device": "nvme", "nvme_path": "{0}"}},
        "offload_param": {{"device": "nvme", "nvme_path": "{0}"}}"#,
        nvme.display()
    );
    let job = |cfg: &Path, dir: &Path| {
        format!(
            "launch --nproc_per_node 2 --config {} {}",
            cfg.display(),
            train(&model, STEPS, dir)
        )
    };

    let with = s.path("with");
    let cfg = s.write("offload.json", &config(&offload));
    let f = finish(spawn_captured(&mut group.command(&job(&cfg, &with))), LIMIT);
    assert!(f.status.success(), "with offload: {}", f.stderr);
    let losses = losses(&with);
    assert_eq!(losses.len(), STEPS as usize, "{}", f.stdout);
    assert!(
        losses[losses.len() - 1] < losses[0],
        "the loss does not fall: {losses:?}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(with.join("summary.json")).unwrap()).unwrap();
    let ranks = summary["ranks"].as_array().unwrap();
    let mib = |m: &serde_json::Value, key: &str| m[key].as_f64().unwrap() / (1u64 << 20) as f64;
    for m in ranks {
        println!(
            "with offload, rank {}: peak RSS {:.0} MiB, {:.0} MiB on disk, under a group limit of {} MiB",
            m["rank"],
            m["peak_rss_mib"].as_f64().unwrap(),
            mib(m, "offloaded_bytes"),
            GROUP_LIMIT >> 20
        );
    }

    let without = s.path("without");
    let cfg = s.write("plain.json", &config(""));
    let f = finish(
        spawn_captured(&mut group.command(&job(&cfg, &without))),
        LIMIT,
    );
    assert!(!f.status.success(), "without offload it fit: {}", f.stdout);
    assert!(
        f.stderr.contains("SIGKILL"),
        "not the OOM killer's SIGKILL: {}",
        f.stderr
    );
    assert!(empty_dir(&nvme), "swap files left behind");
}

fn empty_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none())
}
