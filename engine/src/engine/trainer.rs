//! The training loop of one rank in one compute dtype: layer-wise forward and backward over
//! the parameters a ZeRO stage provides, and the optimizer step on the owned shard.
//!
//! Why long: one rank's forward, backward and step over the parameter stores are one state
//! machine (what is gathered, reduced and released when); pipe.rs and layers.rs hold the
//! pipeline's and a layer's parts.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor, WithDType};
use ds_comm::Group;
use ds_partition::swap::{IoTotals, SwapIo};
use ds_partition::{FlatIndex, Frozen, InitFn, ParamSwap, Placement, Zero};

use super::layers::{self, Dtype, Kind, LayerGrads, LayerParams};
use super::memory::{ExpertBytes, MemoryReport, StepPeak};
use super::offload::OffloadedStates;
use super::param_store::{ExpertPart, ParamStore, StoreLayout};
use super::tied::{self, Tie};
use super::update::{ShardOptimizer, StepOutcome, Updater, STEP_PIECE};
use super::{Settings, Timings};
use crate::checkpoint::{Counters, RankState};
use crate::model::{tensor_bytes, Context, Model, Tape};
use crate::{Batch, Inputs, Targets};
use crate::{EngineError, Result};

/// What forward keeps of a layer for its backward.
enum Saved {
    /// What its backward needs.
    Kept(Kept),
    /// Only the input: backward gathers the parameters again and recomputes the layer.
    Input(Tensor),
    /// Nothing: backward recomputes the layer's segment from the input the segment's first
    /// layer kept (Note [checkpoint segments]).
    Dropped,
}

/// What a layer's backward needs from its forward.
enum Kept {
    /// A taped layer's own record (Note [taped layers] in model/mod.rs), with its
    /// parameters, or `None` where backward materialises them again (Note [tapes hold no
    /// parameters]).
    Tape {
        tape: Box<dyn Tape>,
        params: Option<LayerParams>,
        /// The losses the layer added (`Context::add_loss`), summed: its tape differentiates
        /// them.
        added: Option<Tensor>,
    },
    /// The whole autograd graph: parameters and internals stay alive until backward.
    Graph {
        input: Tensor,
        params: LayerParams,
        output: Tensor,
        /// The losses the layer added (`Context::add_loss`), summed.
        added: Option<Tensor>,
    },
}

impl Kept {
    /// Bytes of (activations, materialised parameters) it holds. candle's graph keeps more
    /// than its two ends: a lower bound for layers differentiated by autograd.
    fn bytes(&self) -> (usize, usize) {
        match self {
            Kept::Tape { tape, params, .. } => (
                tape.activation_bytes(),
                params.as_ref().map_or(0, LayerParams::bytes),
            ),
            Kept::Graph {
                input,
                params,
                output,
                ..
            } => (tensor_bytes(input) + tensor_bytes(output), params.bytes()),
        }
    }

    /// The losses the layer added in its forward, summed.
    fn added(&self) -> Option<&Tensor> {
        match self {
            Kept::Tape { added, .. } | Kept::Graph { added, .. } => added.as_ref(),
        }
    }
}

pub(crate) struct Trainer<T: Dtype> {
    model: Model,
    /// The trained parameters but the experts.
    dense: ParamStore<Zero<T>>,
    /// This rank's experts under expert parallelism, when there are.
    experts: Option<ParamStore<Zero<T>>>,
    /// The frozen parameters (Model::freeze), when there are.
    frozen: Option<ParamStore<Frozen<T>>>,
    /// Per layer, in its declaration order: which store holds each parameter.
    layer_kinds: Vec<Vec<Kind>>,
    updater: Updater,
    settings: Settings,
    /// Per layer: forward keeps its whole graph for backward (else backward recomputes it).
    keep_graph: Vec<bool>,
    dev: Device,
    dp: Group,
    pp: Option<Group>,
    ties: Vec<Tie>,
    /// The first layer reads token ids (the model's first stage), not activations.
    takes_ids: bool,
    saved: Vec<Saved>,
    /// The layers the micro-batch in `saved` ran forward through.
    running: Range<usize>,
    inputs: Option<Inputs>,
    micro_steps: u64,
    timings: Timings,
    /// The I/O of this rank's swap files (NVMe offload), and its reading at the last
    /// `take_timings`.
    swap_io: Arc<SwapIo>,
    swap_taken: IoTotals,
    peak: StepPeak,
    /// The losses the layers added in the last forward (`Context::add_loss`), detached.
    added_losses: Vec<Tensor>,
    /// Whether the forward running is an evaluation (`Context::evaluating`).
    evaluating: bool,
}

