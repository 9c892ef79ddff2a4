//! Pipeline parallelism's equality test (ARCHITECTURE.md invariant 3): the built-in GPT trained for
//! 10 steps with DeepSpeed's TrainSchedule (synchronous 1F1B) at pp = 2, pp = 4, pp = 2 x dp = 2,
//! pp = 2 x tp = 2 and pp = 2 x tp = 2 x dp = 2 (8 ranks) gives every step's loss of the
//! single-process run on the same global batch (8 samples: 4 micro-batches of 2 per replica
//! at dp = 1, 2 at dp = 2), and so does Megatron's interleaved schedule (virtual stages) in
//! the same layouts. Ranks are processes started by `ds-rs launch`; bad layouts are one
//! error line from the launcher before any rank starts.
//!
//! Tolerance, 1e-5 relative: stages run the same operations as one process on the same
//! values, activations travel exactly, and the gradient norm is one sum over the stages (a
//! different order of f32 additions); tensor and data parallelism add their own reordering
//! (tests/tensor_parallel.rs). Measured: 0 to 5.4e-7.

mod common;

use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);
const REL: f64 = 1e-5;

/// Runs are several processes on two cores: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn pipeline_config(stage: u8, extra: &str) -> String {
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}}}{extra}}}"#
    )
}

/// Each step's loss of model tiny trained 10 steps on `nproc` ranks with `args` (and `extra`
/// keys in the config).
fn losses_of(name: &str, nproc: usize, stage: u8, args: &str, extra: &str) -> Vec<f64> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new(&format!("pp-{name}"));
    let cfg = s.write("cfg.json", &pipeline_config(stage, extra));
    let dir = s.path("metrics");
    let cmd = format!(
        "launch --nproc_per_node {nproc} --config {} train --model tiny --steps 10 {args} \
         --eval-interval 0 --eval-batches 1 --metrics-dir {}",
        cfg.display(),
        dir.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{name}: {cmd}\n{}", f.stderr);
    losses(&dir)
}

fn reference() -> &'static Vec<f64> {
    static REFERENCE: OnceLock<Vec<f64>> = OnceLock::new();
    REFERENCE.get_or_init(|| losses_of("reference", 1, 0, "", ""))
}

#[test]
fn pp2_and_pp4_equal_one_process() {
    for (pp, stage) in [(2, 0), (4, 1)] {
        let got = losses_of(&format!("pp{pp}"), pp, stage, &format!("--pp {pp}"), "");
        assert_same_losses(&got, reference(), REL, &format!("pp={pp} ZeRO-{stage}"));
    }
}

#[test]
fn pp2_with_data_and_tensor_parallelism_equals_one_process() {
    for (name, nproc, stage, args) in [
        ("pp=2 x dp=2 ZeRO-1", 4, 1, "--pp 2"),
        ("pp=2 x tp=2", 4, 0, "--pp 2 --tp 2"),
        ("pp=2 x tp=2 x dp=2 ZeRO-1", 8, 1, "--pp 2 --tp 2"),
    ] {
        let got = losses_of(&name.replace([' ', '='], ""), nproc, stage, args, "");
        assert_same_losses(&got, reference(), REL, name);
    }
}

const INTERLEAVED: &str = r#", "pipeline": {"virtual_stages": 2}"#;

/// Megatron's interleaved schedule (`pipeline.virtual_stages`: 2 model chunks per stage, the
/// last stage's first chunk sending back to the first stage) in every layout where tiny's 7
/// layers make 2 chunks per stage and the micro-batches are a multiple of the stages.
#[test]
fn interleaved_schedule_equals_one_process() {
    for (name, nproc, stage, args) in [
        ("pp=2 v=2", 2, 0, "--pp 2"),
        ("pp=2 v=2 x dp=2 ZeRO-1", 4, 1, "--pp 2"),
        ("pp=2 v=2 x tp=2", 4, 0, "--pp 2 --tp 2"),
        ("pp=2 v=2 x tp=2 x dp=2 ZeRO-1", 8, 1, "--pp 2 --tp 2"),
    ] {
        let got = losses_of(
            &name.replace([' ', '='], ""),
            nproc,
            stage,
            args,
            INTERLEAVED,
        );
        assert_same_losses(&got, reference(), REL, name);
    }
}

