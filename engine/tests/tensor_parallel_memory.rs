//! The memory report under tensor parallelism: each rank holds its slices of the split
//! parameters and the whole replicated ones (nn/ARCHITECTURE.md, "Tensor parallelism"), sharded
//! over its data-parallel group by the ZeRO stage's formula.

use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_comm::Groups;
use ds_config::{hjson, resolve, ParallelDims};
use ds_engine::parallel::Tp;
use ds_engine::{Engine, EngineOptions};
use ds_models::gpt::GptConfig;

const GPT: GptConfig = GptConfig {
    vocab_size: 128,
    seq_len: 16,
    hidden: 32,
    heads: 4,
    layers: 2,
    tie_embeddings: false,
    moe: None,
};

/// Parameters one tensor-parallel rank holds, from the architecture (not from the code's
/// parameter list): per block 12 d^2 + 7 d split (q|k|v and the MLP's first linear with
/// their biases, the two output projections' weights) and 6 d replicated (two LayerNorms,
/// the two output projections' biases); wte and lm_head split by vocabulary; wpe and ln_f
/// replicated.
fn per_tp_rank(c: GptConfig, tp: usize) -> usize {
    let (v, t, d, l) = (c.vocab_size, c.seq_len, c.hidden, c.layers);
    let split = 2 * v * d + l * (12 * d * d + 7 * d);
    let replicated = t * d + l * 6 * d + 2 * d;
    assert_eq!(
        split + replicated,
        c.n_params(),
        "the two kinds cover the model"
    );
    split / tp + replicated
}

#[test]
fn memory_report_holds_the_slices() {
    let (world, tp) = (4, 2);
    let dp = world / tp;
    let psi = per_tp_rank(GPT, tp);
    let padded = psi.div_ceil(dp) * dp;
    let shard = padded / dp;
    for stage in 0..=3u8 {
        let text = format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}},
            "optimizer": {{"type": "AdamW"}}, "zero_optimization": {{"stage": {stage}}}}}"#
        );
        let dims = ParallelDims::new(world, tp, 1).unwrap();
        let cfg = resolve(&hjson::parse_bytes(text.as_bytes()).unwrap(), &dims).unwrap();
        let reports = run_ranks(world, Duration::from_secs(60), move |comm| {
            let groups = Groups::new(&comm, dims)?;
            let model = GPT
                .build_parallel(&Tp::new(groups.tp().clone()))
                .map_err(ds_engine::EngineError::Model)?;
            let e = Engine::initialize(model, &cfg, &groups, &EngineOptions::default())?;
            Ok::<_, ds_engine::EngineError>(e.memory_report())
        })
        .unwrap();
        // bf16 parameters and gradients, fp32 master copy and two Adam moments (12 bytes)
        let want = match stage {
            0 => (2 * padded, 2 * padded, 12 * padded),
            1 => (2 * padded, 2 * padded, 12 * shard),
            2 => (2 * padded, 2 * shard, 12 * shard),
            _ => (2 * shard, 2 * shard, 12 * shard),
        };
        for (rank, r) in reports.iter().enumerate() {
            let got = (r.params, r.grads, r.optimizer_states);
            assert_eq!(got, want, "stage {stage}, rank {rank}");
        }
    }
}