/// One micro-batch's state between its forward and its backward.
#[derive(Default)]
pub(crate) struct Micro {
    saved: Vec<Saved>,
    running: Range<usize>,
    inputs: Option<Inputs>,
}

/// The initial values of each store's flat ranges.
pub(crate) struct Inits<'a, 'b> {
    pub dense: &'a mut InitFn<'b, EngineError>,
    pub frozen: &'a mut InitFn<'b, EngineError>,
    pub experts: &'a mut InitFn<'b, EngineError>,
}

/// What a trainer is built from, whatever its dtype.
pub(crate) struct Parts {
    pub model: Model,
    /// The trainable parameters' flat layout ...
    pub index: FlatIndex,
    /// ... and the frozen ones'.
    pub frozen_index: FlatIndex,
    /// This rank's experts, under expert parallelism.
    pub experts: Option<ExpertPart>,
    pub settings: Settings,
    pub dp: Group,
    /// The tensor-parallel group whose other ranks hold the other slices.
    pub tp: Group,
    /// Under pipeline parallelism: the pipeline's group (the gradient norm sums over it) and
    /// whether this stage is the first (its first layer reads token ids).
    pub pp: Option<Group>,
    pub first_stage: bool,
    /// The tied parameters this stage takes part in.
    pub ties: Vec<Tie>,
    pub dev: Device,
}

impl<T: Dtype> Trainer<T> {
    /// `init(range, dst)` writes the initial values of a flat range (only the ranges this
    /// rank keeps are asked for); `updater` builds the optimizer for the flat range this
    /// rank will own, its state for the length given at the placement given.
    pub fn new(
        parts: Parts,
        inits: Inits<'_, '_>,
        updater: impl FnOnce(Range<usize>, usize, &Placement) -> Result<Updater>,
        expert_optimizer: impl FnOnce(Range<usize>, usize, &Placement) -> Result<ShardOptimizer>,
    ) -> Result<Trainer<T>> {
        let Parts {
            model,
            index,
            frozen_index,
            experts,
            settings,
            dp,
            tp,
            pp,
            first_stage,
            ties,
            dev,
        } = parts;
        let layer_kinds: Vec<Vec<Kind>> = model
            .layers()
            .iter()
            .map(|l| {
                let kind =
                    |p: &crate::model::ParamSpec| match (p.frozen, p.expert && experts.is_some()) {
                        (true, _) => Kind::Frozen,
                        (false, true) => Kind::Expert,
                        (false, false) => Kind::Dense,
                    };
                l.params().iter().map(kind).collect()
            })
            .collect();
        let dense = StoreLayout::plan(index, &layer_kinds, Kind::Dense);
        let rank = dp.global_ranks()[dp.rank()];
        let swap_io = Arc::new(SwapIo::default());
        let param_swap = settings.nvme_params.as_deref().map(|nvme_path| ParamSwap {
            nvme_path,
            rank,
            io: &swap_io,
        });
        // the data-parallel group reduces GPU memory where it is: one rank, or NCCL
        let dp_on_gpu = dp.size() == 1 || dp.backend() == ds_comm::Backend::Nccl;
        let mut places = crate::device::placements(&dev, settings.cpu_offload, dp_on_gpu);
        if settings.nvme_optimizer.is_some() {
            // the NVMe tier streams the optimizer's states through host memory
            places.optimizer = Placement::Host;
        }
        let copies: Vec<Range<usize>> = ties.iter().filter_map(Tie::copy_range).collect();
        let trained = TrainedStore {
            settings: &settings,
            places: &places,
            tp: &tp,
            pp: pp.as_ref(),
        };
        let mut zero = trained.build(&dense, dp.clone(), inits.dense, param_swap, copies)?;
        let mut updater = match &settings.nvme_optimizer {
            None => updater(zero.owned(), zero.owned().len(), &places.optimizer)?,
            Some((path, buffers)) => {
                // the optimizer holds one streamed chunk's state; the rest lives on disk
                let owned = zero.owned().len();
                let state_len = STEP_PIECE.min(owned).max(1);
                let mut u = updater(zero.owned(), state_len, &Placement::Host)?;
                let names = u.optimizer().state_names();
                let master = zero.take_master();
                let states = OffloadedStates::new(path, rank, *buffers, &master, &names, &swap_io)?;
                u.offload_to(states);
                u
            }
        };
        let experts = match experts {
            None => None,
            Some(part) => {
                let layout = StoreLayout::plan(part.index, &layer_kinds, Kind::Expert);
                let zero = trained.build(&layout, part.expert_dp, inits.experts, None, vec![])?;
                let owned = zero.owned();
                updater.set_experts(expert_optimizer(
                    owned.clone(),
                    owned.len(),
                    &places.optimizer,
                )?);
                Some(ParamStore {
                    store: zero,
                    layout,
                    spread_over: Some(part.ep),
                })
            }
        };
        let frozen = match frozen_index.numel() {
            0 => None,
            n => Some(ParamStore {
                store: Frozen::new(n, settings.zero, dp.clone(), inits.frozen, &places.params)?,
                layout: StoreLayout::plan(frozen_index, &layer_kinds, Kind::Frozen),
                spread_over: None,
            }),
        };
        let keep_graph = keep_graph(&settings, &dense.index, &dense.layer_ids);
        Ok(Trainer {
            model,
            dense: ParamStore {
                store: zero,
                layout: dense,
                spread_over: None,
            },
            experts,
            frozen,
            layer_kinds,
            updater,
            settings,
            keep_graph,
            dev,
            dp,
            pp,
            ties,
            takes_ids: first_stage,
            saved: Vec::new(),
            running: 0..0,
            inputs: None,
            micro_steps: 0,
            timings: Timings::default(),
            swap_taken: swap_io.totals(),
            swap_io,
            peak: StepPeak::default(),
            added_losses: Vec::new(),
            evaluating: false,
        })
    }