/// One `error:` line naming `needles`, exit 1, no rank started.
fn refused(nproc: usize, cfg_extra: &str, stage: u8, args: &str, needles: &[&str]) {
    let s = Scratch::new("pp-bad");
    let cfg = s.write("cfg.json", &pipeline_config(stage, cfg_extra));
    let model = s.write(
        "model.json",
        r#"{"V": 64, "T": 8, "d": 16, "H": 2, "L": 1}"#,
    );
    let cmd = format!(
        "launch --nproc_per_node {nproc} --config {} train --model {} --steps 1 {args} --metrics-dir {}",
        cfg.display(),
        model.display(),
        s.path("metrics").display()
    );
    let f = run(&cmd, LIMIT);
    assert_eq!(f.status.code(), Some(1), "{cmd}: {}", f.stderr);
    let errors = error_lines(&f.stderr);
    assert_eq!(errors.len(), 1, "{cmd}: {}", f.stderr);
    for n in needles {
        assert!(errors[0].contains(n), "{cmd}: {:?} lacks {n:?}", errors[0]);
    }
    assert!(!f.stdout.contains("[rank"), "a rank started: {}", f.stdout);
    assert!(!s.path("metrics").exists(), "{cmd}: a rank wrote metrics");
}

#[test]
fn bad_pipeline_layouts_are_one_error_before_any_rank_starts() {
    // stages not dividing the world size
    refused(4, "", 0, "--pp 3", &["world size 4", "pp = 1 * 3"]);
    // more stages than layers: embeddings, one block, head, loss
    refused(5, "", 0, "--pp 5", &["4 layers", "5 pipeline stages"]);
    // ZeRO-2 with a pipeline, DeepSpeed's reason
    refused(
        2,
        "",
        2,
        "--pp 2",
        &["ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"],
    );
    // a type: regex that matches no layer
    let partition = r#", "pipeline": {"stages": 2, "partition": "type:attention"}"#;
    refused(2, partition, 0, "", &["type:", "attention"]);
    // interleaving: 2 x 3 virtual stages for 4 layers; 1 micro-batch for 2 stages
    let chunks = r#", "pipeline": {"virtual_stages": 3}"#;
    refused(2, chunks, 0, "--pp 2", &["4 layers", "6 pipeline stages"]);
    refused(
        8,
        INTERLEAVED,
        0,
        "--pp 2",
        &["virtual_stages", "multiple of the pipeline stages (2)"],
    );
}

/// Checkpoints name whole-model parameters with the stage that held them, so a run saved at
/// pp = 2 x dp = 2 (with 1F1B, and interleaved: each stage's chunks apart in the model)
/// resumes at pp = 1 x dp = 2 (and the reverse) with the losses of the straight run, and `checkpoint consolidate` of a pipeline checkpoint is the whole model
/// `--save-weights` wrote (byte for byte).
#[test]
fn pipeline_checkpoints_reshard_and_consolidate() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("pp-ckpt");
    let plain = s.write("cfg.json", &pipeline_config(1, ""));
    let interleaved = s.write("interleaved.json", &pipeline_config(1, INTERLEAVED));
    let job = |cfg: &std::path::Path, nproc: usize, args: &str, dir: &str, steps: u64| {
        let cmd = format!(
            "launch --nproc_per_node {nproc} --config {} train --model tiny --steps {steps} {args} \
             --eval-interval 0 --eval-batches 1 --metrics-dir {}",
            cfg.display(),
            s.path(dir).display()
        );
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{cmd}\n{}", f.stderr);
        f
    };
    job(&plain, 2, "", "straight", 20);
    let straight = losses(&s.path("straight"));
    for (name, first, second) in [
        ("pp2 -> pp1", (&plain, 4, "--pp 2"), (&plain, 2, "")),
        ("pp1 -> pp2", (&plain, 2, ""), (&plain, 4, "--pp 2")),
        (
            "pp2 v2 -> pp1",
            (&interleaved, 4, "--pp 2"),
            (&plain, 2, ""),
        ),
    ] {
        let ckpt = s.path(&format!("ckpt-{}", name.replace(' ', "")));
        let weights = s.path(&format!("w-{}.safetensors", name.replace(' ', "")));
        let (dir, save) = (
            format!("m-{}", name.replace(' ', "")),
            ckpt.display().to_string(),
        );
        let args = format!(
            "{} --save-dir {save} --save-weights {}",
            first.2,
            weights.display()
        );
        job(first.0, first.1, &args, &dir, 10);
        let f = job(
            second.0,
            second.1,
            &format!("{} --save-dir {save} --resume", second.2),
            &dir,
            20,
        );
        assert!(f.stdout.contains("resumed from"), "{name}: {}", f.stdout);
        assert_same_losses(&losses(&s.path(&dir)), &straight, REL, name);
        // the step-10 checkpoint, consolidated, is the model the first run wrote
        let out = s.path("consolidated.safetensors");
        let c = run(
            &format!(
                "checkpoint consolidate {save} --tag global_step10 --out {}",
                out.display()
            ),
            LIMIT,
        );
        assert!(c.status.success(), "{name}: {}", c.stderr);
        let same = std::fs::read(&out).unwrap() == std::fs::read(&weights).unwrap();
        assert!(same, "{name}: consolidate differs from --save-weights");
    }
}

