//! Mixed precision for Hugging Face families: the Llama and GPT-2 fixtures trained from their
//! weights in bf16 and in fp16 (loss scaling) track fp32 for 12 AdamW steps on the reference
//! batch. bf16 keeps 8 significant bits (relative rounding 2^-9) in parameters and
//! activations; fp16 10 bits; reductions, RMSNorm's and LayerNorm's statistics and the master
//! weights stay fp32, so the losses agree to ~1% (the built-in GPT's bound in
//! ds-engine's precision tests).

use std::path::Path;
use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_engine::parallel::Tp;
use ds_engine::Batch;
use ds_engine::{Engine, EngineOptions};
use ds_models::ModelSpec;

fn losses(family: &str, extra: &str) -> Vec<f32> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/tests/fixtures/hf")
        .join(family);
    let r = candle_core::safetensors::load(
        dir.join("reference.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let ids = |k: &str| -> Vec<u32> {
        let t = r[k].flatten_all().unwrap().to_vec1::<i64>().unwrap();
        t.into_iter().map(|v| v as u32).collect()
    };
    let (b, t) = r["input_ids"].dims2().unwrap();
    let batch = Batch {
        inputs: ids("input_ids"),
        targets: ids("targets"),
        batch: b,
        seq: t,
        loss_weight: 1.0,
    };
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": {b}, "gradient_accumulation_steps": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}{extra}}}"#
    );
    let doc = ds_config::hjson::parse_bytes(text.as_bytes()).unwrap();
    let cfg = ds_config::resolve(&doc, &ds_config::ParallelDims::new(1, 1, 1).unwrap()).unwrap();
    let spec = ModelSpec::resolve(dir.to_str().unwrap(), Some(t)).unwrap();
    run_ranks(1, Duration::from_secs(120), move |comm| {
        let opts = EngineOptions {
            init: spec.weights.clone(),
            ..EngineOptions::default()
        };
        let groups = ds_comm::Groups::data_parallel(&comm)?;
        let mut e = Engine::initialize(spec.build(&Tp::none()).unwrap(), &cfg, &groups, &opts)?;
        (0..12)
            .map(|_| e.train_batch(|_| Ok(batch.clone())).map(|(l, _)| l))
            .collect::<ds_engine::Result<Vec<f32>>>()
    })
    .unwrap()
    .remove(0)
}

#[test]
fn bf16_and_fp16_follow_fp32() {
    for family in ["llama", "gpt2"] {
        let fp32 = losses(family, "");
        assert!(
            fp32[11] < 0.9 * fp32[0],
            "{family}: fp32 does not learn: {fp32:?}"
        );
        for (name, extra) in [
            ("bf16", r#", "bf16": {"enabled": true}"#),
            ("fp16", r#", "fp16": {"enabled": true}"#),
        ] {
            let got = losses(family, extra);
            let worst = fp32
                .iter()
                .zip(&got)
                .map(|(a, b)| ((a - b) / a).abs())
                .fold(0f32, f32::max);
            println!("{family} {name}: largest relative difference from fp32 {worst:e}");
            assert!(worst < 2e-2, "{family} {name}: {got:?} vs fp32 {fp32:?}");
        }
    }
}
