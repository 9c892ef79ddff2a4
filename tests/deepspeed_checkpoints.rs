//! DeepSpeed's checkpoints in. The fixtures are DeepSpeed 0.19.8's own
//! (tests/fixtures/deepspeed/make.sh: the peer's GPT trained 5 steps on 2 ranks, saved at
//! ZeRO-2 and ZeRO-3 fp32 and ZeRO-1 bf16, and by its pipeline engine on 2 stages, beside zero_to_fp32.py's output, the moments
//! ds_to_universal.py extracts and the losses of 10 straight steps):
//! - `checkpoint consolidate` gives zero_to_fp32.py's tensors, bit for bit;
//! - `checkpoint import-deepspeed` keeps Adam's moments (ds_to_universal.py's), step,
//!   counters and an fp16 run's dynamic loss scaler (DeepSpeed's own object);
//! - `bench train --load-dir` resumes an import (of ZeRO-2, ZeRO-3, of DeepSpeed's pipeline
//!   engine on 2 stages, and of transformers' Llama by its Hugging Face names) at dp 2 and tp 2 x dp 2 and trains DeepSpeed's own steps 6-10 (within 1e-5: the peer prints its losses to 6 decimals, and one process of
//!   ds-rs agrees with DeepSpeed to ~1e-7 over 10 steps);
//! - hostile and broken files are one clear error each, nothing run and nothing written.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepspeed")
}

fn ok(f: &Finished, what: &str) {
    assert!(f.status.success(), "{what}: {}\n{}", f.stdout, f.stderr);
}

/// The error line of a command that must fail.
fn failed(f: &Finished, what: &str) -> String {
    assert!(!f.status.success(), "{what} succeeded: {}", f.stdout);
    assert!(!f.stderr.contains("panicked"), "{what}: {}", f.stderr);
    error_lines(&f.stderr).join("\n")
}

#[test]
fn consolidation_gives_zero_to_fp32_s_tensors_bit_for_bit() {
    let s = Scratch::new("ds-consolidate");
    for case in ["zero2_fp32", "zero3_fp32", "zero1_bf16"] {
        let out = s.path(&format!("{case}.safetensors"));
        let f = run(
            &format!(
                "checkpoint consolidate {} --out {}",
                fixtures().join(case).display(),
                out.display()
            ),
            LIMIT,
        );
        ok(&f, case);
        let (got, want) = (
            read_weights(&out),
            read_weights(&fixtures().join(format!("{case}.zero_to_fp32.safetensors"))),
        );
        assert_eq!(got.len(), want.len(), "{case}: tensors");
        for (name, w) in &want {
            let g = &got[name];
            let same =
                g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{case}: {name} differs from zero_to_fp32.py's");
        }
    }
}

/// `checkpoint import-deepspeed` of fixture `case` into `dst`.
fn import_fixture(case: &str, dst: &Path) {
    let cmd = format!(
        "checkpoint import-deepspeed {} {}",
        fixtures().join(case).display(),
        dst.display()
    );
    ok(&run(&cmd, LIMIT), &cmd);
}

/// The imported checkpoint's one shard: its manifest and its tensors by name.
fn imported(
    dir: &Path,
) -> (
    serde_json::Value,
    std::collections::HashMap<String, Vec<f32>>,
) {
    let tag = dir.join("global_step5");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tag.join("manifest.json")).unwrap()).unwrap();
    (
        manifest,
        read_weights(&tag.join("zero_rank00000.safetensors")),
    )
}

