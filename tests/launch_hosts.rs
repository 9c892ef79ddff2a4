//! `ds-rs launch` across hosts, for real: two network namespaces joined by a veth pair play two
//! hosts with their own addresses, and the remote-exec template is `ip netns exec {host} sh -c`
//! (what ssh does on a cluster). Needs root and iproute2; skipped, saying why, without them.

mod common;

use std::time::Duration;

use common::netns::*;
use common::*;

#[test]
fn two_hosts_with_two_ranks_each_train_like_one_process() {
    let Some(hosts) = two_hosts("t") else { return };
    let s = Scratch::new("hosts-train");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z3.json", &config(3, ""));
    let (one, four) = (s.path("one"), s.path("four"));
    let alone = format!("{} --config {}", train(&model, 4, &one), cfg.display());
    let f = run(&alone, Duration::from_secs(120));
    assert!(f.status.success(), "{}", f.stderr);
    let args = launch(
        &hosts,
        &hostfile(&s, &hosts, ["2", "2"]),
        29561,
        &cfg,
        &train(&model, 4, &four),
    );
    let f = finish(start_args(&args), Duration::from_secs(240));
    assert!(f.status.success(), "{}", f.stderr);
    assert!(
        f.stdout
            .contains("4 ranks (dp 4 x tp 1 x pp 1), ZeRO stage 3"),
        "{}",
        f.stdout
    );
    // The same tolerance as the one-host layouts: only summation order differs.
    assert_same_losses(
        &losses(&four),
        &losses(&one),
        1e-5,
        "2 hosts x 2 ranks, ZeRO-3",
    );
}

#[test]
fn a_rank_killed_on_the_second_host_brings_every_host_down() {
    let Some(hosts) = two_hosts("k") else { return };
    let s = Scratch::new("hosts-kill");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z2.json", &config(2, ""));
    let dir = s.path("metrics");
    let args = launch(
        &hosts,
        &hostfile(&s, &hosts, ["2", "2"]),
        29562,
        &cfg,
        &train(&model, 100_000, &dir),
    );
    let child = start_args(&args);
    wait_for_steps(&dir, 1);
    let needle = dir.to_string_lossy().into_owned();
    signal(rank_pid(&needle, 3).expect("rank 3 is running"), "KILL");
    let f = finish(child, Duration::from_secs(15));
    assert!(!f.status.success());
    let b = &hosts.names[1];
    let killed = format!("rank 3 on host {b} was killed by SIGKILL");
    assert!(f.stderr.contains(&killed), "{}", f.stderr);
    assert!(
        f.stderr.contains(&format!("node 1 (host {b})")),
        "{}",
        f.stderr
    );
    assert_nothing_left(&needle);
}

#[test]
fn an_unreachable_host_is_named() {
    let Some(hosts) = two_hosts("u") else { return };
    let s = Scratch::new("hosts-unreachable");
    let file = s.write(
        "hostfile",
        &format!("{} slots=1\nno-such-host slots=1\n", hosts.names[0]),
    );
    let cfg = s.write("z0.json", &config(0, ""));
    let args = launch(&hosts, &file, 29563, &cfg, "train --steps 1");
    let f = finish(start_args(&args), Duration::from_secs(60));
    assert!(!f.status.success());
    let last = error_lines(&f.stderr)
        .last()
        .copied()
        .unwrap_or_default()
        .to_string();
    assert!(last.contains("node 1 (host no-such-host)"), "{}", f.stderr);
}

