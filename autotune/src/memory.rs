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
use ds_engine::model::Model;
use ds_engine::parallel::Tp;
use ds_engine::{pipeline_layout, Precision, Settings, STEP_PIECE};
use ds_models::ModelSpec;
use ds_partition::{FlatIndex, ShardLayout, TpRank};
use serde::Serialize;

use crate::activations::{keep_graph, kept, layers, peak, MicroBatch};

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
    /// Micro-batches whose activations a stage holds at once (1 without pipelines; 1F1B:
    /// up to `stages - stage`).
    pub micro_batches_in_flight: u64,
    /// The largest layer's parameters materialised for its forward or backward (at ZeRO-3,
    /// those of every layer that keeps its graph), and its gradients handed to the store.
    pub layer_bytes: u64,
    /// Reduction buckets (ZeRO-2/3) and ZeRO-3's parameter prefetch, at their most.
    pub comm_buffers_bytes: u64,
    /// The largest temporary besides the tapes: the gradient of the logits in backward, or
    /// with the optimizer on NVMe the step's stream buffers, whichever is larger.
    pub transient_bytes: u64,
    /// The process's own cost (code, thread stacks, allocator arenas), measured as the peak
    /// RSS of a one-layer model.
    pub fixed_bytes: u64,
    /// The predicted peak RSS: the sum of all the above.
    pub predicted_peak_bytes: u64,
    /// On disk, not in memory (`offload_param` / `offload_optimizer` to NVMe): the parameter
    /// shard as f32, the master copy and the optimizer's states; the chunks they stream
    /// through are counted above.
    pub offloaded_bytes: u64,
}

impl RankEstimate {
    pub fn model_states(&self) -> u64 {
        self.params_bytes + self.grads_bytes + self.optimizer_states_bytes
    }

    /// The predicted peak RSS: the model states, the activations of the micro-batches in
    /// flight, and the step's working memory.
    fn peak(&self) -> u64 {
        self.model_states()
            + self.activations_bytes * self.micro_batches_in_flight
            + self.layer_bytes
            + self.comm_buffers_bytes
            + self.transient_bytes
            + self.fixed_bytes
    }
}

