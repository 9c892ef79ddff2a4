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
use crate::parallel::Tp;
use crate::{Engine, EngineError, EngineOptions, Result};

/// This process's place in the job (its groups: data, tensor and pipeline parallel) and the
/// ds_config resolved for that layout.
pub struct Job {
    groups: Groups,
    config: Config,
    /// Where the config came from, for messages.
    source: String,
}

impl Job {
    /// Joins the job this process was started in: alone, rank 0 of 1; under `ds-rs launch`,
    /// torchrun, mpirun or srun, its place from the environment. The ds_config is the one
    /// the launcher passed (`ds-rs launch --config`, as DS_RS_CONFIG), else `config`: a
    /// file's path, or the JSON text itself.
    pub fn init(config: &str) -> Result<Job> {
        Job::join(&ds_comm::init_from_env()?, config)
    }

    /// As `init`, on a communicator the program made (ranks in threads, tests).
    pub fn join(comm: &Communicator, config: &str) -> Result<Job> {
        let launched = std::env::var("DS_RS_CONFIG").ok().filter(|c| !c.is_empty());
        let (doc, source) = read_config(launched.as_deref().unwrap_or(config))?;
        let named = |e: ds_config::ConfigError| EngineError::Invalid(format!("{source}: {e}"));
        let dims = ds_config::parallel_dims(&doc, comm.world_size(), None, None).map_err(named)?;
        let groups = Groups::new(comm, dims)?;
        let config = ds_config::resolve(&doc, &dims).map_err(named)?;
        Ok(Job {
            groups,
            config,
            source,
        })
    }

    /// The engine for `model` (built for this job's tensor-parallel group, `tp()`).
    pub fn initialize(&self, model: Model, opts: &EngineOptions) -> Result<Engine> {
        Engine::initialize(model, &self.config, &self.groups, opts)
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", self.source)))
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

    /// This process's rank in the whole job.
    pub fn rank(&self) -> usize {
        self.groups.world().rank()
    }
}

/// The ds_config from `config` (JSON text when it starts with `{`, else a file's path), and
/// its name for messages.
fn read_config(config: &str) -> Result<(ds_config::Value, String)> {
    if config.trim_start().starts_with('{') {
        let doc = ds_config::hjson::parse(config)
            .map_err(|e| EngineError::Invalid(format!("the program's ds_config: {e}")))?;
        return Ok((doc, "the program's ds_config".into()));
    }
    let path = Path::new(config);
    let doc = ds_config::load(path)?;
    Ok((doc, path.display().to_string()))
}