#[test]
fn an_import_keeps_adam_s_moments_step_and_counters() {
    let s = Scratch::new("ds-import");
    let dst = s.path("imported");
    import_fixture("zero3_fp32", &dst);
    let (m, shard) = imported(&dst);
    // a second import into the same directory would replace its `latest`: refused
    let again = run(
        &format!(
            "checkpoint import-deepspeed {} {}",
            fixtures().join("zero2_fp32").display(),
            dst.display()
        ),
        LIMIT,
    );
    let e = failed(&again, "a second import");
    assert!(e.contains("holds checkpoints already"), "{e}");
    assert_eq!(m["global_steps"], 5);
    assert_eq!(m["optimizer_step"], 5, "DeepSpeed's Adam took 5 steps");
    assert_eq!(m["layout"]["dp"], 2);
    assert_eq!(m["layout"]["zero_stage"], 3);
    assert_eq!(
        m["optimizer_buffers"],
        serde_json::json!(["exp_avg", "exp_avg_sq"])
    );
    let want = read_weights(&fixtures().join("zero3_fp32.moments.safetensors"));
    let params = m["params"].as_array().unwrap();
    assert_eq!(params.len() * 2, want.len());
    for p in params {
        let (name, offset) = (
            p["name"].as_str().unwrap(),
            p["offset"].as_u64().unwrap() as usize,
        );
        for buffer in ["exp_avg", "exp_avg_sq"] {
            let w = &want[&format!("{name}/{buffer}")];
            let g = &shard[buffer][offset..offset + w.len()];
            assert!(
                g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: {buffer} differs from ds_to_universal.py's"
            );
        }
    }
}

#[test]
fn an_fp16_run_s_loss_scaler_is_imported() {
    // DeepSpeed's DynamicLossScaler as make.sh set it: scale 2^15, 5 updates, the last
    // overflow at iteration 2, one overflow of hysteresis left
    let s = Scratch::new("ds-fp16");
    let dst = s.path("imported");
    import_fixture("zero2_fp16", &dst);
    let (m, _) = imported(&dst);
    assert_eq!(m["layout"]["dtype"], "f16");
    assert_eq!(
        m["loss_scaler"],
        serde_json::json!({"cur_scale": 32768.0, "cur_iter": 5, "last_overflow_iter": 2, "cur_hysteresis": 1})
    );
}

/// `bench train`'s losses after resuming `dir` at `layout` for 5 steps (`model`: the
/// `--model` and `--seq-len` arguments).
fn resumed_losses(dir: &Path, model: &str, config: &Path, layout: &str) -> Vec<f64> {
    let f = run(
        &format!(
            "bench train {model} --config {} {layout} --warmup 0 --steps 5 --load-dir {} --json",
            config.display(),
            dir.display()
        ),
        LIMIT,
    );
    ok(&f, layout);
    let last = f.stdout.lines().rev().find(|l| l.starts_with('{')).unwrap();
    let r: serde_json::Value = serde_json::from_str(last).unwrap();
    r["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

#[test]
fn an_imported_run_trains_deepspeed_s_next_steps_in_two_layouts() {
    let s = Scratch::new("ds-resume");
    let straight: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("losses.json")).unwrap())
            .unwrap();
    // the pipeline ran 2 micro-batches of 2 on one replica: the samples of dp 2 x 2, the
    // resumed runs' batch
    let gpt = format!("--model {}", fixtures().join("model.json").display());
    // transformers' Llama of the ds-rs Llama fixture, by its Hugging Face names
    let llama = format!(
        "--model {} --seq-len 16",
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models/tests/fixtures/hf/llama")
            .display()
    );
    for (case, model, config) in [
        ("zero2_fp32", &gpt, "zero2_fp32"),
        ("zero3_fp32", &gpt, "zero3_fp32"),
        ("pipe2_fp32", &gpt, "zero2_fp32"),
        ("llama_zero2", &llama, "zero2_fp32"),
    ] {
        let dst = s.path(case);
        import_fixture(case, &dst);
        let want: Vec<f64> = straight[case].as_array().unwrap()[5..]
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let config = fixtures().join(format!("{config}.json"));
        for layout in ["--nproc 2", "--nproc 4 --tp 2"] {
            let got = resumed_losses(&dst, model, &config, layout);
            assert_eq!(got.len(), 5);
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5,
                    "{case} at {layout}: step {} loss {g}, DeepSpeed's {w} ({got:?} vs {want:?})",
                    step + 6
                );
            }
        }
    }
}

/// A copy of the ZeRO-2 fixture with `file` of its tag replaced by `bytes`.
fn broken_copy(s: &Scratch, name: &str, file: &str, bytes: &[u8]) -> PathBuf {
    let src = fixtures().join("zero2_fp32");
    let dir = s.path(name);
    let tag = dir.join("global_step5");
    std::fs::create_dir_all(&tag).unwrap();
    std::fs::copy(src.join("latest"), dir.join("latest")).unwrap();
    for e in std::fs::read_dir(src.join("global_step5")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tag.join(e.file_name())).unwrap();
    }
    std::fs::write(tag.join(file), bytes).unwrap();
    dir
}

