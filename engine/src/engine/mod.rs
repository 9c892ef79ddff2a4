//! `Engine`: DeepSpeed's engine API for a custom training loop: `initialize`, `forward`,
//! `backward`, `step` (which knows accumulation boundaries), `train_batch`, `eval_batch`,
//! `get_lr`, `global_steps`, `memory_report` and wall-clock timings.

mod assemble;
mod autotuning;
mod groups;
mod initial;
mod layers;
mod memory;
mod offload;
mod param_store;
mod pipe;
mod program;
mod report;
mod settings;
mod tied;
mod trainer;
mod update;
mod whole;

use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::Device;
use ds_comm::{Groups, ReduceOp};
use ds_config::Config;
use ds_partition::swap::IoTotals;
use ds_partition::{runs, FlatIndex, TpRank};
use half::{bf16, f16};

use crate::checkpoint;
use crate::model::{weights, ParamSpec};
use crate::{Batch, Inputs};
use crate::{EngineError, Result};
pub use groups::{DecayGroups, ParamGroup};
pub use layers::Dtype;
pub use memory::MemoryReport;
pub use pipe::{pipeline_layout, PipeLayout};
pub use program::{check_optimizer, lr_schedule, optimizer_section, program_optimizer_line};
pub use report::{monitor_events, progress_line, steps_per_print, swap_note, wall_clock_line};
pub use settings::{Precision, Settings};
use trainer::Trainer;
pub use update::{StepOutcome, STEP_PIECE};

/// Choices that are not in ds_config.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Seed of the initial weights (with each parameter's name).
    pub seed: u64,
    /// Start from these weights (safetensors under the model's parameter names).
    pub init: Option<PathBuf>,
    pub device: Device,
    /// Recompute layer internals in backward (also on when ds_config has an
    /// `activation_checkpointing` section; ZeRO-3 recomputes the layers it releases, see
    /// Note [ZeRO-3 reuse]).
    pub activation_checkpointing: bool,
    /// Parameter groups with their own weight decay and learning-rate scale (torch's
    /// `param_groups`); the first that names a parameter takes it. `ParamGroup::hf_no_decay()`
    /// is HF's Trainer's second group.
    pub param_groups: Vec<ParamGroup>,
    /// Report as DeepSpeed's engine does (on by default): rank 0's progress line every
    /// `steps_per_print` steps and the `wall_clock_breakdown` line (which then takes the
    /// timings `take_timings` would return); the config's monitors are written either way.
    /// A program that draws its own progress (`ds-rs train`) turns the lines off.
    pub report: bool,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            seed: 0,
            init: None,
            device: Device::Cpu,
            activation_checkpointing: false,
            param_groups: Vec::new(),
            report: true,
        }
    }
}

/// Time spent since the last `take_timings` (ds_config `wall_clock_breakdown`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    pub forward: Duration,
    pub backward: Duration,
    pub step: Duration,
    /// Per layer, in model order: forward time (gathering its parameters included) ...
    pub layer_forward: Vec<Duration>,
    /// ... and backward time (recomputation and gradient hand-off included).
    pub layer_backward: Vec<Duration>,
    /// Under pipeline parallelism: time in transfers with the neighbouring stages (blocking
    /// sends and receives, so waiting for them included), the stage's share of the bubble.
    pub pipe_wait: Duration,
    /// NVMe offload: the bytes the swap files read and wrote, and the time that took.
    pub swap: IoTotals,
}

impl Timings {
    /// Adds `other` to these totals, layer by layer.
    pub fn add(&mut self, other: &Timings) {
        self.forward += other.forward;
        self.backward += other.backward;
        self.step += other.step;
        self.pipe_wait += other.pipe_wait;
        self.swap += other.swap;
        for (mine, theirs) in [
            (&mut self.layer_forward, &other.layer_forward),
            (&mut self.layer_backward, &other.layer_backward),
        ] {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), Duration::ZERO);
            }
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += *t;
            }
        }
    }
}

enum Core {
    F32(Trainer<f32>),
    Bf16(Trainer<bf16>),
    F16(Trainer<f16>),
}

