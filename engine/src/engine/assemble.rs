//! `Engine::initialize` as a sequence of named phases: the job checked against the groups, the
//! model placed on this rank's pipeline stage, its parameters sorted into the stores that hold
//! them (dense, this rank's experts, frozen) with their flat layouts, the initial values' sources,
//! the optimizer and schedule, and the trainer assembled in the run's precision.

use std::ops::Range;

use ds_comm::Groups;
use ds_config::Config;
use ds_partition::{FlatIndex, Placement, TpRank};

use super::groups::{GroupPlan, GroupRules};
use super::trainer::{self, Trainer};
use super::{autotuning, initial, param_store, pipe, program, tied, update, whole};
use super::{Core, Engine, EngineOptions, Precision, Settings};
use crate::checkpoint;
use crate::loss_scale::LossScaler;
use crate::model::{weights, Model, ParamSpec};
use crate::parallel::PartitionConfig;
use crate::{EngineError, Result};

impl Engine {
    /// Builds the engine for `model` from a resolved ds_config, on this rank's `groups` (whose
    /// layout must be the one the config was resolved for). A model split by tensor
    /// parallelism must have been built for `groups.tp()`.
    pub fn initialize(
        model: Model,
        config: &Config,
        groups: &Groups,
        opts: &EngineOptions,
    ) -> Result<Engine> {
        check_job(config, groups)?;
        let settings = Settings::from_config(config, opts.activation_checkpointing)?;
        let placed = Placed::on_stage(model, config, groups)?;
        let stores = Stores::sort(&placed, &settings, groups, opts)?;
        let sources = Sources::open(&stores, opts)?;
        let program = program::optimizer_and_schedule(config)?;
        let scaler = LossScaler::new(&settings.fp16, settings.zero.stage)?;
        let rules = GroupRules {
            decay: program.groups,
            named: &opts.param_groups,
        };
        rules.check(&stores.trainable)?;
        let Placed { model, stage, .. } = placed;
        let parts = trainer::Parts {
            model,
            index: stores.index.clone(),
            frozen_index: stores.frozen_index.clone(),
            experts: (stores.expert_index.numel() > 0).then(|| param_store::ExpertPart {
                index: stores.expert_index.clone(),
                expert_dp: groups.experts().expert_dp.clone(),
                ep: groups.experts().ep.clone(),
            }),
            settings: settings.clone(),
            dp: groups.dp().clone(),
            tp: groups.tp().clone(),
            pp: stage.as_ref().map(|s| s.group.clone()),
            first_stage: stage.as_ref().is_none_or(pipe::Stage::is_first),
            ties: stores.ties.clone(),
            dev: opts.device.clone(),
        };
        let optimizers = Optimizers {
            program,
            scaler,
            rules: &rules,
        };
        let core = build_core(parts, &stores, sources, optimizers)?;
        let samples = settings.micro_batch * settings.grad_accum * config.dims.replicas();
        let probe = autotuning::TrialProbe::new(config, samples, groups.world().rank() == 0);
        let reporter = super::report::Reporter::new(
            config,
            groups.world().rank(),
            opts.report,
            samples as u64,
        )?;
        Ok(Engine {
            core,
            settings,
            specs: stores.dense,
            config: config.clone(),
            groups: groups.clone(),
            stage,
            all_params: stores.all_params,
            checkpoint_params: stores.checkpoint_params,
            probe,
            reporter,
            output: None,
            frozen: stores.frozen,
        })
    }
}

/// The groups are the layout the config was resolved for, and the config asks for nothing
/// the engine cannot carry out.
fn check_job(config: &Config, groups: &Groups) -> Result<()> {
    if groups.dims() != config.dims {
        return Err(EngineError::Call(format!(
            "the config was resolved for {}, the groups are {}",
            config.dims,
            groups.dims()
        )));
    }
    // Settings the engine cannot carry out would otherwise be ignored.
    config.check_implemented()?;
    let asked = config.expert_parallel.size();
    if asked > 1 && config.dims.ep != asked {
        return Err(EngineError::Call(format!(
            "expert_parallel.autoep_size {asked} is not in the layout ({}): resolve the config with Config::with_expert_parallel, as Job::init does",
            config.dims
        )));
    }
    Ok(())
}

