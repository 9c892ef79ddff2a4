//! The custom-loop example (engine/examples/custom_loop.rs) run as a user runs it: alone with
//! `--config`, and under `ds-rs launch --config` (which passes the file as DS_RS_CONFIG). Each
//! rank must train on its own part of the global batch, so one process and two ranks with the
//! same train_batch_size print the same per-step losses; were every rank to feed the same
//! samples, the two-rank global batch would hold each sample twice and half of them never, and
//! the losses would differ from the first step.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const STEPS: usize = 4;
/// Both runs compute the same fp32 function; only the order of the sums differs (the loss and
/// gradients of 8 samples summed as 4 micro-steps on one rank, or 2 micro-steps on each of 2
/// ranks then averaged by the ring). engine/tests/equality.rs and tests/launch_local.rs hold
/// losses of such layouts to 1e-5 relative over a few steps; the example prints 6 decimals
/// (about 3e-7 relative at these losses), well inside it.
const REL: f64 = 1e-5;
const LIMIT: Duration = Duration::from_secs(240);

/// The example run alone (`args` after the program), without DS_RS_CONFIG.
fn alone(args: &[String]) -> Finished {
    let child = spawn_captured(
        Command::new(custom_loop_example())
            .args(args)
            .env_remove("DS_RS_CONFIG"),
    );
    finish(child, LIMIT)
}

/// The header line and each printed step's loss (rank 0's output; the launcher prefixes it
/// with `[rank0]`).
fn report(stdout: &str) -> (String, Vec<f64>) {
    let header = stdout.lines().next().unwrap_or_default().to_string();
    let losses = stdout
        .lines()
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = words.iter().position(|w| *w == "loss")?;
            words.get(at + 1)?.parse().ok()
        })
        .collect();
    (header, losses)
}

#[test]
fn two_ranks_split_the_global_batch_and_print_the_losses_of_one() {
    let s = Scratch::new("custom-loop");
    // train_batch_size 8, micro-batch 2, steps_per_print 1: 4 accumulation steps on one rank,
    // 2 on each of two.
    let cfg = s.write("ds_config.json", &config(2, ""));
    let steps = ["--steps".to_string(), STEPS.to_string()];

    let one = alone(
        &[
            &["--config".to_string(), cfg.display().to_string()][..],
            &steps,
        ]
        .concat(),
    );
    assert!(one.status.success(), "one rank: {}", one.stderr);
    let (head1, want) = report(&one.stdout);
    assert!(
        head1.contains("2 x 4 accumulation x 1 data-parallel = global batch 8"),
        "{head1}"
    );
    assert_eq!(want.len(), STEPS, "one rank printed {}", one.stdout);
    assert!(want[STEPS - 1] < want[0], "the loss should fall: {want:?}");

    let launch = format!(
        "launch --nproc_per_node 2 --config {} {}",
        cfg.display(),
        custom_loop_example().display()
    );
    let two = run(&format!("{launch} {}", steps.join(" ")), LIMIT);
    assert!(two.status.success(), "two ranks: {}", two.stderr);
    let (head2, got) = report(&two.stdout);
    // The config came through DS_RS_CONFIG (the built-in one prints every 10 steps only).
    assert!(
        head2.contains("2 x 2 accumulation x 2 data-parallel = global batch 8"),
        "{head2}"
    );
    assert!(head2.contains(&cfg.display().to_string()), "{head2}");
    eprintln!("one rank: {want:?}\ntwo ranks: {got:?}");
    assert_same_losses(&got, &want, REL, "custom_loop, 2 ranks vs 1");
}

#[test]
fn a_bad_config_is_one_error_line_and_a_failure() {
    let s = Scratch::new("custom-loop-bad");
    let missing = s.path("missing.json");
    let typo = s.write("typo.json", &config(2, "").replace("\"stage\"", "\"stag\""));
    for (file, why) in [(&missing, "No such file"), (&typo, "did you mean `stage`")] {
        let f = alone(&["--config".to_string(), file.display().to_string()]);
        assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
        let lines: Vec<&str> = f.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one error line: {}", f.stderr);
        assert!(
            lines[0].contains(&file.display().to_string()),
            "{}",
            lines[0]
        );
        assert!(lines[0].contains(why), "{}", lines[0]);
        assert!(f.stdout.is_empty(), "{}", f.stdout);
    }
}

/// DeepSpeed's AutoTP spelling for the example's model: its hidden layer column-parallel,
/// its output projection row-parallel (`patterns` is the one spec's first pattern).
fn tensor_parallel(patterns: &str) -> String {
    format!(
        r#", "tensor_parallel": {{"autotp_size": 2, "partition_config": {{"layer_specs": [
            {{"patterns": ["{patterns}"], "partition_type": "column"}},
            {{"patterns": [".*out\\.weight$"], "partition_type": "row"}}]}}}}"#
    )
}

