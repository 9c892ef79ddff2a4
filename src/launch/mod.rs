//! `ds-rs launch`: DeepSpeed's launcher (deepspeed/launcher/runner.py and launch.py) for
//! ds-rs. The head reads the hosts, checks the config and the program, then either starts the
//! ranks of a one-host job itself or starts one node launcher per host, each of which starts
//! its host's ranks. Any failure stops the whole job; --max_restarts starts it again.

mod binding;
mod gang;
mod hosts;
mod per_node;
mod preflight;
mod relay;
mod remote;
pub mod signals;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context};

use gang::{Gang, Outcome, Spec};
use hosts::Host;
pub use hosts::Hosts;
use preflight::{check_config, check_train};
pub use preflight::{print_config_warnings, CONFIG_WARNED, MEMORY_CHECKED};
use relay::Sink;
use remote::{Launcher, Remote};
pub(crate) use signals::StopFlag;

/// DeepSpeed's default hostfile, used when it exists and no other is named.
const DEFAULT_HOSTFILE: &str = "/job/hostfile";
/// torchrun's and DeepSpeed's rendezvous port for multi-host jobs.
const DEFAULT_MASTER_PORT: u16 = 29500;
/// ds-rs subcommands that `launch` runs with this same executable.
const OWN_COMMANDS: [&str; 7] = [
    "train",
    "eval",
    "bench",
    "autotune",
    "estimate",
    "checkpoint",
    "config",
];