/// The model on this rank's pipeline stage, with every parameter of the whole model (split as
/// tensor parallelism asks) and the stage and layer that hold each: checkpoints record the
/// whole model.
struct Placed {
    /// This stage's layers (the whole model without a pipeline).
    model: Model,
    stage: Option<pipe::Stage>,
    /// The whole model's parameters, with `tensor_parallel.partition_config` applied ...
    specs: Vec<ParamSpec>,
    /// ... the pipeline stage of each ...
    stage_of: Vec<usize>,
    /// ... and the layer that declares each.
    layer_of: Vec<usize>,
    /// The parameters other expert-parallel ranks hold (`Model::elsewhere`).
    elsewhere: Vec<ParamSpec>,
}

impl Placed {
    fn on_stage(model: Model, config: &Config, groups: &Groups) -> Result<Placed> {
        let mut specs = model.params();
        if let Some(rules) = &config.tp_partition_config {
            PartitionConfig::parse(rules)?.apply(&mut specs)?;
        }
        let layer_of = whole::layer_of(&model);
        let (model, stage, stage_of) = match config.dims.pp {
            1 => (model, None, vec![0; specs.len()]),
            stages => {
                let layout = pipe::pipeline_layout(config, &model)?;
                let stage_of = layout.param_stages(&model);
                let s = groups.grid().stage_id();
                let chunks = layout.chunk_layers(s);
                // the chunks as ranges of the stage's own layers
                let mut at = 0;
                let local = chunks
                    .iter()
                    .map(|r| {
                        at += r.len();
                        at - r.len()..at
                    })
                    .collect();
                let stage = pipe::Stage {
                    group: groups.pp().clone(),
                    stage: s,
                    stages,
                    chunks: local,
                };
                (model.into_stage(&chunks), Some(stage), stage_of)
            }
        };
        let elsewhere = model.elsewhere().to_vec();
        Ok(Placed {
            model,
            stage,
            specs,
            stage_of,
            layer_of,
            elsewhere,
        })
    }

    fn my_stage(&self) -> usize {
        self.stage.as_ref().map_or(0, |s| s.stage)
    }
}

/// This stage's parameters sorted into the stores that hold them, their flat layouts on this
/// tensor-parallel rank, and the whole model as checkpoints and ties see it.
struct Stores {
    /// The dense store's parameters ...
    dense: Vec<ParamSpec>,
    /// ... this rank's experts (under expert parallelism) ...
    experts: Vec<ParamSpec>,
    /// ... and the frozen ones.
    frozen_specs: Vec<ParamSpec>,
    index: FlatIndex,
    expert_index: FlatIndex,
    frozen_index: FlatIndex,
    /// Every trainable parameter of the whole model (the optimizer's groups name them).
    trainable: Vec<ParamSpec>,
    /// What a weights file of the whole model may hold: other expert-parallel ranks' experts
    /// too.
    known: Vec<ParamSpec>,
    all_params: Vec<checkpoint::ParamEntry>,
    checkpoint_params: std::result::Result<Vec<checkpoint::ParamEntry>, String>,
    frozen: Option<checkpoint::FrozenPart>,
    ties: Vec<tied::Tie>,
}