/// Import and consolidation of `src` both fail with an error naming `file` and saying
/// `says`; nothing is written.
fn refused(s: &Scratch, src: &Path, file: &str, says: &str) {
    let (dst, out) = (s.path("never"), s.path("never.safetensors"));
    for cmd in [
        format!(
            "checkpoint import-deepspeed {} {}",
            src.display(),
            dst.display()
        ),
        format!(
            "checkpoint consolidate {} --out {}",
            src.display(),
            out.display()
        ),
    ] {
        let f = finish(
            spawn_captured(Command::new(BIN).args(words(&cmd)).current_dir(&s.0)),
            LIMIT,
        );
        let e = failed(&f, &cmd);
        assert!(e.contains(file) && e.contains(says), "{cmd}: {e}");
        assert!(!dst.exists() && !out.exists(), "{cmd} wrote something");
    }
}

#[test]
fn hostile_and_broken_files_are_one_error_each_with_nothing_run_or_written() {
    let s = Scratch::new("ds-hostile");
    let model_states = "mp_rank_00_model_states.pt";
    let optim = "zero_pp_rank_1_mp_rank_00_optim_states.pt";
    // a pickle calling os.system, as torch.load(weights_only=False) would
    let evil = std::fs::read(fixtures().join("hostile/os_system.pt")).unwrap();
    let dir = broken_copy(&s, "evil", model_states, &evil);
    refused(&s, &dir, model_states, "global posix.system is not one");
    assert!(!s.path("pwned.txt").exists(), "the pickle's command ran");
    // a file cut short
    let whole = std::fs::read(fixtures().join("zero2_fp32/global_step5").join(optim)).unwrap();
    let dir = broken_copy(&s, "truncated", optim, &whole[..whole.len() / 2]);
    refused(&s, &dir, optim, "truncated");
    // a storage record shorter than its tensor (make.sh cut rank 0's storage 0 in half)
    let short = std::fs::read(fixtures().join("hostile/short_storage.pt")).unwrap();
    let file = "zero_pp_rank_0_mp_rank_00_optim_states.pt";
    let dir = broken_copy(&s, "short", file, &short);
    refused(&s, &dir, file, "shorter than the tensor");
}

#[test]
fn a_checkpoint_of_another_shape_is_refused_on_resume() {
    let s = Scratch::new("ds-shape");
    let dst = s.path("imported");
    import_fixture("zero2_fp32", &dst);
    // the fixture's model with 16 positions: wpe.weight is [16, 16], the checkpoint's [8, 16]
    let model = s.write(
        "model.json",
        r#"{"V": 32, "T": 16, "d": 16, "H": 2, "L": 1}"#,
    );
    let f = run(
        &format!(
            "bench train --model {} --config {} --nproc 2 --warmup 0 --steps 1 --load-dir {}",
            model.display(),
            fixtures().join("zero2_fp32.json").display(),
            dst.display()
        ),
        LIMIT,
    );
    let e = failed(&f, "resume with another model");
    assert!(
        e.contains("wpe.weight [8, 16] does not match this model's [16, 16]"),
        "{e}"
    );
}

