//! Handwritten digits (scikit-learn's 8x8 set) classified by a small CNN written with plain
//! candle-nn (classifier.rs), trained with ZeRO-2 through the engine: f32 images in, logits
//! out, the program's own loss and accuracy.
//!
//! ```sh
//! cargo run --release -p ds-engine --example digits
//! cargo build --release -p ds-engine --example digits
//! ds-rs launch --nproc_per_node 2 target/release/examples/digits   # dp2, the same losses
//! ```
//!
//! Option: `--steps N` (optimizer steps, default 300: about 7 epochs of 1,437 images).

mod classifier;

use classifier::{accuracy, build, train, Digits, TEST, TRAIN};
use ds_engine::{EngineOptions, Job};

/// A global batch of 32 images: 16 per micro-batch, accumulated over 2 on one rank, 1 on two.
const DS_CONFIG: &str = r#"{
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2}
}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = match std::env::args().skip(1).collect::<Vec<_>>().as_slice() {
        [] => 300,
        [flag, n] if flag == "--steps" => n.parse()?,
        other => return Err(format!("unexpected arguments {other:?} (--steps N)").into()),
    };
    let job = Job::init(DS_CONFIG)?;
    let mut engine = job.initialize(build()?, &EngineOptions::default())?;
    let losses = train(&mut engine, &Digits::read(TRAIN), steps)?;
    let acc = accuracy(&mut engine, &Digits::read(TEST))?;
    if job.rank() == 0 {
        for (step, loss) in losses.iter().enumerate().filter(|(s, _)| (s + 1) % 50 == 0) {
            println!("step {:>4}  loss {loss:.4}", step + 1);
        }
        println!(
            "test accuracy {:.2}% of {} images",
            acc * 100.0,
            Digits::read(TEST).len()
        );
    }
    Ok(())
}
