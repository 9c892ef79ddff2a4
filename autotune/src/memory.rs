//! ds-rs's own memory model: what each rank of a layout will hold, computed from the config,
//! the model and the layout before anything runs (`ds-rs estimate --config`).
//!
//! Model states are exact: they follow the buffers ds-partition allocates (a rank's flat
//! buffer is its pipeline stage's parameters, its tensor-parallel slices, padded to a multiple
//! of the data-parallel size; ZeRO-1 and up keep the master copy and the moments of one shard,
//! ZeRO-2 and up one shard of gradients, ZeRO-3 one shard of parameters). The step's working
//! memory (activations, a layer's parameters and gradients, buckets) is a model of the
//! built-in GPT's layers; its figures are checked against `memory_report` and peak RSS.

use ds_config::{Config, ZeroStage};
use ds_engine::gpt::GptConfig;
use ds_engine::model::Model;
use ds_engine::{pipeline_layout, Precision, Settings};
use ds_partition::{FlatIndex, ShardLayout, TpRank};
use serde::Serialize;

/// One rank's predicted bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankEstimate {
    pub rank: usize,
    pub stage: usize,
    pub tp_rank: usize,
    pub dp_rank: usize,
    /// Parameters in the compute dtype, held between steps.
    pub params_bytes: u64,
    pub grads_bytes: u64,
    /// The fp32 master copy and the optimizer's states of the owned range.
    pub optimizer_states_bytes: u64,
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
}

/// The model states of every rank of the config's layout (`config.dims`), in global rank
/// order (DeepSpeed's topology: the pipeline stage outermost, then the data-parallel rank,
/// then the tensor-parallel rank).
pub fn model_states(run: &Run) -> anyhow::Result<Vec<RankEstimate>> {
    let cfg = run.config;
    let dims = cfg.dims;
    let settings = Settings::from_config(cfg, false)?;
    let model = run.model.build();
    let specs = model.params();
    let stage_of = match dims.pp {
        1 => vec![0; specs.len()],
        _ => pipeline_layout(cfg, &model)?.param_stages(&model),
    };
    let per_element = optimizer_state_bytes_per_element(cfg)?;
    let dtype = dtype_bytes(settings.precision);
    let stage = cfg.zero_stage();
    let (tp, dp) = (dims.tp, dims.dp());
    // ZeRO-3 keeps a layer at most stage3_param_persistence_threshold long whole once
    // gathered, until the step (forward gathers it again)
    let threshold = settings.zero.stage3.param_persistence_threshold;
    let mut out = Vec::new();
    for rank in 0..dims.world_size {
        let (tp_rank, dp_rank, pp_stage) = (rank % tp, (rank / tp) % dp, rank / (tp * dp));
        let slice = TpRank {
            rank: tp_rank,
            size: tp,
        };
        let layers = layer_numels(&model, &stage_of, pp_stage, slice)?;
        let layout = ShardLayout::new(layers.iter().sum(), dp);
        let (padded, shard) = (layout.padded() as u64, layout.shard_len() as u64);
        let persistent: usize = layers.iter().filter(|&&n| n <= threshold).sum();
        let (params, grads, owned) = match stage {
            ZeroStage::Disabled => (padded, padded, padded),
            ZeroStage::OptimizerStates => (padded, padded, shard),
            ZeroStage::Gradients => (padded, shard, shard),
            ZeroStage::Weights => (shard + persistent as u64, shard, shard),
        };
        out.push(RankEstimate {
            rank,
            stage: pp_stage,
            tp_rank,
            dp_rank,
            params_bytes: dtype * params,
            grads_bytes: dtype * grads,
            optimizer_states_bytes: owned * (4 + per_element),
        });
    }
    Ok(out)
}

/// The elements of each layer of pipeline stage `stage` (that has parameters there) as
/// tensor-parallel rank `tp` holds them (its slices), in layer order.
fn layer_numels(
    model: &Model,
    stage_of: &[usize],
    stage: usize,
    tp: TpRank,
) -> anyhow::Result<Vec<usize>> {
    let mut out = Vec::new();
    let mut at = 0;
    for layer in model.layers() {
        let params = layer.params();
        let mut index = FlatIndex::sliced(tp);
        let mine = params.iter().zip(&stage_of[at..]);
        for (p, _) in mine.filter(|(_, s)| **s == stage) {
            index.push_split(&p.name, &p.shape, p.split)?;
        }
        if !index.is_empty() {
            out.push(index.numel());
        }
        at += params.len();
    }
    Ok(out)
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
