//! Tensor parallelism's equality test (ARCHITECTURE.md invariant 3): the built-in GPT trained for
//! 10 steps at tp = 2, tp = 4, tp = 2 x dp = 2 at every ZeRO stage, and with sequence
//! parallelism gives every step's loss, and the final whole weights, of the single-process
//! run on the same global batch. Ranks are processes started by `ds-rs launch`.
//!
//! Tolerance, 1e-5 relative: a layout changes the order of floating-point sums (a
//! row-parallel product is two partial sums added by the all-reduce, a vocabulary-parallel
//! normaliser is a sum of partial sums), so values differ by a few f32 roundings (~1e-7
//! relative) per step; over 10 Adam steps they stay far below 1e-5, while a wrong slice, a
//! missing reduction or a replicated parameter counted twice moves the loss by 1e-3 or more.

mod common;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);
const STEPS: u64 = 10;
const REL: f64 = 1e-5;

/// What a run left: each step's loss and the whole trained weights by name.
struct Trained {
    losses: Vec<f64>,
    /// Each step's gradient norm before clipping (clipping at 1.0 is active at these norms).
    grad_norms: Vec<f64>,
    weights: HashMap<String, Vec<f32>>,
}

/// A fixed global batch of 8 (micro-batch 2, the accumulation steps follow the data-parallel
/// degree) and AdamW with eps = 1e-6.
///
/// Note [Adam's eps]: with DeepSpeed's default eps = 1e-8, an element whose true gradient
/// is below ~1e-8 (some q-bias elements at initialisation) gets an update of about
/// lr x sign(gradient), and the sign of so small a gradient follows the rounding of the sums
/// that produced it: the final q bias then differs by ~1e-5 between any two layouts, data
/// parallelism alone included. eps = 1e-6 (BERT's) keeps the update proportional to the
/// gradient there, so the weights compare at the precision of the computation itself.
fn adam_config(stage: u8, extra: &str) -> String {
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6,
        "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}}}{extra}}}"#
    )
}

/// Runs are several processes each on two cores: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Trains model tiny in fp32 for STEPS steps on `nproc` ranks with tensor-parallel degree
/// `tp`, ZeRO `stage` and `extra` config keys.
fn train(name: &str, nproc: usize, tp: usize, stage: u8, extra: &str) -> Trained {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new(&format!("tp-{name}"));
    let cfg = s.write("cfg.json", &adam_config(stage, extra));
    let (dir, weights) = (s.path("metrics"), s.path("final.safetensors"));
    let cmd = format!(
        "launch --nproc_per_node {nproc} --config {} train --model tiny --steps {STEPS} --tp {tp} \
         --eval-interval 0 --eval-batches 1 --metrics-dir {} --save-weights {}",
        cfg.display(),
        dir.display(),
        weights.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{name}: {cmd}\n{}", f.stderr);
    Trained {
        losses: losses(&dir),
        grad_norms: steps(&dir)
            .iter()
            .map(|v| v["grad_norm"].as_f64().unwrap())
            .collect(),
        weights: read_weights(&weights),
    }
}

/// The single-process run every layout is compared with.
fn reference() -> &'static Trained {
    static REFERENCE: OnceLock<Trained> = OnceLock::new();
    REFERENCE.get_or_init(|| train("reference", 1, 1, 0, ""))
}

/// Every step's loss within REL of the reference, and max over tensors of ||a - b|| / ||b||
/// within REL.
///
/// Note [the key bias]: the k third of each block's `attn.c_attn.bias` is left out of that
/// maximum. Adding a vector to every key shifts each query's scores by one constant, which
/// softmax ignores, so its true gradient is exactly zero; what backward computes for it is
/// rounding noise (~1e-9), and Adam divides each element by its own running magnitude, so
/// that noise moves it by up to lr per step in a direction set by the summation order. Its
/// value is therefore noise in any two layouts (data parallelism alone, without tensor
/// parallelism, differs there as much); the test checks instead that it
/// stays noise: below 1% of the q bias's norm in both runs.
fn assert_same_as_reference(name: &str, got: &Trained) {
    let want = reference();
    assert_same_losses(&got.losses, &want.losses, REL, name);
    // one global norm over tp and dp, replicated parameters counted once
    let norms = format!("{name}: gradient norms");
    assert_same_losses(&got.grad_norms, &want.grad_norms, REL, &norms);
    assert_eq!(got.weights.len(), want.weights.len(), "{name}: tensors");
    let mut worst = (0.0f64, String::new());
    for (tensor, b) in &want.weights {
        let a = got
            .weights
            .get(tensor)
            .unwrap_or_else(|| panic!("{name}: no {tensor}"));
        assert_eq!(a.len(), b.len(), "{name}: {tensor}");
        for (part, x, y) in comparable_parts(name, tensor, a, b) {
            let rel = relative_difference(x, y);
            if rel > worst.0 {
                worst = (rel, part);
            }
        }
    }
    assert!(
        worst.0 < REL,
        "{name}: final weights differ: {} has ||a-b||/||b|| = {:.3e}",
        worst.1,
        worst.0
    );
    eprintln!("{name}: worst tensor {} at {:.3e}", worst.1, worst.0);
}