/// Activation checkpointing inside a pipeline stage (`pipeline.activation_checkpoint_interval`,
/// counted from the stage's first layer as DeepSpeed does): the same losses within 1e-6 and
/// fewer activation bytes on every stage; rank 0 prints the stage -> layer map.
#[test]
fn checkpointed_stages_keep_the_losses_and_hold_fewer_activations() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("pp-ac");
    let run_with = |name: &str, extra: &str| {
        let cfg = s.write(&format!("{name}.json"), &pipeline_config(1, extra));
        let dir = s.path(name);
        let cmd = format!(
            "launch --nproc_per_node 2 --config {} train --model tiny --steps 4 --pp 2 \
             --eval-interval 0 --eval-batches 1 --metrics-dir {}",
            cfg.display(),
            dir.display()
        );
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{cmd}\n{}", f.stderr);
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap())
                .unwrap();
        let held: Vec<u64> = (0..2)
            .map(|r| summary["ranks"][r]["activations_bytes"].as_u64().unwrap())
            .collect();
        (f.stdout, losses(&dir), held)
    };
    let (stdout, want, plain) = run_with("plain", "");
    assert!(
        stdout.contains("pipeline: 2 stages by best: stage 0 = layers 0..3 (wte+wpe, h.0, h.1)"),
        "{stdout}"
    );
    for k in [1, 2] {
        let extra = format!(r#", "pipeline": {{"activation_checkpoint_interval": {k}}}"#);
        let (_, got, held) = run_with(&format!("interval{k}"), &extra);
        assert_same_losses(&got, &want, 1e-6, &format!("interval {k}"));
        for r in 0..2 {
            assert!(
                held[r] < plain[r],
                "interval {k}, rank {r}: {held:?} vs {plain:?}"
            );
        }
    }
}

