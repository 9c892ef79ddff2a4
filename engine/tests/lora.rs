//! LoRA fine-tuning of a saved model (`Model::lora`): the Llama example's candle-nn model,
//! its weights saved by a first run, adapted on the query and value projections. The base
//! keeps its bits, only the adapters hold optimizer state (the memory report against the
//! formula), ZeRO-3 shards the frozen base, the loss falls, dp2 ZeRO-3 equals one process, and
//! the same adapters on ds-models' Llama (whose layers differentiate themselves, so the
//! adapters' gradients come by the chain rule) give the same losses as on the candle-nn one
//! (autograd through `W + s B A`).

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use ds_comm::testkit::run_ranks;
use ds_comm::ReduceOp;
use ds_engine::model::LoraConfig;
use ds_engine::{Engine, EngineOptions, Job, MemoryReport};
use support::{data_err, ds_models_config, lm_micro_step, markov_loader, model};

const STEPS: u64 = 16;
const SEQ: usize = 16;

fn lora() -> LoraConfig {
    LoraConfig {
        r: 4,
        alpha: 8.0,
        target_modules: "(q|v)_proj$".into(),
    }
}

fn config(stage: u8) -> String {
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.05}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    )
}

/// The fine-tuning data: a token stream the base never saw.
fn finetune_data(engine: &Engine) -> ds_data::DataLoader {
    markov_loader(engine, SEQ, 2, 11)
}

struct Run {
    losses: Vec<f32>,
    params: HashMap<String, Vec<f32>>,
    memory: MemoryReport,
}

/// Fine-tunes the candle-nn model (or ds-models' Llama with `taped`) from `base`.
fn finetune(world: usize, stage: u8, base: Arc<PathBuf>, taped: bool) -> Vec<Run> {
    run_ranks(world, Duration::from_secs(120), move |comm| {
        let c = model::Config::tiny();
        let job = Job::join(&comm, &config(stage))?;
        let m = match taped {
            false => model::build(c, job.tp())?,
            true => ds_models::llama::build(&ds_models_config(&c), &job.parallel())
                .map_err(ds_engine::EngineError::Model)?,
        };
        let opts = EngineOptions {
            init: Some(base.to_path_buf()),
            ..EngineOptions::default()
        };
        let mut engine = job.initialize(m.lora(&lora())?, &opts)?;
        let data = finetune_data(&engine);
        let accum = engine.settings().grad_accum;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let mut total = 0.0;
            for k in 0..accum {
                let b = data.micro_batch(step, k).map_err(data_err)?;
                let loss = match taped {
                    // ds-models' Llama ends in its loss layer
                    true => {
                        let loss = engine.forward(&b.to_inputs(&Device::Cpu)?)?;
                        engine.backward(&loss)?;
                        engine.step()?;
                        loss.to_scalar::<f32>()?
                    }
                    false => lm_micro_step(&mut engine, &job.tp(), b)?,
                };
                total += loss / accum as f32;
            }
            let mut mean = [total];
            job.groups().dp().all_reduce(&mut mean, ReduceOp::Avg)?;
            losses.push(mean[0]);
        }
        let params = engine.gather_params()?.into_iter().collect();
        Ok::<_, ds_engine::EngineError>(Run {
            losses,
            params,
            memory: engine.memory_report(),
        })
    })
    .unwrap()
}

/// The base model: the candle-nn model's seeded weights, saved as a user's earlier run would.
fn save_base(path: &Path) {
    let path = path.to_path_buf();
    run_ranks(1, Duration::from_secs(60), move |comm| {
        let job = Job::join(&comm, &config(0))?;
        let engine = job.initialize(
            model::build(model::Config::tiny(), job.tp())?,
            &EngineOptions::default(),
        )?;
        engine.save_weights(&path)
    })
    .unwrap();
}

fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

