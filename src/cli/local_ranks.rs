//! Whether this process is a rank of a job: the bench commands start their own ranks
//! (`ds-rs launch`'s local path) unless a launcher or scheduler already did.

/// Whether this process is a rank of a job a launcher or scheduler started (torchrun, ds-rs
/// launch, OpenMPI, Slurm, Azure ML); a malformed rank environment counts, so that joining
/// reports it.
pub fn inside_job() -> bool {
    !matches!(ds_comm::env::RankEnv::from_env(), Ok(None))
}
