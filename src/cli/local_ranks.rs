//! Whether this process is a rank of a job (the bench commands start their own ranks, with
//! `ds-rs launch`'s local path or mpirun, unless a launcher or scheduler already did), and what
//! connects the ranks (`--dist_backend`).

use ds_comm::Backend;

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
    /// started by mpirun (built with --features mpi); nccl: GPU builds.
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
