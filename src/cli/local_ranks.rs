//! Whether this process is a rank of a job (the bench commands start their own ranks, with
//! `ds-rs launch`'s local path or mpirun, unless a launcher or scheduler already did), what
//! connects the ranks (`--dist_backend`) and where each computes (`--device`).

use std::process::{Command, ExitCode};

use anyhow::Context;
use ds_comm::Backend;
use ds_engine::device::DeviceChoice;

/// Whether this process is a rank of a job a launcher or scheduler started (torchrun, ds-rs
/// launch, OpenMPI, Slurm, Azure ML); a malformed rank environment counts, so that joining
/// reports it.
pub fn inside_job() -> bool {
    !matches!(ds_comm::env::RankEnv::from_env(), Ok(None))
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

/// Runs this same command line as `nproc` ranks on this host: under mpirun for the MPI
/// backend, else through `ds-rs launch`'s local path over `transport`.
pub fn start_ranks(nproc: usize, backend: Backend, transport: &str) -> anyhow::Result<ExitCode> {
    if backend != Backend::Mpi {
        return crate::launch::spawn_local(nproc, transport);
    }
    let exe = std::env::current_exe().context("locating the ds-rs executable")?;
    // --oversubscribe: the ranks asked for, even beyond mpirun's count of cores.
    let status = Command::new("mpirun")
        .args(["--oversubscribe", "-np", &nproc.max(1).to_string()])
        .arg(exe)
        .args(std::env::args_os().skip(1))
        .status()
        .context("--dist_backend mpi: running mpirun (scripts/install-mpi.sh installs OpenMPI)")?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    })
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
