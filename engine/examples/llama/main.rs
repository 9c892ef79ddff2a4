//! A Llama-style decoder written with plain candle-nn (model.rs), trained by the engine in a
//! loop a DeepSpeed user knows: `initialize`, then `forward`, the program's own loss,
//! `backward(&loss)`, `step`, and a checkpoint at the end. The ZeRO stage, precision,
//! optimizer and tensor parallelism come from the ds_config; the code is the same for all.
//!
//! ```sh
//! # one rank, the built-in ds_config below (ZeRO-3)
//! cargo run --release -p ds-engine --example llama
//! # four ranks: tensor parallelism 2 x data parallelism 2
//! cargo build --release -p ds-engine --example llama
//! ds-rs launch --nproc_per_node 4 --config tp2.json target/release/examples/llama
//! ```
//!
//! `tp2.json` is the built-in config with `"tensor_parallel": {"autotp_size": 2,
//! "partition_config": ...}` (the rules below). Options: `--steps N` (default 50), `--save
//! DIR` (a checkpoint at the end) and `--save-weights FILE` (the model as one safetensors
//! file, which the lora example adapts) and `--hidden N` (the width, a multiple of 32;
//! default 64).

mod model;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use ds_data::{DataLoader, MarkovTokens, SampleOrder, Windows};
use ds_engine::parallel::vocab_parallel_cross_entropy;
use ds_engine::{EngineOptions, Inputs, Job};
use model::{build, Config};

/// ZeRO-3 with Adam. With tensor parallelism (`ds-rs launch --config tp2.json`), add
/// `"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns":
/// [".*((q|k|v|gate|up)_proj|lm_head)\\.weight$"], "partition_type": "column"}, {"patterns":
/// [".*(o|down)_proj\\.weight$"], "partition_type": "row"}]}}`: the attention and the MLP split
/// as Megatron splits them, the head by vocabulary.
const DS_CONFIG: &str = r#"{
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3},
    "steps_per_print": 10
}"#;

const SEQ: usize = 32;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let c = Config::tiny().with_hidden(args.hidden);
    let job = Job::init(DS_CONFIG)?;
    let mut engine = job.initialize(build(c, job.tp())?, &EngineOptions::default())?;

    // a learnable token stream (its entropy rate is the lowest reachable loss), each rank
    // reading its share of every global batch
    let s = engine.settings();
    let (micro, accum) = (s.micro_batch, s.grad_accum);
    let dp = job.groups().dp();
    let tokens = MarkovTokens::new(c.vocab, 4, 1 << 16, 7)?;
    let floor = tokens.entropy_rate_nats();
    let order = SampleOrder::new(SEQ, micro, accum, dp.rank(), dp.size())?;
    let samples = Windows::new(Arc::new(tokens), SEQ)?.shuffled(1);
    let loader = DataLoader::new(Arc::new(samples), order, c.vocab)?;

    for step in 0..args.steps {
        let mut total = 0.0;
        for k in 0..accum {
            let b = loader.micro_batch(step, k)?;
            let ids = Tensor::from_vec(b.inputs, (b.batch, b.seq), &Device::Cpu)?;
            let labels = Tensor::from_vec(b.targets, b.batch * b.seq, &Device::Cpu)?;
            let logits = engine.forward(&Inputs::new().with("input_ids", ids))?;
            let loss = vocab_parallel_cross_entropy(&job.tp(), &logits.flatten_to(1)?, &labels)?;
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
    if let Some(dir) = args.save {
        engine.save_checkpoint(&dir, "final", serde_json::json!({}))?;
    }
    if let Some(file) = args.save_weights {
        engine.save_weights(&file)?;
    }
    Ok(())
}

struct Args {
    steps: u64,
    hidden: usize,
    save: Option<std::path::PathBuf>,
    save_weights: Option<std::path::PathBuf>,
}

/// `--steps N`, `--save DIR`, `--save-weights FILE`.
fn parse_args() -> Result<Args, String> {
    let mut out = Args {
        steps: 50,
        hidden: 64,
        save: None,
        save_weights: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--steps" => out.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--save" => out.save = Some(value()?.into()),
            "--save-weights" => out.save_weights = Some(value()?.into()),
            "--hidden" => out.hidden = hidden(&value()?)?,
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--steps N, --save DIR, --save-weights FILE, --hidden N)"
                ))
            }
        }
    }
    Ok(out)
}

/// `--hidden`: a positive multiple of 32 (heads of 16, an even number of them).
fn hidden(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(h) if h > 0 && h.is_multiple_of(32) => Ok(h),
        _ => Err(format!("--hidden {v}: expected a positive multiple of 32")),
    }
}