#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Hostfile of `hostname slots=N` lines (default: /job/hostfile if it exists, else this host).
    #[arg(short = 'H', long)]
    hostfile: Option<PathBuf>,
    /// Only these hosts/slots: NAME[:SLOT[,SLOT...]][@NAME...].
    #[arg(short = 'i', long, default_value = "")]
    include: String,
    /// All hosts/slots but these: NAME[:SLOT[,SLOT...]][@NAME...].
    #[arg(short = 'e', long, default_value = "")]
    exclude: String,
    /// Use the first N hosts.
    #[arg(long = "num_nodes", alias = "num-nodes")]
    num_nodes: Option<usize>,
    /// Ranks per host (GPUs; on CPU the same as --nproc_per_node).
    #[arg(long = "num_gpus", alias = "num-gpus")]
    num_gpus: Option<usize>,
    /// Ranks per host.
    #[arg(long = "nproc_per_node", alias = "nproc-per-node")]
    nproc_per_node: Option<usize>,
    /// Address of rank 0's host (default: 127.0.0.1 on one host, the first host otherwise).
    #[arg(long = "master_addr", alias = "master-addr")]
    master_addr: Option<String>,
    /// Rendezvous port (default: a free port on one host, 29500 on several).
    #[arg(long = "master_port", alias = "master-port")]
    master_port: Option<u16>,
    /// How to reach the other hosts. openmpi starts every rank with mpirun, on one host too,
    /// so that `train --dist_backend mpi` finds its MPI job.
    #[arg(long, value_enum, default_value = "ssh")]
    launcher: Launcher,
    /// The remote-exec command for --launcher ssh; {host} is replaced by the host name and
    /// the node's command line is appended as one argument.
    #[arg(long = "ssh_template", alias = "ssh-template", default_value = remote::SSH_TEMPLATE)]
    ssh_template: String,
    /// Start the remote-host path even for one host.
    #[arg(long = "force_multi", alias = "force-multi")]
    force_multi: bool,
    /// Restart the whole job up to this many times after a failure.
    #[arg(long = "max_restarts", alias = "max-restarts", default_value_t = 0)]
    max_restarts: u32,
    /// Also write each rank's output to DIR/rank{N}.log.
    #[arg(long = "log_dir", alias = "log-dir")]
    log_dir: Option<PathBuf>,
    /// Write each rank's output only to DIR/{time}_rank{N}.log, as DeepSpeed does.
    #[arg(long = "enable_each_rank_log", alias = "enable-each-rank-log")]
    enable_each_rank_log: Option<PathBuf>,
    /// Pass rank output through unchanged instead of prefixing each line with `[rankN]`.
    #[arg(long = "no_prefix", alias = "no-prefix")]
    no_prefix: bool,
    /// The ds_config every rank reads (passed as DS_RS_CONFIG).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Bind each local rank to its own contiguous share of the cores (and give it that many
    /// compute threads), as DeepSpeed's launcher does for CPU jobs.
    #[arg(long = "bind_cores_to_rank", alias = "bind-cores-to-rank")]
    bind_cores_to_rank: bool,
    /// The cores --bind_cores_to_rank shares out, e.g. 1,3-5,7 (default: all this host's).
    #[arg(
        long = "bind_core_list",
        alias = "bind-core-list",
        requires = "bind_cores_to_rank"
    )]
    bind_core_list: Option<String>,
    /// torchrun's per-node start: the job's number of nodes. Each node runs `ds-rs launch
    /// --nnodes N --node_rank R --master_addr A` itself (no ssh), as Kubernetes operators, Azure
    /// ML and clusters without ssh start jobs; node R starts ranks R*K .. R*K+K-1 of
    /// --nproc_per_node K.
    #[arg(long)]
    nnodes: Option<usize>,
    /// With --nnodes: this node's position, 0 to N-1 (node 0 holds rank 0, at --master_addr).
    #[arg(long = "node_rank", alias = "node-rank")]
    node_rank: Option<usize>,
    /// With --nnodes: the job's id, the same on every node (torchrun's --rdzv_id); it keeps
    /// ranks of other jobs at the same address out [default: DS_RS_JOB_TOKEN, else the
    /// scheduler's job id].
    #[arg(long = "rdzv_id", requires = "nnodes")]
    rdzv_id: Option<String>,
    /// Set by a head launcher: every host and its slots.
    #[arg(long = "world_info", alias = "world-info", hide = true)]
    world_info: Option<String>,
    /// Tune the configuration first (DeepSpeed's autotuner, driven by the config's
    /// `autotuning` section): `tune` writes the best to its results_dir, `run` then runs it.
    #[arg(long, value_enum)]
    pub(crate) autotuning: Option<crate::flags::AutotuneMode>,
    /// With --autotuning: the memory one rank may use, e.g. 2G (default: this host's RAM
    /// divided among its ranks); the memory model rules out what would not fit.
    #[arg(long = "memory_per_rank", alias = "memory-per-rank")]
    pub(crate) memory_per_rank: Option<String>,
    /// With --autotuning: seconds a trial may run before it is stopped and recorded as failed.
    #[arg(long = "trial_timeout", alias = "trial-timeout", default_value_t = 900)]
    pub(crate) trial_timeout: u64,
    /// `train [ARGS]`, another ds-rs command, or any program that embeds the engine.
    #[arg(required = true, trailing_var_arg = true)]
    pub(crate) program: Vec<String>,
}

impl LaunchArgs {
    /// For autotuning: the whole cluster (the hostfile after --include/--exclude), and the
    /// hosts and ranks per host one trial takes, where the user limited them.
    pub(crate) fn trial_shape(&self) -> anyhow::Result<(Hosts, Option<usize>, Option<usize>)> {
        let (hosts, per_node) = cluster(self)?;
        Ok((hosts, self.num_nodes, per_node))
    }

    /// For autotuning: the user's rendezvous address, the port trials start from, and the
    /// remote-exec template.
    pub(crate) fn rendezvous(&self) -> (Option<String>, u16, &str) {
        let port = self.master_port.unwrap_or(DEFAULT_MASTER_PORT);
        (self.master_addr.clone(), port, &self.ssh_template)
    }
}