macro_rules! each {
    ($core:expr, $t:ident => $body:expr) => {
        match $core {
            Core::F32($t) => $body,
            Core::Bf16($t) => $body,
            Core::F16($t) => $body,
        }
    };
}

/// One rank's training engine.
pub struct Engine {
    core: Core,
    settings: Settings,
    specs: Vec<ParamSpec>,
    /// The resolved ds_config, as checkpoints record it.
    config: Config,
    groups: Groups,
    /// Under pipeline parallelism: this rank's stage.
    stage: Option<pipe::Stage>,
    /// This rank's model's trainable parameters with their stages (the whole model at ep 1).
    all_params: Vec<checkpoint::ParamEntry>,
    /// The whole model's parameters as checkpoints record them: every expert-parallel rank's
    /// experts too, in the model's order at ep 1, each with its stage and store; or why the
    /// model's experts held elsewhere cannot be placed (Note [the whole model under expert
    /// parallelism]).
    checkpoint_params: std::result::Result<Vec<checkpoint::ParamEntry>, String>,
    /// An autotuning trial's step timer (a config with `autotuning.metric_path`).
    probe: Option<autotuning::TrialProbe>,
    /// DeepSpeed's progress lines and monitor events (report.rs).
    reporter: report::Reporter,
    /// The output `forward` returned, until `backward` differentiates the loss made from it.
    output: Option<candle_core::Var>,
    /// The frozen parameters and their source, which checkpoints record (they hold only the
    /// trainable ones).
    frozen: Option<checkpoint::FrozenPart>,
}

impl Engine {
    /// The device this rank computes on.
    pub fn device(&self) -> Device {
        each!(&self.core, t => t.device().clone())
    }

