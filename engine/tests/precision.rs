//! Mixed precision against fp32, fp16 loss scaling against DeepSpeed's rules, and the memory
//! report against the ZeRO paper's formulas.

use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_config::{hjson, resolve, ParallelDims};
use ds_engine::Batch;
use ds_engine::{Engine, EngineOptions};
use ds_models::gpt::GptConfig;

fn config(world: usize, stage: u8, extra: &str) -> ds_config::Config {
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}
        {extra}}}"#
    );
    let doc = hjson::parse_bytes(text.as_bytes()).unwrap();
    resolve(&doc, &ParallelDims::new(world, 1, 1).unwrap()).unwrap()
}

/// A small GPT and a learnable token stream (16 symbols with a fixed successor rule).
const SMALL: GptConfig = GptConfig {
    vocab_size: 64,
    seq_len: 32,
    hidden: 64,
    heads: 4,
    layers: 2,
    tie_embeddings: false,
    moe: None,
};

fn batch(step: u64, rank: usize) -> Batch {
    let t = SMALL.seq_len;
    let start = (step as usize * 7 + rank * 3) % 16;
    let w: Vec<u32> = (0..2 * (t + 1))
        .map(|i| ((start + i * 5) % 16) as u32)
        .collect();
    let (a, b) = w.split_at(t + 1);
    Batch {
        inputs: [&a[..t], &b[..t]].concat(),
        targets: [&a[1..], &b[1..]].concat(),
        batch: 2,
        seq: t,
        loss_weight: 1.0,
    }
}

fn losses(cfg: ds_config::Config, steps: u64) -> Vec<f32> {
    run_ranks(1, Duration::from_secs(60), move |comm| {
        let mut e = Engine::initialize(
            SMALL.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &EngineOptions::default(),
        )?;
        (0..steps)
            .map(|s| e.train_batch(|_| Ok(batch(s, 0))).map(|(l, _)| l))
            .collect::<ds_engine::Result<Vec<f32>>>()
    })
    .unwrap()
    .remove(0)
}

#[test]
fn bf16_follows_fp32() {
    // bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%) in parameters and
    // activations; reductions and master weights stay fp32, so losses track fp32 to ~1%.
    let fp32 = losses(config(1, 0, ""), 12);
    let bf16 = losses(config(1, 0, r#", "bf16": {"enabled": true}"#), 12);
    assert!(fp32[11] < 0.8 * fp32[0], "fp32 does not learn: {fp32:?}");
    for (s, (a, b)) in fp32.iter().zip(&bf16).enumerate() {
        assert!(((a - b) / a).abs() < 2e-2, "step {s}: bf16 {b} vs fp32 {a}");
    }
}

#[test]
fn fp16_overflow_skips_the_step_and_halves_the_scale() {
    // 2^30 times any sizeable gradient overflows fp16 (max 65504). DeepSpeed's ZeRO scaler
    // with hysteresis 1 halves on each overflow and skips the step, leaving the parameters.
    let cfg = config(
        1,
        2,
        r#", "fp16": {"enabled": true, "initial_scale_power": 30, "hysteresis": 1}"#,
    );
    run_ranks(1, Duration::from_secs(60), move |comm| {
        let mut e = Engine::initialize(
            SMALL.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &EngineOptions::default(),
        )?;
        let before = e.gather_params()?;
        assert_eq!(e.loss_scale(), 2f64.powi(30));
        let (_, out) = e.train_batch(|_| Ok(batch(0, 0)))?;
        assert!(out.skipped && !out.grad_norm.is_finite(), "{out:?}");
        assert_eq!((e.global_steps(), e.skipped_steps()), (1, 1));
        assert_eq!(e.loss_scale(), 2f64.powi(29));
        assert_eq!(
            e.gather_params()?,
            before,
            "a skipped step changed the parameters"
        );
        // the scale keeps halving until the gradients fit, then steps are taken
        let mut taken = 0;
        for s in 1..40 {
            taken += usize::from(!e.train_batch(|_| Ok(batch(s, 0)))?.1.skipped);
        }
        assert!(
            taken > 0 && e.loss_scale() < 2f64.powi(20),
            "scale {}",
            e.loss_scale()
        );
        Ok::<_, ds_engine::EngineError>(())
    })
    .unwrap();
}

#[test]
fn memory_report_follows_the_zero_formulas() {
    // ZeRO paper, mixed precision with Adam: stage 0: 16 Psi, 1: 4 Psi + 12 Psi/N,
    // 2: 2 Psi + 14 Psi/N, 3: 16 Psi/N, with Psi padded to a multiple of N.
    let n = 4;
    let psi = SMALL.n_params();
    let padded = psi.div_ceil(n) * n;
    let shard = padded / n;
    for stage in 0..=3u8 {
        let cfg = config(n, stage, r#", "bf16": {"enabled": true}"#);
        let reports = run_ranks(n, Duration::from_secs(60), move |comm| {
            let e = Engine::initialize(
                SMALL.build(),
                &cfg,
                &ds_comm::Groups::data_parallel(&comm)?,
                &EngineOptions::default(),
            )?;
            Ok::<_, ds_engine::EngineError>(e.memory_report())
        })
        .unwrap();
        let (p, g, o) = match stage {
            0 => (2 * padded, 2 * padded, 12 * padded),
            1 => (2 * padded, 2 * padded, 12 * shard),
            2 => (2 * padded, 2 * shard, 12 * shard),
            _ => (2 * shard, 2 * shard, 12 * shard),
        };
        for r in reports {
            assert_eq!(
                (r.params, r.grads, r.optimizer_states),
                (p, g, o),
                "stage {stage}"
            );
            let formula = [
                16 * psi,
                4 * psi + 12 * psi / n,
                2 * psi + 14 * psi / n,
                16 * psi / n,
            ];
            assert!(
                r.model_states().abs_diff(formula[stage as usize]) <= 16 * n,
                "stage {stage}"
            );
        }
    }
}