pub fn run(args: &LaunchArgs) -> anyhow::Result<ExitCode> {
    let stop = StopFlag::on_signals()?;
    if let Some(nnodes) = args.nnodes {
        return per_node::run(args, nnodes, &stop);
    }
    if let (Some(node), None) = (args.node_rank, &args.world_info) {
        bail!(
            "--node_rank {node} needs --nnodes (torchrun's start on each node) or a multi-node \
             launch: give --hostfile on the head node, whose launcher starts each node's launcher"
        );
    }
    if let (Some(node), Some(info)) = (args.node_rank, &args.world_info) {
        // A node launcher: the head holds our stdin and closes it when it stops.
        stop.watch_stdin();
        let hosts = Hosts::from_spec(info).context("--world_info")?;
        let job = Job::new(args, hosts)?;
        return Ok(report(job.run_node(node, &stop)?, args));
    }
    let hosts = select_hosts(args)?;
    let job = Job::new(args, hosts)?;
    let mut attempt = 0;
    loop {
        let outcome = job.run_once(attempt, &stop)?;
        let failed = matches!(outcome, Outcome::Failed { .. });
        if failed && attempt < args.max_restarts && stop.get().is_none() {
            eprintln!(
                "{}; restarting the job ({} of {})",
                describe(&outcome),
                attempt + 1,
                args.max_restarts
            );
            attempt += 1;
            continue;
        }
        return Ok(report(outcome, args));
    }
}

/// Everything the ranks of every host need to know, fixed at the head.
struct Job<'a> {
    args: &'a LaunchArgs,
    hosts: Hosts,
    program: PathBuf,
    program_args: Vec<String>,
    config: Option<PathBuf>,
    master_addr: String,
    master_port: u16,
    /// The secret every rank of the job shares (None: a per-node start given no job id).
    token: Option<String>,
}

impl<'a> Job<'a> {
    fn new(args: &'a LaunchArgs, hosts: Hosts) -> anyhow::Result<Job<'a>> {
        let (program, program_args) = resolve_program(&args.program)?;
        let config = args.config.as_deref().map(absolute).transpose()?;
        // the head prints the config's warnings: node 0 of a per-node start
        let head = args.world_info.is_none() && args.node_rank.unwrap_or(0) == 0;
        let world = hosts.world_size();
        if args.program.first().is_some_and(|p| p == "train") {
            let node = args.node_rank.unwrap_or(0).min(hosts.0.len() - 1);
            let first = hosts.first_rank(node);
            let local = first..first + hosts.0[node].slots.len();
            check_train(&args.program, config.as_deref(), world, head, local)?;
        } else if let Some(c) = &config {
            check_config(c, world, head)?;
        }
        let multi = remote_path(args, &hosts);
        let master_addr = match &args.master_addr {
            Some(a) => a.clone(),
            None if multi => hosts.0[0].name.clone(),
            None => "127.0.0.1".into(),
        };
        let master_port = match args.master_port {
            Some(p) => p,
            None if multi => DEFAULT_MASTER_PORT,
            None => free_port()?,
        };
        let token = match std::env::var("DS_RS_JOB_TOKEN") {
            Ok(t) if args.world_info.is_some() => Some(t),
            _ if args.nnodes.is_some() => per_node::token(args),
            _ => Some(fresh_token()?),
        };
        Ok(Job {
            args,
            hosts,
            program,
            program_args,
            config,
            master_addr,
            master_port,
            token,
        })
    }

    fn run_once(&self, attempt: u32, stop: &StopFlag) -> anyhow::Result<Outcome> {
        if !remote_path(self.args, &self.hosts) {
            return self.run_node_attempt(0, attempt, stop);
        }
        let specs = self
            .remote()?
            .commands()?
            .into_iter()
            .map(|(who, command)| Spec {
                who,
                command,
                sink: Sink {
                    prefix: String::new(),
                    console: true,
                    log: None,
                },
                hold_stdin: true,
            });
        Gang::start(specs.collect())?.supervise(stop)
    }

    fn run_node(&self, node: usize, stop: &StopFlag) -> anyhow::Result<Outcome> {
        let attempt = std::env::var("DS_RS_RESTART_COUNT")
            .ok()
            .and_then(|c| c.parse().ok());
        self.run_node_attempt(node, attempt.unwrap_or(0), stop)
    }

    /// Starts this host's ranks and supervises them.
    fn run_node_attempt(
        &self,
        node: usize,
        attempt: u32,
        stop: &StopFlag,
    ) -> anyhow::Result<Outcome> {
        let host = self
            .hosts
            .0
            .get(node)
            .with_context(|| format!("--node_rank {node}: no such node"))?;
        let local = host.slots.len();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = (cores / local).max(1).to_string();
        let slots: Vec<String> = host.slots.iter().map(usize::to_string).collect();
        let binding = match self.args.bind_cores_to_rank {
            true => Some(binding::plan(self.args.bind_core_list.as_deref(), local)?),
            false => None,
        };
        let stamp = chrono_stamp();
        let mut specs = Vec::new();
        for local_rank in 0..local {
            let rank = self.hosts.first_rank(node) + local_rank;
            let mut cmd = Command::new(&self.program);
            cmd.args(&self.program_args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", local_rank.to_string())
                .env("WORLD_SIZE", self.hosts.world_size().to_string())
                .env("LOCAL_WORLD_SIZE", local.to_string())
                .env("NODE_RANK", node.to_string())
                .env("MASTER_ADDR", &self.master_addr)
                .env("MASTER_PORT", self.master_port.to_string())
                .env("DS_RS_RESTART_COUNT", attempt.to_string())
                .env(MEMORY_CHECKED, "1")
                .env("CUDA_VISIBLE_DEVICES", slots.join(","));
            if let Some(t) = &self.token {
                cmd.env("DS_RS_JOB_TOKEN", t);
            }
            // Each rank's compute threads get its share of the cores unless the user chose.
            for var in ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"] {
                if std::env::var_os(var).is_none() {
                    cmd.env(var, &threads);
                }
            }
            if let Some(cores) = &binding {
                binding::bind(&mut cmd, &cores[local_rank]);
            }
            if let Some(c) = &self.config {
                cmd.env("DS_RS_CONFIG", c).env(CONFIG_WARNED, c);
            }
            // Rank 0 may draw a progress bar: the relay keeps carriage returns intact.
            if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                cmd.env("DS_RS_TTY", "1");
            }
            specs.push(Spec {
                who: format!("rank {rank} on host {}", host.name),
                command: cmd,
                sink: self.sink(rank, &stamp)?,
                hold_stdin: false,
            });
        }
        Gang::start(specs)?.supervise(stop)
    }

