//! Runs this same command as N local ranks: each a child process with the rank environment
//! of DESIGN.md (RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_ADDR/PORT) and a fresh job token.
//! If one rank fails, the others are stopped; nothing outlives the parent's deadline.

use anyhow::{bail, Context};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

/// How long the local ranks may run in all before they are stopped.
const JOB_LIMIT: Duration = Duration::from_secs(3600);

/// Whether this process is a rank of a job a launcher or scheduler started (torchrun, ds-rs
/// launch, OpenMPI, Slurm, Azure ML); a malformed rank environment counts, so that joining
/// reports it.
pub fn inside_job() -> bool {
    !matches!(ds_comm::env::RankEnv::from_env(), Ok(None))
}

pub fn spawn_local(nproc: usize, transport: &str) -> anyhow::Result<ExitCode> {
    if nproc == 0 {
        bail!("--nproc must be at least 1");
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free port for the rendezvous")?
        .port();
    let token = fresh_token()?;
    let exe = std::env::current_exe().context("locating the ds-rs executable")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Each rank gets its share of the cores for its compute threads (rayon: candle's matmul
    // and the optimizer), unless the user chose.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads =
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| (cores / nproc).max(1).to_string());
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..nproc {
        let child = Command::new(&exe)
            .args(&args)
            .env("RAYON_NUM_THREADS", &threads)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("NODE_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("DS_RS_JOB_TOKEN", &token)
            .env("DS_RS_TRANSPORT", transport)
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                stop(&mut children);
                return Err(e).context(format!("starting rank {rank}"));
            }
        }
    }
    wait_all(children)
}

fn fresh_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Waits for every rank; the first failure stops the rest and is reported.
fn wait_all(mut children: Vec<Child>) -> anyhow::Result<ExitCode> {
    let deadline = Instant::now() + JOB_LIMIT;
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for rank in 0..children.len() {
            if done[rank] {
                continue;
            }
            if let Some(status) = children[rank].try_wait().context("waiting for a rank")? {
                done[rank] = true;
                if !status.success() {
                    stop(&mut children);
                    bail!("rank {rank} failed ({status}); stopped the other ranks");
                }
            }
        }
        if Instant::now() >= deadline {
            stop(&mut children);
            bail!("the ranks ran past {}s; stopped them", JOB_LIMIT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(ExitCode::SUCCESS)
}

fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
    }
    for c in children.iter_mut() {
        let _ = c.wait();
    }
}
