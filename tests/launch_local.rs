//! `ds-rs launch ... train` end to end on this host: real processes, real sockets, real files.
//! Every layout trains the same model on the same samples, so its losses must match one plain
//! process's (ARCHITECTURE.md invariant 3); failures and signals bring the whole job down.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const STEPS: u64 = 4;
/// fp32 losses of different layouts differ only by summation order (gradients reduced over
/// ranks and micro-steps in another order); the in-process equality test holds 1e-5 relative
/// over the same few steps.
const REL: f64 = 1e-5;
const LIMIT: Duration = Duration::from_secs(240);

/// One plain process (world size 1, 4 accumulation steps) with the same global batch.
fn reference(s: &Scratch) -> (Vec<f64>, f64) {
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("ref.json", &config(0, ""));
    let dir = s.path("ref");
    let f = run(
        &format!("{} --config {}", train(&model, STEPS, &dir), cfg.display()),
        LIMIT,
    );
    assert!(f.status.success(), "{}", f.stderr);
    (losses(&dir), eval_loss(&dir))
}

fn launched(s: &Scratch, nproc: usize, stage: u8) -> (Vec<f64>, f64) {
    let model = s.path("model.json");
    let cfg = s.write(&format!("z{stage}.json"), &config(stage, ""));
    let dir = s.path(&format!("n{nproc}z{stage}"));
    let launch = format!("launch --nproc_per_node {nproc} --config {}", cfg.display());
    let f = run(&format!("{launch} {}", train(&model, STEPS, &dir)), LIMIT);
    let what = format!("{nproc} ranks, stage {stage}");
    assert!(f.status.success(), "{what}: {}", f.stderr);
    (losses(&dir), eval_loss(&dir))
}

#[test]
fn every_zero_stage_on_two_and_four_ranks_trains_like_one_process() {
    let s = Scratch::new("launch-stages");
    let (want, want_eval) = reference(&s);
    assert_eq!(want.len(), 4);
    assert!(want[3] < want[0], "the loss should fall: {want:?}");
    for nproc in [2, 4] {
        for stage in 0..=3 {
            let (got, got_eval) = launched(&s, nproc, stage);
            let what = format!("{nproc} ranks, ZeRO-{stage}");
            assert_same_losses(&got, &want, REL, &what);
            assert_same_losses(
                &[got_eval],
                &[want_eval],
                REL,
                &format!("{what}, held-out loss"),
            );
        }
    }
}

