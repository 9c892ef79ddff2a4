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
//! The ZeRO-0 run must fail because the kernel's OOM killer killed one of its processes (the
//! cgroup's oom_kill counter), not for any other reason; the ZeRO-3 run must see no OOM kill.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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

/// Which cgroup hierarchy a limit lives in.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Version {
    V1,
    V2,
}

/// A memory cgroup made by the test; its processes are killed and the directory removed when
/// dropped (also when the test fails).
struct Cgroup {
    dir: PathBuf,
    version: Version,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("writing {value:?} to {}: {e}", path.display()))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The value of `key` in a flat keyed file (memory.events, memory.oom_control).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next()?.parse().ok())
            .flatten()
    })
}

/// This process's cgroup path in the hierarchy whose /proc/self/cgroup line matches `want`.
fn own_path(want: impl Fn(&str, &str) -> bool) -> Option<String> {
    read(Path::new("/proc/self/cgroup")).lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        want(id, controllers).then(|| path.to_string())
    })
}

impl Cgroup {
    /// A fresh memory cgroup limited to `bytes` (swap included where the kernel counts it), or
    /// why none can be made here.
    fn new(bytes: u64) -> Result<Cgroup, String> {
        let name = format!(
            "ds-rs-memlimit-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let mut why = Vec::new();
        for (version, parent) in candidates() {
            let dir = parent.join(&name);
            if let Err(e) = std::fs::create_dir(&dir) {
                why.push(format!("mkdir {}: {e}", dir.display()));
                continue;
            }
            let cg = Cgroup { dir, version };
            match cg.limit(bytes) {
                Ok(()) => return Ok(cg),
                Err(e) => why.push(e), // dropped: the directory is removed
            }
        }
        if why.is_empty() {
            why.push(
                "no cgroup v1 memory controller, and no cgroup v2 hierarchy whose memory \
                 controller is handed down to where this test could make a cgroup"
                    .into(),
            );
        }
        Err(why.join("; "))
    }

    fn limit(&self, bytes: u64) -> Result<(), String> {
        let file = |n: &str| self.dir.join(n);
        match self.version {
            Version::V1 => {
                write(&file("memory.limit_in_bytes"), &bytes.to_string())?;
                // No swap may hide the overrun (memsw exists only with swap accounting).
                if file("memory.memsw.limit_in_bytes").exists() {
                    write(&file("memory.memsw.limit_in_bytes"), &bytes.to_string())?;
                }
                let _ = write(&file("memory.swappiness"), "0");
            }
            Version::V2 => {
                if !file("memory.max").exists() {
                    return Err(format!(
                        "{}: no memory.max (memory controller not enabled)",
                        self.dir.display()
                    ));
                }
                write(&file("memory.max"), &bytes.to_string())?;
                if file("memory.swap.max").exists() {
                    write(&file("memory.swap.max"), "0")?;
                }
            }
        }
        Ok(())
    }

    /// The file a process writes its pid to, to join.
    fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn pids(&self) -> Vec<u32> {
        read(&self.procs())
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Processes the OOM killer killed in this cgroup, and how often usage hit the limit.
    fn oom_kills(&self) -> (Option<u64>, Option<u64>) {
        match self.version {
            Version::V1 => {
                // With swap accounting the memory+swap counter is charged first and fails first.
                let count = |f: &str| read(&self.dir.join(f)).trim().parse::<u64>().ok();
                let hits = match (count("memory.failcnt"), count("memory.memsw.failcnt")) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                (
                    keyed(&read(&self.dir.join("memory.oom_control")), "oom_kill"),
                    hits,
                )
            }
            Version::V2 => {
                let events = read(&self.dir.join("memory.events"));
                (keyed(&events, "oom_kill"), keyed(&events, "max"))
            }
        }
    }

    /// The most memory the cgroup was charged (v1 always; v2 where memory.peak exists).
    fn peak(&self) -> Option<u64> {
        let f = match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        };
        read(&self.dir.join(f)).trim().parse().ok()
    }

    /// Waits (at most `limit`) until no process is left in the cgroup.
    fn wait_empty(&self, limit: Duration) -> bool {
        wait_for(limit, || self.pids().is_empty())
    }
}

/// Where a memory cgroup can be made: the v1 memory controller (under this process's own
/// cgroup, then the hierarchy's root), or cgroup v2 (beside this process's cgroup, whose parent
/// hands the memory controller down, or at the root).
fn candidates() -> Vec<(Version, PathBuf)> {
    let mut out = Vec::new();
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if v1.join("memory.limit_in_bytes").exists() {
        let own = own_path(|_, c| c.split(',').any(|c| c == "memory"));
        if let Some(own) = own.filter(|p| p != "/") {
            out.push((Version::V1, v1.join(own.trim_start_matches('/'))));
        }
        out.push((Version::V1, v1.to_path_buf()));
    }
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let root = Path::new(root);
        if !read(&root.join("cgroup.controllers"))
            .split_whitespace()
            .any(|c| c == "memory")
        {
            continue;
        }
        // The root may hand the controller down; a non-root cgroup with processes cannot.
        let enabled = |dir: &Path| {
            read(&dir.join("cgroup.subtree_control"))
                .split_whitespace()
                .any(|c| c == "memory")
        };
        if let Some(own) = own_path(|id, _| id == "0").filter(|p| p != "/") {
            let own = root.join(own.trim_start_matches('/'));
            if let Some(parent) = own.parent().filter(|p| enabled(p)) {
                out.push((Version::V2, parent.to_path_buf()));
            }
        }
        // (The test does not enable the controller itself: that would outlive it.)
        if enabled(root) {
            out.push((Version::V2, root.to_path_buf()));
        }
    }
    out
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Whatever is still inside was started by this test (the launcher and its ranks).
        let t0 = Instant::now();
        while !self.pids().is_empty() && t0.elapsed() < Duration::from_secs(20) {
            for pid in self.pids() {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // The kernel releases a cgroup a moment after its last process is reaped.
        let removed = wait_for(Duration::from_secs(10), || {
            std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists()
        });
        if !removed {
            eprintln!("could not remove the cgroup {}", self.dir.display());
        }
    }
}

/// `ds-rs ARGS` started in `cg` (through a shell that joins it, then becomes the launcher),
/// run to the end (at most LIMIT).
fn run_in(cg: &Cgroup, args: &[String]) -> Finished {
    let child = spawn_captured(
        Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(cg.procs())
            .arg(BIN)
            .args(args),
    );
    finish(child, LIMIT)
}

fn launch(s: &Scratch, model: &Path, stage: u8, dir: &Path) -> Vec<String> {
    let cfg = s.write(&format!("z{stage}.json"), &config(stage));
    words(&format!(
        "launch --nproc_per_node {NPROC} --config {} train --model {} --steps 2 --eval-batches 1 --metrics-dir {}",
        cfg.display(),
        model.display(),
        dir.display()
    ))
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
    let f = finish(start_args(&launch(&s, &tiny, 3, &tiny_dir)), LIMIT);
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

    // ZeRO-3 trains within the limit.
    let cg = Cgroup::new(limit).unwrap();
    let dir3 = s.path("zero3");
    let f = run_in(&cg, &launch(&s, &model, 3, &dir3));
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

    // ZeRO-0 needs 8 Psi bytes per rank: the OOM killer ends it.
    let cg = Cgroup::new(limit).unwrap();
    let dir0 = s.path("zero0");
    let f = run_in(&cg, &launch(&s, &model, 0, &dir0));
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