/// The parts of a tensor compared with REL: the whole tensor, or for a q|k|v bias its q
/// and v thirds, after checking that its k third is noise in both runs (Note [the key bias]).
fn comparable_parts<'a>(
    name: &str,
    tensor: &str,
    a: &'a [f32],
    b: &'a [f32],
) -> Vec<(String, &'a [f32], &'a [f32])> {
    if !tensor.ends_with("attn.c_attn.bias") {
        return vec![(tensor.to_string(), a, b)];
    }
    let d = b.len() / 3;
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    for (run, v) in [("this layout", a), ("the reference", b)] {
        let (q, k) = (norm(&v[..d]), norm(&v[d..2 * d]));
        assert!(
            k < 0.01 * q,
            "{name}: {tensor}: the key bias of {run} is not noise: |k| = {k:.3e}, |q| = {q:.3e}"
        );
    }
    vec![
        (format!("{tensor}[q]"), &a[..d], &b[..d]),
        (format!("{tensor}[v]"), &a[2 * d..], &b[2 * d..]),
    ]
}

fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
fn tp2_equals_one_process() {
    assert_same_as_reference("tp=2", &train("tp2", 2, 2, 0, ""));
}

#[test]
fn tp4_equals_one_process() {
    assert_same_as_reference("tp=4", &train("tp4", 4, 4, 0, ""));
}

#[test]
fn tp2_dp2_equals_one_process_at_every_zero_stage() {
    for stage in 0..=3 {
        let name = format!("tp=2 x dp=2 ZeRO-{stage}");
        assert_same_as_reference(&name, &train(&format!("tp2dp2z{stage}"), 4, 2, stage, ""));
    }
}

#[test]
fn tp2_with_sequence_parallelism_equals_one_process() {
    let sp = r#", "tensor_parallel": {"sequence_parallel": true}"#;
    let got = train("tp2sp", 2, 2, 1, sp);
    assert_same_as_reference("tp=2 with sequence parallelism", &got);
}

/// Rank 0's comms-logger table from a run's output: (op, message size) -> count.
fn comms_counts(stdout: &str) -> HashMap<(String, String), usize> {
    let mut counts = HashMap::new();
    let mut op = String::new();
    for line in stdout.lines() {
        let line = line.strip_prefix("[rank0] ").unwrap_or(line);
        if line.starts_with("Comm. Op") || line.trim().is_empty() {
            continue;
        }
        if !line.starts_with(' ') {
            op = line.trim().to_string();
            continue;
        }
        let cells: Vec<&str> = line
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect();
        if let (Some(size), Some(Ok(n))) = (cells.first(), cells.get(1).map(|c| c.parse())) {
            counts.insert((op.clone(), size.to_string()), n);
        }
    }
    counts
}

/// One step and one held-out batch of model tiny (L = 4 blocks, d = 256, T = 128) at
/// micro-batch 2 on tp = 2, the comms logger on; returns rank 0's counts.
fn one_logged_step(name: &str, extra: &str) -> HashMap<(String, String), usize> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new(&format!("tp-comms-{name}"));
    let cfg = s.write(
        "cfg.json",
        &format!(
            r#"{{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {{"type": "AdamW"}}, "zero_optimization": {{"stage": 0}},
            "comms_logger": {{"enabled": true, "prof_all": true}}{extra}}}"#
        ),
    );
    let cmd = format!(
        "launch --nproc_per_node 2 --config {} train --model tiny --steps 1 --tp 2 \
         --eval-interval 0 --eval-batches 1 --metrics-dir {}",
        cfg.display(),
        s.path("metrics").display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}\n{}", f.stderr);
    comms_counts(&f.stdout)
}