/// A user's model split by `partition_config` computes the function of the unsplit one:
/// tp = 2 (2 ranks) and tp = 2 x dp = 2 (4 ranks) print the losses of one process.
#[test]
fn a_user_model_split_by_partition_config_prints_the_losses_of_one_rank() {
    let s = Scratch::new("custom-loop-tp");
    let plain = s.write("plain.json", &config(2, ""));
    let split = s.write(
        "tp.json",
        &config(2, &tensor_parallel(r".*hidden\\.weight$")),
    );
    let steps = ["--steps".to_string(), STEPS.to_string()];
    let one = alone(
        &[
            &["--config".to_string(), plain.display().to_string()][..],
            &steps,
        ]
        .concat(),
    );
    assert!(one.status.success(), "one rank: {}", one.stderr);
    let (_, want) = report(&one.stdout);
    for nproc in [2, 4] {
        let cmd = format!(
            "launch --nproc_per_node {nproc} --config {} {} {}",
            split.display(),
            custom_loop_example().display(),
            steps.join(" ")
        );
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{nproc} ranks: {}", f.stderr);
        let (head, got) = report(&f.stdout);
        let dp = nproc / 2;
        assert!(head.contains(&format!("x {dp} data-parallel")), "{head}");
        assert_same_losses(
            &got,
            &want,
            REL,
            &format!("tp=2 on {nproc} ranks vs 1 rank"),
        );
    }
}

/// A `partition_config` pattern that matches no parameter is an error naming it, and the
/// job stops with status 1.
#[test]
fn a_partition_config_pattern_matching_nothing_is_named() {
    let s = Scratch::new("custom-loop-tp-bad");
    let cfg = s.write("tp.json", &config(2, &tensor_parallel(r"hiden\\.weight$")));
    let cmd = format!(
        "launch --nproc_per_node 2 --config {} {} --steps 1",
        cfg.display(),
        custom_loop_example().display()
    );
    let f = run(&cmd, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    let named = f
        .stderr
        .lines()
        .filter(|l| l.contains("partition_config.layer_specs[0].patterns") && l.contains("hiden"));
    assert!(named.count() >= 1, "{}", f.stderr);
    assert!(!f.stdout.contains("step"), "nothing trained: {}", f.stdout);
}

/// The library's engine reports as DeepSpeed's does, from the program's ds_config alone: rank
/// 0's `step=N, skipped=K, lr=[...], mom=[...]` and throughput lines every steps_per_print
/// steps, the wall_clock_breakdown line, the comms logger's table, and TensorBoard events (read back by TensorBoard's
/// own reader when DS_RS_PYTHON names a Python with it) at the samples seen.
#[test]
fn the_engine_reports_as_deepspeed_does() {
    let s = Scratch::new("custom-loop-report");
    let tb = s.path("tb");
    let extra = format!(
        r#", "wall_clock_breakdown": true, "comms_logger": {{"enabled": true}},
        "tensorboard": {{"enabled": true, "output_path": "{}", "job_name": "run"}}"#,
        tb.display()
    );
    let cfg = s.write(
        "ds_config.json",
        &config(2, &extra).replace(r#""steps_per_print": 1"#, r#""steps_per_print": 2"#),
    );
    let launch = format!(
        "launch --nproc_per_node 2 --config {} {} --steps {STEPS}",
        cfg.display(),
        custom_loop_example().display()
    );
    let f = run(&launch, LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    let lines = |needle: &str| -> Vec<String> {
        f.stdout
            .lines()
            .filter(|l| l.contains(needle))
            .map(String::from)
            .collect()
    };
    let progress = lines("] step=");
    assert_eq!(progress.len(), STEPS / 2, "{}", f.stdout);
    for (i, line) in progress.iter().enumerate() {
        let want = format!(
            "[rank0] [Rank 0] step={}, skipped=0, lr=[0.001], mom=[(0.9, 0.95)]",
            2 * (i + 1)
        );
        assert_eq!(line, &want);
    }
    assert_eq!(lines("CurrSamplesPerSec=").len(), STEPS / 2, "{}", f.stdout);
    assert_eq!(lines("time (ms) | fwd:").len(), STEPS / 2, "{}", f.stdout);
    assert!(
        !f.stdout.contains("[rank1] [Rank 0]"),
        "rank 1 printed: {}",
        f.stdout
    );

    let files: Vec<_> = std::fs::read_dir(tb.join("run"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let Some(scalars) = tensorboard_scalars(&files[0]) else {
        return;
    };
    let of = |tag: &str| scalars.get(tag).cloned().unwrap_or_default();
    // x: the samples seen, train_batch_size (8) a step
    let xs: Vec<u64> = of("Train/Samples/train_loss")
        .iter()
        .map(|(x, _)| *x)
        .collect();
    assert_eq!(xs, [8, 16, 24, 32]);
    for (x, lr) in of("Train/Samples/lr") {
        assert_eq!(lr, 1e-3f32, "lr at {x}");
    }
    assert_eq!(of("Train/Samples/loss_scale").len(), STEPS);
}
