//! ds-comm: how the ranks of a ds-rs job find each other and move data.
//!
//! - [`init`] / [`init_from_env`]: rendezvous through a key-value [`store`] hosted by rank 0,
//!   then persistent links between every pair of ranks (shared memory within a host, TCP
//!   between hosts).
//! - [`Communicator`] and [`Group`]: all_reduce, reduce_scatter, all_gather, broadcast,
//!   send/recv and barrier on f32, bf16 and f16, blocking or async, on the world, any
//!   sub-group, or the groups of a 3D [`topology`].
//! - [`Backend`] (`--dist_backend`): those collectives over the built-in links, or (feature
//!   `mpi`) as MPI's own, in a job `mpirun` started.
//! - [`logger`]: DeepSpeed's comms logger. `nccl` (feature): the same collectives on GPUs.

mod algo;
mod backend;
mod convert;
pub mod dtype;
pub mod env;
pub mod error;
mod exchange;
mod frame;
mod group;
mod link;
pub mod logger;
mod mesh;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nccl")]
mod nccl_net;
mod parallel;
pub mod store;
pub mod testkit;
pub mod topology;

pub use backend::{Backend, BACKEND_VAR};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use group::{Communicator, Group, Work, DEFAULT_TIMEOUT};
pub use mesh::Transport;
pub use parallel::{ExpertGroups, Groups};

use backend::Net;
use ds_config::monitor::CommsLoggerConfig;
use group::Parts;
use link::Links;
use logger::CommsLogger;
use std::time::Duration;
use store::{StoreClient, StoreServer};

/// Where this rank stands in the job and how to reach the others.
#[derive(Debug, Clone)]
pub struct InitOptions {
    pub rank: usize,
    pub world_size: usize,
    /// Host name or address of rank 0's store.
    pub master_addr: String,
    pub master_port: u16,
    /// Rank 0 starts the store itself (false when the caller hosts one, as tests do).
    pub host_store: bool,
    /// The job's secret; the store and the peers refuse connections without it.
    pub token: Option<String>,
    /// How long any wait (rendezvous or collective) may take before it fails.
    pub timeout: Duration,
    pub transport: Transport,
    pub comms_logger: Option<CommsLoggerConfig>,
    /// What moves the data: the built-in transport, or MPI (rank and world size are then
    /// MPI_COMM_WORLD's; the addresses, token and transport go unused), or NCCL for GPU
    /// memory beside the built-in transport.
    pub backend: Backend,
    /// The GPU this rank computes on (`--device`): where NCCL runs.
    pub gpu: Option<usize>,
}

impl InitOptions {
    pub fn new(rank: usize, world_size: usize, master_addr: &str, master_port: u16) -> InitOptions {
        InitOptions {
            rank,
            world_size,
            master_addr: master_addr.to_string(),
            master_port,
            host_store: true,
            token: None,
            timeout: DEFAULT_TIMEOUT,
            transport: Transport::Auto,
            comms_logger: None,
            backend: Backend::Ds,
            gpu: None,
        }
    }
}

/// Joins the job: rendezvous, then connections to every other rank.
pub fn init(opts: &InitOptions) -> Result<Communicator> {
    if opts.world_size == 0 || opts.rank >= opts.world_size {
        return Err(CommError::Env(format!(
            "rank {} is not within world size {}",
            opts.rank, opts.world_size
        )));
    }
    let logger = opts
        .comms_logger
        .as_ref()
        .filter(|c| c.enabled)
        .map(|c| CommsLogger::new(c).with_rank(opts.rank));
    opts.backend.check_built()?;
    #[cfg(feature = "mpi")]
    if opts.backend == Backend::Mpi {
        return init_mpi(opts, logger);
    }
    if opts.world_size == 1 {
        let links = Links { links: vec![None] };
        let parts = Parts {
            rank: 0,
            world: 1,
            timeout: opts.timeout,
            net: net(opts, links)?,
            logger,
            store: None,
            server: None,
        };
        return Ok(Communicator::new(parts));
    }
    let master = format!("{}:{}", opts.master_addr, opts.master_port);
    let token = opts.token.as_deref();
    let server = match opts.host_store && opts.rank == 0 {
        true => Some(StoreServer::bind(
            bind_addr(&opts.master_addr, opts.master_port),
            token,
        )?),
        false => None,
    };
    let store = StoreClient::connect(&master, token, opts.timeout)?;
    let spec = mesh::MeshSpec {
        rank: opts.rank,
        world: opts.world_size,
        token: token.unwrap_or(""),
        transport: opts.transport,
        timeout: opts.timeout,
    };
    let links = mesh::connect_mesh(&store, &spec, &master)?;
    let parts = Parts {
        rank: opts.rank,
        world: opts.world_size,
        timeout: opts.timeout,
        net: net(opts, links)?,
        logger,
        store: Some(store),
        server,
    };
    let comm = Communicator::new(parts);
    // Nobody leaves the rendezvous (and rank 0 keeps its store) until everyone is connected.
    comm.world().barrier()?;
    Ok(comm)
}

/// What moves a rank's data: the built-in links, with NCCL beside them for GPU memory under
/// `--dist_backend nccl` (nccl_net.rs).
fn net(opts: &InitOptions, links: Links) -> Result<Net> {
    #[cfg(feature = "nccl")]
    if opts.backend == Backend::Nccl {
        let gpu = opts.gpu.ok_or_else(|| {
            CommError::Env(
                "dist_backend nccl: this rank computes on the CPU; NCCL needs a GPU \
                 (--device cuda, in the cuda build)"
                    .into(),
            )
        })?;
        let nccl = nccl_net::NcclNet::new(gpu, opts.timeout)?;
        return Ok(Net::Nccl(links.into(), nccl));
    }
    let _ = &opts.gpu;
    Ok(Net::Links(links.into()))
}