/// Megatron's tensor-parallel communication (nn/ARCHITECTURE.md, "Tensor parallelism"): per
/// micro-step, forward all-reduces the embedding and the two row-parallel outputs of each
/// block, backward the two column-parallel input gradients of each block and the LM head's:
/// 4L + 2 all-reduces of [B, T, d]; the vocabulary-parallel loss adds one of [B*T] (maxima)
/// and one of [B*T, 2] (normalisers and target logits) in forward. Here one training
/// micro-step and one evaluation forward (2L + 1 and 2 more).
#[test]
fn tensor_parallel_collectives_follow_megatrons_count() {
    let (l, rows, d) = (4, 2 * 128, 256);
    let counts = one_logged_step("plain", "");
    let at = |op: &str, bytes: usize| {
        let key = (op.to_string(), ds_comm::logger::convert_size(bytes as u64));
        counts.get(&key).copied().unwrap_or(0)
    };
    assert_eq!(
        at("all_reduce", rows * d * 4),
        (4 * l + 2) + (2 * l + 1),
        "{counts:?}"
    );
    assert_eq!(
        at("all_reduce", rows * 4),
        2,
        "the rows' maxima: {counts:?}"
    );
    assert_eq!(
        at("all_reduce", rows * 2 * 4),
        2,
        "normalisers and targets: {counts:?}"
    );
    assert_eq!(at("reduce_scatter_tensor", rows * d * 4), 0, "{counts:?}");
}

/// With sequence parallelism each all-reduce of activations becomes a reduce-scatter and an
/// all-gather (Note [gather and reduce]); backward gathers the column-parallel inputs again
/// for the weight gradients, as Megatron-LM does. Per micro-step: forward 2L + 1
/// reduce-scatters (embedding, two per block) and 2L + 1 all-gathers (two per block, the
/// head's input); backward 2L + 1 reduce-scatters and 4L + 2 all-gathers; and one
/// all-reduce per layer of the replicated gradients computed from this rank's positions.
#[test]
fn sequence_parallel_collectives_follow_megatrons_count() {
    let (l, rows, d, tp) = (4, 2 * 128, 256, 2);
    let sp = r#", "tensor_parallel": {"sequence_parallel": true}"#;
    let counts = one_logged_step("sp", sp);
    let at = |op: &str, bytes: usize| {
        let key = (op.to_string(), ds_comm::logger::convert_size(bytes as u64));
        counts.get(&key).copied().unwrap_or(0)
    };
    // the logger counts a reduce-scatter's input and an all-gather's part, as DeepSpeed does
    let (scattered, gathered) = (rows * d * 4, rows * d * 4 / tp);
    let (fwd_rs, fwd_ag, bwd_rs, bwd_ag) = (2 * l + 1, 2 * l + 1, 2 * l + 1, 4 * l + 2);
    assert_eq!(
        at("reduce_scatter_tensor", scattered),
        fwd_rs + bwd_rs + fwd_rs,
        "{counts:?}"
    );
    assert_eq!(
        at("all_gather_into_tensor", gathered),
        fwd_ag + bwd_ag + fwd_ag,
        "{counts:?}"
    );
    assert_eq!(
        at("all_reduce", rows * d * 4),
        0,
        "no all-reduce of activations: {counts:?}"
    );
    // the replicated gradients: ln_1, ln_2 and the two row-parallel biases of each block
    // (6d), ln_f (2d), wpe (T d)
    assert_eq!(at("all_reduce", 6 * d * 4), l, "{counts:?}");
    // ln_f's 2d gradients, and the loss's [B*T, 2] sums in the two forwards (here the same
    // size: B*T = 2 * 128 = d)
    assert_eq!(at("all_reduce", 2 * d * 4), 1 + 2, "{counts:?}");
    assert_eq!(at("all_reduce", 128 * d * 4), 1, "{counts:?}");
}

/// `--init` reads whole tensors: each tensor-parallel rank takes its slice of the file, so
/// tp = 2 started from a file trains as one process started from it.
#[test]
fn tp2_starts_from_a_whole_model_file() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = Scratch::new("tp-init");
    let cfg = s.write("cfg.json", &adam_config(1, ""));
    let weights = s.path("start.safetensors");
    let base = format!(
        "--config {} train --model tiny --eval-interval 0 --eval-batches 1",
        cfg.display()
    );
    let made = run(
        &format!("launch --nproc_per_node 1 {base} --steps 1 --seed 7 --save-weights {} --metrics-dir {}",
            weights.display(), s.path("made").display()),
        LIMIT,
    );
    assert!(made.status.success(), "{}", made.stderr);
    let mut runs = Vec::new();
    for (nproc, tp) in [(1, 1), (2, 2)] {
        let dir = s.path(&format!("from-{tp}"));
        let cmd = format!(
            "launch --nproc_per_node {nproc} {base} --steps 3 --tp {tp} --init {} --metrics-dir {}",
            weights.display(),
            dir.display()
        );
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{cmd}: {}", f.stderr);
        runs.push(losses(&dir));
    }
    // a different start than the seed's: the file was trained one step
    assert_ne!(runs[0][0], losses(&s.path("made"))[0]);
    assert_same_losses(&runs[1], &runs[0], REL, "tp=2 from --init vs one process");
}