    /// This rank's groups.
    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }
    /// This rank's parameters (its pipeline stage's, whole shapes), in flat order.
    pub fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Forward of one micro-batch (`Batch::to_inputs` for token batches); returns the
    /// model's output, differentiable: the loss for a model that ends in one, else what its
    /// last layer returns (logits), from which the program computes its loss for `backward`.
    pub fn forward(&mut self, inputs: &Inputs) -> Result<candle_core::Tensor> {
        self.not_pipelined("forward")?;
        let rows = self.settings.micro_batch;
        if let Some((name, dims)) = inputs.not_leading(rows) {
            return Err(EngineError::Call(format!(
                "forward: the batch tensor {name:?} has shape {dims:?}; its leading dimension must be the micro-batch, train_micro_batch_size_per_gpu = {rows}"
            )));
        }
        let inputs = inputs.to_device(&self.device())?;
        let x = inputs.first().cloned().ok_or_else(|| {
            EngineError::Call("forward: the batch holds no tensor for the first layer".into())
        })?;
        let y = each!(&mut self.core, t => t.forward_stage(x, inputs))?;
        let output = candle_core::Var::from_tensor(&y.detach())?;
        let y = output.as_tensor().clone();
        self.output = Some(output);
        Ok(y)
    }

    /// The model's output for `inputs` without gradients (evaluation, metrics): nothing is
    /// kept for a backward, and the batch may have any number of rows (the same in each
    /// tensor).
    pub fn infer(&mut self, inputs: &Inputs) -> Result<candle_core::Tensor> {
        self.not_pipelined("infer")?;
        if self.output.is_some() {
            return Err(EngineError::Call(
                "infer() between forward() and backward(): finish the micro-batch first".into(),
            ));
        }
        let rows = inputs.first().and_then(|t| t.dims().first().copied());
        if let Some((name, dims)) = rows.and_then(|r| inputs.not_leading(r)) {
            return Err(EngineError::Call(format!(
                "infer: the batch tensor {name:?} has shape {dims:?}, its first dimension differs from the first tensor's ({})",
                rows.unwrap_or(0)
            )));
        }
        let inputs = inputs.to_device(&self.device())?;
        let x = inputs.first().cloned().ok_or_else(|| {
            EngineError::Call("infer: the batch holds no tensor for the first layer".into())
        })?;
        let y = each!(&mut self.core, t => t.evaluate_stage(x, inputs))?;
        Ok(y.detach())
    }

    /// Backward of the last forward from `loss`, any scalar the program computed from its
    /// output (for a model that ends in a loss, the output itself). Scaled by the loss scale
    /// over the accumulation steps, as DeepSpeed's `backward`; gradients are reduced at
    /// accumulation boundaries (ZeRO-2/3: at every micro-step).
    pub fn backward(&mut self, loss: &candle_core::Tensor) -> Result<()> {
        self.not_pipelined("backward")?;
        let output = self
            .output
            .take()
            .ok_or_else(|| EngineError::Call("backward() needs a forward() first".into()))?;
        if loss.elem_count() != 1 {
            return Err(EngineError::Call(format!(
                "backward: the loss must be a scalar, it has shape {:?}",
                loss.dims()
            )));
        }
        self.reporter.record_loss(loss);
        let seed = each!(&self.core, t => t.loss_seed());
        let grads = loss.affine(seed, 0.0)?.backward()?;
        let dy = grads.get(output.as_tensor()).cloned().ok_or_else(|| {
            EngineError::Call(
                "backward: the loss does not depend on the output of forward(), so on no trainable parameter".into(),
            )
        })?;
        each!(&mut self.core, t => t.backward_stage(Some(dy))).map(|_| ())
    }

    /// The optimizer step when an accumulation window is complete; `None` otherwise.
    pub fn step(&mut self) -> Result<Option<StepOutcome>> {
        self.not_pipelined("step")?;
        let outcome = each!(&mut self.core, t => t.step())?;
        outcome.map(|o| self.after_step(o, None)).transpose()
    }

    /// After each optimizer step: DeepSpeed's reporting (`loss`: the step's, when the caller
    /// has it), and an autotuning trial's probe, whose outcome says when the trial's last
    /// profiled step is done (the program ends there).
    fn after_step(&mut self, mut outcome: StepOutcome, loss: Option<f64>) -> Result<StepOutcome> {
        let steps = self.global_steps();
        outcome.skipped_steps = self.skipped_steps();
        let timings = self.reporter.wants_timings().then(|| self.take_timings());
        self.reporter
            .after_step(steps, &mut outcome, loss, timings)?;
        if let Some(probe) = &mut self.probe {
            outcome.trial_complete = probe.after_step(steps)?;
        }
        Ok(outcome)
    }

    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        each!(&self.core, t => t.is_boundary())
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches from `next`;
    /// returns the loss averaged over the micro-batches and the data-parallel ranks.
    /// (A data loader's error becomes the engine's with `EngineError::input`.)
    pub fn train_batch(
        &mut self,
        mut next: impl FnMut(usize) -> Result<Batch>,
    ) -> Result<(f32, StepOutcome)> {
        let ga = self.settings.grad_accum;
        if let Some(stage) = self.stage.clone() {
            return self.train_batch_pipe(&stage, &mut next);
        }
        // The losses are read after the step: on a GPU a read waits for the device, which
        // between forward and backward would stop the host queueing backward's kernels.
        let mut losses = Vec::with_capacity(ga);
        for k in 0..ga {
            let loss = self.forward(&next(k)?.to_inputs(&self.device())?)?;
            self.backward(&loss)?;
            losses.push(loss.detach());
        }
        let outcome = each!(&mut self.core, t => t.step())?.ok_or_else(|| {
            EngineError::Call(
                "train_batch: an accumulation window was already open (forward/backward \
                 called without step); finish it with step() first"
                    .into(),
            )
        })?;
        let mut sum = 0.0f32;
        for loss in losses {
            sum += loss.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        }
        let loss = self.mean_over_ranks(sum / ga as f32)?;
        // reported with the loss over every rank, as the program sees it
        Ok((loss, self.after_step(outcome, Some(loss as f64))?))
    }

    /// One pipeline step: DeepSpeed's TrainSchedule over the accumulation steps' micro-batches
    /// (Note [pipeline transfers] in pipe.rs); the loss, computed on the last stage, is sent
    /// to every stage and averaged over the data-parallel ranks.
    fn train_batch_pipe(
        &mut self,
        stage: &pipe::Stage,
        next: &mut dyn FnMut(usize) -> Result<Batch>,
    ) -> Result<(f32, StepOutcome)> {
        let ga = self.settings.grad_accum;
        let (sum, outcome) = each!(&mut self.core, t => pipe::train_batch(t, stage, ga, next))
            .map_err(|e| pipe::name_stages(e, stage))?;
        let outcome = outcome.ok_or_else(|| {
            EngineError::Internal("pipe schedule: the batch ended without an optimizer step".into())
        })?;
        let mut loss = [sum / ga as f32];
        stage
            .group
            .broadcast(&mut loss, stage.last())
            .map_err(|e| pipe::name_stages(e.into(), stage))?;
        let loss = self.mean_over_ranks(loss[0])?;
        Ok((loss, self.after_step(outcome, Some(loss as f64))?))
    }

    /// The loss of `gradient_accumulation_steps` micro-batches from `next` without
    /// gradients (DeepSpeed's `eval_batch`; pipelines run its InferenceSchedule), averaged
    /// over the micro-batches and the data-parallel ranks.
    pub fn eval_batch(&mut self, mut next: impl FnMut(usize) -> Result<Batch>) -> Result<f32> {
        let ga = self.settings.grad_accum;
        let sum = match self.stage.clone() {
            Some(stage) => each!(&mut self.core, t => pipe::eval_batch(t, &stage, ga, &mut next))
                .map_err(|e| pipe::name_stages(e, &stage))?,
            None => {
                let mut sum = 0.0f32;
                for k in 0..ga {
                    let (ids, targets) = each!(&self.core, t => t.batch_tensors(&next(k)?))?;
                    let inputs = Inputs::targets_only(targets);
                    let loss = each!(&mut self.core, t => t.evaluate_stage(ids, inputs))?;
                    sum += loss.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
                }
                sum
            }
        };
        self.mean_over_ranks(sum / ga as f32)
    }

    /// DeepSpeed's PipelineEngine runs whole batches only: a stage has no loss of its own.
    fn not_pipelined(&self, what: &str) -> Result<()> {
        match &self.stage {
            None => Ok(()),
            Some(s) => Err(EngineError::Call(format!(
                "{what}() with pipeline parallelism ({} stages): use train_batch / eval_batch, as DeepSpeed's PipelineEngine",
                s.stages
            ))),
        }
    }

    fn mean_over_ranks(&self, v: f32) -> Result<f32> {
        let mut buf = [v];
        each!(&self.core, t => t.dp().all_reduce(&mut buf, ReduceOp::Avg))?;
        Ok(buf[0])
    }

    /// The losses the model's layers added to its loss in the last `forward` (an MoE router's
    /// load-balancing loss, `Context::add_loss`): part of what `backward` differentiates,
    /// though not of the output `forward` returned.
    pub fn added_loss(&self) -> Result<f32> {
        each!(&self.core, t => t.added_loss())
    }

    /// The learning rate the next optimizer step will use.
    pub fn get_lr(&self) -> f64 {
        each!(&self.core, t => t.updater().lr())
    }
    pub fn global_steps(&self) -> u64 {
        each!(&self.core, t => t.updater().global_steps())
    }
    pub fn skipped_steps(&self) -> u64 {
        each!(&self.core, t => t.updater().skipped_steps())
    }
    pub fn loss_scale(&self) -> f64 {
        each!(&self.core, t => t.updater().loss_scale())
    }

    /// Bytes this rank holds for parameters, gradients and optimizer states, and the most a
    /// step has held besides them.
    pub fn memory_report(&self) -> MemoryReport {
        each!(&self.core, t => t.memory_report())
    }

    /// Each layer's report name, parameter count and forward FLOPs for a micro-batch input of
    /// [micro_batch, seq] (None where the layer does not say), in model order.
    pub fn layer_profile(&self, seq: usize) -> Vec<(String, usize, Option<u64>)> {
        let shape = [self.settings.micro_batch, seq];
        each!(&self.core, t => t.model().layers().iter().map(|l| {
            let n = l.params().iter().map(|p| p.numel()).sum();
            (l.display_name(), n, l.layer.forward_flops(&shape))
        }).collect())
    }

    /// Forward/backward/step time since the last call.
    /// Writes `(tag, value, x)` events to the config's monitors (TensorBoard, CSV) on rank 0,
    /// beside the engine's own, as DeepSpeed's `engine.monitor.write_events`.
    pub fn write_events(&mut self, events: &[(&str, f64, u64)]) -> Result<()> {
        self.reporter.write_events(events)
    }

    pub fn take_timings(&mut self) -> Timings {
        each!(&mut self.core, t => t.take_timings())
    }

    /// Writes the whole model as one safetensors file under the parameter names (fp32). A
    /// collective: every rank saves what it owns as a checkpoint beside `path`, rank 0 writes
    /// the file from it a tensor at a time and removes it, so no rank holds the model.
    pub fn save_weights(&self, path: &Path) -> Result<()> {
        let mut staging = path.as_os_str().to_owned();
        staging.push(".ds-rs-staging");
        let staging = PathBuf::from(staging);
        let saved = self.save_checkpoint(&staging, "weights", serde_json::json!({}))?;
        let frozen = self.gather_frozen()?;
        let mut result = Ok(());
        if self.groups.world().rank() == 0 {
            let f32 = weights::SaveDtype::F32;
            result = checkpoint::write_weights_with(&saved, path, f32, &frozen)
                .map(|_| ())
                .map_err(EngineError::from);
            std::fs::remove_dir_all(&staging).map_err(|e| EngineError::file(&staging, e))?;
        }
        // no rank returns before the file is there
        self.groups.world().barrier()?;
        result
    }

    /// Writes checkpoint `dir/tag` (a collective: every rank calls it with the same
    /// arguments): this rank's owned range (of its dense store, and of its experts' store
    /// under expert parallelism), and on rank 0 the manifest and `latest`. `client_state` is
    /// kept in the manifest for the training program.
    pub fn save_checkpoint(
        &self,
        dir: &Path,
        tag: &str,
        client_state: serde_json::Value,
    ) -> Result<PathBuf> {
        let index = each!(&self.core, t => t.index());
        let desc = checkpoint::Description {
            layout: self.checkpoint_layout(),
            params: self.checkpoint_params()?,
            numel: index.numel(),
            tp_rank: self.groups.tp().rank(),
            stage: self.stage.as_ref().map_or(0, |s| s.stage),
            ep_rank: self.groups.experts().ep.rank(),
            counters: each!(&self.core, t => t.updater().counters()),
            client_state,
            config: serde_json::to_value(&self.config).unwrap_or_default(),
            frozen: self.frozen.clone(),
        };
        let dense = each!(&self.core, t => t.rank_state())?;
        let experts = each!(&self.core, t => t.expert_state())?;
        // Stage 0 keeps the whole range on every rank of a store's data-parallel group: one
        // copy is enough.
        let partitioned = self.settings.zero.stage.partitions_optimizer();
        let shares = checkpoint::Shares {
            dense: checkpoint::Share {
                state: &dense,
                writes: partitioned || self.dp_rank() == 0,
            },
            experts: experts.as_ref().map(|state| checkpoint::Share {
                state,
                writes: partitioned || self.groups.experts().expert_dp.rank() == 0,
            }),
        };
        Ok(checkpoint::save(
            self.groups.world(),
            dir,
            tag,
            &shares,
            desc,
        )?)
    }

    /// Resumes from checkpoint `dir/tag` (`tag` None: the one `latest` names; Ok(None) when
    /// there is none), whatever layout saved it; returns the manifest, whose `client_state`
    /// is the training program's. A collective.
    pub fn load_checkpoint(
        &mut self,
        dir: &Path,
        tag: Option<&str>,
    ) -> Result<Option<checkpoint::Manifest>> {
        let tag = match tag {
            Some(t) => t.to_string(),
            None => match checkpoint::latest(dir)? {
                Some(t) => t,
                None => return Ok(None),
            },
        };
        let tag_dir = dir.join(&tag);
        let loaded = self.read_checkpoint(&tag_dir);
        // Every rank must succeed before any changes its state.
        let (manifest, mut states) = checkpoint::agree(self.groups.world(), loaded)?;
        check_frozen_source(&tag_dir, manifest.frozen.as_ref(), self.frozen.as_ref())?;
        let counters = checkpoint::Counters {
            global_steps: manifest.global_steps,
            skipped_steps: manifest.skipped_steps,
            loss_scaler: manifest.loss_scaler,
        };
        let experts = states.split_off(1).pop();
        let dense = states
            .pop()
            .expect("invariant: the dense store is read first");
        each!(&mut self.core, t => t.restore(dense, experts, counters))?;
        Ok(Some(manifest))
    }

    /// This rank's share of checkpoint `tag_dir`: its dense store's range, then, under expert
    /// parallelism, its experts' store's.
    fn read_checkpoint(
        &self,
        tag_dir: &Path,
    ) -> Result<(checkpoint::Manifest, Vec<checkpoint::RankState>)> {
        let params = self.checkpoint_params()?;
        let buffers = each!(&self.core, t => t.buffer_names());
        let dense = checkpoint::Expect {
            params: &params,
            buffers: Some(&buffers),
            owned: each!(&self.core, t => t.owned()),
            tp: TpRank {
                rank: self.groups.tp().rank(),
                size: self.groups.tp().size(),
            },
            stage: self.stage.as_ref().map_or(0, |s| s.stage),
            ep_rank: None,
        };
        let experts = each!(&self.core, t => t.expert_owned()).map(|owned| checkpoint::Expect {
            owned,
            ep_rank: Some(self.groups.experts().ep.rank()),
            ..dense
        });
        let expects: Vec<checkpoint::Expect> = std::iter::once(dense).chain(experts).collect();
        Ok(checkpoint::load_stores(tag_dir, &expects)?)
    }

    /// The whole model's parameters as checkpoints record them.
    fn checkpoint_params(&self) -> Result<Vec<checkpoint::ParamEntry>> {
        self.checkpoint_params
            .clone()
            .map_err(|why| EngineError::Model(format!("checkpoints: {why}")))
    }

    /// This rank's position in the data-parallel group.
    pub fn dp_rank(&self) -> usize {
        each!(&self.core, t => t.dp().rank())
    }

    fn checkpoint_layout(&self) -> checkpoint::Layout {
        let dims = &self.config.dims;
        checkpoint::Layout {
            world_size: dims.world_size,
            dp: dims.dp(),
            tp: dims.tp,
            pp: dims.pp,
            zero_stage: u8::from(self.settings.zero.stage),
            ep: dims.ep,
            dtype: match self.settings.precision {
                Precision::F32 => "f32",
                Precision::BF16 => "bf16",
                Precision::F16 => "f16",
            }
            .into(),
        }
    }

    /// Every parameter's fp32 master value by name, whole: the logical tensors, assembled
    /// from every tensor-parallel rank's slices (a collective: all ranks call it). A
    /// replicated parameter that differs between tensor-parallel ranks (an invariant of
    /// tensor parallelism, nn/ARCHITECTURE.md) is an error naming it.
    /// Under expert parallelism each rank holds only its experts: an error there (the
    /// weights file and the checkpoint of `save_weights` / `save_checkpoint` hold them all).
    pub fn gather_params(&self) -> Result<Vec<(String, Vec<f32>)>> {
        if let ep @ 2.. = self.groups.experts().ep.size() {
            return Err(EngineError::NotBuilt(format!(
                "gather_params under expert parallelism (ep {ep}) is not built: each rank holds only its experts; save_weights writes the whole model"
            )));
        }
        let mine = self.gather_stage_params()?;
        let Some(stage) = &self.stage else {
            return Ok(mine);
        };
        // every stage's tensors one stage after another, each stage's in model order (an
        // interleaved stage holds several chunks of the model)
        let mut counts = vec![0; stage.stages];
        for p in &self.all_params {
            counts[p.stage] += p.shape.iter().product::<usize>();
        }
        let mut starts: Vec<usize> = counts
            .iter()
            .scan(0, |at, c| {
                *at += c;
                Some(*at - c)
            })
            .collect();
        let mut flat = vec![0f32; counts.iter().sum()];
        let mut put = starts[stage.stage];
        for (_, v) in &mine {
            flat[put..put + v.len()].copy_from_slice(v);
            put += v.len();
        }
        stage.group.all_gather_v(&mut flat, &counts)?;
        Ok(self
            .all_params
            .iter()
            .map(|p| {
                let n: usize = p.shape.iter().product();
                let at = &mut starts[p.stage];
                *at += n;
                (p.name.clone(), flat[*at - n..*at].to_vec())
            })
            .collect())
    }

    /// The frozen parameters, whole, with their shapes (a collective; none without): what a
    /// weights file holds beside a checkpoint's trainable parameters.
    fn gather_frozen(&self) -> Result<Vec<WholeTensor>> {
        let Some((values, index)) = each!(&self.core, t => t.gather_frozen())? else {
            return Ok(Vec::new());
        };
        let shapes = index.entries().iter().map(|e| e.logical_shape.clone());
        let tensors = self.assemble(values, index)?.into_iter().zip(shapes);
        Ok(tensors.map(|((n, v), s)| (n, s, v)).collect())
    }

    /// This stage's parameters, whole (the frozen ones after the trainable ones): the logical
    /// tensors assembled from every tensor-parallel rank's slices.
    fn gather_stage_params(&self) -> Result<Vec<(String, Vec<f32>)>> {
        let local = each!(&self.core, t => t.gather_master())?;
        let mut all = self.assemble(local, each!(&self.core, t => t.index()))?;
        all.extend(self.gather_frozen()?.into_iter().map(|(n, _, v)| (n, v)));
        Ok(all)
    }

    /// Whole logical tensors from this rank's flat values `local` of `index` and the other
    /// tensor-parallel ranks' (a collective over the tensor-parallel group).
    fn assemble(&self, local: Vec<f32>, index: &FlatIndex) -> Result<Vec<(String, Vec<f32>)>> {
        let tp = self.groups.tp();
        let n = local.len();
        let all = match tp.size() {
            1 => local,
            size => {
                let mut all = vec![0f32; n * size];
                tp.all_gather(&local, &mut all)?;
                all
            }
        };
        let held: Vec<&[f32]> = all.chunks(n.max(1)).collect();
        index
            .entries()
            .iter()
            .map(|e| {
                if e.split.is_replicated() {
                    check_replicated(&e.name, &held, e.range())?;
                }
                let mut whole = vec![0f32; e.logical_numel()];
                for (rank, held) in held.iter().enumerate() {
                    let slice = TpRank {
                        rank,
                        size: tp.size(),
                    };
                    for r in runs(&e.logical_shape, e.split, slice) {
                        let src = e.offset + r.local;
                        whole[r.logical..r.logical + r.len]
                            .copy_from_slice(&held[src..src + r.len]);
                    }
                }
                Ok((e.name.clone(), whole))
            })
            .collect()
    }
}

