//! The flags several commands share, in one place: `--dist_backend`, `--device`, the parallel
//! degrees, Hugging Face's training arguments, `--autotuning`. A command's own flags live with the command.

mod layout;
mod training_args;

use ds_comm::Backend;
use ds_engine::device::DeviceChoice;

pub(crate) use layout::LayoutArgs;
pub(crate) use training_args::TrainingArgsCli;

/// `--autotuning`: tune only, or tune and then run the best configuration.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutotuneMode {
    Tune,
    Run,
}

/// `--dist_backend`, DeepSpeed's name for what moves the data between ranks.
#[derive(clap::Args, Debug, Clone)]
pub struct BackendArg {
    /// ds: the built-in shared memory and TCP transport; mpi: MPI's collectives, in a job
    /// started by mpirun (built with --features mpi); nccl: collectives on GPU memory through
    /// NCCL, the rest over the built-in transport (the cuda build, --device cuda).
    #[arg(
        long = "dist_backend",
        alias = "dist-backend",
        env = ds_comm::BACKEND_VAR,
        default_value = "ds",
        value_parser = parse_backend
    )]
    pub dist_backend: Backend,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    let b = Backend::parse(s).map_err(|e| e.to_string())?;
    b.check_built().map_err(|e| e.to_string())?;
    Ok(b)
}

/// `--device`: where this rank's layers compute.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArg {
    /// cpu, cuda (the GPU LOCAL_RANK names) or cuda:N. Default: cuda in a build with the cuda
    /// feature that sees a GPU, else cpu.
    #[arg(long, value_parser = DeviceChoice::parse)]
    pub device: Option<DeviceChoice>,
}

impl DeviceArg {
    fn choice(&self) -> DeviceChoice {
        self.device.unwrap_or_else(DeviceChoice::default_for_build)
    }

    pub fn open(&self) -> anyhow::Result<ds_engine::Device> {
        Ok(self.choice().open(local_rank())?)
    }

    /// The GPU this rank computes on (None on the CPU): where `--dist_backend nccl` runs.
    pub fn gpu_ordinal(&self) -> Option<usize> {
        match self.choice() {
            DeviceChoice::Cpu => None,
            DeviceChoice::Cuda(n) => Some(n.unwrap_or_else(local_rank)),
        }
    }
}

/// This rank's index on its host (0 outside a job).
fn local_rank() -> usize {
    match ds_comm::env::RankEnv::from_env() {
        Ok(Some(e)) => e.local_rank,
        _ => 0,
    }
}