    /// Materialises layer `i`'s parameters and starts gathering layer `next`'s.
    fn materialise(&mut self, i: usize, next: Option<usize>) -> Result<LayerParams> {
        let dev = &self.dev;
        let params = self.dense.layer_params(i, next, dev)?;
        let experts = match &mut self.experts {
            Some(e) => Some(e.layer_params(i, next, dev)?),
            None => None,
        };
        let frozen = match &mut self.frozen {
            Some(f) => Some(f.layer_params(i, next, dev)?),
            None => None,
        };
        Ok(params.with_others(experts, frozen, &self.layer_kinds[i]))
    }

    /// Layer `i` forward on `x`: its output and what its backward needs.
    fn run_layer(&self, i: usize, params: LayerParams, x: Tensor) -> Result<(Tensor, Kept)> {
        let inputs = self
            .inputs
            .as_ref()
            .expect("invariant: forward set the inputs");
        let added = std::cell::RefCell::new(Vec::new());
        let cx = Context::new(inputs)
            .adding_into(&added)
            .in_evaluation(self.evaluating);
        let (layer, dtype) = (&self.model.layers()[i], <T as WithDType>::DTYPE);
        if let Some(taped) = layers::forward_taped(layer, &params, &x, &cx, dtype)? {
            let (tape, params) = (taped.tape, Some(params));
            let added = layers::sum_losses(added.into_inner())?.map(|a| a.detach());
            return Ok((
                taped.output,
                Kept::Tape {
                    tape,
                    params,
                    added,
                },
            ));
        }
        let input = match (i, self.takes_ids) {
            (0, true) => x,
            _ => layers::leaf(&x)?.into_inner(),
        };
        let y = layers::forward(layer, &params, &input, &cx, dtype)?;
        let added = layers::sum_losses(added.into_inner())?;
        let output = y.clone();
        Ok((
            y,
            Kept::Graph {
                input,
                params,
                output,
                added,
            },
        ))
    }