    fn sink(&self, rank: usize, stamp: &str) -> anyhow::Result<Sink> {
        let (dir, name, console) = match (&self.args.enable_each_rank_log, &self.args.log_dir) {
            (Some(d), _) => (d, format!("{stamp}_rank{rank}.log"), false),
            (None, Some(d)) => (d, format!("rank{rank}.log"), true),
            (None, None) => {
                return Ok(Sink {
                    prefix: self.prefix(rank),
                    console: true,
                    log: None,
                })
            }
        };
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating log directory {}", dir.display()))?;
        let path = dir.join(name);
        let file =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Sink {
            prefix: self.prefix(rank),
            console,
            log: Some(std::sync::Arc::new(std::sync::Mutex::new(file))),
        })
    }

    fn prefix(&self, rank: usize) -> String {
        if self.args.no_prefix {
            String::new()
        } else {
            format!("[rank{rank}] ")
        }
    }

    fn remote(&self) -> anyhow::Result<Remote<'_>> {
        if self.args.bind_cores_to_rank
            && matches!(self.args.launcher, Launcher::Slurm | Launcher::Openmpi)
        {
            bail!(
                "--bind_cores_to_rank: with --launcher slurm or openmpi the scheduler starts the \
                 ranks; bind them with srun --cpu-bind or mpirun --bind-to"
            );
        }
        let exe = std::env::current_exe().context("locating the ds-rs executable")?;
        let exe = exe.to_string_lossy().into_owned();
        let mut env = remote::exported_env();
        env.retain(|(k, _)| {
            !["DS_RS_JOB_TOKEN", "DS_RS_CONFIG", CONFIG_WARNED].contains(&k.as_str())
        });
        if let Some(t) = &self.token {
            env.push(("DS_RS_JOB_TOKEN".into(), t.clone()));
        }
        if let Some(c) = &self.config {
            let c = c.to_string_lossy().into_owned();
            env.push(("DS_RS_CONFIG".into(), c.clone()));
            // A node launcher has no --config: its ranks inherit this from it.
            env.push((CONFIG_WARNED.into(), c));
        }
        let mut node_argv = vec![exe];
        node_argv.extend(["--world_info".into(), self.hosts.to_spec()]);
        node_argv.extend(["--master_addr".into(), self.master_addr.clone()]);
        node_argv.extend(["--master_port".into(), self.master_port.to_string()]);
        for (flag, dir) in [
            ("--log_dir", &self.args.log_dir),
            ("--enable_each_rank_log", &self.args.enable_each_rank_log),
        ] {
            if let Some(d) = dir {
                node_argv.extend([
                    flag.to_string(),
                    absolute(d)?.to_string_lossy().into_owned(),
                ]);
            }
        }
        if self.args.bind_cores_to_rank {
            node_argv.push("--bind_cores_to_rank".into());
        }
        if let Some(list) = &self.args.bind_core_list {
            node_argv.extend(["--bind_core_list".into(), list.clone()]);
        }
        node_argv.extend(self.args.program.iter().cloned());
        let mut rank_argv = vec![self.program.to_string_lossy().into_owned()];
        rank_argv.extend(self.program_args.iter().cloned());
        env.push(("MASTER_ADDR".into(), self.master_addr.clone()));
        env.push(("MASTER_PORT".into(), self.master_port.to_string()));
        Ok(Remote {
            launcher: self.args.launcher,
            ssh_template: &self.args.ssh_template,
            hosts: &self.hosts,
            env,
            node_argv,
            rank_argv,
        })
    }
}

