//! Whether this process is a rank of a job (the bench commands start their own ranks, with
//! `ds-rs launch`'s local path or mpirun, unless a launcher or scheduler already did).

use std::process::{Command, ExitCode};

use anyhow::Context;
use ds_comm::Backend;

/// Whether this process is a rank of a job a launcher or scheduler started (torchrun, ds-rs
/// launch, OpenMPI, Slurm, Azure ML); a malformed rank environment counts, so that joining
/// reports it.
pub fn inside_job() -> bool {
    !matches!(ds_comm::env::RankEnv::from_env(), Ok(None))
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
