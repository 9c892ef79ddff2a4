//! Frozen parameters (`Model::freeze`): the Llama example's candle-nn model with its
//! embedding and first block frozen. They keep their initial bits at ZeRO 0 and 3, hold no
//! gradient or optimizer state (the memory report against the formula), stay sharded at
//! ZeRO-3, and training gives the same losses as the same parameters left trainable at a
//! learning rate of 0 without weight decay (an optimizer group that cannot move them).

mod support;

use std::collections::HashMap;
use std::time::Duration;

use candle_core::{Device, Tensor};
use ds_comm::testkit::run_ranks;
use ds_comm::ReduceOp;
use ds_engine::nn::cross_entropy;
use ds_engine::{EngineOptions, Inputs, Job, MemoryReport, ParamGroup};
use support::model;

const FROZEN: &str = r"^model\.(embed_tokens|layers\.0)\.";
const STEPS: usize = 6;

fn config(stage: u8) -> String {
    // no clipping: frozen parameters have no gradient to count in the norm; no persistent
    // parameters, so that ZeRO-3 keeps exactly its shard of each
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.003, "weight_decay": 0.01}}}},
            "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0}}}}"#
    )
}

struct Run {
    losses: Vec<f32>,
    before: HashMap<String, Vec<f32>>,
    after: HashMap<String, Vec<f32>>,
    memory: MemoryReport,
}

/// Trains the model on fixed token windows; `freeze`: freeze FROZEN, else put it in a group
/// at learning rate 0 without decay.
fn train(world: usize, stage: u8, freeze: bool) -> Vec<Run> {
    run_ranks(world, Duration::from_secs(120), move |comm| {
        let c = model::Config::tiny();
        let job = Job::join(&comm, &config(stage))?;
        let mut m = model::build(c, job.tp())?;
        let mut opts = EngineOptions::default();
        match freeze {
            true => m = m.freeze(FROZEN)?,
            false => {
                opts.param_groups = vec![ParamGroup::names(FROZEN)?.lr_scale(0.0).weight_decay(0.0)]
            }
        }
        let mut engine = job.initialize(m, &opts)?;
        let before = engine.gather_params()?.into_iter().collect();
        let dp = job.groups().dp();
        let accum = engine.settings().grad_accum;
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            let mut total = 0.0;
            for k in 0..accum {
                // the same global batch of 8 each step, so the loss falls fast; sample s of it
                // is a fixed token pattern
                let first = (k * dp.size() + dp.rank()) * 4;
                let seq = |s: usize, t: usize| ((s * 7 + t * 3 + t * t) % c.vocab) as u32;
                let ids: Vec<u32> = (first..first + 4)
                    .flat_map(|s| (0..16).map(move |t| seq(s, t)))
                    .collect();
                let next: Vec<u32> = (first..first + 4)
                    .flat_map(|s| (1..17).map(move |t| seq(s, t)))
                    .collect();
                let ids = Tensor::from_vec(ids, (4, 16), &Device::Cpu)?;
                let logits = engine.forward(&Inputs::new().with("input_ids", ids))?;
                let loss = cross_entropy(
                    &logits.flatten_to(1)?,
                    &Tensor::from_vec(next, 64, &Device::Cpu)?,
                )?;
                engine.backward(&loss)?;
                engine.step()?;
                total += loss.to_scalar::<f32>()? / accum as f32;
            }
            let mut mean = [total];
            dp.all_reduce(&mut mean, ReduceOp::Avg)?;
            losses.push(mean[0]);
        }
        let after = engine.gather_params()?.into_iter().collect();
        Ok::<_, ds_engine::EngineError>(Run {
            losses,
            before,
            after,
            memory: engine.memory_report(),
        })
    })
    .unwrap()
}

fn is_frozen(name: &str) -> bool {
    regex::Regex::new(FROZEN).unwrap().is_match(name)
}

fn numel(run: &Run, frozen: bool) -> usize {
    run.before
        .iter()
        .filter(|(n, _)| is_frozen(n) == frozen)
        .map(|(_, v)| v.len())
        .sum()
}

#[test]
fn frozen_parameters_keep_their_bits_hold_no_state_and_train_as_a_zero_learning_rate() {
    let reference = train(1, 0, false).remove(0);
    for (world, stage) in [(1, 0), (2, 3)] {
        for (rank, run) in train(world, stage, true).iter().enumerate() {
            let at = format!("ZeRO {stage}, rank {rank} of {world}");
            for (name, before) in &run.before {
                let same = before
                    .iter()
                    .zip(&run.after[name])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert_eq!(same, is_frozen(name), "{at}: {name} changed: {}", !same);
            }
            for (step, (a, b)) in run.losses.iter().zip(&reference.losses).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{at}: step {step}: loss {a} frozen, {b} at lr 0"
                );
            }
            assert!(
                run.losses[STEPS - 1] < run.losses[0] - 0.3,
                "{at}: {:?}",
                run.losses
            );
            // fp32: 4 bytes a parameter; Adam: the master copy and two moments, 12 bytes a
            // trainable parameter; ZeRO-3 shards all three (and the frozen ones) over dp, padded
            // to a multiple of it
            let share = |n: usize| n.div_ceil(world);
            let (trainable, frozen) = (numel(run, false), numel(run, true));
            let m = &run.memory;
            assert_eq!(m.optimizer_states, 12 * share(trainable), "{at}: {m:?}");
            assert_eq!(m.grads, 4 * share(trainable), "{at}: {m:?}");
            assert_eq!(m.params, 4 * share(trainable), "{at}: {m:?}");
            assert_eq!(m.frozen_params, 4 * share(frozen), "{at}: {m:?}");
        }
    }
}