    /// Note [tapes hold no parameters]: where the store keeps parameters whole (stages 0-2),
    /// a tape's parameters are dropped until its backward, which copies them again.
    fn release_params(&self, kept: Kept) -> Kept {
        match kept {
            Kept::Tape { tape, added, .. } if !self.settings.zero.stage.partitions_parameters() => {
                Kept::Tape {
                    tape,
                    params: None,
                    added,
                }
            }
            kept => kept,
        }
    }

    /// A micro-batch's token ids and targets as tensors [batch, seq].
    pub fn batch_tensors(&self, batch: &Batch) -> Result<(Tensor, Option<Targets>)> {
        let inputs = batch.to_inputs(&self.dev)?;
        let ids = inputs.first().expect("invariant: a batch has ids").clone();
        Ok((ids, inputs.targets().cloned()))
    }

    /// Forward of one micro-batch over this rank's layers from `x` (the first named input on
    /// the first stage, the previous stage's activations on the others), with the
    /// micro-batch's `inputs` for every layer to read; returns the last layer's output (the
    /// loss, for a model that ends in one).
    pub fn forward_stage(&mut self, x: Tensor, inputs: Inputs) -> Result<Tensor> {
        self.forward_layers(0..self.model.layers().len(), x, inputs)
    }

    /// The seed of backward: the loss scale over the accumulation steps (DeepSpeed's
    /// `backward` scales the loss by both).
    pub fn loss_seed(&self) -> f64 {
        self.updater.loss_scale() / self.settings.grad_accum as f64
    }

    /// Forward of one micro-batch over this rank's layers `layers` (a model chunk of an
    /// interleaved pipeline, or all of them).
    pub fn forward_layers(
        &mut self,
        layers: Range<usize>,
        mut x: Tensor,
        inputs: Inputs,
    ) -> Result<Tensor> {
        let t0 = Instant::now();
        self.inputs = Some(inputs);
        self.added_losses.clear();
        self.saved.clear();
        self.running = layers.clone();
        for i in layers.clone() {
            let t_layer = Instant::now();
            let params = self.materialise(i, (i + 1 < layers.end).then_some(i + 1))?;
            let (y, kept) = self.run_layer(i, params, x.clone())?;
            if let Some(a) = kept.added() {
                // read only when asked (`added_loss`): no device round trip per layer
                self.added_losses.push(a.detach());
            }
            // the chunk's first layer always keeps its input (Note [checkpoint segments])
            let checkpoint = (i - layers.start).is_multiple_of(self.settings.checkpoint_interval);
            self.saved.push(match (self.keep_graph[i], checkpoint) {
                (true, _) => Saved::Kept(self.release_params(kept)),
                (false, true) => Saved::Input(x),
                (false, false) => Saved::Dropped,
            });
            x = y;
            add_at(&mut self.timings.layer_forward, i, t_layer.elapsed());
        }
        self.note_peak(None);
        self.timings.forward += t0.elapsed();
        Ok(x)
    }

    /// Whether the backward about to run ends an accumulation window.
    pub fn is_boundary(&self) -> bool {
        (self.micro_steps + 1).is_multiple_of(self.settings.grad_accum as u64)
    }

    /// Backward of the last forward over this rank's layers, from `dy`, the gradient of the
    /// stage's output (None on the last stage: the loss seed); returns the gradient of the
    /// stage's input (None on the first stage: token ids have none).
    pub fn backward_stage(&mut self, dy: Option<Tensor>) -> Result<Option<Tensor>> {
        self.backward_layers(dy, true)
    }

