//! `ds-rs launch --autotuning tune` on this host: DeepSpeed's search over ZeRO stage and
//! micro-batch, with the memory model ruling out what cannot fit `--memory_per_rank`.
//! Every trial that ran was predicted to fit; the outputs are DeepSpeed's layout; the chosen
//! configuration is the best metric among the trials' own metrics files; a program that
//! embeds the engine is tuned through its own flags; an earlier search's trials are reused
//! without `overwrite`; bad input is one error each with nothing written. (The tuners' logic
//! is tested in autotune/tuning.rs; trials side by side on two hosts in launch_hosts.rs.)

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(600);
const MODEL: &str = r#"{"V": 512, "T": 32, "d": 64, "H": 2, "L": 2}"#;

fn config(autotuning: &str, extra: &str) -> String {
    format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}{extra},
        "autotuning": {{"enabled": true, "start_profile_step": 1, "end_profile_step": 3,
            "max_train_micro_batch_size_per_gpu": 64{autotuning}}}}}"#
    )
}

/// The autotuning keys that put the results and experiments in `results` and `exps`.
fn dirs(results: &Path, exps: &Path) -> String {
    format!(
        r#", "results_dir": "{}", "exps_dir": "{}""#,
        results.display(),
        exps.display()
    )
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn tuning_stays_within_the_memory_model_and_picks_the_best_trial() {
    let s = Scratch::new("autotune");
    let model = s.write("model.json", MODEL);
    let (results, exps) = (s.path("results"), s.path("exps"));
    let cfg = s.write(
        "cfg.json",
        &config(
            &format!(
                r#", "results_dir": "{}", "exps_dir": "{}""#,
                results.display(),
                exps.display()
            ),
            r#", "zero_optimization": {"stage": [0, 3]}"#,
        ),
    );
    // 45 MiB: above a rank's fixed cost and model states, below the activations of the
    // largest micro-batches (64) at ZeRO-0
    let memory = 45u64 << 20;
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 2 --memory_per_rank 45M --config {} train --model {}",
        cfg.display(),
        model.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}\n{}", f.stdout, f.stderr);
    for file in [
        "summary.txt",
        "ds_config_optimal.json",
        "cmd_optimal.txt",
        "records.json",
        "autotune.png",
    ] {
        assert!(results.join(file).exists(), "{file} missing");
    }
    let records = json(&results.join("records.json"));
    let mut best: Option<(String, f64)> = None;
    let mut ran = 0;
    for r in records.as_array().unwrap() {
        let name = r["experiment"]["name"].as_str().unwrap().to_string();
        let predicted = r["predicted_peak_bytes"].as_u64().unwrap();
        if r["outcome"].get("ran").is_none() {
            continue;
        }
        ran += 1;
        assert!(
            predicted <= memory,
            "{name} ran though predicted {predicted} bytes"
        );
        let dir = results.join(&name);
        for file in [
            "ds_config.json",
            "cmd.txt",
            "metrics.json",
            "stdout.log",
            "stderr.log",
        ] {
            assert!(dir.join(file).exists(), "{name}: {file} missing");
        }
        assert!(
            exps.join(format!("{name}.json")).exists(),
            "{name}: no experiment file"
        );
        // the trial's own measurement, not the tuner's record of it
        let throughput = json(&dir.join("metrics.json"))["throughput"]
            .as_f64()
            .unwrap();
        if best.as_ref().is_none_or(|(_, b)| throughput > *b) {
            best = Some((name, throughput));
        }
    }
    assert!(ran >= 2, "{records}");
    let (name, _) = best.unwrap();
    let optimal = json(&results.join("ds_config_optimal.json"));
    let chosen = json(&results.join(&name).join("ds_config.json"));
    assert_eq!(
        optimal, chosen,
        "the optimal config is not the best trial's ({name})"
    );
    assert!(f.stdout.contains(&format!("best {name}")), "{}", f.stdout);
    // the memory model, not the cap of 64, bounded the micro-batches tried at ZeRO-0
    let largest_z0 = records
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["experiment"]["stage"] == 0)
        .filter_map(|r| r["experiment"]["micro_batch"].as_u64())
        .max()
        .unwrap();
    assert!(largest_z0 < 64, "{records}");
}