/// What the estimate needs to know of the run.
pub struct Run<'a> {
    pub config: &'a Config,
    pub model: &'a ModelSpec,
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
    let model = run.model.build(&Tp::none()).map_err(anyhow::Error::msg)?;
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
        sp: dims.sp as u64,
        tile: run.model.tile.map(|t| t as u64),
        dtype,
    };
    let layers = layers(run.model, micro);
    let interval = settings.checkpoint_interval.max(1);
    let mut out = Vec::new();
    for rank in 0..dims.world_size {
        let (tp_rank, dp_rank, pp_stage) = (rank % tp, (rank / tp) % dp, rank / (tp * dp));
        let slice = TpRank {
            rank: tp_rank,
            size: tp,
        };
        let mine = &chunks[pp_stage];
        // per layer: its dense elements and its experts' (all of them: this rank holds 1/ep)
        let split = layer_numels(&model, mine, slice)?;
        let ep = dims.ep;
        let apart = ep > 1;
        let numel: Vec<Vec<usize>> = split
            .iter()
            .map(|c| {
                c.iter()
                    .map(|(dense, experts)| dense + experts / ep)
                    .collect()
            })
            .collect();
        let total =
            |f: &dyn Fn(&(usize, usize)) -> usize| -> usize { split.iter().flatten().map(f).sum() };
        let (dense_numel, expert_numel) = match apart {
            true => (total(&|n| n.0), total(&|n| n.1) / ep),
            false => (total(&|n| n.0 + n.1), 0),
        };
        let layout = ShardLayout::new(dense_numel, dp);
        let (padded, shard) = (layout.padded() as u64, layout.shard_len() as u64);
        // an expert-parallel rank's experts: their own store over the expert-data-parallel
        // group
        let experts = ShardLayout::new(expert_numel, dims.expert_dp());
        let (e_padded, e_shard) = (experts.padded() as u64, experts.shard_len() as u64);
        let (e_padded, e_shard) = match apart {
            true => (e_padded, e_shard),
            false => (0, 0),
        };
        // ZeRO-3 keeps a layer at most stage3_param_persistence_threshold long whole once
        // gathered, until the step (forward gathers it again); a store whose group is one
        // rank lends its shard in memory instead (`ShardedParams::get`) and keeps none
        let gathers = |group: usize| group > 1 || settings.nvme_params.is_some();
        let persists = |n: usize, group: usize| {
            let whole = gathers(group) && n <= z3.param_persistence_threshold;
            if whole {
                n
            } else {
                0
            }
        };
        let persistent: usize = split
            .iter()
            .flatten()
            .map(|&(dense, experts)| match apart {
                true => persists(dense, dp) + persists(experts / ep, dims.expert_dp()),
                false => persists(dense + experts, dp),
            })
            .sum();
        let (mut params, grads, owned) = match stage {
            ZeroStage::Disabled => (padded + e_padded, padded + e_padded, padded + e_padded),
            ZeroStage::OptimizerStates => (padded + e_padded, padded + e_padded, shard + e_shard),
            ZeroStage::Gradients => (padded + e_padded, shard + e_shard, shard + e_shard),
            ZeroStage::Weights => (
                shard + e_shard + persistent as u64,
                shard + e_shard,
                shard + e_shard,
            ),
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
        let activations = if settings.recompute { with } else { without };
        let in_flight = match dims.pp {
            1 => 1,
            p => (p - pp_stage).min(settings.grad_accum) as u64,
        };
        // the layer being computed; at ZeRO-3 the layers that keep their graph hold their
        // gathered parameters until backward (Note [tapes hold no parameters])
        let largest = numel.iter().flatten().copied().max().unwrap_or(0) as u64;
        let graphs: u64 = match (zero3, settings.recompute) {
            (Some(_), false) => numel
                .iter()
                .map(|n| {
                    let keep = keep_graph(n, zero3);
                    n.iter()
                        .zip(keep)
                        .filter(|(_, k)| *k)
                        .map(|(n, _)| *n as u64)
                        .sum::<u64>()
                })
                .sum(),
            _ => 0,
        };
        let layer_bytes = (largest.max(graphs) + largest) * dtype;
        let comm = comm_buffers(&settings, &numel, shard as usize, padded as usize) as u64 * dtype;
        // whole, or a tile's logits, softmax (f32) and their gradient (Note [tiles])
        let vocab = (run.model.vocab_size() / tp) as u64;
        let logits_grad = match micro.tile {
            None => micro.rows * (run.model.seq_len / dims.sp) as u64 * vocab * dtype,
            Some(tile) => tile * vocab * (2 * dtype + 4),
        };
        let mut transient = logits_grad;
        let mut optimizer_states = owned * (4 + per_element);
        let mut offloaded = 0;
        if settings.nvme_params.is_some() {
            offloaded += shard * 4; // f32 on disk, whatever the compute dtype
            params -= shard;
        }
        if let Some((_, buffers)) = &settings.nvme_optimizer {
            offloaded += optimizer_states;
            // the optimizer holds one chunk's states; the step streams master and states
            // through `buffer_count` sets of chunk buffers, after the logits' gradient is gone
            let chunk = owned.min(STEP_PIECE as u64);
            optimizer_states = chunk * per_element;
            let streamed = (*buffers as u64 * (4 + per_element) + 4) * chunk;
            transient = transient.max(streamed);
        }
        let mut r = RankEstimate {
            rank,
            stage: pp_stage,
            tp_rank,
            dp_rank,
            params_bytes: dtype * params,
            grads_bytes: dtype * grads,
            optimizer_states_bytes: optimizer_states,
            activations_bytes: activations,
            activations_without_checkpointing_bytes: without,
            activations_with_checkpointing_bytes: with,
            micro_batches_in_flight: in_flight,
            layer_bytes,
            comm_buffers_bytes: comm,
            transient_bytes: transient,
            fixed_bytes: FIXED,
            predicted_peak_bytes: 0,
            offloaded_bytes: offloaded,
        };
        r.predicted_peak_bytes = r.peak();
        out.push(r);
    }
    Ok(out)
}