impl Stores {
    fn sort(
        placed: &Placed,
        settings: &Settings,
        groups: &Groups,
        opts: &EngineOptions,
    ) -> Result<Stores> {
        let my_stage = placed.my_stage();
        check_frozen(&placed.specs, placed.stage.is_some())?;
        // this stage's parameters, trainable and frozen apart
        let (frozen_specs, specs): (Vec<ParamSpec>, Vec<ParamSpec>) = placed
            .specs
            .iter()
            .zip(&placed.stage_of)
            .filter(|(_, s)| **s == my_stage)
            .map(|(p, _)| p.clone())
            .partition(|p| p.frozen);
        let known: Vec<ParamSpec> = placed
            .specs
            .iter()
            .chain(&placed.elsewhere)
            .cloned()
            .collect();
        let frozen = frozen_part(&placed.specs, opts);
        let ep = &groups.experts().ep;
        let declared = whole::declared(&placed.specs, &placed.layer_of, &placed.stage_of);
        let checkpoint_params =
            whole::whole_model(declared, &placed.elsewhere, (ep.rank(), ep.size()))
                .map(|placed| logical_entries(placed.into_iter().filter(|p| !p.spec.frozen)));
        // checkpoints, ties and the optimizer know the trainable parameters only
        let (trainable, stage_of): (Vec<ParamSpec>, Vec<usize>) = placed
            .specs
            .iter()
            .cloned()
            .zip(placed.stage_of.iter().copied())
            .filter(|(p, _)| !p.frozen)
            .unzip();
        let all_params = logical_entries(whole::in_place(&trainable, &stage_of));
        let tp = TpRank {
            rank: groups.tp().rank(),
            size: groups.tp().size(),
        };
        // under expert parallelism this rank's experts live in a store of their own
        let expert_parallel = ep.size() > 1;
        check_experts(&frozen_specs, settings, expert_parallel)?;
        let (experts, dense): (Vec<ParamSpec>, Vec<ParamSpec>) =
            specs.into_iter().partition(|p| p.expert && expert_parallel);
        let (index, frozen_index) = (flat_index(&dense, tp)?, flat_index(&frozen_specs, tp)?);
        let expert_index = flat_index(&experts, tp)?;
        let rank_of = |s: usize| placed.stage.as_ref().map_or(0, |st| st.rank_of(s));
        let ties = tied::ties(&trainable, &stage_of, my_stage, &index, rank_of)?;
        Ok(Stores {
            dense,
            experts,
            frozen_specs,
            index,
            expert_index,
            frozen_index,
            trainable,
            known,
            all_params,
            checkpoint_params,
            frozen,
            ties,
        })
    }
}

/// Where each store's initial values come from: the seed, or the `--init` weights file.
struct Sources {
    dense: initial::Source,
    experts: initial::Source,
    frozen: initial::Source,
}

impl Sources {
    fn open(stores: &Stores, opts: &EngineOptions) -> Result<Sources> {
        let source = |specs: &[ParamSpec]| -> Result<initial::Source> {
            Ok(match &opts.init {
                Some(path) => initial::Source::File(
                    weights::WeightsFile::open(path, specs, &stores.known)?,
                    opts.seed,
                ),
                None => initial::Source::Seed(opts.seed),
            })
        };
        let experts = source(&stores.experts)?;
        let frozen = source(&stores.frozen_specs)?;
        Ok(Sources {
            dense: source(&stores.dense)?,
            experts,
            frozen,
        })
    }
}

/// What builds each store's optimizer over the shard a rank comes to own.
struct Optimizers<'a> {
    program: program::ProgramOptimizer,
    scaler: LossScaler,
    rules: &'a GroupRules<'a>,
}

/// The trainer in the run's precision, its stores filled from `sources`.
fn build_core(
    parts: trainer::Parts,
    stores: &Stores,
    sources: Sources,
    o: Optimizers,
) -> Result<Core> {
    let Optimizers {
        program,
        scaler,
        rules,
    } = o;
    let s = stores;
    let expert_section = program.optimizer.clone();
    let expert_optimizer = move |owned: Range<usize>, len: usize, place: &Placement| {
        let mut optimizer = crate::optim::build_from_section(&expert_section, len, place)?;
        optimizer.set_groups(rules.hypers());
        let groups = GroupPlan::new(rules, &s.experts, &s.expert_index, &owned);
        Ok(update::ShardOptimizer { optimizer, groups })
    };
    let updater = move |owned: Range<usize>, len: usize, place: &Placement| {
        let mut opt = crate::optim::build_from_section(&program.optimizer, len, place)?;
        opt.set_groups(rules.hypers());
        let plan = GroupPlan::new(rules, &s.dense, &s.index, &owned);
        Ok(update::Updater::new(opt, program.schedule, scaler, plan))
    };
    let init = initial::InitialValues::new(&stores.dense, &stores.index, sources.dense);
    let mut fill = |range, dst: &mut [f32]| init.fill(range, dst);
    let frozen_init =
        initial::InitialValues::new(&stores.frozen_specs, &stores.frozen_index, sources.frozen);
    let mut frozen_fill = |range, dst: &mut [f32]| frozen_init.fill(range, dst);
    let expert_init =
        initial::InitialValues::new(&stores.experts, &stores.expert_index, sources.experts);
    let mut expert_fill = |range, dst: &mut [f32]| expert_init.fill(range, dst);
    let inits = trainer::Inits {
        dense: &mut fill,
        frozen: &mut frozen_fill,
        experts: &mut expert_fill,
    };
    let precision = parts.settings.precision;
    Ok(match precision {
        Precision::F32 => Core::F32(Trainer::new(parts, inits, updater, expert_optimizer)?),
        Precision::BF16 => Core::Bf16(Trainer::new(parts, inits, updater, expert_optimizer)?),
        Precision::F16 => Core::F16(Trainer::new(parts, inits, updater, expert_optimizer)?),
    })
}