#[test]
fn metrics_contract_chart_monitors_and_rank_logs() {
    let s = Scratch::new("launch-metrics");
    let model = s.write("model.json", SMALL_MODEL);
    let out = s.path("monitors");
    let extra = format!(
        r#", "wall_clock_breakdown": true,
        "tensorboard": {{"enabled": true, "output_path": "{0}", "job_name": "tb"}},
        "csv_monitor": {{"enabled": true, "output_path": "{0}", "job_name": "csv"}},
        "flops_profiler": {{"enabled": true, "profile_step": 2, "output_file": "{1}"}}"#,
        out.display(),
        s.path("flops.txt").display()
    );
    let cfg = s.write("cfg.json", &config(1, &extra));
    let (dir, logs) = (s.path("metrics"), s.path("logs"));
    let launch = format!(
        "launch --nproc_per_node 2 --log_dir {} --config {}",
        logs.display(),
        cfg.display()
    );
    let train = format!("{} --eval-interval 3", train(&model, 6, &dir));
    let f = run(&format!("{launch} {train}"), LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    // Every console line of a rank carries its prefix, and rank 0 reports progress.
    assert!(
        f.stdout
            .lines()
            .all(|l| l.starts_with("[rank0] ") || l.starts_with("[rank1] ")),
        "{}",
        f.stdout
    );
    assert!(f.stdout.contains("[rank0] step 6/6 | loss"), "{}", f.stdout);
    assert!(
        f.stdout.contains("time (ms) | fwd:"),
        "wall_clock_breakdown: {}",
        f.stdout
    );

    let records = steps(&dir);
    assert_eq!(records.len(), 6);
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["step"].as_u64(), Some(i as u64));
        for key in ["loss", "lr", "loss_scale", "tokens_per_s", "step_ms"] {
            assert!(
                r[key].as_f64().is_some_and(f64::is_finite),
                "step {i}: {key} in {r}"
            );
        }
        assert_eq!(r["skipped"].as_bool(), Some(false));
    }
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(
        text.matches("eval_loss").count(),
        2,
        "evaluations at steps 3 and 6: {text}"
    );

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"].as_u64(), Some(6));
    assert_eq!(summary["final_loss"].as_f64(), records[5]["loss"].as_f64());
    assert_eq!(summary["layout"]["world_size"].as_u64(), Some(2));
    let ranks = summary["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        assert!(r["peak_rss_mib"].as_f64().unwrap() > 1.0, "{r}");
        assert!(r["optimizer_states_bytes"].as_u64().unwrap() > 0, "{r}");
    }
    // ZeRO-1: each rank holds half of the optimizer states.
    let opt: Vec<u64> = ranks
        .iter()
        .map(|r| r["optimizer_states_bytes"].as_u64().unwrap())
        .collect();
    let params = summary["model"]["parameters"].as_u64().unwrap();
    assert!(
        opt.iter().sum::<u64>() >= 12 * params && opt[0] < 12 * params,
        "{opt:?}"
    );

    let png = std::fs::read(dir.join("chart.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let csv =
        std::fs::read_to_string(out.join("csv").join("Train_Samples_train_loss.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 7, "header + 6 steps: {csv}");
    // x is samples seen (global batch 8 per step); y is the loss of metrics.jsonl.
    let last: Vec<&str> = rows[6].split(',').collect();
    assert_eq!(last[0], "48");
    let logged: f64 = last[1].parse().unwrap();
    assert!((logged - records[5]["loss"].as_f64().unwrap()).abs() < 1e-6);
    let tb = std::fs::read_dir(out.join("tb"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned());
    assert!(tb
        .into_iter()
        .any(|n| n.starts_with("events.out.tfevents.")));

    // The flops profiler: forward FLOPs of SMALL_MODEL per rank and step, from the architecture
    // (2 per multiply-add): per micro-batch of B=2 rows of T=32 tokens, d=64, V=512, L=2:
    // positions added (B T d) + blocks (2 B T (12 d^2 + 2 T d) each) + head (2 B T d V);
    // 2 micro-batches per rank with 2 ranks.
    let (b, t, d, v, l) = (2u64, 32, 64, 512, 2);
    let micro = b * t * d + l * 2 * b * t * (12 * d * d + 2 * t * d) + 2 * b * t * d * v;
    let want = format!("{:.2} M", (2 * micro) as f64 / 1e6);
    let profile = std::fs::read_to_string(s.path("flops.txt")).unwrap();
    let fwd = profile
        .lines()
        .find(|l| l.starts_with("fwd flops per GPU:"))
        .unwrap();
    assert!(fwd.ends_with(&want), "{fwd} vs {want}\n{profile}");
    assert!(profile.contains("Profile Summary at step 2:"), "{profile}");
    for layer in ["wte+wpe", "h.0", "h.1", "ln_f+lm_head", "loss"] {
        assert!(
            profile.contains(&format!(") {layer}: ")),
            "{layer}: {profile}"
        );
    }

    let log0 = std::fs::read_to_string(logs.join("rank0.log")).unwrap();
    assert!(
        log0.contains("step 6/6") && !log0.contains("[rank0]"),
        "{log0}"
    );
    assert!(logs.join("rank1.log").exists());
}

/// Starts a long job and waits until it has trained a step.
fn long_job(s: &Scratch) -> (std::process::Child, std::path::PathBuf) {
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("cfg.json", &config(2, ""));
    let dir = s.path("metrics");
    let launch = format!("launch --nproc_per_node 2 --config {}", cfg.display());
    let child = start(&format!("{launch} {}", train(&model, 100_000, &dir)));
    wait_for_steps(&dir, 1);
    (child, dir)
}

#[test]
fn a_rank_killed_mid_run_brings_the_job_down() {
    let s = Scratch::new("launch-kill");
    let (child, dir) = long_job(&s);
    let needle = dir.to_str().unwrap().to_string();
    let victim = rank_pid(&needle, 1).expect("rank 1 is running");
    signal(victim, "KILL");
    let f = finish(child, Duration::from_secs(15));
    assert!(!f.status.success());
    assert!(
        f.stderr
            .contains("rank 1 on host localhost was killed by SIGKILL"),
        "{}",
        f.stderr
    );
    assert_nothing_left(&needle);
    eprintln!("the job ended {:?} after the kill", f.took);
}

#[test]
fn sigint_to_the_launcher_stops_every_rank() {
    let s = Scratch::new("launch-sigint");
    let (child, dir) = long_job(&s);
    let needle = dir.to_str().unwrap().to_string();
    signal(child.id(), "INT");
    let f = finish(child, Duration::from_secs(15));
    assert_eq!(f.status.code(), Some(130), "{}", f.stderr);
    assert!(f.stderr.contains("stopped by SIGINT"), "{}", f.stderr);
    assert_nothing_left(&needle);
}

#[test]
fn max_restarts_runs_the_job_again_after_a_failure() {
    let s = Scratch::new("launch-restart");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("cfg.json", &config(2, ""));
    let dir = s.path("metrics");
    let launch = format!(
        "launch --nproc_per_node 2 --max_restarts 1 --config {}",
        cfg.display()
    );
    let child = start(&format!("{launch} {}", train(&model, 300, &dir)));
    wait_for_steps(&dir, 1);
    signal(
        rank_pid(dir.to_str().unwrap(), 1).expect("rank 1 is running"),
        "KILL",
    );
    let f = finish(child, LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    assert!(
        f.stderr.contains(
            "rank 1 on host localhost was killed by SIGKILL; restarting the job (1 of 1)"
        ),
        "{}",
        f.stderr
    );
    assert_eq!(steps(&dir).len(), 300);
}

#[test]
fn bad_input_gives_one_error_line() {
    let s = Scratch::new("launch-bad");
    let good = s.write("good.json", &config(0, ""));
    let bad_cfg = s.write("bad.json", r#"{"train_micro_batch_size_per_gpu": "eight"}"#);
    let missing = s.path("missing.json");
    let hostfile = s.write("hostfile", "worker-0 slots=2\nworker-1 slots=two\n");
    let (hostfile, bad_cfg, good, missing) = (
        hostfile.display(),
        bad_cfg.display(),
        good.display(),
        missing.display(),
    );
    let cases: [(String, &[&str]); 9] = [
        (
            format!("launch --hostfile {hostfile} train"),
            &["line 2", "slots=two"],
        ),
        (
            "launch --nproc_per_node 2 no-such-program".into(),
            &["no-such-program", "not found"],
        ),
        (
            format!("launch --nproc_per_node 2 --config {bad_cfg} train"),
            &["bad.json", "train_micro_batch_size_per_gpu"],
        ),
        (
            format!("launch --nproc_per_node 2 --config {good} --include worker-9 train"),
            &["worker-9"],
        ),
        (
            format!("launch --nproc_per_node 2 --config {missing} train"),
            &["missing.json"],
        ),
        (
            "launch --nproc_per_node 1 --bind_cores_to_rank --bind_core_list 3-1 true".into(),
            &["--bind_core_list", "3-1"],
        ),
        // once ignored: a node rank means nothing without a multi-node launch
        (
            format!("launch --nproc_per_node 2 --config {good} --node_rank 1 train"),
            &["--node_rank 1", "--nnodes", "--hostfile"],
        ),
        (
            format!("launch --nnodes 2 --master_addr 127.0.0.1 --config {good} train"),
            &["--nnodes 2", "--node_rank"],
        ),
        (
            format!("launch --nnodes 2 --node_rank 1 --config {good} train"),
            &["--nnodes 2", "--master_addr"],
        ),
    ];
    for (args, needles) in cases {
        let f = run(&args, Duration::from_secs(30));
        assert!(!f.status.success(), "{args:?}");
        let errors = error_lines(&f.stderr);
        assert_eq!(errors.len(), 1, "{args:?}: {}", f.stderr);
        for n in needles {
            assert!(
                errors[0].contains(n),
                "{args:?}: {:?} lacks {n:?}",
                errors[0]
            );
        }
        assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
    }
}

/// The cores of a `Cpus_allowed_list` value such as `0-3,6`.
fn cores_of(list: &str) -> Vec<usize> {
    list.trim()
        .split(',')
        .flat_map(|r| {
            let (lo, hi) = r.split_once('-').unwrap_or((r, r));
            lo.parse::<usize>().unwrap()..=hi.parse::<usize>().unwrap()
        })
        .collect()
}

fn allowed_list(status: &str) -> &str {
    let line = status
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list:"))
        .expect("no Cpus_allowed_list");
    line.split_once(':').unwrap().1
}

#[test]
fn bind_cores_to_rank_gives_each_rank_its_own_share_of_the_cores() {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let mine = cores_of(allowed_list(&status));
    if mine.len() < 2 {
        eprintln!("skipped: binding two ranks needs two cores, this test may use {mine:?}");
        return;
    }
    let mut args = words("launch --nproc_per_node 2 --bind_cores_to_rank sh -c");
    args.push("grep Cpus_allowed_list /proc/self/status; echo threads=$OMP_NUM_THREADS".into());
    let f = finish(start_args(&args), Duration::from_secs(30));
    assert!(f.status.success(), "{}", f.stderr);
    let half = mine.len() / 2;
    for (rank, want) in [(0, &mine[..half]), (1, &mine[half..2 * half])] {
        let prefix = format!("[rank{rank}] ");
        let lines: Vec<&str> = f
            .stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .collect();
        let got = cores_of(allowed_list(&lines.join("\n")));
        assert_eq!(got, want, "rank {rank}: {}", f.stdout);
        let threads = format!("threads={half}");
        assert!(
            lines.contains(&threads.as_str()),
            "rank {rank}: {}",
            f.stdout
        );
    }
}

/// Ranks started with only TensorFlow's TF_CONFIG (Azure ML's TensorFlow distribution), two
/// and four workers on loopback, train as `ds-rs launch` does: the same losses, bit for bit
/// (same layout, same reduction order).
#[test]
fn tf_config_workers_train_like_the_launcher() {
    let s = Scratch::new("tf-config");
    s.write("model.json", SMALL_MODEL);
    for nproc in [2, 4] {
        let (want, _) = launched(&s, nproc, 2);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let workers: Vec<String> = (0..nproc)
            .map(|i| format!("\"127.0.0.1:{}\"", port as usize + i))
            .collect();
        let dir = s.path(&format!("tf{nproc}"));
        let cmd = format!(
            "{} --config {}",
            train(&s.path("model.json"), STEPS, &dir),
            s.path("z2.json").display()
        );
        let ranks: Vec<_> = (0..nproc)
            .map(|i| {
                let tf = format!(
                    r#"{{"cluster": {{"worker": [{}]}}, "task": {{"type": "worker", "index": {i}}}}}"#,
                    workers.join(", ")
                );
                let mut c = std::process::Command::new(BIN);
                c.args(words(&cmd)).env("TF_CONFIG", tf);
                for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
                    c.env_remove(var);
                }
                spawn_captured(&mut c)
            })
            .collect();
        for (i, rank) in ranks.into_iter().enumerate() {
            let f = finish(rank, LIMIT);
            assert!(f.status.success(), "worker {i} of {nproc}: {}", f.stderr);
            let joined = format!("{nproc} ranks (dp {nproc}");
            assert!(i > 0 || f.stdout.contains(&joined), "{}", f.stdout);
        }
        assert_eq!(losses(&dir), want, "{nproc} TF_CONFIG workers");
    }
}

/// `--dist_backend` (and DS_RS_DIST_BACKEND) values this build cannot run are a usage error
/// that says what would do: nccl on the CPU build, mpi without the `mpi` feature, and names
/// ds-rs does not have.
#[test]
fn a_dist_backend_this_build_lacks_is_refused_saying_what_would_do() {
    let cases = [
        ("nccl", "use \"ds\" (the default)"),
        ("gloo", "expected \"ds\""),
        ("mpi", "--features mpi"),
    ];
    for (name, says) in cases {
        if name == "mpi" && cfg!(feature = "mpi") {
            continue; // this binary has it: tests/mpi_train.rs
        }
        let f = run(&format!("train --dist_backend {name} --steps 1"), LIMIT);
        assert_eq!(f.status.code(), Some(2), "{name}: {}", f.stderr);
        assert!(f.stderr.contains(says), "{name}: {}", f.stderr);
        let mut cmd = Command::new(BIN);
        cmd.args(words("train --steps 1"))
            .env("DS_RS_DIST_BACKEND", name);
        let f = finish(spawn_captured(&mut cmd), LIMIT);
        assert_eq!(
            f.status.code(),
            Some(2),
            "DS_RS_DIST_BACKEND={name}: {}",
            f.stderr
        );
    }
}

/// `--launcher slurm` without a hostfile takes the allocation's nodes from SLURM_JOB_NODELIST
/// (a hostlist with ranges) and runs the same srun a hostfile naming them gives; without the
/// variable it says where the nodes would come from. A stand-in `srun` on PATH records its
/// arguments (the job token, fresh per launch, aside).
#[test]
fn slurm_nodelist_gives_the_plan_a_hostfile_gives() {
    use std::os::unix::fs::PermissionsExt;
    let s = Scratch::new("launch-slurm");
    let bin = s.path("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let srun = s.write(
        "bin/srun",
        "#!/bin/sh\nprintf '%s\\n' \"$@\" > \"$SRUN_ARGS\"\n",
    );
    std::fs::set_permissions(&srun, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hostfile = s.write(
        "hostfile",
        "gpu01 slots=2\ngpu02 slots=2\ngpu03 slots=2\ngpu07 slots=2\n",
    );
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let srun_args = |extra: &[&str], nodelist: Option<&str>| {
        let out = s.path("srun.args");
        let _ = std::fs::remove_file(&out);
        let mut cmd = Command::new(BIN);
        cmd.args(["launch", "--launcher", "slurm", "--nproc_per_node", "2"])
            .args(extra)
            .arg("true")
            .env("PATH", &path)
            .env("SRUN_ARGS", &out)
            .env_remove("SLURM_NODELIST")
            .env_remove("DS_RS_JOB_TOKEN");
        match nodelist {
            Some(l) => cmd.env("SLURM_JOB_NODELIST", l),
            None => cmd.env_remove("SLURM_JOB_NODELIST"),
        };
        let f = finish(spawn_captured(&mut cmd), Duration::from_secs(30));
        let args = std::fs::read_to_string(&out).unwrap_or_default();
        let args: Vec<String> = args
            .lines()
            .map(|a| match a.find("DS_RS_JOB_TOKEN=") {
                Some(i) => a[..i].to_string(),
                None => a.to_string(),
            })
            .collect();
        (f, args)
    };
    let (f, from_nodelist) = srun_args(&[], Some("gpu[01-03,07]"));
    assert!(f.status.success(), "{}", f.stderr);
    let hostfile = hostfile.display().to_string();
    let (f, from_hostfile) = srun_args(&["--hostfile", &hostfile], None);
    assert!(f.status.success(), "{}", f.stderr);
    assert!(
        from_nodelist.contains(&"--nodelist=gpu01,gpu02,gpu03,gpu07".to_string()),
        "{from_nodelist:?}"
    );
    assert!(
        from_nodelist.contains(&"--ntasks=8".to_string()),
        "{from_nodelist:?}"
    );
    assert_eq!(from_nodelist, from_hostfile);
    let (f, _) = srun_args(&[], None);
    assert!(!f.status.success());
    let errors = error_lines(&f.stderr);
    assert_eq!(errors.len(), 1, "{}", f.stderr);
    assert!(errors[0].contains("SLURM_JOB_NODELIST") && errors[0].contains("--hostfile"));
}
