//! A user-defined model trained through the engine API, as a DeepSpeed user's own loop would:
//! `cargo run --release -p ds-engine --example custom_loop` (one rank; under `ds-rs launch`
//! each rank joins the job from its environment).
//!
//! The model is a two-layer bigram MLP over a repeating 16-symbol sequence: its loss falls
//! from ln(64) toward 0 within a few hundred steps.

use candle_core::{Module, Tensor};
use candle_nn::{embedding, linear, VarBuilder};
use ds_engine::data::Batch;
use ds_engine::model::gpt::CrossEntropyLoss;
use ds_engine::model::{Context, Init, Layer, Model, ParamSpec};
use ds_engine::{Engine, EngineOptions};

const VOCAB: usize = 64;
const WIDTH: usize = 32;
const SEQ: usize = 16;

/// Token ids to logits: an embedding, a tanh hidden layer and an output projection.
struct BigramMlp;

impl Layer for BigramMlp {
    fn params(&self) -> Vec<ParamSpec> {
        let normal = Init::Normal {
            mean: 0.0,
            std: 0.1,
        };
        vec![
            ParamSpec::new("emb.weight", &[VOCAB, WIDTH], normal),
            ParamSpec::new("hidden.weight", &[WIDTH, WIDTH], normal),
            ParamSpec::new("hidden.bias", &[WIDTH], Init::Zeros),
            ParamSpec::new("out.weight", &[VOCAB, WIDTH], normal),
            ParamSpec::new("out.bias", &[VOCAB], Init::Zeros),
        ]
    }

    fn forward(&self, vb: &VarBuilder, ids: &Tensor, _: &Context) -> candle_core::Result<Tensor> {
        let x = embedding(VOCAB, WIDTH, vb.pp("emb"))?.forward(ids)?;
        let h = linear(WIDTH, WIDTH, vb.pp("hidden"))?.forward(&x)?.tanh()?;
        linear(WIDTH, VOCAB, vb.pp("out"))?.forward(&h)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::new()
        .layer("", BigramMlp)
        .layer("", CrossEntropyLoss);
    let text = r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20}},
        "zero_optimization": {"stage": 2}}"#;
    let comm = ds_comm::init_from_env()
        .or_else(|_| ds_comm::init(&ds_comm::InitOptions::new(0, 1, "127.0.0.1", 0)))?;
    let dims = ds_config::ParallelDims::new(comm.world_size(), 1, 1)?;
    let config = ds_config::resolve(&ds_config::hjson::parse_bytes(text.as_bytes())?, &dims)?;
    let mut engine = Engine::initialize(model, &config, &comm, &EngineOptions::default())?;
    let sequence = |start: usize| {
        (0..=SEQ)
            .map(|i| ((start + i) % 16 * 3) as u32)
            .collect::<Vec<_>>()
    };
    for step in 0..200 {
        let w: Vec<Vec<u32>> = (0..4).map(|b| sequence(step * 4 + b)).collect();
        let batch = Batch {
            inputs: w.iter().flat_map(|s| s[..SEQ].to_vec()).collect(),
            targets: w.iter().flat_map(|s| s[1..].to_vec()).collect(),
            batch: 4,
            seq: SEQ,
        };
        let loss = engine.forward(&batch)?;
        engine.backward()?;
        if engine.step()?.is_some() && step % 40 == 1 && comm.rank() == 0 {
            println!(
                "step {:>3}  loss {loss:.4}  lr {:.5}",
                engine.global_steps(),
                engine.get_lr()
            );
        }
    }
    Ok(())
}