/// The model's frozen parameters and where their values come from, when it has any.
fn frozen_part(specs: &[ParamSpec], opts: &EngineOptions) -> Option<checkpoint::FrozenPart> {
    let params: Vec<(String, Vec<usize>)> = specs
        .iter()
        .filter(|p| p.frozen)
        .map(|p| (p.name.clone(), p.shape.clone()))
        .collect();
    if params.is_empty() {
        return None;
    }
    let source = match &opts.init {
        None => format!("seed {}", opts.seed),
        Some(path) => {
            let name = path.file_name().map_or(path.display().to_string(), |n| {
                n.to_string_lossy().into_owned()
            });
            match std::fs::metadata(path) {
                Ok(m) if m.is_file() => format!("weights file {name} ({} bytes)", m.len()),
                _ => format!("weights directory {name}"),
            }
        }
    };
    Some(checkpoint::FrozenPart { params, source })
}

/// The flat layout of `specs` on this tensor-parallel rank.
fn flat_index(specs: &[ParamSpec], tp: TpRank) -> Result<FlatIndex> {
    let mut index = FlatIndex::sliced(tp);
    for s in specs {
        index.push_split(&s.name, &s.shape, s.split)?;
    }
    Ok(index)
}

/// What the experts' store of expert parallelism does not do yet: hold frozen experts (a
/// frozen store over the expert-data-parallel group) or reach NVMe.
fn check_experts(frozen: &[ParamSpec], settings: &Settings, expert_parallel: bool) -> Result<()> {
    if !expert_parallel {
        return Ok(());
    }
    if let Some(p) = frozen.iter().find(|p| p.expert) {
        return Err(EngineError::NotBuilt(format!(
            "{} is a frozen expert: freezing experts under expert parallelism is not built yet",
            p.name
        )));
    }
    if settings.nvme_optimizer.is_some() || settings.nvme_params.is_some() {
        return Err(EngineError::NotBuilt(
            "zero_optimization.offload_optimizer/offload_param to nvme under expert parallelism is not built yet (the experts' store stays in memory): offload to cpu, or train at ep 1".into(),
        ));
    }
    Ok(())
}

/// What freezing parameters (`Model::freeze`) cannot do: freeze everything, a tied pair, or
/// (for now) run under pipeline parallelism.
fn check_frozen(specs: &[ParamSpec], pipelined: bool) -> Result<()> {
    if !specs.iter().any(|p| p.frozen) {
        return Ok(());
    }
    if specs.iter().all(|p| p.frozen) {
        return Err(EngineError::Model(
            "every parameter of the model is frozen: nothing would train".into(),
        ));
    }
    let frozen = |name: &str| specs.iter().any(|o| o.name == name && o.frozen);
    let tied = specs.iter().filter(|p| p.tied.is_some());
    if let Some(p) = tied
        .into_iter()
        .find(|p| p.frozen || frozen(p.value_name()))
    {
        return Err(EngineError::NotBuilt(format!(
            "{} is tied to {}: tied parameters cannot be frozen yet",
            p.name,
            p.value_name()
        )));
    }
    if pipelined {
        return Err(EngineError::NotBuilt(
            "frozen parameters under pipeline parallelism are not supported yet".into(),
        ));
    }
    Ok(())
}

/// The logical parameters as a checkpoint records them: logical shapes, offsets in the
/// logical flat order, how tensor parallelism splits each, which stage holds it and, under
/// expert parallelism, which expert-parallel rank's experts' store.
fn logical_entries(placed: impl Iterator<Item = whole::Placed>) -> Vec<checkpoint::ParamEntry> {
    let mut offset = 0;
    placed
        .map(|p| {
            let entry = checkpoint::ParamEntry {
                name: p.spec.name.clone(),
                shape: p.spec.shape.clone(),
                offset,
                split: p.spec.split.into(),
                stage: p.stage,
                ep_rank: p.holder,
            };
            offset += p.spec.numel();
            entry
        })
        .collect()
}
