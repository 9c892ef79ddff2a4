//! Nothing in a ds_config is silently ignored by the real binary: a setting ds-rs cannot carry
//! out yet is refused with one error line naming its key, by `train` before it trains and by
//! `launch` before any rank starts; a warning (a misspelt top-level key) is printed once per
//! job, by the launcher or else by rank 0, never once per rank.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

/// A config that trains the small model, with `extra` keys.
fn with(extra: &str) -> String {
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}, {extra}}}"#
    )
}

/// Configs DeepSpeed accepts that ask for what ds-rs does not do yet, with the key named (of
/// a job of 2 ranks).
fn refused_configs() -> [(&'static str, String, &'static str); 1] {
    [(
        "partitioned-activations",
        with(
            r#""tensor_parallel": {"autotp_size": 2},
            "activation_checkpointing": {"partition_activations": true}"#,
        ),
        "activation_checkpointing.partition_activations",
    )]
}

/// Exit status 1, exactly one `error:` line, naming `key` and saying it is not implemented.
fn assert_refused(f: &Finished, key: &str, what: &str) {
    assert_eq!(f.status.code(), Some(1), "{what}: {}", f.stderr);
    let errors = error_lines(&f.stderr);
    assert_eq!(errors.len(), 1, "{what}: {}", f.stderr);
    assert!(
        errors[0].contains(key) && errors[0].contains("not implemented yet"),
        "{what}: {:?} should name {key} and say it is not implemented yet",
        errors[0]
    );
    assert!(!f.stderr.contains("panicked"), "{what}: {}", f.stderr);
}

#[test]
fn settings_not_implemented_yet_are_refused_with_one_line_naming_the_key() {
    let s = Scratch::new("refusals");
    let model = s.write("model.json", SMALL_MODEL);
    for (name, text, key) in refused_configs() {
        let cfg = s.write(&format!("{name}.json"), &text);
        let dir = s.path(name);
        // rank 0 of 2, as a launcher would start it: the refusal comes before it joins
        let job = format!("{} --config {}", train(&model, 2, &dir), cfg.display());
        let rank0 = spawn_captured(
            Command::new(BIN)
                .args(words(&job))
                .envs([("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")])
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")]),
        );
        let f = finish(rank0, LIMIT);
        assert_refused(&f, key, &format!("train, {name}"));
        assert!(!dir.exists(), "train {name}: refused only after starting");

        let launch = format!("launch --nproc_per_node 2 --config {}", cfg.display());
        let f = run(&format!("{launch} {}", train(&model, 2, &dir)), LIMIT);
        assert_refused(&f, key, &format!("launch, {name}"));
        // A rank's output is prefixed `[rankN]`: none may have run.
        assert!(!f.stderr.contains("[rank"), "launch {name}: {}", f.stderr);
        assert!(!f.stdout.contains("[rank"), "launch {name}: {}", f.stdout);
    }
}

#[test]
fn config_check_keeps_deepspeeds_verdict_on_them_and_warns() {
    let s = Scratch::new("refusals-check");
    for (name, text, key) in refused_configs() {
        let cfg = s.write(&format!("{name}.json"), &text);
        let f = run(
            &format!("config check {} --world-size 2", cfg.display()),
            LIMIT,
        );
        assert!(f.status.success(), "{name}: {}", f.stderr);
        let warned = f
            .stdout
            .lines()
            .any(|l| l.starts_with("warning:") && l.contains(key) && l.contains("refuse"));
        assert!(warned, "{name}: {}", f.stdout);
    }
}

/// The `activation_checkpointing` keys that tune DeepSpeed's CUDA checkpoint storage, which
/// ds-rs reads but does not act on (it checkpoints by recomputation), the `pipeline` keys
/// without effect in ds-rs, and the ds-rs extension `pipeline.virtual_stages`: one warning
/// line each, naming the key.
#[test]
fn activation_checkpointing_keys_without_effect_are_warned_about() {
    let s = Scratch::new("ac-warnings");
    let cfg = s.write(
        "ac.json",
        &with(
            r#""activation_checkpointing": {"partition_activations": true,
                "cpu_checkpointing": true, "contiguous_memory_optimization": true,
                "number_checkpoints": 4, "synchronize_checkpoint_boundary": true,
                "profile": true},
            "pipeline": {"virtual_stages": 2, "seed_layers": true, "pipe_partitioned": false,
                "grad_partitioned": true}"#,
        ),
    );
    let f = run(&format!("config check {}", cfg.display()), LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    for key in [
        "partition_activations",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "activation_checkpointing.profile",
        "pipeline.virtual_stages",
        "pipeline.seed_layers",
        "pipeline.pipe_partitioned",
        "pipeline.grad_partitioned",
    ] {
        let warned: Vec<&str> = lines_with(&f, key)
            .into_iter()
            .filter(|l| l.starts_with("warning:"))
            .collect();
        assert_eq!(warned.len(), 1, "{key}: {}", f.stdout);
    }
}

#[test]
fn tensor_parallel_autotp_size_is_carried_out_not_refused() {
    let s = Scratch::new("refusals-autotp");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write(
        "autotp.json",
        &with(r#""tensor_parallel": {"autotp_size": 2}"#),
    );
    let dir = s.path("metrics");
    let launch = format!("launch --nproc_per_node 2 --config {}", cfg.display());
    let f = run(&format!("{launch} {}", train(&model, 1, &dir)), LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    let text = std::fs::read_to_string(dir.join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
    let layout = &summary["layout"];
    assert_eq!(layout["tp"].as_u64(), Some(2), "{layout}");
    assert_eq!(layout["dp"].as_u64(), Some(1), "{layout}");
}

/// The lines of a finished command (stdout and stderr) that mention `needle`.
fn lines_with<'a>(f: &'a Finished, needle: &str) -> Vec<&'a str> {
    f.stdout
        .lines()
        .chain(f.stderr.lines())
        .filter(|l| l.contains(needle))
        .collect()
}

#[test]
fn a_misspelt_top_level_key_is_warned_about_once_per_job() {
    let s = Scratch::new("typo");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("typo.json", &config(1, r#", "gradient_clipingg": 1.0"#));
    let hint = "did you mean `gradient_clipping`";
    let dir = |n: &str| s.path(n);
    let cfg = cfg.display();
    // (command, how the one warning line starts: the launcher's, or rank 0's through it)
    let cases = [
        (
            format!("{} --config {cfg}", train(&model, 2, &dir("one"))),
            "warning: gradient_clipingg",
        ),
        (
            format!(
                "launch --nproc_per_node 2 --config {cfg} {}",
                train(&model, 2, &dir("launched"))
            ),
            "warning: gradient_clipingg",
        ),
        (
            format!(
                "launch --nproc_per_node 2 {} --config {cfg}",
                train(&model, 2, &dir("rank0"))
            ),
            "[rank0] warning: gradient_clipingg",
        ),
    ];
    for (cmd, start) in cases {
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{cmd}: {}", f.stderr);
        let warned = lines_with(&f, hint);
        assert_eq!(warned.len(), 1, "{cmd}: {}", f.stderr);
        assert!(warned[0].starts_with(start), "{cmd}: {:?}", warned[0]);
    }
}
