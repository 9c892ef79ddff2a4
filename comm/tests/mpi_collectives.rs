//! The collective matrix of the built-in transport (common/matrix.rs), run over MPI: this
//! binary starts itself under `mpirun -np 2` and `-np 4`; each process is one rank of an MPI
//! job and runs every case on its communicator, checked element by element. A failing rank
//! panics, and mpirun ends the job with its message.

mod common;

use std::process::Command;
use std::time::Duration;

use common::matrix::{every_op, Ranks};
use ds_comm::{init, options_for, Backend, Communicator};

/// This process, one rank of the mpirun job.
struct MpiRank(Communicator);

impl Ranks for MpiRank {
    fn world(&self) -> usize {
        self.0.world_size()
    }
    fn run(&self, f: impl Fn(&Communicator) + Send + Sync + 'static) {
        f(&self.0)
    }
}

fn main() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return rank_main();
    }
    if Command::new("mpirun").arg("--version").output().is_err() {
        println!("mpi_collectives: skipped: no mpirun (scripts/install-mpi.sh installs OpenMPI)");
        return;
    }
    let me = std::env::current_exe().expect("this test's path");
    // OpenMPI's session directory, removed at the end (by default /tmp/ompi.<host>.<uid>).
    let session = std::env::temp_dir().join(format!("ds-rs-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&session).expect("a session directory");
    for np in [2, 4] {
        let status = Command::new("timeout")
            .args(["-k", "5", "300", "mpirun", "--oversubscribe"])
            .args(["-np", &np.to_string()])
            .arg(&me)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_orte_tmpdir_base", &session)
            .status()
            .expect("running mpirun");
        assert!(status.success(), "mpirun -np {np}: {status}");
        println!("mpi_collectives: mpirun -np {np}: every case passed on every rank");
    }
    let _ = std::fs::remove_dir_all(&session);
}

fn rank_main() {
    let mut opts = options_for(Backend::Mpi).expect("MPI's rank and world size");
    opts.timeout = Duration::from_secs(60);
    let comm = init(&opts).expect("joining the MPI job");
    assert_eq!(comm.backend(), Backend::Mpi);
    let rank = MpiRank(comm);
    every_op(&rank);
}