/// Joins the MPI job this process was started in (by `mpirun`, or alone as a singleton).
#[cfg(feature = "mpi")]
fn init_mpi(opts: &InitOptions, logger: Option<CommsLogger>) -> Result<Communicator> {
    let world = mpi_backend::take_world(opts.timeout)?;
    if (world.rank, world.size) != (opts.rank, opts.world_size) {
        return Err(CommError::Env(format!(
            "rank {} of {} asked for, MPI placed this process as rank {} of {}",
            opts.rank, opts.world_size, world.rank, world.size
        )));
    }
    let comm = Communicator::new(Parts {
        rank: world.rank,
        world: world.size,
        timeout: opts.timeout,
        net: Net::Mpi(world),
        logger,
        store: None,
        server: None,
    });
    comm.world().barrier()?;
    Ok(comm)
}

/// The store listens on the master address when it is local, else on every interface.
fn bind_addr(master: &str, port: u16) -> String {
    match std::net::TcpListener::bind((master, 0)) {
        Ok(_) => format!("{master}:{port}"),
        Err(_) => format!("0.0.0.0:{port}"),
    }
}

/// Variable naming how long any wait may take, in seconds (default 300).
pub const TIMEOUT_VAR: &str = "DS_RS_COMM_TIMEOUT";
/// Variable forcing the transport: `tcp` or `auto`.
pub const TRANSPORT_VAR: &str = "DS_RS_TRANSPORT";

/// Joins the job the environment describes (torchrun, the ds-rs launcher, OpenMPI, Slurm,
/// Azure ML, TF_CONFIG) over the backend `DS_RS_DIST_BACKEND` names; a process with no such
/// environment is a job of one rank.
pub fn init_from_env() -> Result<Communicator> {
    init(&options_from_env()?)
}

/// The options [`init_from_env`] uses, for a caller to adjust (transport, comms logger).
pub fn options_from_env() -> Result<InitOptions> {
    options_for(Backend::from_env()?)
}

/// The options of this process's place in the job over `backend`: under MPI, MPI's own
/// (initialising MPI); otherwise the rank environment's.
pub fn options_for(backend: Backend) -> Result<InitOptions> {
    backend.check_built()?;
    let get = |k: &str| std::env::var(k).ok();
    #[cfg(feature = "mpi")]
    if backend == Backend::Mpi {
        let (rank, world) = mpi_backend::place()?;
        check_mpi_place(rank, world)?;
        let mut opts = InitOptions::new(rank, world, "", 0);
        opts.backend = backend;
        opts.timeout = timeout_from_env(&get)?.unwrap_or(opts.timeout);
        return Ok(opts);
    }
    let env = env::RankEnv::from_env().map_err(|e| CommError::Env(e.to_string()))?;
    let mut opts = match env {
        Some(e) => InitOptions::new(e.rank, e.world_size, &e.master_addr, e.master_port),
        None => InitOptions::new(0, 1, "127.0.0.1", env::DEFAULT_MASTER_PORT),
    };
    opts.token = env::job_token(&get);
    opts.transport = match get(TRANSPORT_VAR).as_deref() {
        None | Some("auto") | Some("") => Transport::Auto,
        Some("tcp") => Transport::Tcp,
        Some(other) => {
            return Err(CommError::Env(format!(
                "{TRANSPORT_VAR}={other:?}: expected \"tcp\" or \"auto\""
            )))
        }
    };
    opts.timeout = timeout_from_env(&get)?.unwrap_or(opts.timeout);
    if opts.token.is_none() && opts.world_size > 1 && !is_loopback(&opts.master_addr) {
        eprintln!("warning: no job token (DS_RS_JOB_TOKEN): any host that reaches {}:{} can join this job", opts.master_addr, opts.master_port);
    }
    opts.backend = backend;
    Ok(opts)
}

/// A process that another launcher placed (torchrun's or ds-rs launch's variables) but MPI
/// did not: MPI then sees a job of one, and training alone would look like success.
#[cfg(feature = "mpi")]
fn check_mpi_place(rank: usize, world: usize) -> Result<()> {
    let Ok(Some(e)) = env::RankEnv::from_env() else {
        return Ok(());
    };
    if (e.rank, e.world_size) == (rank, world) {
        return Ok(());
    }
    Err(CommError::Env(format!(
        "dist_backend mpi: the environment ({:?}) makes this process rank {} of {}, MPI \
         makes it rank {rank} of {world}: start the job with mpirun (or `ds-rs launch \
         --launcher openmpi`), whose ranks MPI knows",
        e.source, e.rank, e.world_size
    )))
}

/// `DS_RS_COMM_TIMEOUT`, when set.
fn timeout_from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Duration>> {
    let Some(raw) = get(TIMEOUT_VAR) else {
        return Ok(None);
    };
    let secs: f64 = raw
        .trim()
        .parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s > 0.0)
        .ok_or_else(|| {
            CommError::Env(format!(
                "{TIMEOUT_VAR}={raw:?}: expected a positive number of seconds"
            ))
        })?;
    Ok(Some(Duration::from_secs_f64(secs)))
}

fn is_loopback(host: &str) -> bool {
    use std::net::ToSocketAddrs;
    (host, 0)
        .to_socket_addrs()
        .map(|mut a| a.all(|a| a.ip().is_loopback()))
        .unwrap_or(false)
}
