//! Bad input to the engine gives an error that names what was wrong and where, never a panic.

use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_config::{hjson, resolve, ParallelDims};
use ds_engine::model::weights;
use ds_engine::{Engine, EngineOptions};
use ds_models::gpt::GptConfig;

const MODEL: GptConfig = GptConfig {
    vocab_size: 32,
    seq_len: 8,
    hidden: 16,
    heads: 2,
    layers: 1,
    tie_embeddings: false,
    moe: None,
};

fn config(json: &str, world: usize, tp: usize) -> ds_config::Config {
    let doc = hjson::parse_bytes(json.as_bytes()).unwrap();
    resolve(&doc, &ParallelDims::new(world, tp, 1).unwrap()).unwrap()
}

/// The first rank's error from initialising the engine with `cfg` and `opts`.
fn init_error(cfg: ds_config::Config, opts: EngineOptions, world: usize) -> String {
    run_ranks(world, Duration::from_secs(30), move |comm| {
        Engine::initialize(
            MODEL.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &opts,
        )
        .map(|_| ())
    })
    .unwrap_err()
}

const OK: &str = r#"{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}"#;

#[test]
fn configs_the_engine_cannot_run_are_named() {
    let e = init_error(
        config(r#"{"train_micro_batch_size_per_gpu": 1}"#, 2, 1),
        EngineOptions::default(),
        2,
    );
    assert!(e.contains("optimizer"), "{e}");
    let lamb = r#"{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Lamb"}}"#;
    let e = init_error(config(lamb, 2, 1), EngineOptions::default(), 2);
    assert!(e.contains("optimizer.type") && e.contains("lamb"), "{e}");
    let e = init_error(config(OK, 4, 2), EngineOptions::default(), 4);
    // a config resolved for tp 2 given data-parallel groups
    assert!(
        e.contains("dp 2 x tp 2 x pp 1") && e.contains("dp 4 x tp 1"),
        "{e}"
    );
}

#[test]
fn settings_not_implemented_yet_are_refused_naming_the_key() {
    let partitioned = r#"{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
        "activation_checkpointing": {"partition_activations": true}}"#;
    let cfg = config(partitioned, 2, 2);
    let e = run_ranks(2, Duration::from_secs(30), move |comm| {
        let groups = ds_comm::Groups::new(&comm, cfg.dims)?;
        Engine::initialize(MODEL.build(), &cfg, &groups, &EngineOptions::default()).map(|_| ())
    })
    .unwrap_err();
    assert!(
        e.contains("activation_checkpointing.partition_activations")
            && e.contains("not implemented yet"),
        "{e}"
    );
}