/// `--autotuning tune` over two hosts whose trials take one host each (`--num_nodes 1`): the
/// tuner runs trials on both hosts at the same time, each with its own rendezvous (the
/// second host's address asked of it through the template), and the all-reduce it measures
/// for its time model runs through the same launcher.
#[test]
fn the_autotuner_runs_trials_side_by_side_on_both_hosts() {
    let Some(hosts) = two_hosts("a") else { return };
    let s = Scratch::new("hosts-autotune");
    let model = s.write("model.json", SMALL_MODEL);
    let (results, exps) = (s.path("results"), s.path("exps"));
    let cfg = s.write(
        "tune.json",
        &format!(
            r#"{{"train_micro_batch_size_per_gpu": [1, 2], "gradient_accumulation_steps": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "zero_optimization": {{"stage": [0, 1]}},
            "autotuning": {{"enabled": true, "start_profile_step": 1, "end_profile_step": 3,
                "results_dir": "{}", "exps_dir": "{}"}}}}"#,
            results.display(),
            exps.display()
        ),
    );
    let mut args = launch(
        &hosts,
        &hostfile(&s, &hosts, ["2", "2"]),
        29564,
        &cfg,
        &format!("train --model {}", model.display()),
    );
    let at = args.iter().position(|a| a == "launch").unwrap() + 1;
    let tuning = words("--autotuning tune --num_nodes 1 --num_gpus 2 --memory_per_rank 1G");
    args.splice(at..at, tuning);
    let f = finish(start_args(&args), Duration::from_secs(300));
    assert!(f.status.success(), "{}\n{}", f.stdout, f.stderr);
    let records: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(results.join("records.json")).unwrap())
            .unwrap();
    // where and when each trial ran, from its own results directory
    let mut spans: Vec<(String, f64, f64)> = Vec::new();
    for r in records.as_array().unwrap() {
        assert!(r["outcome"].get("ran").is_some(), "{r}");
        let name = r["experiment"]["name"].as_str().unwrap();
        let text = std::fs::read_to_string(results.join(name).join("trial.json")).unwrap();
        let t: serde_json::Value = serde_json::from_str(&text).unwrap();
        let host = t["hosts"].as_str().unwrap().split(':').next().unwrap();
        let (a, b) = (
            t["started_s"].as_f64().unwrap(),
            t["finished_s"].as_f64().unwrap(),
        );
        spans.push((host.to_string(), a, b));
    }
    assert_eq!(spans.len(), 4, "{records}");
    for h in &hosts.names {
        assert!(
            spans.iter().any(|(x, ..)| x == h),
            "no trial on {h}: {spans:?}"
        );
    }
    let side_by_side = spans.iter().any(|(h1, a1, b1)| {
        spans
            .iter()
            .any(|(h2, a2, b2)| h1 != h2 && a1 < b2 && a2 < b1)
    });
    assert!(side_by_side, "no two trials overlapped in time: {spans:?}");
}

/// torchrun's per-node start: each namespace host runs its own `ds-rs launch --nnodes 2
/// --node_rank R --master_addr A` (no ssh, no head), and the four ranks train as one host's
/// four do.
#[test]
fn nodes_started_one_by_one_train_like_one_host() {
    let Some(hosts) = two_hosts("n") else { return };
    let s = Scratch::new("hosts-per-node");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z2.json", &config(2, ""));
    let (local, nodes) = (s.path("local"), s.path("nodes"));
    let one_host = format!(
        "launch --nproc_per_node 4 --config {} {}",
        cfg.display(),
        train(&model, 4, &local)
    );
    let f = run(&one_host, Duration::from_secs(120));
    assert!(f.status.success(), "{}", f.stderr);
    let node = |r: usize| {
        let launch = format!(
            "launch --nnodes 2 --node_rank {r} --master_addr {} --master_port 29563 \
             --rdzv_id job-{} --nproc_per_node 2 --config {} {}",
            hosts.addrs[0],
            std::process::id(),
            cfg.display(),
            train(&model, 4, &nodes)
        );
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", &hosts.names[r], BIN]);
        cmd.args(words(&launch));
        spawn_captured(&mut cmd)
    };
    let (second, first) = (node(1), node(0));
    let (first, second) = (
        finish(first, Duration::from_secs(240)),
        finish(second, Duration::from_secs(240)),
    );
    assert!(first.status.success(), "{}", first.stderr);
    assert!(second.status.success(), "{}", second.stderr);
    assert!(
        first.stdout.contains("4 ranks (dp 4 x tp 1 x pp 1)"),
        "{}",
        first.stdout
    );
    assert_same_losses(
        &losses(&nodes),
        &losses(&local),
        1e-5,
        "2 nodes started one by one x 2 ranks vs 4 ranks on one host",
    );
}
