//! ZeRO-Infinity's NVMe tier (`offload_optimizer` / `offload_param: {"device": "nvme"}`),
//! end to end with the real binary: the same losses, bit for bit, as the run that keeps
//! everything in memory, optimizer states at ZeRO 1-3 and parameters (alone and with them) at
//! ZeRO-3, over 2 ranks; checkpoints that are the same files
//! (resuming an offloaded run without offload, and the other way, is exact); the swap files
//! gone after every run; bad input named.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(240);

/// The tests' config with `offload` inside `zero_optimization` (after the stage).
fn offload_config(stage: u8, offload: &str) -> String {
    config(stage, "").replace(
        &format!(r#""zero_optimization": {{"stage": {stage}}}"#),
        &format!(r#""zero_optimization": {{"stage": {stage}{offload}}}"#),
    )
}

fn nvme(path: &Path) -> String {
    format!(
        r#", "offload_optimizer": {{"device": "nvme", "nvme_path": "{}", "buffer_count": 4}}"#,
        path.display()
    )
}

fn nvme_params(path: &Path) -> String {
    format!(
        r#", "offload_param": {{"device": "nvme", "nvme_path": "{}"}}"#,
        path.display()
    )
}

fn ok(cmd: &str) -> Finished {
    let f = run(cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}", f.stderr);
    f
}

fn train_cmd(cfg: &Path, model: &Path, steps: u64, dir: &Path, extra: &str) -> String {
    format!(
        "launch --nproc_per_node 2 --config {} {} --save-dir {} {extra}",
        cfg.display(),
        train(model, steps, dir),
        dir.join("ckpt").display()
    )
}

#[test]
fn states_on_nvme_train_bit_identically() {
    let s = Scratch::new("offload-equal");
    let model = s.write("model.json", SMALL_MODEL);
    let swap = s.path("nvme");
    std::fs::create_dir_all(&swap).unwrap();
    let cases = [
        (1, nvme(&swap)),
        (2, nvme(&swap)),
        (3, nvme(&swap)),
        (3, nvme_params(&swap)),
        (3, nvme(&swap) + &nvme_params(&swap)),
    ];
    for (i, (stage, offload)) in cases.iter().enumerate() {
        let stage = *stage;
        let memory = s.write(&format!("mem{i}.json"), &offload_config(stage, ""));
        let disk = s.write(&format!("nvme{i}.json"), &offload_config(stage, offload));
        let (a, b): (PathBuf, PathBuf) = (s.path(&format!("mem{i}")), s.path(&format!("nvme{i}")));
        ok(&train_cmd(&memory, &model, 8, &a, ""));
        ok(&train_cmd(&disk, &model, 8, &b, ""));
        let (in_memory, on_disk) = (losses(&a), losses(&b));
        assert_eq!(in_memory.len(), 8);
        assert_eq!(
            on_disk, in_memory,
            "ZeRO-{stage} {offload}: offloading changed the losses"
        );
        assert!(
            is_empty_dir(&swap),
            "ZeRO-{stage}: swap files left in {}",
            swap.display()
        );
        // the report tells resident from offloaded bytes
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(b.join("summary.json")).unwrap())
                .unwrap();
        for rank in summary["ranks"].as_array().unwrap() {
            assert!(
                rank["offloaded_bytes"].as_u64().unwrap() > 0,
                "ZeRO-{stage}: {rank}"
            );
        }
    }
}

/// Checkpoints of an offloaded run are the files of a run in memory: 3 steps offloaded, then
/// 3 more resumed in memory, give the losses of 6 straight steps offloaded, and the reverse
/// (optimizer states at ZeRO-2; optimizer states and parameters at ZeRO-3).
#[test]
fn checkpoints_resume_across_offload_exactly() {
    let s = Scratch::new("offload-resume");
    let model = s.write("model.json", SMALL_MODEL);
    let swap = s.path("nvme");
    std::fs::create_dir_all(&swap).unwrap();
    for (stage, offload) in [(2, nvme(&swap)), (3, nvme(&swap) + &nvme_params(&swap))] {
        let memory = s.write("mem.json", &offload_config(stage, ""));
        let disk = s.write("nvme.json", &offload_config(stage, &offload));
        let straight = s.path(&format!("straight{stage}"));
        ok(&train_cmd(&disk, &model, 6, &straight, ""));
        for (first, second, name) in [(&disk, &memory, "to-memory"), (&memory, &disk, "to-disk")] {
            let split = s.path(&format!("{name}{stage}"));
            ok(&train_cmd(first, &model, 3, &split, ""));
            let resumed = ok(&train_cmd(second, &model, 6, &split, "--resume"));
            assert!(resumed.stdout.contains("at step 3"), "{}", resumed.stdout);
            assert_eq!(losses(&split), losses(&straight), "ZeRO-{stage} {name}");
        }
        assert!(is_empty_dir(&swap), "swap files left in {}", swap.display());
    }
}

#[test]
fn bad_offload_settings_are_one_clear_error() {
    let s = Scratch::new("offload-bad");
    let model = s.write("model.json", SMALL_MODEL);
    let file = s.write("a-file", "");
    let cases = [
        (
            offload_config(2, r#", "offload_optimizer": {"device": "nvme"}"#),
            "offload_optimizer.nvme_path",
        ),
        (offload_config(2, &nvme(&s.path("missing"))), "missing"),
        (offload_config(2, &nvme(&file)), "not a directory"),
        (
            offload_config(0, &nvme(&s.path(""))),
            "zero_optimization.stage 1, 2 or 3",
        ),
        (
            offload_config(2, &nvme_params(&s.path(""))),
            "offload_param.device = \"nvme\" needs zero_optimization.stage 3",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let cfg = s.write(&format!("bad{i}.json"), text);
        let dir = s.path(&format!("run{i}"));
        // a config's mistake is the launcher's one line; a path is checked where the rank
        // runs (on its own host), each rank naming it
        assert_refused(&cfg, &model, &dir, |l| l.contains(needle), needle);
    }
}

/// A 2-rank `launch` training `model` with `cfg` fails, without a panic, with an `error:` line
/// that `names` accepts.
fn assert_refused(cfg: &Path, model: &Path, dir: &Path, names: impl Fn(&str) -> bool, what: &str) {
    let f = run(
        &format!(
            "launch --nproc_per_node 2 --config {} {}",
            cfg.display(),
            train(model, 2, dir)
        ),
        LIMIT,
    );
    assert!(!f.status.success(), "{what}: {}", f.stdout);
    let named = f.stderr.lines().any(|l| l.contains("error:") && names(l));
    assert!(named, "{what}: {}", f.stderr);
    assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
}

/// The swap files' disk full (a 64 KiB tmpfs) or mounted read-only: one error naming the
/// path and the cause, before the first step; nothing left on the disk.
#[test]
fn a_full_or_read_only_disk_is_named_before_the_first_step() {
    let s = Scratch::new("offload-disk");
    let model = s.write("model.json", SMALL_MODEL);
    for (name, options, cause) in [
        ("full", "size=64k", "No space left on device"),
        ("read-only", "ro,size=1m", "Read-only file system"),
    ] {
        let disk = match Tmpfs::mount(s.path(name), options) {
            Ok(d) => d,
            Err(why) => {
                println!("skipped: cannot mount a tmpfs ({why}); needs root");
                return;
            }
        };
        let cfg = s.write(&format!("{name}.json"), &offload_config(3, &nvme(&disk.0)));
        let dir = s.path(&format!("run-{name}"));
        let path = disk.0.display().to_string();
        let names = |l: &str| l.contains(&path) && l.contains(cause);
        assert_refused(&cfg, &model, &dir, names, name);
        assert!(steps(&dir).is_empty(), "{name}: a step ran");
        assert!(is_empty_dir(&disk.0), "{name}: swap files left behind");
    }
}

/// A rank killed by SIGKILL mid-run (no destructor runs) leaves no swap file: the files are
/// unlinked as soon as they are open, so the kernel frees them with the process.
#[test]
fn a_rank_killed_mid_run_leaves_no_swap_file() {
    let s = Scratch::new("offload-kill");
    let model = s.write("model.json", SMALL_MODEL);
    let swap = s.path("nvme");
    std::fs::create_dir_all(&swap).unwrap();
    let both = format!("{}{}", nvme(&swap), nvme_params(&swap));
    let cfg = s.write("both.json", &offload_config(3, &both));
    let dir = s.path("run");
    let job = start(&format!(
        "launch --nproc_per_node 2 --config {} {}",
        cfg.display(),
        train(&model, 10_000, &dir)
    ));
    wait_for_steps(&dir, 1);
    assert!(
        is_empty_dir(&swap),
        "a swap file has a name while the job runs"
    );
    let ranks = processes_with(&dir.display().to_string());
    let rank = ranks
        .iter()
        .find(|(_, env)| env.lines().any(|l| l == "RANK=1"))
        .map(|(pid, _)| *pid)
        .expect("rank 1 runs");
    signal(rank, "KILL");
    let f = finish(job, LIMIT);
    assert!(!f.status.success(), "{}", f.stderr);
    assert!(f.stderr.contains("SIGKILL"), "{}", f.stderr);
    assert!(is_empty_dir(&swap), "swap files left behind");
}