/// A replicated parameter must hold the same bits on every tensor-parallel rank (`held`: each
/// rank's buffer; `range`: the parameter's place in it).
fn check_replicated(name: &str, held: &[&[f32]], range: std::ops::Range<usize>) -> Result<()> {
    let bits = |h: &[f32]| {
        h[range.clone()]
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    match (1..held.len()).find(|&r| bits(held[r]) != bits(held[0])) {
        None => Ok(()),
        Some(r) => Err(EngineError::Model(format!(
            "{name} differs between tensor-parallel ranks 0 and {r}: a replicated parameter must stay identical"
        ))),
    }
}

/// A parameter's name, logical shape and values.
type WholeTensor = (String, Vec<usize>, Vec<f32>);

/// A checkpoint holds only the trainable parameters: resuming it where the frozen ones are
/// other ones, or start from another source, would train the adapters of another model.
fn check_frozen_source(
    dir: &Path,
    saved: Option<&checkpoint::FrozenPart>,
    now: Option<&checkpoint::FrozenPart>,
) -> Result<()> {
    let describe = |f: Option<&checkpoint::FrozenPart>| match f {
        None => "no frozen parameters".to_string(),
        Some(f) => format!("{} frozen parameters from {}", f.params.len(), f.source),
    };
    if saved == now {
        return Ok(());
    }
    Err(EngineError::file(
        dir,
        format!(
            "the checkpoint was trained with {}, this run has {}: start the frozen part as the checkpoint's run did (the same --init or seed)",
            describe(saved),
            describe(now)
        ),
    ))
}
