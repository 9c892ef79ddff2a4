//! Parameter groups against torch: an MLP written with candle-nn, trained 5 steps with AdamW
//! and Hugging Face Trainer's two groups (`ParamGroup::hf_no_decay()`), ends with the
//! parameters torch.optim.AdamW gives (fixtures/param_groups/gen_param_groups.py), at ZeRO 0
//! on one rank and ZeRO-3 on two. Both clip the gradient norm at 1.0 (DeepSpeed's default
//! `gradient_clipping`, HF's `max_grad_norm`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use candle_core::{Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder};
use ds_comm::testkit::run_ranks;
use ds_engine::model::Model;
use ds_engine::nn::LayerNorm;
use ds_engine::{EngineOptions, Inputs, Job, ParamGroup};
use serde_json::Value;

/// fc1 -> LayerNorm -> tanh -> fc2, as the fixture's torch module.
struct Mlp {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Mlp> {
        Ok(Mlp {
            fc1: linear(8, 16, vb.pp("fc1"))?,
            norm: LayerNorm::new(16, 1e-5, vb.pp("norm"))?,
            fc2: linear(16, 4, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2
            .forward(&self.norm.forward(&self.fc1.forward(x)?)?.tanh()?)
    }
}

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/param_groups/param_groups.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// The fixture's initial weights as a safetensors file for `EngineOptions::init`.
fn init_file(f: &Value, dir: &std::path::Path) -> PathBuf {
    let tensors: HashMap<String, Tensor> = f["init"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, values)| {
            let shape: Vec<usize> = f["shapes"][name]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (
                name.clone(),
                Tensor::from_vec(floats(values), shape, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    let path = dir.join("init.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    path
}

/// Every parameter after the fixture's steps at ZeRO `stage` on `world` ranks, by name.
fn train(world: usize, stage: u8, groups: Vec<ParamGroup>) -> HashMap<String, Vec<f32>> {
    let dir = std::env::temp_dir().join(format!(
        "ds-rs-param-groups-{}-{world}-{stage}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let f = fixture();
    let init = init_file(&f, &dir);
    let config = format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "betas": [0.9, 0.999],
                "eps": 1e-8, "weight_decay": 0.1}}}},
            "zero_optimization": {{"stage": {stage}}}}}"#
    );
    let opts = EngineOptions {
        init: Some(init),
        param_groups: groups,
        ..EngineOptions::default()
    };
    let mut ranks = run_ranks(world, Duration::from_secs(60), move |comm| {
        let job = Job::join(&comm, &config)?;
        let mut engine = job.initialize(Model::new().module("", Mlp::new)?, &opts)?;
        let (x, y) = (floats(&f["x"]), &f["y"]);
        let accum = engine.settings().grad_accum;
        let dp = job.groups().dp();
        for step in 0..5 {
            for k in 0..accum {
                // rows of the step's batch of 8: micro-batch k of this rank
                let first = step * 8 + (k * dp.size() + dp.rank()) * 4;
                let rows =
                    Tensor::from_vec(x[first * 8..(first + 4) * 8].to_vec(), (4, 8), &Device::Cpu)?;
                let labels: Vec<u32> = (first..first + 4)
                    .map(|i| y[i].as_u64().unwrap() as u32)
                    .collect();
                let labels = Tensor::from_vec(labels, 4, &Device::Cpu)?;
                let logits = engine.forward(&Inputs::new().with("x", rows))?;
                engine.backward(&candle_nn::loss::cross_entropy(&logits, &labels)?)?;
                engine.step()?;
            }
        }
        Ok::<_, ds_engine::EngineError>(
            engine
                .gather_params()?
                .into_iter()
                .collect::<HashMap<_, _>>(),
        )
    })
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    ranks.remove(0)
}

/// The largest difference from torch's parameters, relative to each tensor's largest value.
fn worst_relative(got: &HashMap<String, Vec<f32>>) -> (String, f64) {
    let f = fixture();
    let mut worst = (String::new(), 0.0);
    for (name, want) in f["after"].as_object().unwrap() {
        let want = floats(want);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let diff = got[name]
            .iter()
            .zip(&want)
            .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
        if diff / scale > worst.1 {
            worst = (name.clone(), diff / scale);
        }
    }
    worst
}

#[test]
fn hf_parameter_groups_match_torch_adamw_at_zero_0_and_3() {
    for (world, stage) in [(1, 0), (2, 3)] {
        let got = train(world, stage, vec![ParamGroup::hf_no_decay()]);
        let (name, rel) = worst_relative(&got);
        eprintln!("ZeRO {stage}, {world} rank(s): worst {name}, {rel:e} of its largest value");
        // f32 AdamW in two implementations, five steps: a few ulps of the largest value
        assert!(
            rel <= 1e-6,
            "ZeRO {stage}, {world} rank(s): {name} is {rel:e} off torch's"
        );
    }
    // the groups matter: decaying the biases and the norm too lands elsewhere
    let (name, rel) = worst_relative(&train(1, 0, Vec::new()));
    assert!(rel > 1e-4, "without the groups {name} is only {rel:e} off");
}