/// Starts a long pp = 2 job (with `env`), waits for its first step, sends `sig` to stage 1's
/// rank, and returns how the job ended within `limit`, with the text naming its processes.
fn signal_stage_one(
    tag: &str,
    sig: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> (Finished, String) {
    let s = Scratch::new(tag);
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("cfg.json", &pipeline_config(1, ""));
    let dir = s.path("metrics");
    let launch = format!("launch --nproc_per_node 2 --config {}", cfg.display());
    let cmd = format!("{launch} {} --pp 2", train(&model, 100_000, &dir));
    let child = spawn_captured(
        std::process::Command::new(BIN)
            .args(words(&cmd))
            .envs(env.iter().copied()),
    );
    wait_for_steps(&dir, 1);
    let needle = dir.to_str().unwrap().to_string();
    let victim = rank_pid(&needle, 1).expect("stage 1 is running");
    signal(victim, sig);
    (finish(child, limit), needle)
}

/// A stage that dies brings the job down like any rank: named, within 15 s, nothing left.
#[test]
fn a_killed_stage_brings_the_job_down() {
    let (f, needle) = signal_stage_one("pp-kill", "KILL", &[], Duration::from_secs(15));
    assert!(!f.status.success());
    assert!(
        f.stderr
            .contains("rank 1 on host localhost was killed by SIGKILL"),
        "{}",
        f.stderr
    );
    assert_nothing_left(&needle);
}

/// A stage that stops answering (SIGSTOP: alive, silent) makes its neighbour's wait run out at
/// the communication timeout, and the error names the silent stage, not only its rank; the
/// job then ends, nothing left.
#[test]
fn a_silent_stage_is_named_when_the_transfer_times_out() {
    let env = [("DS_RS_COMM_TIMEOUT", "4")];
    let (f, needle) = signal_stage_one("pp-stall", "STOP", &env, Duration::from_secs(30));
    assert!(!f.status.success());
    let named = f.stderr.lines().any(|l| {
        l.contains("pipeline stage 1: ")
            && l.contains("timed out after 4s")
            && l.contains("waiting for rank 1")
    });
    assert!(named, "{}", f.stderr);
    assert_nothing_left(&needle);
}

/// A GPT whose LM head is tied to the token embedding (`"tie_embeddings": true` in the model
/// JSON; DeepSpeed's TiedLayerSpec), against PyTorch: tests/fixtures/tied holds the peer's GPT
/// with `lm_head.weight` tied to `wte.weight`, its initial weights, tokens, and the losses of
/// 5 SGD steps in float64 (gen_tied_reference.py). ds-rs from the same weights on the same
/// samples: in one process the two uses share a stage and their gradients are summed there;
/// at pp = 2 (and pp = 2 x dp = 2) they sit on the first and last stages and the sum crosses
/// (ReduceTiedGrads); at ZeRO 2-3 each rank holds a shard of both copies' gradients and the
/// pair is summed by one all-reduce of its pieces. Every step's loss within 1e-5 relative (float32 against float64 over a
/// model of 21k parameters: measured 1e-7), and the two copies still bit-identical at the end.
#[test]
fn tied_embeddings_train_as_pytorchs_tied_gpt() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tied");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("reference.json")).unwrap())
            .unwrap();
    let want: Vec<f64> = reference["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let s = Scratch::new("pp-tied");
    for (name, nproc, args, stage) in [
        ("one process", 1, "", 0),
        ("pp=2", 2, "--pp 2", 0),
        ("pp=2 x dp=2", 4, "--pp 2", 0),
        // the gradients sharded: the pair's pieces summed by one all-reduce
        ("dp=2 ZeRO-2", 2, "", 2),
        ("dp=2 ZeRO-3", 2, "", 3),
    ] {
        let cfg = s.write(
            &format!("cfg{stage}.json"),
            &format!(
                r#"{{"train_batch_size": {}, "train_micro_batch_size_per_gpu": 2,
                "optimizer": {{"type": "SGD", "params": {{"lr": {}}}}},
                "zero_optimization": {{"stage": {stage}}}}}"#,
                reference["global_batch"], reference["lr"]
            ),
        );
        let tag = name.replace([' ', '='], "");
        let (dir, weights) = (s.path(&tag), s.path(&format!("{tag}.safetensors")));
        let cmd = format!(
            "launch --nproc_per_node {nproc} --config {} train --model {} --init {} --data {} \
             --no-shuffle --steps {} {args} --eval-interval 0 --eval-batches 1 --metrics-dir {} --save-weights {}",
            cfg.display(),
            fixtures.join("model.json").display(),
            fixtures.join("init.safetensors").display(),
            fixtures.join("tokens.bin").display(),
            want.len(),
            dir.display(),
            weights.display()
        );
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{cmd}\n{}", f.stderr);
        assert_same_losses(&losses(&dir), &want, REL, name);
        let w = read_weights(&weights);
        assert!(
            w["wte.weight"] == w["lm_head.weight"],
            "{name}: the tied copies drifted apart"
        );
    }
}
