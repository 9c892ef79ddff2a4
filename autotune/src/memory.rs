//! ds-rs's own memory model: what each rank of a layout will hold, computed from the config,
//! the model and the layout before anything runs (`ds-rs estimate --config`).
//!
//! Model states are exact: they follow the buffers ds-partition allocates (a rank's flat
//! buffer is its pipeline stage's parameters, its tensor-parallel slices, padded to a multiple
//! of the data-parallel size; ZeRO-1 and up keep the master copy and the moments of one shard,
//! ZeRO-2 and up one shard of gradients, ZeRO-3 one shard of parameters and the small layers
//! it keeps whole). Activations follow the trainer's rules over the built-in GPT's layers
//! (activations.rs).

use std::ops::Range;

use ds_config::{Config, ZeroStage};
use ds_engine::gpt::GptConfig;
use ds_engine::model::Model;
use ds_engine::{pipeline_layout, Precision, Settings};
use ds_partition::{FlatIndex, ShardLayout, TpRank};
use serde::Serialize;

use crate::activations::{gpt_layers, keep_graph, kept, peak, MicroBatch};

/// One rank's predicted bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankEstimate {
    pub rank: usize,
    pub stage: usize,
    pub tp_rank: usize,
    pub dp_rank: usize,
    /// Parameters in the compute dtype, held during a step.
    pub params_bytes: u64,
    pub grads_bytes: u64,
    /// The fp32 master copy and the optimizer's states of the owned range.
    pub optimizer_states_bytes: u64,
    /// The most activation bytes one micro-batch holds, as the config runs.
    pub activations_bytes: u64,
    /// The same without activation checkpointing (every layer keeps what its backward needs,
    /// ZeRO-3's released layers their input).
    pub activations_without_checkpointing_bytes: u64,
    /// The same with activation checkpointing at the config's interval (1 if none is set).
    pub activations_with_checkpointing_bytes: u64,
}

impl RankEstimate {
    pub fn model_states(&self) -> u64 {
        self.params_bytes + self.grads_bytes + self.optimizer_states_bytes
    }
}

/// What the estimate needs to know of the run.
pub struct Run<'a> {
    pub config: &'a Config,
    pub model: &'a GptConfig,
    /// The micro-batch (rows per rank), if not the config's.
    pub micro_batch: Option<usize>,
}

/// Every rank of the config's layout (`config.dims`), in global rank order (DeepSpeed's
/// topology: the pipeline stage outermost, then the data-parallel rank, then the
/// tensor-parallel rank).
pub fn estimate(run: &Run) -> anyhow::Result<Vec<RankEstimate>> {
    let cfg = run.config;
    let dims = cfg.dims;
    let settings = Settings::from_config(cfg, false)?;
    let model = run.model.build();
    // each stage's model chunks, as ranges of layers
    let chunks: Vec<Vec<Range<usize>>> = match dims.pp {
        1 => vec![vec![0..model.layers().len()]],
        _ => {
            let layout = pipeline_layout(cfg, &model)?;
            (0..dims.pp).map(|s| layout.chunk_layers(s)).collect()
        }
    };
    let per_element = optimizer_state_bytes_per_element(cfg)?;
    let dtype = dtype_bytes(settings.precision);
    let stage = cfg.zero_stage();
    let (tp, dp) = (dims.tp, dims.dp());
    let z3 = &settings.zero.stage3;
    let micro = MicroBatch {
        rows: run.micro_batch.unwrap_or(settings.micro_batch) as u64,
        tp: tp as u64,
        dtype,
    };
    let layers = gpt_layers(run.model, micro);
    let interval = settings.checkpoint_interval.max(1);
    let mut out = Vec::new();
    for rank in 0..dims.world_size {
        let (tp_rank, dp_rank, pp_stage) = (rank % tp, (rank / tp) % dp, rank / (tp * dp));
        let slice = TpRank {
            rank: tp_rank,
            size: tp,
        };
        let mine = &chunks[pp_stage];
        let numel = layer_numels(&model, mine, slice)?;
        let layout = ShardLayout::new(numel.iter().flatten().sum(), dp);
        let (padded, shard) = (layout.padded() as u64, layout.shard_len() as u64);
        // ZeRO-3 keeps a layer at most stage3_param_persistence_threshold long whole once
        // gathered, until the step (forward gathers it again)
        let persistent: usize = numel
            .iter()
            .flatten()
            .filter(|&&n| n <= z3.param_persistence_threshold)
            .sum();
        let (params, grads, owned) = match stage {
            ZeroStage::Disabled => (padded, padded, padded),
            ZeroStage::OptimizerStates => (padded, padded, shard),
            ZeroStage::Gradients => (padded, shard, shard),
            ZeroStage::Weights => (shard + persistent as u64, shard, shard),
        };
        // the activations of one micro-batch through the stage's chunks, the largest
        let zero3 = (stage == ZeroStage::Weights)
            .then_some((settings.max_reuse_distance, z3.max_live_parameters));
        let activations = |recompute: Option<usize>| {
            mine.iter()
                .zip(&numel)
                .map(|(r, n)| {
                    let graph = keep_graph(n, zero3);
                    peak(&layers[r.clone()], &kept(r.len(), recompute, &graph))
                })
                .max()
                .unwrap_or(0)
        };
        let (without, with) = (activations(None), activations(Some(interval)));
        out.push(RankEstimate {
            rank,
            stage: pp_stage,
            tp_rank,
            dp_rank,
            params_bytes: dtype * params,
            grads_bytes: dtype * grads,
            optimizer_states_bytes: owned * (4 + per_element),
            activations_bytes: if settings.recompute { with } else { without },
            activations_without_checkpointing_bytes: without,
            activations_with_checkpointing_bytes: with,
        });
    }
    Ok(out)
}

/// Per chunk, per layer: the elements the layer's parameters take in tensor-parallel rank
/// `tp`'s slices.
fn layer_numels(
    model: &Model,
    chunks: &[Range<usize>],
    tp: TpRank,
) -> anyhow::Result<Vec<Vec<usize>>> {
    chunks
        .iter()
        .map(|r| {
            model.layers()[r.clone()]
                .iter()
                .map(|layer| {
                    let mut index = FlatIndex::sliced(tp);
                    for p in layer.params() {
                        index.push_split(&p.name, &p.shape, p.split)?;
                    }
                    Ok(index.numel())
                })
                .collect()
        })
        .collect()
}

fn dtype_bytes(p: Precision) -> u64 {
    match p {
        Precision::F32 => 4,
        Precision::BF16 | Precision::F16 => 2,
    }
}

/// The optimizer's state bytes per owned element (Adam's two moments: 8; SGD with momentum:
/// 4; without: 0), from the config's optimizer built over a one-element shard.
fn optimizer_state_bytes_per_element(cfg: &Config) -> anyhow::Result<u64> {
    let section = cfg
        .optimizer
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("the ds_config has no `optimizer` section"))?;
    let probe = ds_engine::optim::build_from_section(section, 1)?;
    Ok(probe.state_bytes() as u64)
}
