//! The digits example's CNN (plain candle-nn, f32 images in, logits out, the program's own
//! loss): at dp2 ZeRO-2 it classifies at least 95% of the held-out images right, measured by
//! the program from the logits the engine returns, and its losses equal one process's.

#[path = "../examples/digits/classifier.rs"]
mod classifier;

use std::time::Duration;

use classifier::{accuracy, build, train, Digits, TEST, TRAIN};
use ds_comm::testkit::run_ranks;
use ds_comm::ReduceOp;
use ds_engine::{EngineOptions, Job};

/// About 5 epochs of the 1,437 training images.
const STEPS: u64 = 220;

fn config(stage: u8) -> String {
    format!(
        r#"{{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 16,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}}}}}"#
    )
}

/// Each step's loss over the global batch, and the test accuracy, on every rank.
fn run(world: usize, stage: u8) -> Vec<(Vec<f32>, f64)> {
    run_ranks(world, Duration::from_secs(300), move |comm| {
        let job = Job::join(&comm, &config(stage))?;
        let mut engine = job.initialize(build()?, &EngineOptions::default())?;
        let mut losses = train(&mut engine, &Digits::read(TRAIN), STEPS)?;
        engine
            .groups()
            .dp()
            .all_reduce(&mut losses, ReduceOp::Avg)?;
        let acc = accuracy(&mut engine, &Digits::read(TEST))?;
        Ok::<_, ds_engine::EngineError>((losses, acc))
    })
    .unwrap()
}

#[test]
fn the_digits_cnn_learns_at_dp2_zero2_and_matches_one_process() {
    let dp2 = run(2, 2);
    let one = run(1, 0).remove(0);
    let worst = (dp2[0].0.iter().zip(&one.0))
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "test accuracy {:.2}% at dp2 ZeRO-2, {:.2}% on one rank; losses {worst:e} apart at most",
        dp2[0].1 * 100.0,
        one.1 * 100.0
    );
    for (rank, (losses, acc)) in dp2.iter().enumerate() {
        assert!(*acc >= 0.95, "rank {rank}: test accuracy {acc}");
        for (step, (a, b)) in losses.iter().zip(&one.0).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5,
                "rank {rank}: step {step}: loss {a} at dp2 ZeRO-2 against {b} on one rank"
            );
        }
    }
    // the same model, so the same accuracy to the image (360 test images)
    assert!(
        (dp2[0].1 - one.1).abs() < 0.5 / 360.0,
        "{} against {}",
        dp2[0].1,
        one.1
    );
}