#[test]
fn train_resumes_from_deepspeed_once_then_from_its_own_checkpoints() {
    let s = Scratch::new("ds-train");
    let (ck, metrics) = (s.path("ck"), s.path("metrics"));
    let cmd = |steps: u64| {
        format!(
            "launch --nproc_per_node 2 --config {} train --model {} --data uniform --steps {steps} \
             --save-dir {} --metrics-dir {} --resume-from-deepspeed {}",
            fixtures().join("zero2_fp32.json").display(),
            fixtures().join("model.json").display(),
            ck.display(),
            metrics.display(),
            fixtures().join("zero2_fp32").display()
        )
    };
    let f = run(&cmd(7), LIMIT);
    ok(&f, "train");
    assert!(
        f.stdout
            .contains("imported DeepSpeed's ZeRO-2 f32 checkpoint")
            && f.stdout.contains("at step 5"),
        "{}",
        f.stdout
    );
    let steps: Vec<u64> = common::steps(&metrics)
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        steps,
        [5, 6],
        "the 6th and 7th steps (0-based) after DeepSpeed's 5"
    );
    // the run saved global_step7: a second start resumes from it, importing nothing
    let f = run(&cmd(9), LIMIT);
    ok(&f, "restart");
    assert!(!f.stdout.contains("imported DeepSpeed"), "{}", f.stdout);
    assert!(
        f.stdout.contains("global_step7") && f.stdout.contains("at step 7"),
        "{}",
        f.stdout
    );
}

/// DeepSpeed's ZeRO-3 run, imported and exported again as a universal checkpoint, read back
/// by CPython's own unpickler as torch.load(weights_only=True) reads it
/// (fixtures/deepspeed/read_universal.py): every parameter's fp32 weights, moments and step
/// are DeepSpeed's own (zero_to_fp32.py's, ds_to_universal.py's), and the counters those a
/// DeepSpeed load restores. (DeepSpeed itself resuming an export of a ds-rs run is
/// scripts/bench/deepspeed_checkpoints.sh.)
#[test]
fn an_export_is_deepspeed_s_universal_checkpoint_of_the_same_state() {
    let s = Scratch::new("ds-export");
    let (dst, universal) = (s.path("imported"), s.path("universal"));
    import_fixture("zero3_fp32", &dst);
    let cmd = format!(
        "checkpoint export-universal {} {}",
        dst.display(),
        universal.display()
    );
    ok(&run(&cmd, LIMIT), &cmd);
    let out = Command::new("python3")
        .arg(fixtures().join("read_universal.py"))
        .arg(&universal)
        .output()
        .expect("python3 (the standard library only) reads the export");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(read["tag"], "global_step5");
    let files = &read["files"];
    let values = |v: &serde_json::Value| -> Vec<f32> {
        v["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let (m, _) = imported(&dst);
    let weights = read_weights(&fixtures().join("zero3_fp32.zero_to_fp32.safetensors"));
    let moments = read_weights(&fixtures().join("zero3_fp32.moments.safetensors"));
    let params = m["params"].as_array().unwrap();
    for p in params {
        let name = p["name"].as_str().unwrap();
        for (file, want) in [
            ("fp32", &weights[name]),
            ("exp_avg", &moments[&format!("{name}/exp_avg")]),
            ("exp_avg_sq", &moments[&format!("{name}/exp_avg_sq")]),
        ] {
            let t = &files[format!("zero/{name}/{file}.pt")]["param"];
            assert_eq!(t["shape"], p["shape"], "{name}/{file}");
            let got = values(t);
            assert!(
                got.len() == want.len()
                    && got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}/{file} differs from DeepSpeed's"
            );
        }
        assert_eq!(files[format!("zero/{name}/step.pt")], 5, "Adam's step");
    }
    // DeepSpeed loads every .pt of a parameter's directory as an optimizer state
    let per_param = files
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.matches('/').count() == 2)
        .count();
    assert_eq!(per_param, params.len() * 4);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("zero3_fp32.json")).unwrap())
            .unwrap();
    // after the 4 warm-up steps WarmupLR holds warmup_max_lr
    let lr = &files["zero/optimizer_state.pt"]["param_groups"][0]["lr"];
    assert_eq!(lr, &config["scheduler"]["params"]["warmup_max_lr"]);
    let states = &files["mp_rank_00_model_states.pt"];
    assert_eq!(states["global_steps"], 5);
    assert_eq!(states["skipped_steps"], 0);
    assert_eq!(
        states["lr_scheduler"]["last_batch_iteration"], 4,
        "5 applied steps"
    );
    assert_eq!(
        states["global_samples"],
        5 * 2 * 2,
        "5 steps of micro-batch 2 on 2 ranks"
    );
    assert_eq!(states["mp_world_size"], 1);
    assert_eq!(states, &files["zero_pp_rank_0_mp_rank_00_model_states.pt"]);
}