    /// Backward of the last forward (`forward_layers`) over its layers; `ends_micro` when no
    /// other chunk of this micro-batch is left to differentiate on this rank (the micro-step,
    /// and a possible accumulation boundary, ends here).
    pub fn backward_layers(
        &mut self,
        dy: Option<Tensor>,
        ends_micro: bool,
    ) -> Result<Option<Tensor>> {
        let layers = self.running.clone();
        if self.saved.len() != layers.len() || layers.is_empty() {
            return Err(EngineError::Call(
                "backward() needs a forward() first".into(),
            ));
        }
        let t0 = Instant::now();
        let seed = self.loss_seed();
        let mut dy = dy;
        let mut dx_input = None;
        for k in (0..self.saved.len()).rev() {
            let i = layers.start + k;
            let t_layer = Instant::now();
            if matches!(self.saved.last(), Some(Saved::Dropped)) {
                self.recompute_segment(k)?;
            }
            let kept = match self.saved.pop().expect("invariant: one per layer") {
                Saved::Kept(Kept::Tape {
                    tape,
                    params: None,
                    added,
                }) => {
                    let params = Some(self.materialise(i, None)?);
                    Kept::Tape {
                        tape,
                        params,
                        added,
                    }
                }
                Saved::Kept(kept) => kept,
                Saved::Input(x) => {
                    let before = (k > 0).then(|| i - 1);
                    let params = self.materialise(i, before)?;
                    self.run_layer(i, params, x)?.1
                }
                Saved::Dropped => unreachable!("recompute_segment replaced it"),
            };
            self.note_peak(Some(&kept));
            let (dx, mut g, dense) = self.layer_backward(i, kept, dy.as_ref(), seed)?;
            self.peak.layer_grads = self.peak.layer_grads.max(g.bytes());
            let expert_grads = g.split_off(dense);
            self.dense.add_grads(i, g)?;
            if let Some(e) = &mut self.experts {
                e.add_grads(i, expert_grads)?;
            }
            dy = match (k, dx) {
                (0, dx) => {
                    dx_input = dx;
                    None
                }
                (_, Some(dx)) => Some(dx),
                (_, None) => {
                    return Err(EngineError::Model(format!(
                        "layer {i}'s output does not depend on its input"
                    )))
                }
            };
            add_at(&mut self.timings.layer_backward, i, t_layer.elapsed());
        }
        if ends_micro {
            let boundary = self.is_boundary();
            self.dense.store.finish_backward(boundary)?;
            if let Some(e) = &mut self.experts {
                e.store.finish_backward(boundary)?;
            }
            self.micro_steps += 1;
        }
        self.timings.backward += t0.elapsed();
        Ok(dx_input)
    }

    /// What this rank keeps of the micro-batch between its forward and backward, taken out
    /// so that a pipeline stage can hold several micro-batches in flight.
    pub fn take_micro(&mut self) -> Micro {
        Micro {
            saved: std::mem::take(&mut self.saved),
            running: std::mem::take(&mut self.running),
            inputs: self.inputs.take(),
        }
    }

    /// Puts back a micro-batch taken with `take_micro`.
    pub fn put_micro(&mut self, m: Micro) {
        self.saved = m.saved;
        self.running = m.running;
        self.inputs = m.inputs;
    }

    /// Note [checkpoint segments]: with a checkpoint interval k, forward keeps the input of
    /// layers 0, k, 2k, ... only (DeepSpeed's `activation_checkpoint_interval`). When backward
    /// reaches a layer that kept nothing, it runs forward again from its segment's input over
    /// the segment's layers up to this one, keeping what their backward needs, and then goes
    /// on layer by layer as if forward had kept it: at most one segment's activations are
    /// alive beside the checkpoints.
    fn recompute_segment(&mut self, top: usize) -> Result<()> {
        let start = (0..=top)
            .rev()
            .find(|&j| matches!(self.saved[j], Saved::Input(_)))
            .expect("invariant: a chunk's first layer keeps its input");
        let Saved::Input(mut x) = std::mem::replace(&mut self.saved[start], Saved::Dropped) else {
            unreachable!("found above")
        };
        let first = self.running.start;
        for j in start..=top {
            let params = self.materialise(first + j, None)?;
            let (y, kept) = self.run_layer(first + j, params, x)?;
            self.saved[j] = Saved::Kept(self.release_params(kept));
            x = y;
        }
        Ok(())
    }