/// The bench commands' --nproc: this same command line as `nproc` ranks on this host over
/// `transport`, their output passed through unchanged (rank 0 prints the report).
pub fn spawn_local(nproc: usize, transport: &str) -> anyhow::Result<ExitCode> {
    let mut words: Vec<String> = ["launch", "--no_prefix", "--nproc_per_node"]
        .map(String::from)
        .into();
    words.push(nproc.max(1).to_string());
    words.extend(std::env::args().skip(1));
    let (launch, _) = crate::flags::parse_args::<LaunchArgs>("launch", words).context("--nproc")?;
    // Inherited by the ranks; nothing else runs in this process yet.
    std::env::set_var("DS_RS_TRANSPORT", transport);
    run(&launch)
}

/// Whether the ranks start through the remote path (one launcher per host, or the scheduler's
/// command), rather than as children of this process.
fn remote_path(args: &LaunchArgs, hosts: &Hosts) -> bool {
    hosts.0.len() > 1 || args.force_multi || args.launcher == Launcher::Openmpi
}

/// The hosts after the hostfile, --include/--exclude and the per-node limits.
fn select_hosts(args: &LaunchArgs) -> anyhow::Result<Hosts> {
    let (hosts, per_node) = cluster(args)?;
    let hosts = hosts.limit(args.num_nodes, per_node);
    if hosts.world_size() == 0 {
        bail!("no slots left to run on after --include/--exclude/--num_nodes");
    }
    Ok(hosts)
}

/// The hostfile's hosts after --include/--exclude (this host alone without one), and the
/// ranks per host asked for.
fn cluster(args: &LaunchArgs) -> anyhow::Result<(Hosts, Option<usize>)> {
    let per_node = cluster_per_node(args)?;
    let hostfile = args.hostfile.clone().or_else(|| {
        Path::new(DEFAULT_HOSTFILE)
            .exists()
            .then(|| DEFAULT_HOSTFILE.into())
    });
    let mut hosts = match &hostfile {
        Some(path) => Hosts::from_hostfile(path)?,
        None if args.launcher == Launcher::Slurm => slurm_hosts(per_node.unwrap_or(1))?,
        None => Hosts::single("localhost", per_node.unwrap_or(1)),
    };
    if !args.include.is_empty() && !args.exclude.is_empty() {
        bail!("--include and --exclude are mutually exclusive");
    }
    if !args.include.is_empty() {
        hosts = hosts.include(&args.include)?;
    } else if !args.exclude.is_empty() {
        hosts = hosts.exclude(&args.exclude)?;
    }
    Ok((hosts, per_node))
}

