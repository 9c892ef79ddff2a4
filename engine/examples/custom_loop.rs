//! A user-defined model trained through the engine API in a custom loop:
//! `cargo run --release -p ds-engine --example custom_loop` (alone it is one rank; under
//! `ds-rs launch` each rank joins the job from its environment).
use candle_core::{Module, Tensor};
use candle_nn::{embedding, linear, VarBuilder};
use ds_engine::data::Batch;
use ds_engine::model::{gpt::CrossEntropyLoss, Context, Init, Layer, Model, ParamSpec};
use ds_engine::{Engine, EngineOptions};

const V: usize = 64; // vocabulary
const W: usize = 32; // width
const T: usize = 16; // sequence length

/// Token ids to next-token logits: embedding, a tanh hidden layer, output projection.
struct BigramMlp;

impl Layer for BigramMlp {
    fn params(&self) -> Vec<ParamSpec> {
        let n = Init::normal(0.1);
        vec![
            ParamSpec::new("emb.weight", &[V, W], n),
            ParamSpec::new("hidden.weight", &[W, W], n),
            ParamSpec::new("hidden.bias", &[W], Init::Zeros),
            ParamSpec::new("out.weight", &[V, W], n),
            ParamSpec::new("out.bias", &[V], Init::Zeros),
        ]
    }
    fn forward(&self, vb: &VarBuilder, ids: &Tensor, _: &Context) -> candle_core::Result<Tensor> {
        let x = embedding(V, W, vb.pp("emb"))?.forward(ids)?;
        let h = linear(W, W, vb.pp("hidden"))?.forward(&x)?.tanh()?;
        linear(W, V, vb.pp("out"))?.forward(&h)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Model::new().layer("", BigramMlp);
    let model = model.layer("", CrossEntropyLoss);
    let config = r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2}}"#;
    let comm = ds_comm::init_from_env()?;
    let dims = ds_config::ParallelDims::new(comm.world_size(), 1, 1)?;
    let config = ds_config::resolve(&ds_config::hjson::parse_bytes(config.as_bytes())?, &dims)?;
    let mut engine = Engine::initialize(model, &config, &comm, &EngineOptions::default())?;
    // the data: the sequence 0, 3, 6, ..., 45 repeated, in windows of T + 1 tokens
    let window = |s: usize| (s..=s + T).map(|i| (i % 16 * 3) as u32).collect::<Vec<_>>();
    for micro_step in 0..200 {
        let rows: Vec<Vec<u32>> = (0..4).map(|b| window(micro_step * 4 + b)).collect();
        let loss = engine.forward(&Batch::from_windows(&rows))?;
        engine.backward()?;
        let (stepped, step) = (engine.step()?.is_some(), engine.global_steps());
        if stepped && step % 20 == 1 && comm.rank() == 0 {
            println!("step {step:>3}  loss {loss:.4}  lr {}", engine.get_lr());
        }
    }
    Ok(())
}