    /// One layer's backward from what its forward kept: the gradient of its input and those
    /// of its parameters, the dense ones first, and how many those are (the parameters
    /// themselves are dropped here).
    fn layer_backward(
        &self,
        i: usize,
        kept: Kept,
        dy: Option<&Tensor>,
        seed: f64,
    ) -> Result<(Option<Tensor>, LayerGrads<T>, usize)> {
        match kept {
            Kept::Tape {
                mut tape, params, ..
            } => {
                let seed_tensor;
                let dy = match dy {
                    Some(dy) => dy,
                    None => {
                        seed_tensor = Tensor::new(seed as f32, &self.dev)?;
                        &seed_tensor
                    }
                };
                let params = params.expect("invariant: backward materialised them");
                let (layer, dtype) = (&self.model.layers()[i], <T as WithDType>::DTYPE);
                let vb = params.var_builder(&layer.prefix, dtype, &self.dev, false)?;
                tape.seed_added_loss(seed);
                let grads = tape.backward(dy, &vb)?;
                let g = params.taped_grads::<T>(&layer.display_name(), grads.params)?;
                Ok((grads.input, g, params.dense()))
            }
            Kept::Graph {
                input,
                params,
                output,
                added,
            } => {
                let grads = layers::backward(&output, dy, seed, added.as_ref())?;
                let g = params.graph_grads::<T>(&grads)?;
                Ok((grads.get(&input).cloned(), g, params.dense()))
            }
        }
    }

    /// The optimizer step at an accumulation boundary; `None` between boundaries.
    pub fn step(&mut self) -> Result<Option<StepOutcome>> {
        if self.micro_steps == 0
            || !self
                .micro_steps
                .is_multiple_of(self.settings.grad_accum as u64)
        {
            return Ok(None);
        }
        let t0 = Instant::now();
        if !self.ties.is_empty() {
            match self.dense.store.whole_grads_mut() {
                Some(grads) => tied::reduce_tied(&self.ties, grads, self.pp.as_ref())?,
                None => tied::reduce_tied_sharded(&self.ties, &mut self.dense.store)?,
            }
        }
        let experts = match &mut self.experts {
            None => None,
            Some(e) => {
                // each expert-parallel rank's experts are others: their norms add up
                let mut sq = [e.store.grad_norm_sq()? as f32];
                if let Some(spread) = &e.spread_over {
                    spread.all_reduce(&mut sq, ds_comm::ReduceOp::Sum)?;
                }
                Some((&mut e.store, sq[0] as f64))
            }
        };
        let outcome = self
            .updater
            .step(&mut self.dense.store, experts, self.settings.clip)?;
        self.timings.step += t0.elapsed();
        Ok(Some(outcome))
    }

    pub fn memory_report(&self) -> MemoryReport {
        let offloaded = self.updater.offloaded().map_or(0, |o| o.bytes())
            + self.dense.store.offloaded_param_bytes();
        let mut states = self.dense.store.memory(self.updater.state_bytes());
        let experts = self
            .experts
            .as_ref()
            .map(|e| e.store.memory(self.updater.expert_state_bytes()));
        if let Some(e) = &experts {
            states.add(e);
        }
        let frozen = self.frozen.as_ref().map_or(0, |f| f.store.bytes());
        if let Some(f) = &self.frozen {
            states.comm_buffers += f.store.peak_gathered_bytes();
            states.gpu += if f.store.on_host() { 0 } else { frozen };
        }
        let experts = experts.as_ref().map(ExpertBytes::of).unwrap_or_default();
        MemoryReport::new(
            states,
            experts,
            frozen,
            self.peak,
            offloaded,
            !self.dev.is_cpu(),
        )
    }

    /// Records the activations and layer parameters alive now: what forward keeps for
    /// backward, plus `current` (a layer being differentiated), as the step's peak so far.
    fn note_peak(&mut self, current: Option<&Kept>) {
        let held = self.saved.iter().map(|s| match s {
            Saved::Input(x) => (tensor_bytes(x), 0),
            Saved::Kept(kept) => kept.bytes(),
            Saved::Dropped => (0, 0),
        });
        let (activations, layer_params) = held
            .chain(current.map(Kept::bytes))
            .fold((0, 0), |(a, p), (x, y)| (a + x, p + y));
        self.peak.activations = self.peak.activations.max(activations);
        self.peak.layer_params = self.peak.layer_params.max(layer_params);
    }

    /// The value of the losses the layers added in the last forward.
    pub fn added_loss(&self) -> Result<f32> {
        let mut sum = 0.0;
        for l in &self.added_losses {
            sum += l.to_scalar::<f32>()?;
        }
        Ok(sum)
    }