/// `--autotuning run` tunes, then trains with the best configuration and the user's own
/// arguments (here 2 steps).
#[test]
fn run_mode_trains_with_the_best_configuration() {
    let s = Scratch::new("autotune-run");
    let model = s.write("model.json", MODEL);
    let results = s.path("results");
    let cfg = s.write(
        "cfg.json",
        &config(&dirs(&results, &s.path("exps")), "").replace(
            r#""train_micro_batch_size_per_gpu": 1"#,
            r#""train_micro_batch_size_per_gpu": [2, 4]"#,
        ),
    );
    let metrics = s.path("final");
    let cmd = format!(
        "launch --autotuning run --nproc_per_node 1 --memory_per_rank 1G --config {} train --model {} --steps 2 --metrics-dir {}",
        cfg.display(),
        model.display(),
        metrics.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}\n{}", f.stdout, f.stderr);
    assert_eq!(steps(&metrics).len(), 2, "{}", f.stdout);
    let optimal = json(&results.join("ds_config_optimal.json"));
    let chosen = optimal["train_micro_batch_size_per_gpu"].as_u64().unwrap();
    assert!([2, 4].contains(&chosen), "{optimal}");
}

#[test]
fn bad_autotuning_input_is_one_error_and_nothing_written() {
    let s = Scratch::new("autotune-bad");
    let model = s.write("model.json", MODEL);
    let results = s.path("results");
    let blocker = s.write("a-file", "");
    let exps = s.path("exps");
    let dirs = dirs(&results, &exps);
    let cases = [
        (
            config(&format!(r#"{dirs}, "metric": "speed""#), ""),
            "autotuning.metric",
        ),
        (
            config(&format!(r#"{dirs}, "tuner_type": "bayes""#), ""),
            "autotuning.tuner_type",
        ),
        (
            config(&dirs, "").replace(
                r#""train_micro_batch_size_per_gpu": 1"#,
                r#""train_micro_batch_size_per_gpu": [2, 0]"#,
            ),
            "train_micro_batch_size_per_gpu",
        ),
        (
            config(
                &format!(
                    r#", "results_dir": "{}/sub", "exps_dir": "{}""#,
                    blocker.display(),
                    exps.display()
                ),
                "",
            ),
            "autotuning",
        ),
        (
            config(&dirs, r#", "tensor_parallel": {"autotp_size": [0, 2]}"#),
            "tensor_parallel.autotp_size",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let cfg = s.write(&format!("cfg{i}.json"), text);
        let cmd = format!(
            "launch --autotuning tune --nproc_per_node 1 --config {} train --model {}",
            cfg.display(),
            model.display()
        );
        let f = run(&cmd, LIMIT);
        assert_eq!(f.status.code(), Some(1), "{cmd}: {}", f.stderr);
        let errors = error_lines(&f.stderr);
        assert!(
            errors.len() == 1 && errors[0].contains(needle),
            "{needle}: {}",
            f.stderr
        );
        assert!(!results.exists(), "{needle}: results were written");
        assert!(!exps.exists(), "{needle}: experiments were written");
    }
    // a program that fails at once: every trial fails, recorded with its reason
    let cfg = s.write("ok.json", &config(&dirs, ""));
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 1 --memory_per_rank 1G --config {} train --model {} --data missing.bin",
        cfg.display(),
        model.display()
    );
    let f = run(&cmd, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{cmd}: {}", f.stderr);
    assert!(
        error_lines(&f.stderr)[0].contains("no trial ran successfully"),
        "{}",
        f.stderr
    );
    let summary = std::fs::read_to_string(results.join("summary.txt")).unwrap();
    assert!(
        summary.contains("failed: exit status 1") && summary.contains("missing.bin"),
        "{summary}"
    );
}

/// Ctrl-C (SIGINT to the tuner) stops the trial in flight and leaves the results so far
/// readable: the summary and every record written, exit status 130, no process left.
#[test]
fn ctrl_c_stops_the_trials_and_keeps_the_results() {
    let s = Scratch::new("autotune-stop");
    let model = s.write("model.json", MODEL);
    let results = s.path("results");
    let cfg = s.write(
        "cfg.json",
        &config(
            &dirs(&results, &s.path("exps")),
            r#", "zero_optimization": {"stage": [0, 1, 2, 3]}"#,
        )
        .replace(r#""end_profile_step": 3"#, r#""end_profile_step": 100000"#),
    );
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 1 --memory_per_rank 1G --config {} train --model {}",
        cfg.display(),
        model.display()
    );
    let child = start(&cmd);
    let pid = child.id();
    // the first trial has written some steps
    let started = wait_for(Duration::from_secs(60), || {
        std::fs::read_dir(&results).is_ok_and(|d| {
            d.flatten()
                .any(|e| e.path().join("metrics/metrics.jsonl").exists())
        })
    });
    assert!(started, "no trial started");
    signal(pid, "INT");
    let f = finish(child, Duration::from_secs(30));
    assert_eq!(f.status.code(), Some(130), "{}\n{}", f.stdout, f.stderr);
    assert!(
        f.stderr.contains("stopped; the results so far"),
        "{}",
        f.stderr
    );
    let summary = std::fs::read_to_string(results.join("summary.txt")).unwrap();
    assert!(summary.contains("failed: stopped"), "{summary}");
    assert_nothing_left(&results.display().to_string());
}

/// A program that embeds the engine (the custom-loop example), tuned through its own flag:
/// `arg_mappings` puts each trial's micro-batch on its command line (`--micro-batch`), and
/// the engine's trial hook times the profiled steps, writes the metrics file and says so in
/// the step's outcome, on which the program ends its own loop of 100 steps.
#[test]
fn a_program_embedding_the_engine_is_tuned_through_its_own_flags() {
    let s = Scratch::new("autotune-program");
    let (results, exps) = (s.path("results"), s.path("exps"));
    let tuning = format!(
        r#"{}, "arg_mappings": {{"train_micro_batch_size_per_gpu": "--micro-batch"}},
        "model_info": {{"num_params": 5000}}"#,
        dirs(&results, &exps)
    );
    let cfg = s.write(
        "cfg.json",
        &config(&tuning, r#", "zero_optimization": {"stage": [0, 2]}"#).replace(
            r#""train_micro_batch_size_per_gpu": 1"#,
            r#""train_micro_batch_size_per_gpu": [1, 4]"#,
        ),
    );
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 2 --memory_per_rank 1G --config {} {} --steps 100",
        cfg.display(),
        custom_loop_example().display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}\n{}", f.stdout, f.stderr);
    let records = json(&results.join("records.json"));
    let records = records.as_array().unwrap();
    assert_eq!(records.len(), 4, "{records:?}");
    for r in records {
        assert!(r["outcome"].get("ran").is_some(), "{r}");
        let name = r["experiment"]["name"].as_str().unwrap();
        let m = r["experiment"]["micro_batch"].as_u64().unwrap();
        let dir = results.join(name);
        let line = std::fs::read_to_string(dir.join("cmd.txt")).unwrap();
        assert!(line.contains(&format!("--micro-batch {m}")), "{line}");
        // the program's own report: the micro-batch it trained with, and no step 10 reached
        let out = std::fs::read_to_string(dir.join("stdout.log")).unwrap();
        assert!(out.contains(&format!("micro-batch {m} x")), "{out}");
        assert!(
            !out.contains("step   10"),
            "the trial ran past its profile: {out}"
        );
        let metrics = json(&dir.join("metrics.json"));
        assert!(metrics["latency"].as_f64().unwrap() > 0.0, "{metrics}");
    }
    let optimal = json(&results.join("ds_config_optimal.json"));
    assert!(optimal.get("autotuning").is_none(), "{optimal}");
}

/// `"overwrite": false` (DeepSpeed's rule): a second search over the same results_dir reuses
/// the trials whose metrics are there instead of running them again.
#[test]
fn without_overwrite_a_second_search_reuses_the_trials() {
    let s = Scratch::new("autotune-reuse");
    let model = s.write("model.json", MODEL);
    let (results, exps) = (s.path("results"), s.path("exps"));
    let tuning = format!(r#"{}, "overwrite": false"#, dirs(&results, &exps));
    let cfg = s.write(
        "cfg.json",
        &config(&tuning, "").replace(
            r#""train_micro_batch_size_per_gpu": 1"#,
            r#""train_micro_batch_size_per_gpu": [1, 2]"#,
        ),
    );
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 1 --memory_per_rank 1G --config {} train --model {}",
        cfg.display(),
        model.display()
    );
    let first = run(&cmd, LIMIT);
    assert!(first.status.success(), "{}", first.stderr);
    assert_eq!(
        first.stdout.matches("[autotune] trial ").count(),
        2,
        "{}",
        first.stdout
    );
    let second = run(&cmd, LIMIT);
    assert!(second.status.success(), "{}", second.stderr);
    assert_eq!(
        second.stdout.matches("[autotune] trial ").count(),
        0,
        "{}",
        second.stdout
    );
    assert_eq!(
        second.stdout.matches("from an earlier search").count(),
        2,
        "{}",
        second.stdout
    );
}

/// Beyond DeepSpeed: lists in `tensor_parallel.autotp_size` and `pipeline.stages` are tuning
/// dimensions. Each trial's config carries its layout; tp 2 x pp 2 cannot be laid out over a
/// trial's 2 ranks and ZeRO-2 is refused with a pipeline: both are recorded with the reason
/// and never launched.
#[test]
fn tensor_and_pipeline_degrees_are_tuned_and_impossible_layouts_pruned() {
    let s = Scratch::new("autotune-layouts");
    let model = s.write("model.json", MODEL);
    let (results, exps) = (s.path("results"), s.path("exps"));
    let cfg = s.write(
        "cfg.json",
        &config(
            &dirs(&results, &exps),
            r#", "zero_optimization": {"stage": [0, 2]},
            "tensor_parallel": {"autotp_size": [1, 2]}, "pipeline": {"stages": [1, 2]}"#,
        )
        .replace(
            r#""train_micro_batch_size_per_gpu": 1"#,
            r#""train_micro_batch_size_per_gpu": [2]"#,
        ),
    );
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 2 --memory_per_rank 1G --config {} train --model {}",
        cfg.display(),
        model.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}\n{}", f.stdout, f.stderr);
    let records = json(&results.join("records.json"));
    let mut ran = Vec::new();
    for r in records.as_array().unwrap() {
        let e = &r["experiment"];
        let (tp, pp, stage) = (
            e["layout"]["tp"].as_u64().unwrap(),
            e["layout"]["pp"].as_u64().unwrap(),
            e["stage"].as_u64().unwrap(),
        );
        let impossible = tp * pp > 2 || (pp > 1 && stage >= 2);
        match r["outcome"].get("ran") {
            Some(_) => {
                assert!(!impossible, "{r}");
                let trial = json(
                    &results
                        .join(e["name"].as_str().unwrap())
                        .join("ds_config.json"),
                );
                assert_eq!(trial["tensor_parallel"]["autotp_size"], tp, "{trial}");
                assert_eq!(trial["pipeline"]["stages"], pp, "{trial}");
                ran.push((tp, pp, stage));
            }
            None => assert!(impossible && r["outcome"].get("pruned").is_some(), "{r}"),
        }
    }
    ran.sort();
    assert_eq!(
        ran,
        vec![(1, 1, 0), (1, 1, 2), (1, 2, 0), (2, 1, 0), (2, 1, 2)],
        "{records}"
    );
}

/// The expert-parallel size is a dimension too, where the config's `expert_parallel` section
/// (DeepSpeed's AutoEP) is enabled with a list: an MoE GPT of 4 experts on 2 ranks runs at ep
/// 1 and ep 2, each trial's config carrying its size; ep 2 with tp 2 leaves one data-parallel
/// rank for two expert-parallel ones, and is pruned with the reason.
#[test]
fn the_expert_parallel_size_is_tuned() {
    let s = Scratch::new("autotune-ep");
    let model = s.write(
        "moe.json",
        r#"{"V": 512, "T": 32, "d": 64, "H": 2, "L": 2, "moe": {"num_experts": 4, "k": 2}}"#,
    );
    let (results, exps) = (s.path("results"), s.path("exps"));
    let cfg = s.write(
        "cfg.json",
        &config(
            &dirs(&results, &exps),
            r#", "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": [1, 2]},
            "expert_parallel": {"enabled": true, "autoep_size": [1, 2]}"#,
        )
        .replace(
            r#""train_micro_batch_size_per_gpu": 1"#,
            r#""train_micro_batch_size_per_gpu": [2]"#,
        ),
    );
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 2 --memory_per_rank 1G --config {} train --model {}",
        cfg.display(),
        model.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}\n{}", f.stdout, f.stderr);
    let records = json(&results.join("records.json"));
    let mut ran = Vec::new();
    for r in records.as_array().unwrap() {
        let e = &r["experiment"];
        let (tp, ep) = (
            e["layout"]["tp"].as_u64().unwrap(),
            e["layout"]["ep"].as_u64().unwrap(),
        );
        match r["outcome"].get("ran") {
            Some(_) => {
                let trial = results.join(e["name"].as_str().unwrap());
                let config = json(&trial.join("ds_config.json"));
                assert_eq!(config["expert_parallel"]["autoep_size"], ep, "{config}");
                ran.push((tp, ep));
            }
            None => {
                let why = r["outcome"]["pruned"].as_str().unwrap_or_default();
                assert!(tp * ep > 2 && why.contains("expert-parallel"), "{r}");
            }
        }
    }
    ran.sort();
    assert_eq!(ran, vec![(1, 1), (1, 2), (2, 1)], "{records}");
}

/// `sequence_parallel_size` as a list is a dimension of the search: each trial's config takes
/// one size, and its batch counts the replicas (ranks over sp), as the trial's `train` does.
#[test]
fn the_sequence_parallel_size_is_tuned() {
    let s = Scratch::new("autotune-sp");
    let model = s.write("m.json", r#"{"V": 512, "T": 32, "d": 64, "H": 2, "L": 2}"#);
    let (results, exps) = (s.path("results"), s.path("exps"));
    let cfg = s.write(
        "cfg.json",
        &config(
            &dirs(&results, &exps),
            r#", "zero_optimization": {"stage": 1}, "sequence_parallel_size": [1, 2]"#,
        )
        .replace(
            r#""train_micro_batch_size_per_gpu": 1"#,
            r#""train_micro_batch_size_per_gpu": [2]"#,
        ),
    );
    let cmd = format!(
        "launch --autotuning tune --nproc_per_node 2 --memory_per_rank 1G --config {} train --model {}",
        cfg.display(),
        model.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}\n{}", f.stdout, f.stderr);
    let records = json(&results.join("records.json"));
    let mut ran = Vec::new();
    for r in records.as_array().unwrap() {
        let e = &r["experiment"];
        let sp = e["layout"]["sp"].as_u64().unwrap();
        assert!(r["outcome"].get("ran").is_some(), "{r}");
        let config = json(
            &results
                .join(e["name"].as_str().unwrap())
                .join("ds_config.json"),
        );
        assert_eq!(config["sequence_parallel_size"], sp, "{config}");
        assert_eq!(config["train_batch_size"], 2 * 2 / sp, "{config}");
        ran.push(sp);
    }
    ran.sort();
    assert_eq!(ran, vec![1, 2], "{records}");
}