/// The ranks per host asked for (--num_gpus or --nproc_per_node).
fn cluster_per_node(args: &LaunchArgs) -> anyhow::Result<Option<usize>> {
    let per_node = match (args.num_gpus, args.nproc_per_node) {
        (Some(a), Some(b)) if a != b => bail!("--num_gpus {a} and --nproc_per_node {b} disagree"),
        (a, b) => a.or(b),
    };
    if per_node == Some(0) || args.num_nodes == Some(0) {
        bail!("--num_gpus, --nproc_per_node and --num_nodes must be at least 1");
    }
    Ok(per_node)
}

/// `--launcher slurm` without a hostfile: the allocation's nodes, as Slurm names them
/// (SLURM_JOB_NODELIST, ranges like `node[01-04,07]`), `slots` ranks each.
fn slurm_hosts(slots: usize) -> anyhow::Result<Hosts> {
    let (var, list) = ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
        .into_iter()
        .find_map(|v| Some((v, std::env::var(v).ok().filter(|l| !l.is_empty())?)))
        .context(
            "--launcher slurm without --hostfile takes the nodes from SLURM_JOB_NODELIST, which \
             is not set: run inside an allocation (salloc, sbatch), or give --hostfile",
        )?;
    let names = ds_comm::env::expand_hostlist(&list)
        .map_err(|why| anyhow::anyhow!("{var}={list:?}: {why}"))?;
    Ok(Hosts(
        names
            .into_iter()
            .map(|name| Host {
                name,
                slots: (0..slots).collect(),
            })
            .collect(),
    ))
}

/// `train ...` and the other ds-rs commands run this executable; anything else is a program
/// that must exist now, so that a typo fails once here rather than once per rank.
fn resolve_program(words: &[String]) -> anyhow::Result<(PathBuf, Vec<String>)> {
    let first = words
        .first()
        .context("no program given: expected `train [ARGS]` or a program")?;
    if OWN_COMMANDS.contains(&first.as_str()) {
        let exe = std::env::current_exe().context("locating the ds-rs executable")?;
        return Ok((exe, words.to_vec()));
    }
    let path = which(first).with_context(|| {
        format!(
            "program {first:?} not found: expected a ds-rs command ({}) or an executable",
            OWN_COMMANDS.join(", ")
        )
    })?;
    Ok((path, words[1..].to_vec()))
}

fn which(program: &str) -> Option<PathBuf> {
    let is_exec = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = PathBuf::from(program);
        return is_exec(&p).then(|| absolute(&p).unwrap_or(p));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| is_exec(p))
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))
}

fn free_port() -> anyhow::Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .context("finding a free port for the rendezvous")
}

/// The job's shared secret: 128 random bits.
fn fresh_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Seconds since the epoch, for log file names that do not overwrite an earlier run's.
fn chrono_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    secs.to_string()
}

fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Done => "the job finished".into(),
        Outcome::Failed { who, how, .. } => format!("{who} {how}"),
        Outcome::Stopped { signal } => format!("stopped by {}", signals::name(*signal)),
    }
}

/// One line on how the job ended, and the launcher's exit status.
fn report(outcome: Outcome, args: &LaunchArgs) -> ExitCode {
    let whole = if args.world_info.is_some() {
        "this host's ranks"
    } else {
        "the job"
    };
    match &outcome {
        Outcome::Done => ExitCode::SUCCESS,
        Outcome::Failed { code, .. } => {
            eprintln!("error: {}; stopped {whole}", describe(&outcome));
            ExitCode::from(*code)
        }
        Outcome::Stopped { signal } => {
            eprintln!("error: launcher {}; stopped {whole}", describe(&outcome));
            ExitCode::from((128 + signal).min(255) as u8)
        }
    }
}