    pub fn updater(&self) -> &Updater {
        &self.updater
    }

    pub fn dp(&self) -> &Group {
        &self.dp
    }

    /// The flat range (padded coordinates) this rank's master copy and optimizer cover.
    pub fn owned(&self) -> Range<usize> {
        self.dense.store.owned()
    }

    /// This rank's share of the training state, for a checkpoint.
    pub fn rank_state(&self) -> Result<RankState> {
        let opt = self.updater.optimizer().state();
        self.dense.rank_state(opt, self.updater.offloaded())
    }

    /// The flat range (padded coordinates of the experts' buffer) this rank's experts'
    /// master copy and optimizer cover, under expert parallelism.
    pub fn expert_owned(&self) -> Option<Range<usize>> {
        self.experts.as_ref().map(|e| e.store.owned())
    }

    /// This rank's share of its experts' store, for a checkpoint (the same buffers as the
    /// dense store's; the experts' store never reaches NVMe).
    pub fn expert_state(&self) -> Result<Option<RankState>> {
        match (&self.experts, self.updater.expert_optimizer()) {
            (Some(e), Some(opt)) => e.rank_state(opt.state(), None).map(Some),
            _ => Ok(None),
        }
    }

    /// The optimizer's state buffer names.
    pub fn buffer_names(&self) -> Vec<String> {
        let opt = self.updater.optimizer().state();
        opt.buffers.iter().map(|(n, _)| n.to_string()).collect()
    }

    /// Resumes from a checkpoint: this rank's master range and optimizer state (of its
    /// experts' store too, under expert parallelism), the counters; then the compute-dtype
    /// parameters follow from the master copy (a collective).
    pub fn restore(
        &mut self,
        state: RankState,
        experts: Option<RankState>,
        counters: Counters,
    ) -> Result<()> {
        check_owned(Some(&state), Some(self.dense.store.owned()))?;
        check_owned(experts.as_ref(), self.expert_owned())?;
        self.updater
            .restore(counters, state.optimizer_step, &state.buffers)?;
        if let (Some(s), Some(e)) = (experts, self.experts.as_mut()) {
            self.updater.restore_experts(s.optimizer_step, &s.buffers)?;
            e.restore_master(&s.master, None)?;
        }
        self.micro_steps = counters.global_steps * self.settings.grad_accum as u64;
        self.saved.clear();
        self.dense
            .restore_master(&state.master, self.updater.offloaded())
    }

    /// The device the layers compute on (received activations land there).
    pub fn device(&self) -> &Device {
        &self.dev
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Adds time a pipeline stage waited for its neighbours.
    pub fn add_pipe_wait(&mut self, d: std::time::Duration) {
        self.timings.pipe_wait += d;
    }

    pub fn take_timings(&mut self) -> Timings {
        let now = self.swap_io.totals();
        self.timings.swap = now - std::mem::replace(&mut self.swap_taken, now);
        std::mem::take(&mut self.timings)
    }

    /// Every parameter's fp32 master value, whole, in flat order (a collective).
    pub fn gather_master(&self) -> Result<Vec<f32>> {
        match self.updater.offloaded() {
            Some(o) => Ok(self.dense.store.gather(&o.master()?)?),
            None => Ok(self.dense.store.gather_master()?),
        }
    }

    pub fn index(&self) -> &FlatIndex {
        &self.dense.layout.index
    }

    /// The frozen parameters' values, whole, in their flat order, with their layout (a
    /// collective at ZeRO-3); None without frozen parameters.
    pub fn gather_frozen(&self) -> Result<Option<(Vec<f32>, &FlatIndex)>> {
        match &self.frozen {
            None => Ok(None),
            Some(f) => Ok(Some((f.store.gather()?, &f.layout.index))),
        }
    }
}

impl<T: Dtype> Trainer<T> {
    /// Forgets a forward that will not be followed by backward.
    fn drop_saved(&mut self) {
        self.saved.clear();
        self.running = 0..0;
    }