#[test]
fn lora_trains_the_adapters_only_in_every_layout_and_on_taped_layers() {
    let dir = std::env::temp_dir().join(format!("ds-rs-lora-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base_path = Arc::new(dir.join("base.safetensors"));
    save_base(&base_path);
    let base = candle_core::safetensors::load(base_path.as_path(), &Device::Cpu).unwrap();

    let one = finetune(1, 0, base_path.clone(), false).remove(0);
    let mean = |l: &[f32]| l.iter().sum::<f32>() / l.len() as f32;
    let (first, last) = (
        mean(&one.losses[..4]),
        mean(&one.losses[STEPS as usize - 4..]),
    );
    eprintln!("fine-tuning loss: first 4 steps {first:.4}, last 4 {last:.4}");
    assert!(
        last < first - 0.3,
        "the loss does not fall: {:?}",
        one.losses
    );
    let taped = finetune(1, 0, base_path.clone(), true).remove(0);
    let dp2 = finetune(2, 3, base_path.clone(), false);
    let runs = [("ds-models' taped Llama", 1, &taped)]
        .into_iter()
        .chain(dp2.iter().map(|r| ("dp2 ZeRO-3", 2, r)));
    for (what, _, run) in runs {
        for (step, (a, b)) in run.losses.iter().zip(&one.losses).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5,
                "{what}: step {step}: loss {a} against {b} on one rank"
            );
        }
    }
    for (what, world, run) in [("one rank", 1, &one)]
        .into_iter()
        .chain(dp2.iter().map(|r| ("dp2 ZeRO-3", 2, r)))
    {
        let (mut adapters, mut frozen) = (0, 0);
        for (name, values) in &run.params {
            if is_adapter(name) {
                adapters += values.len();
                continue;
            }
            frozen += values.len();
            let want = base[name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let same = want
                .iter()
                .zip(values)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: the frozen {name} changed");
        }
        // q: A [4, 64] + B [64, 4]; v: A [4, 64] + B [32, 4]; two layers
        assert_eq!(adapters, 2 * (256 + 256 + 256 + 128), "{what}");
        // Adam: fp32 master and two moments, 12 bytes an adapter parameter; the frozen base
        // in fp32, 4 bytes a parameter; ZeRO-3 shards both over dp (padded to a multiple)
        let share = |n: usize| n.div_ceil(world);
        let m = &run.memory;
        assert_eq!(m.optimizer_states, 12 * share(adapters), "{what}: {m:?}");
        assert_eq!(m.grads, 4 * share(adapters), "{what}: {m:?}");
        assert_eq!(m.frozen_params, 4 * share(frozen), "{what}: {m:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Optimizer steps `steps` of the candle-nn model on the fine-tuning data; this rank's losses.
fn train_steps(engine: &mut Engine, steps: std::ops::Range<u64>) -> ds_engine::Result<Vec<f32>> {
    let data = finetune_data(engine);
    let accum = engine.settings().grad_accum;
    let mut losses = Vec::new();
    let tp = ds_engine::parallel::Tp::none();
    for step in steps {
        for k in 0..accum {
            let b = data.micro_batch(step, k).map_err(data_err)?;
            losses.push(lm_micro_step(engine, &tp, b)?);
        }
    }
    Ok(losses)
}

#[test]
fn a_lora_run_resumes_exactly_from_its_adapter_checkpoint() {
    let dir = std::env::temp_dir().join(format!("ds-rs-lora-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("base.safetensors");
    save_base(&base);
    let ckpt = dir.join("ckpt");
    let (b, c) = (base.clone(), ckpt.clone());
    let ranks = run_ranks(2, Duration::from_secs(120), move |comm| {
        let job = Job::join(&comm, &config(3))?;
        let opts = EngineOptions {
            init: Some(b.clone()),
            ..EngineOptions::default()
        };
        let engine = || -> ds_engine::Result<Engine> {
            let m = model::build(model::Config::tiny(), job.tp())?.lora(&lora())?;
            job.initialize(m, &opts)
        };
        let straight = train_steps(&mut engine()?, 0..8)?;
        let mut first = engine()?;
        let mut resumed = train_steps(&mut first, 0..4)?;
        let saved = first.save_checkpoint(&c, "step4", serde_json::json!({}))?;
        drop(first);
        let mut second = engine()?;
        second.load_checkpoint(&c, None)?;
        assert_eq!(second.global_steps(), 4);
        resumed.extend(train_steps(&mut second, 4..8)?);
        // the adapters of another base (here: the seeded one) are refused, naming both
        let m = model::build(model::Config::tiny(), job.tp())?.lora(&lora())?;
        let mut other = job.initialize(m, &EngineOptions::default())?;
        let refused = other
            .load_checkpoint(&c, None)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("weights file base.safetensors") && refused.contains("seed 0"),
            "{refused}"
        );
        Ok::<_, ds_engine::EngineError>((straight, resumed, saved))
    })
    .unwrap();
    for (rank, (straight, resumed, saved)) in ranks.iter().enumerate() {
        let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(straight),
            bits(resumed),
            "rank {rank}: {straight:?}\n{resumed:?}"
        );
        // the checkpoint holds the adapters only: the base stays in its file, which it names
        let manifest = std::fs::read_to_string(saved.join("manifest.json")).unwrap();
        let m: serde_json::Value = serde_json::from_str(&manifest).unwrap();
        let params = m["params"].as_array().unwrap();
        assert!(
            params
                .iter()
                .all(|p| p["name"].as_str().unwrap().contains(".lora_")),
            "{manifest}"
        );
        let source = m["frozen"]["source"].as_str().unwrap();
        assert!(
            source.starts_with("weights file base.safetensors"),
            "{source}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
