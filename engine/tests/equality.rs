//! The main correctness test (ARCHITECTURE.md invariant 3): one logical model trained with any
//! data-parallel degree, ZeRO stage and accumulation gives the losses and parameters of a
//! single rank with the same global batch.
//!
//! Tolerances: every layout computes the same fp32 function; only the order of the gradient
//! sums differs (a mean over 4 ranks instead of over one batch, ring reductions). Those
//! reorderings change gradients in the last bits (relative ~1e-7). Losses agree to 1e-5
//! relative. Parameters are held to a relative L2 distance of 1e-6 over the whole vector: the
//! largest seen after 10 steps is 2.7e-7. Not element-wise: AdamW divides the momentum by
//! sqrt(v), so for a parameter whose gradient is near zero a last-bit change is magnified up
//! to a fraction of the lr (1e-3); the largest single difference seen is 7.0e-6 (printed).

use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_config::{hjson, resolve, ParallelDims};
use ds_engine::Batch;
use ds_engine::{Engine, EngineOptions};
use ds_models::gpt::GptConfig;

const STEPS: u64 = 10;
const GLOBAL_BATCH: usize = 4;

fn config(world: usize, micro: usize, ga: usize, stage: u8, extra: &str) -> ds_config::Config {
    // extras for zero_optimization start with "z:"
    let (zero_extra, extra) = match extra.strip_prefix("z:") {
        Some(z) => (z, ""),
        None => ("", extra),
    };
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": {micro}, "gradient_accumulation_steps": {ga},
        "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}, "reduce_bucket_size": 300000{zero_extra}}}
        {extra}}}"#
    );
    let doc = hjson::parse_bytes(text.as_bytes()).unwrap();
    resolve(&doc, &ParallelDims::new(world, 1, 1).unwrap()).unwrap()
}

/// Sample g of the global stream: a deterministic pseudo-random window of T+1 tokens.
fn sample(g: usize, vocab: usize, t: usize) -> Vec<u32> {
    let mut x = 1234u64 ^ (g as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..=t)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64 % 16) as u32
        })
        .collect()
}

/// Rank `r`'s micro-batch `k` of step `s`: samples s*GB + (r*GA + k)*B + b.
fn batch(c: GptConfig, s: u64, r: usize, ga: usize, k: usize, micro: usize) -> Batch {
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for b in 0..micro {
        let g = s as usize * GLOBAL_BATCH + (r * ga + k) * micro + b;
        let w = sample(g, c.vocab_size, c.seq_len);
        inputs.extend(&w[..c.seq_len]);
        targets.extend(&w[1..]);
    }
    Batch {
        inputs,
        targets,
        batch: micro,
        seq: c.seq_len,
        loss_weight: 1.0,
    }
}

struct Run {
    losses: Vec<f32>,
    params: Vec<(String, Vec<f32>)>,
}

fn train(world: usize, stage: u8, ga: usize, extra: &'static str) -> Run {
    let micro = GLOBAL_BATCH / world / ga;
    let c = GptConfig::preset("tiny").unwrap();
    let runs = run_ranks(world, Duration::from_secs(120), move |comm| {
        let cfg = config(world, micro, ga, stage, extra);
        let mut engine = Engine::initialize(
            c.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &EngineOptions::default(),
        )?;
        let r = comm.rank();
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (loss, _) = engine.train_batch(|k| Ok(batch(c, s, r, ga, k, micro)))?;
            losses.push(loss);
        }
        let params = engine.gather_params()?;
        Ok::<_, ds_engine::EngineError>(Run { losses, params })
    })
    .unwrap();
    runs.into_iter().next().unwrap()
}

/// Largest absolute parameter difference and the relative L2 distance of the two runs'
/// total parameter vectors.
fn param_distance(a: &Run, b: &Run) -> (f32, f64) {
    let (mut worst, mut diff2, mut norm2) = (0f32, 0f64, 0f64);
    let names = |r: &Run| r.params.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "the runs hold different parameters");
    for ((name, x), (_, y)) in a.params.iter().zip(&b.params) {
        assert_eq!(x.len(), y.len(), "{name}: sizes differ");
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
            diff2 += ((p - q) as f64).powi(2);
            norm2 += (*p as f64).powi(2);
        }
    }
    (worst, (diff2 / norm2).sqrt())
}

fn assert_same(base: &Run, run: &Run, what: &str) {
    assert_eq!(base.losses.len(), run.losses.len(), "{what}: step counts");
    for (s, (a, b)) in base.losses.iter().zip(&run.losses).enumerate() {
        assert!(
            ((a - b) / a).abs() < 1e-5,
            "{what}: step {s} loss {b} vs {a}"
        );
    }
    let (worst, rel) = param_distance(base, run);
    eprintln!("{what}: max |dp| {worst:e}, relative L2 {rel:e}");
    assert!(
        rel < 1e-6,
        "{what}: parameters differ: max {worst}, relative {rel}"
    );
}

#[test]
fn every_layout_trains_like_one_rank() {
    let base = train(1, 0, 1, "");
    eprintln!("baseline losses {:?}", base.losses);
    assert!(
        base.losses[STEPS as usize - 1] < base.losses[0],
        "the baseline does not learn"
    );
    for world in [2, 4] {
        for stage in 0..=3 {
            for ga in [1, 2] {
                if !GLOBAL_BATCH.is_multiple_of(world * ga) {
                    continue;
                }
                let run = train(world, stage, ga, "");
                assert_same(&base, &run, &format!("dp={world} stage={stage} ga={ga}"));
            }
        }
    }
    // activation checkpointing: layer internals recomputed in backward
    let ckpt = r#", "activation_checkpointing": {"partition_activations": false}"#;
    assert_same(
        &base,
        &train(2, 1, 1, ckpt),
        "dp=2 stage=1 activation checkpointing",
    );
}