/// The peak RSS of a rank training a one-layer model (V = 64, d = 64) at ZeRO-0 and ZeRO-3:
/// 19-20 MiB (partition/ARCHITECTURE.md, decisions).
const FIXED: u64 = 20 << 20;

/// The most elements held in reduction buckets and ZeRO-3 prefetches at once: at stages 2-3
/// the bucket being filled and, with `overlap_comm`, the one being reduced (buckets of whole
/// layers up to the bucket size, Note [bounded buckets]); at stage 3 also the next layer's
/// gathered parameters.
fn comm_buffers(s: &Settings, numel: &[Vec<usize>], shard: usize, padded: usize) -> usize {
    let stage = s.zero.stage;
    if !stage.partitions_gradients() {
        return 0;
    }
    let layers: Vec<usize> = numel.iter().flatten().copied().filter(|&n| n > 0).collect();
    let bound = ((padded - shard) / 4).max(1);
    let mut size = s.zero.reduce.bucket_size.min(bound);
    if stage == ZeroStage::Weights {
        size = size.min(s.zero.stage3.max_live_parameters / 2);
    }
    // backward fills buckets from the last layer down
    let mut buckets: Vec<usize> = Vec::new();
    for &n in layers.iter().rev() {
        match buckets.last_mut() {
            Some(b) if *b + n <= size => *b += n,
            _ => buckets.push(n),
        }
    }
    let overlap = s.zero.reduce.overlap_comm;
    let held = (0..buckets.len())
        .map(|i| buckets[i] + if overlap && i > 0 { buckets[i - 1] } else { 0 })
        .max()
        .unwrap_or(0);
    // a group of one adds its gradients straight into the shard (`ShardGrads::alone`, at the
    // default predivide factor) and lends its parameters from memory (nothing to prefetch)
    let alone = padded == shard;
    let held = match alone && s.zero.reduce.predivide_factor == 1.0 {
        true => 0,
        false => held,
    };
    let z3 = &s.zero.stage3;
    let prefetch = match stage {
        ZeroStage::Weights if alone && s.nvme_params.is_none() => 0,
        ZeroStage::Weights => layers
            .iter()
            .copied()
            .filter(|&n| {
                n > z3.param_persistence_threshold
                    && n <= z3.prefetch_bucket_size
                    && 2 * n <= z3.max_live_parameters
            })
            .max()
            .unwrap_or(0),
        _ => 0,
    };
    held + prefetch
}

/// Per chunk, per layer: the elements the layer's dense parameters and its experts (all of
/// them, `ParamSpec::expert`) take in tensor-parallel rank `tp`'s slices.
fn layer_numels(
    model: &Model,
    chunks: &[Range<usize>],
    tp: TpRank,
) -> anyhow::Result<Vec<Vec<(usize, usize)>>> {
    chunks
        .iter()
        .map(|r| {
            model.layers()[r.clone()]
                .iter()
                .map(|layer| {
                    let (mut dense, mut experts) = (FlatIndex::sliced(tp), FlatIndex::sliced(tp));
                    for p in layer.params() {
                        let index = if p.expert { &mut experts } else { &mut dense };
                        index.push_split(&p.name, &p.shape, p.split)?;
                    }
                    Ok((dense.numel(), experts.numel()))
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
/// 4; without: 0), from the run's optimizer (the config's, else the one its training
/// arguments build) over a one-element shard.
fn optimizer_state_bytes_per_element(cfg: &Config) -> anyhow::Result<u64> {
    let section = ds_engine::optimizer_section(cfg)?;
    let probe = ds_engine::optim::build_from_section(&section, 1, &ds_partition::Placement::Host)?;
    Ok(probe.state_bytes() as u64)
}
