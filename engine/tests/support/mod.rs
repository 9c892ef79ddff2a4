//! What the tests of users' candle-nn models share: the Llama example's model, the same
//! Llama as ds-models builds it, and one micro-step of a program's own loop.
#![allow(dead_code)] // each test uses its part

#[path = "../../examples/llama/model.rs"]
pub mod model;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use ds_data::{DataLoader, MarkovTokens, SampleOrder, Windows};
use ds_engine::parallel::{vocab_parallel_cross_entropy, Tp};
use ds_engine::{Batch, Engine, Inputs};
use ds_models::llama::{Family, LlamaConfig, Rope, Scaling};

/// ds-models' Llama with the example's sizes (plain rope, no biases, untied).
pub fn ds_models_config(c: &model::Config) -> LlamaConfig {
    LlamaConfig {
        family: Family::Llama,
        vocab_size: c.vocab,
        hidden_size: c.hidden,
        intermediate_size: c.intermediate,
        num_hidden_layers: c.layers,
        num_attention_heads: c.heads,
        num_key_value_heads: c.kv_heads,
        head_dim: c.head_dim(),
        max_position_embeddings: c.max_seq,
        rms_norm_eps: c.eps,
        rope: Rope {
            theta: c.rope_theta,
            scaling: Scaling::Default,
        },
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        tie_word_embeddings: false,
        windows: vec![None; c.layers],
        initializer_range: 0.02,
        qk_norm: false,
        moe: None,
    }
}

/// One micro-step of the program's loop on a token batch: forward to logits, the
/// cross-entropy (split by vocabulary under tensor parallelism), backward, step; the loss.
pub fn lm_micro_step(engine: &mut Engine, tp: &Tp, b: Batch) -> ds_engine::Result<f32> {
    let ids = Tensor::from_vec(b.inputs, (b.batch, b.seq), &Device::Cpu)?;
    let labels = Tensor::from_vec(b.targets, b.batch * b.seq, &Device::Cpu)?;
    let logits = engine.forward(&Inputs::new().with("input_ids", ids))?;
    let loss = vocab_parallel_cross_entropy(tp, &logits.flatten_to(1)?, &labels)?;
    engine.backward(&loss)?;
    engine.step()?;
    Ok(loss.to_scalar::<f32>()?)
}

/// Windows of `seq` + 1 tokens of a Markov stream (`states` states per token, `seed`), this
/// rank's share of every global batch of `engine`'s layout.
pub fn markov_loader(engine: &Engine, seq: usize, states: usize, seed: u64) -> DataLoader {
    let (s, dp) = (engine.settings(), engine.groups().dp());
    let order = SampleOrder::new(seq, s.micro_batch, s.grad_accum, dp.rank(), dp.size()).unwrap();
    let vocab = model::Config::tiny().vocab;
    let tokens = MarkovTokens::new(vocab, states, 1 << 14, seed).unwrap();
    let samples = Windows::new(Arc::new(tokens), seq).unwrap().shuffled(1);
    DataLoader::new(Arc::new(samples), order, vocab).unwrap()
}

/// A data error as the engine's, for closures that return the engine's results.
pub fn data_err(e: impl std::fmt::Display) -> ds_engine::EngineError {
    ds_engine::EngineError::input(e.to_string())
}
