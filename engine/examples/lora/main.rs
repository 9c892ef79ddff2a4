//! LoRA fine-tuning of a saved model: the Llama example's candle-nn decoder, its weights from
//! an earlier run, gets low-rank adapters on the attention's query and value projections;
//! everything else is frozen (no gradients, no optimizer state, still sharded by ZeRO-3), and
//! only the adapters train, on a token stream the base never saw.
//!
//! ```sh
//! cargo build --release -p ds-engine --example llama --example lora
//! target/release/examples/llama --steps 100 --save-weights base.safetensors
//! target/release/examples/lora --base base.safetensors --save adapters/
//! ds-rs launch --nproc_per_node 2 target/release/examples/lora --base base.safetensors
//! ```
//!
//! Options: `--base FILE` (the model to adapt, required), `--steps N` (default 60), `--save
//! DIR` (a checkpoint of the adapters at the end: the frozen base stays in FILE) and `--hidden
//! N` (the base's width, as the llama example was given it; default 64).

#[path = "../llama/model.rs"]
mod model;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use ds_data::{DataLoader, MarkovTokens, SampleOrder, Windows};
use ds_engine::model::LoraConfig;
use ds_engine::nn::cross_entropy;
use ds_engine::{EngineOptions, Inputs, Job};
use model::{build, Config};

const DS_CONFIG: &str = r#"{
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 3}
}"#;

const SEQ: usize = 32;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (base, steps, save, hidden) = parse_args()?;
    let c = Config::tiny().with_hidden(hidden);
    let job = Job::init(DS_CONFIG)?;
    let lora = LoraConfig {
        r: 8,
        alpha: 16.0,
        target_modules: "(q|v)_proj$".into(),
    };
    let model = build(c, job.tp())?.lora(&lora)?;
    let opts = EngineOptions {
        init: Some(base),
        ..EngineOptions::default()
    };
    let mut engine = job.initialize(model, &opts)?;

    // the new data: a stream with another transition table than the base's
    let s = engine.settings();
    let dp = job.groups().dp();
    let tokens = MarkovTokens::new(c.vocab, 2, 1 << 16, 11)?;
    let floor = tokens.entropy_rate_nats();
    let order = SampleOrder::new(SEQ, s.micro_batch, s.grad_accum, dp.rank(), dp.size())?;
    let samples = Windows::new(Arc::new(tokens), SEQ)?.shuffled(1);
    let loader = DataLoader::new(Arc::new(samples), order, c.vocab)?;
    let accum = s.grad_accum;

    for step in 0..steps {
        let mut total = 0.0;
        for k in 0..accum {
            let b = loader.micro_batch(step, k)?;
            let ids = Tensor::from_vec(b.inputs, (b.batch, b.seq), &Device::Cpu)?;
            let labels = Tensor::from_vec(b.targets, b.batch * b.seq, &Device::Cpu)?;
            let logits = engine.forward(&Inputs::new().with("input_ids", ids))?;
            let loss = cross_entropy(&logits.flatten_to(1)?, &labels)?;
            engine.backward(&loss)?;
            engine.step()?;
            total += loss.to_scalar::<f32>()? / accum as f32;
        }
        if job.rank() == 0 && (step + 1) % 10 == 0 {
            println!("step {:>4}  loss {total:.4}  (floor {floor:.4})", step + 1);
        }
    }
    if job.rank() == 0 {
        println!("{}", model::memory_line(&engine.memory_report()));
    }
    if let Some(dir) = save {
        engine.save_checkpoint(&dir, "adapters", serde_json::json!({}))?;
    }
    Ok(())
}

/// `--base FILE`, `--steps N`, `--save DIR`, `--hidden N`.
fn parse_args() -> Result<(PathBuf, u64, Option<PathBuf>, usize), String> {
    let (mut base, mut steps, mut save, mut hidden) = (None, 60, None, 64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--base" => base = Some(PathBuf::from(value()?)),
            "--steps" => steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--save" => save = Some(value()?.into()),
            "--hidden" => {
                let v = value()?;
                hidden = v
                    .parse()
                    .ok()
                    .filter(|h: &usize| *h > 0 && h.is_multiple_of(32))
                    .ok_or(format!("--hidden {v}: expected a positive multiple of 32"))?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--base FILE, --steps N, --save DIR, --hidden N)"
                ))
            }
        }
    }
    let base =
        base.ok_or("--base FILE: the weights to adapt (the llama example's --save-weights)")?;
    Ok((base, steps, save, hidden))
}
