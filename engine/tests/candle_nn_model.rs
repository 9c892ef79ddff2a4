//! A model written with plain candle-nn (the Llama example's model.rs) trained through the
//! engine's library API: forward to logits, the program's own loss, `backward(&loss)`. One
//! logical model, many layouts: the losses at dp2 ZeRO-3 and tp2 x dp2 equal one process's,
//! and one process's equal those of the same Llama built from ds-rs's own layers (ds-models),
//! from the same initial weights. Under tensor parallelism the head is split by vocabulary
//! and the program's loss is `vocab_parallel_cross_entropy`.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_comm::{Communicator, ReduceOp};
use ds_engine::{EngineOptions, Job};
use support::{ds_models_config, lm_micro_step, markov_loader, model};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SEQ: usize = 16;
const STEPS: u64 = 10;

/// The same global batch (8 samples: micro-batch 4 x accumulation x dp) in every layout.
fn config(stage: u8, tp: usize) -> String {
    let split = r#", "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
        {"patterns": [".*((q|k|v|gate|up)_proj|lm_head)\\.weight$"], "partition_type": "column"},
        {"patterns": [".*(o|down)_proj\\.weight$"], "partition_type": "row"}]}}"#;
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}}}{}}}"#,
        if tp == 2 { split } else { "" }
    )
}

fn opts(init: &Path) -> EngineOptions {
    EngineOptions {
        init: Some(init.to_path_buf()),
        ..EngineOptions::default()
    }
}

/// The step losses of the candle-nn model (the mean over the global batch).
fn candle_nn_losses(comm: Communicator, cfg: &str, init: &Path) -> R<Vec<f32>> {
    let c = model::Config::tiny();
    let job = Job::join(&comm, cfg)?;
    let mut engine = job.initialize(model::build(c, job.tp())?, &opts(init))?;
    let data = markov_loader(&engine, SEQ, 4, 3);
    let accum = engine.settings().grad_accum;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut total = 0.0;
        for k in 0..accum {
            total +=
                lm_micro_step(&mut engine, &job.tp(), data.micro_batch(step, k)?)? / accum as f32;
        }
        let mut mean = [total];
        engine.groups().dp().all_reduce(&mut mean, ReduceOp::Avg)?;
        losses.push(mean[0]);
    }
    Ok(losses)
}

/// The ds-models Llama's step losses from `init`, one process; writes `init` first when
/// `write_init` (its seeded initial weights).
fn ds_models_losses(comm: Communicator, init: &Path, write_init: bool) -> R<Vec<f32>> {
    let c = model::Config::tiny();
    let job = Job::join(&comm, &config(0, 1))?;
    let build = || ds_models::llama::build(&ds_models_config(&c), &job.parallel());
    if write_init {
        let seeded = job.initialize(build()?, &EngineOptions::default())?;
        seeded.save_weights(init)?;
    }
    let mut engine = job.initialize(build()?, &opts(init))?;
    let data = markov_loader(&engine, SEQ, 4, 3);
    let batch = |step, k| data.micro_batch(step, k).map_err(support::data_err);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        losses.push(engine.train_batch(|k| batch(step, k))?.0);
    }
    Ok(losses)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds-rs-candle-nn-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "{what}: the losses differ by {worst:e} at most over {} steps",
        got.len()
    );
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5,
            "{what}: step {step}: loss {g} against {w} ({:e} apart)\n got {got:?}\nwant {want:?}",
            (g - w).abs()
        );
    }
}

#[test]
fn candle_nn_llama_trains_the_same_in_every_layout_and_as_ds_models_llama() {
    let dir = scratch("layouts");
    let init = Arc::new(dir.join("init.safetensors"));
    let t = Duration::from_secs(120);
    let i = init.clone();
    let reference = run_ranks(1, t, move |comm| ds_models_losses(comm, &i, true)).unwrap();
    let reference = &reference[0];
    let run = |world: usize, cfg: String| {
        let i = init.clone();
        run_ranks(world, t, move |comm| candle_nn_losses(comm, &cfg, &i)).unwrap()
    };
    let one = run(1, config(0, 1)).remove(0);
    // the loss falls: the model trains
    assert!(one[STEPS as usize - 1] < one[0] - 0.5, "{one:?}");
    // the candle-nn model and ds-rs's own layers compute the same function and gradients
    assert_close("candle-nn dp1 against ds-models dp1", &one, reference);
    for (name, world, cfg) in [
        ("dp2 ZeRO-3", 2, config(3, 1)),
        ("tp2 x dp2 ZeRO-3", 4, config(3, 2)),
    ] {
        let ranks = run(world, cfg);
        for r in &ranks {
            assert_close(&format!("candle-nn {name}"), r, &one);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
