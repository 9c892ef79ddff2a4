//! Joining a training job: DeepSpeed's `init_distributed` and the config half of
//! `deepspeed.initialize`, so that a training program starts in two calls:
//!
//! ```ignore
//! let job = Job::init(DS_CONFIG)?;                 // the ranks, the layout, the ds_config
//! let engine = job.initialize(model, &EngineOptions::default())?;
//! ```

use std::path::Path;

use ds_comm::{Communicator, Groups};
use ds_config::Config;

use crate::model::Model;
use crate::parallel::{Ep, Parallel, Tp};
use crate::plan::{ConfigSource, JobPlan, Overrides};
use crate::{Engine, EngineError, EngineOptions, Result};

/// This process's place in the job (its groups: data, tensor and pipeline parallel) and the
/// ds_config resolved for that layout.
pub struct Job {
    groups: Groups,
    config: Config,
    /// Where the config came from, for messages.
    source: String,
    /// The communicator `init` made (a program that joins with its own keeps it).
    comm: Option<Communicator>,
}

impl Job {
    /// Joins the job this process was started in: alone, rank 0 of 1; under `ds-rs launch`,
    /// torchrun, mpirun or srun, its place from the environment. The ds_config is the one
    /// the launcher passed (`ds-rs launch --config`, as DS_RS_CONFIG), else `config`: a
    /// file's path, or the JSON text itself.
    /// DeepSpeed's comms logger (`comms_logger` in the config) times this rank's collectives;
    /// `comms_summary` prints its table, as `deepspeed.comm.log_summary()`.
    pub fn init(config: &str) -> Result<Job> {
        let mut opts = ds_comm::options_from_env()?;
        let plan = plan(config, opts.world_size)?;
        opts.comms_logger = plan.config.comms_logger.clone().filter(|c| c.enabled);
        let comm = ds_comm::init(&opts)?;
        let mut job = Job::from_plan(&comm, plan)?;
        job.comm = Some(comm);
        Ok(job)
    }

    /// As `init`, on a communicator the program made (ranks in threads, tests).
    pub fn join(comm: &Communicator, config: &str) -> Result<Job> {
        Job::from_plan(comm, plan(config, comm.world_size())?)
    }

    fn from_plan(comm: &Communicator, plan: JobPlan) -> Result<Job> {
        let groups = Groups::new(comm, plan.config.dims)?;
        Ok(Job {
            groups,
            config: plan.config,
            source: plan.source,
            comm: None,
        })
    }

    /// The comms logger's table of this rank's collectives (None unless the config's
    /// `comms_logger` is enabled and `init` made the communicator).
    pub fn comms_summary(&self) -> Option<String> {
        self.comm.as_ref()?.comms_summary()
    }

    /// The engine for `model` (built for this job's tensor-parallel group, `tp()`).
    pub fn initialize(&self, model: Model, opts: &EngineOptions) -> Result<Engine> {
        Engine::initialize(model, &self.config, &self.groups, opts)
            .map_err(|e| EngineError::at(self.source.to_string(), e))
    }

    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The tensor-parallel group, for a model's layers that split (`parallel::Tp`).
    pub fn tp(&self) -> Tp {
        Tp::new(self.groups.tp().clone())
    }

    /// The whole layout as a model's layers see it (tensor, expert and sequence parallelism),
    /// for a model built with every split at once (`ds_models::ModelSpec::build_with`).
    pub fn parallel(&self) -> Parallel {
        Parallel::of(&self.groups, self.config.sequence_parallel)
    }

    /// The expert-parallel group, for a mixture of experts' layers (`parallel::Ep`).
    pub fn ep(&self) -> Ep {
        Ep::new(self.groups.experts().ep.clone())
    }

    /// This process's rank in the whole job.
    pub fn rank(&self) -> usize {
        self.groups.world().rank()
    }
}

/// The job's config for `world` ranks: the launcher's (DS_RS_CONFIG), else `config` (a file's
/// path, or the JSON text itself), alone, as deepspeed.initialize reads it; the model arrives
/// with `initialize`.
fn plan(config: &str, world: usize) -> Result<JobPlan> {
    let launched = std::env::var("DS_RS_CONFIG").ok().filter(|c| !c.is_empty());
    let text = launched.as_deref().unwrap_or(config);
    let source = match text.trim_start().starts_with('{') {
        true => ConfigSource::Text {
            text,
            name: "the program's ds_config",
        },
        false => ConfigSource::File(Path::new(text)),
    };
    JobPlan::new(source, world, &Overrides::default(), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A program's job takes the config's AutoEP size into its layout and groups, so the
    /// model it builds with `ep()` splits its experts as the engine stores them.
    #[test]
    fn the_config_sets_expert_parallelism() {
        let config = r#"{"train_micro_batch_size_per_gpu": 1,
            "expert_parallel": {"enabled": true, "autoep_size": 2}}"#;
        let got = ds_comm::testkit::run_ranks(4, std::time::Duration::from_secs(30), |comm| {
            let job = Job::join(&comm, config)?;
            let e = job.groups().experts();
            Ok::<_, EngineError>((
                job.config().dims.ep,
                job.ep().size(),
                e.ep.global_ranks().to_vec(),
                e.expert_dp.global_ranks().to_vec(),
            ))
        })
        .unwrap();
        // DeepSpeed's E + D order: expert-parallel groups of consecutive data-parallel ranks
        assert_eq!(got[1], (2, 2, vec![0, 1], vec![1, 3]));
        assert_eq!(got[2], (2, 2, vec![2, 3], vec![0, 2]));
    }
}