#[test]
fn init_files_of_another_model_are_named() {
    let dir = std::env::temp_dir().join(format!("ds-rs-bad-init-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut specs = MODEL.build().params();
    let values: Vec<Vec<f32>> = specs.iter().map(|s| vec![0.0; s.numel()]).collect();
    // one parameter missing
    let missing = dir.join("missing.safetensors");
    weights::save(&missing, &specs[1..], &values[1..]).unwrap();
    let opts = EngineOptions {
        init: Some(missing),
        ..EngineOptions::default()
    };
    let e = init_error(config(OK, 2, 1), opts, 2);
    assert!(
        e.contains("missing.safetensors") && e.contains("'wte.weight' is missing"),
        "{e}"
    );
    // one parameter of another shape
    specs[0].shape = vec![MODEL.vocab_size, MODEL.hidden + 1];
    let mut values = values;
    values[0] = vec![0.0; MODEL.vocab_size * (MODEL.hidden + 1)];
    let shaped = dir.join("shape.safetensors");
    weights::save(&shaped, &specs, &values).unwrap();
    let opts = EngineOptions {
        init: Some(shaped),
        ..EngineOptions::default()
    };
    let e = init_error(config(OK, 2, 1), opts, 2);
    assert!(
        e.contains("shape.safetensors") && e.contains("[32, 17]"),
        "{e}"
    );
    // not a safetensors file
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a tensor file").unwrap();
    let opts = EngineOptions {
        init: Some(garbage),
        ..EngineOptions::default()
    };
    assert!(init_error(config(OK, 2, 1), opts, 2).contains("garbage.safetensors"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn backward_without_forward_is_an_error() {
    let e = run_ranks(1, Duration::from_secs(30), |comm| {
        let cfg = config(OK, 1, 1);
        let mut engine = Engine::initialize(
            MODEL.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &EngineOptions::default(),
        )?;
        let loss = candle_core::Tensor::new(1f32, &engine.device())?;
        engine.backward(&loss)
    })
    .unwrap_err();
    assert!(e.contains("forward"), "{e}");
}

#[test]
fn train_batch_inside_an_open_accumulation_window_is_an_error() {
    let ga2 = r#"{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW"}}"#;
    let e = run_ranks(1, Duration::from_secs(30), move |comm| {
        let mut engine = Engine::initialize(
            MODEL.build(),
            &config(ga2, 1, 1),
            &ds_comm::Groups::data_parallel(&comm)?,
            &EngineOptions::default(),
        )?;
        let w: Vec<u32> = (0..=MODEL.seq_len as u32).collect();
        let batch = ds_engine::Batch::from_windows(&[w]);
        let loss = engine.forward(&batch.to_inputs(&engine.device())?)?;
        engine.backward(&loss)?;
        engine.train_batch(|_| Ok(batch.clone())).map(|_| ())
    })
    .unwrap_err();
    assert!(e.contains("accumulation window"), "{e}");
}

/// The error from building a model of candle-nn modules with `build`.
fn module_error<E: std::fmt::Display>(
    build: impl FnOnce() -> Result<ds_engine::model::Model, E>,
) -> String {
    match build() {
        Ok(_) => panic!("the model was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_parameter_built_twice_is_an_error_naming_it() {
    use ds_engine::model::Model;
    // twice in one module
    let e = module_error(|| {
        Model::new().module("fc", |vb| {
            let a = candle_nn::linear(4, 4, vb.clone())?;
            let _b = candle_nn::linear(4, 4, vb)?;
            Ok(a)
        })
    });
    assert!(e.contains("fc.weight") && e.contains("twice"), "{e}");
    // by two modules under one prefix
    let e = module_error(|| {
        Model::new()
            .module("fc", |vb| candle_nn::linear(4, 4, vb))?
            .module("fc", |vb| candle_nn::linear(4, 4, vb))
    });
    assert!(e.contains("fc.weight") && e.contains("twice"), "{e}");
}

#[test]
fn a_module_that_reads_no_parameter_is_an_error() {
    use ds_engine::model::Model;
    let e = module_error(|| Model::new().module("act", |_| Ok(candle_nn::Activation::Relu)));
    assert!(e.contains("\"act\"") && e.contains("no parameter"), "{e}");
}

/// The first rank's error from one training micro-step of a one-layer candle-nn model, with
/// `inputs` and the loss `loss(logits)`.
fn micro_step_error(
    inputs: fn() -> candle_core::Result<ds_engine::Inputs>,
    loss: fn(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> String {
    run_ranks(1, Duration::from_secs(30), move |comm| {
        let job = ds_engine::Job::join(&comm, OK)?;
        let model =
            ds_engine::model::Model::new().module("fc", |vb| candle_nn::linear(4, 3, vb))?;
        let mut engine = job.initialize(model, &EngineOptions::default())?;
        let logits = engine.forward(&inputs()?)?;
        engine.backward(&loss(&logits)?)
    })
    .unwrap_err()
}

fn features(rows: usize) -> candle_core::Result<candle_core::Tensor> {
    candle_core::Tensor::ones(
        (rows, 4),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
}

#[test]
fn a_loss_that_does_not_depend_on_the_model_is_an_error() {
    let e = micro_step_error(
        || Ok(ds_engine::Inputs::new().with("x", features(1)?)),
        |logits| candle_core::Tensor::new(1f32, logits.device()),
    );
    assert!(e.contains("does not depend"), "{e}");
}

#[test]
fn a_batch_tensor_of_another_size_than_the_micro_batch_is_an_error() {
    // the config's micro-batch is 1
    let e = micro_step_error(
        || Ok(ds_engine::Inputs::new().with("x", features(3)?)),
        |logits| logits.sum_all(),
    );
    assert!(
        e.contains("\"x\"")
            && e.contains("[3, 4]")
            && e.contains("train_micro_batch_size_per_gpu = 1"),
        "{e}"
    );
}