    /// A forward of this rank's layers `layers` for evaluation: the layers see
    /// `Context::evaluating` (an MoE gate's evaluation capacity), nothing is kept.
    pub fn evaluate_layers(
        &mut self,
        layers: Range<usize>,
        x: Tensor,
        inputs: Inputs,
    ) -> Result<Tensor> {
        self.evaluating = true;
        let y = self.forward_layers(layers, x, inputs);
        self.evaluating = false;
        self.drop_saved();
        y
    }

    /// `evaluate_layers` over all of this rank's layers.
    pub fn evaluate_stage(&mut self, x: Tensor, inputs: Inputs) -> Result<Tensor> {
        self.evaluate_layers(0..self.model.layers().len(), x, inputs)
    }
}

/// A checkpoint's state of a store must cover the range this rank owns of it (no state for
/// a store this rank does not have: the experts' without expert parallelism).
fn check_owned(state: Option<&RankState>, owned: Option<Range<usize>>) -> Result<()> {
    let covers = state.map(|s| (s.owned.clone(), s.master.len()));
    if covers != owned.clone().map(|o| (o.clone(), o.len())) {
        return Err(EngineError::Resume(format!(
            "checkpoint state covers {:?}, this rank owns {owned:?}",
            state.map(|s| &s.owned)
        )));
    }
    Ok(())
}

/// Which layers keep their graph from forward to backward.
///
/// Note [ZeRO-3 reuse]: candle's graph holds the tensors its ops saved (a matmul keeps its
/// weight), so a layer whose gathered parameters are released after forward must be recomputed
/// in backward. As DeepSpeed's coordinator does with `stage3_max_reuse_distance`, a layer is
/// not released when the parameters used between its forward and its backward (those of the
/// layers after it) number at most that distance, and the kept ones fit
/// `stage3_max_live_parameters`. Stages 0-2 keep every graph; activation checkpointing none.
fn keep_graph(settings: &Settings, index: &FlatIndex, layer_ids: &[Range<usize>]) -> Vec<bool> {
    let numel = |ids: &Range<usize>| index.span(ids.clone()).len();
    if settings.recompute {
        return vec![false; layer_ids.len()];
    }
    if !settings.zero.stage.partitions_parameters() {
        return vec![true; layer_ids.len()];
    }
    let (mut keep, mut after, mut live) = (vec![false; layer_ids.len()], 0, 0);
    for (i, ids) in layer_ids.iter().enumerate().rev() {
        live += numel(ids);
        if after > settings.max_reuse_distance || live > settings.zero.stage3.max_live_parameters {
            break;
        }
        keep[i] = true;
        after += numel(ids);
    }
    keep
}

/// `v[i] += d`, growing `v` as needed (timings start empty after each take).
fn add_at(v: &mut Vec<std::time::Duration>, i: usize, d: std::time::Duration) {
    if v.len() <= i {
        v.resize(i + 1, std::time::Duration::ZERO);
    }
    v[i] += d;
}

/// How the trained groups' ZeRO stores are built: the job's settings, placements and groups.
struct TrainedStore<'a> {
    settings: &'a Settings,
    places: &'a ds_partition::Placements,
    tp: &'a Group,
    pp: Option<&'a Group>,
}

impl TrainedStore<'_> {
    /// A group's store over `dp`, its buckets planned by layer; its replicated parameters
    /// (but the tied `copies`, which the tie reduces) reduced over the tensor-parallel group.
    fn build<T: Dtype>(
        &self,
        layout: &StoreLayout,
        dp: Group,
        init: &mut InitFn<'_, EngineError>,
        swap: Option<ParamSwap<'_>>,
        copies: Vec<Range<usize>>,
    ) -> Result<Zero<T>> {
        let index = &layout.index;
        let numel = index.numel();
        let mut zero = Zero::new(numel, self.settings.zero, dp, init, swap, self.places)?;
        zero.plan_buckets(&layout.layer_flat);
        let replicated = index.entries().iter().filter(|e| e.split.is_replicated());
        let replicated = replicated
            .map(|e| e.range())
            .filter(|r| !copies.contains(r));
        zero.set_tensor_parallel(self.tp.clone(), replicated.collect());
        zero.set_duplicates(copies);
        if let Some(pp) = self.pp {
            zero.set_pipeline(pp.clone());
        }
        Ok(zero)
    }
}
