//! Where this process sits in a distributed job, read from the environment.
//!
//! Every common launcher already tells its processes their rank, the job size
//! and where to meet; reading those variables directly means a job started by
//! torchrun, DeepSpeed's launcher, OpenMPI's `mpirun`, Slurm's `srun` or Azure
//! ML needs no wrapper script that translates them.
//!
//! Sources are tried in DeepSpeed's order (`deepspeed.comm.init_distributed`):
//! explicit torchrun-style variables first, then the MPI environment (Azure ML's
//! flavour of it when running inside Azure ML), then TensorFlow's `TF_CONFIG` (Azure
//! ML's TensorFlow distribution; DeepSpeed does not read it), and Slurm last, because
//! `mpirun` inside a Slurm allocation leaves the allocation's `SLURM_*` variables behind.
//! Within every source, `MASTER_ADDR` and `MASTER_PORT` win over anything the
//! scheduler suggests, so a user can always pin the rendezvous point.

mod tf_config;

/// The port torchrun and DeepSpeed use when nothing else names one.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Master of a job that fits on one node: loopback needs no name resolution.
const LOCALHOST: &str = "127.0.0.1";

/// DeepSpeed's port for multi-node Azure ML MPI jobs
/// (`patch_aml_env_for_torch_nccl_backend(master_port=6105)`).
const AML_MULTI_NODE_PORT: u16 = 6105;

/// DeepSpeed's `DEFAULT_AML_MASTER_PORT`, used by single-node Azure ML jobs.
const AML_SINGLE_NODE_PORT: u16 = 54965;

/// Upper bound on an expanded Slurm hostlist, so that a malformed range such as
/// `n[0-99999999999]` fails cleanly instead of exhausting memory.
const MAX_HOSTS: usize = 1 << 16;

/// Which launcher's variables described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// `RANK`/`WORLD_SIZE` and friends: torchrun, DeepSpeed's launcher, Azure ML's
    /// PyTorch distribution, or a user exporting them by hand.
    Torchrun,
    /// `OMPI_COMM_WORLD_*` from OpenMPI's `mpirun`.
    OpenMpi,
    /// OpenMPI ranks inside Azure ML, with the master from `AZ_BATCH*` variables.
    AzureMlMpi,
    /// TensorFlow's `TF_CONFIG`: Azure ML's TensorFlow distribution.
    TfConfig,
    /// `SLURM_*` from an `srun` task.
    Slurm,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub source: EnvSource,
}

/// A variable that is missing, malformed or inconsistent with another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("{var} is not set, but {reason}")]
    Missing { var: &'static str, reason: String },
    #[error("{var}={value:?} is invalid: expected {expected}")]
    Invalid {
        var: &'static str,
        value: String,
        expected: String,
    },
    #[error("{var}={value} is out of range: expected a value below {bound_var}={bound}")]
    OutOfRange {
        var: &'static str,
        value: usize,
        bound_var: &'static str,
        bound: usize,
    },
    #[error(
        "{local_var}={local} exceeds {world_var}={world}: expected no more processes on one node than in the whole job"
    )]
    LocalExceedsWorld {
        local_var: &'static str,
        local: usize,
        world_var: &'static str,
        world: usize,
    },
    #[error(
        "MASTER_ADDR is not set and {hint}, but the job spans several nodes ({world_var}={world}, {local_var}={local}): expected MASTER_ADDR=<host of rank 0>"
    )]
    NoMasterAddr {
        hint: &'static str,
        world_var: &'static str,
        world: usize,
        local_var: &'static str,
        local: usize,
    },
}

impl RankEnv {
    /// None when the environment describes no distributed job (a plain single process).
    pub fn from_env() -> Result<Option<RankEnv>, EnvError> {
        // A value that is not UTF-8 is passed on lossily, so that it fails parsing
        // with a message instead of silently counting as unset.
        Self::from_vars(&|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Same, reading variables through `get` (for tests).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<RankEnv>, EnvError> {
        let vars = Vars { get };
        // Half a torchrun environment means some launcher meant to set it and
        // failed; guessing from other variables could disagree with the peers.
        match (vars.raw("RANK"), vars.raw("WORLD_SIZE")) {
            (Some(_), Some(_)) => return torchrun(&vars).map(Some),
            (Some(rank), None) => return Err(half_torchrun("WORLD_SIZE", "RANK", &rank)),
            (None, Some(world)) => return Err(half_torchrun("RANK", "WORLD_SIZE", &world)),
            (None, None) => {}
        }
        if vars.any(&["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]) {
            // DeepSpeed: `in_aml() and not in_dlts()`; DLTS clusters also set the
            // Azure ML marker but use plain MPI discovery.
            return if vars.any(&["AZUREML_EXPERIMENT_ID"]) && !vars.any(&["DLTS_JOB_ID"]) {
                azure_ml_mpi(&vars).map(Some)
            } else {
                open_mpi(&vars).map(Some)
            };
        }
        if let Some(text) = vars.raw("TF_CONFIG") {
            return tf(&vars, &text).map(Some);
        }
        if vars.any(&["SLURM_PROCID"]) {
            return slurm(&vars).map(Some);
        }
        Ok(None)
    }
}

/// The secret that the job's store and peers check: DS_RS_JOB_TOKEN, else a scheduler job id
/// (TORCHELASTIC_RUN_ID, SLURM_JOB_ID + SLURM_STEP_ID, OMPI_MCA_ess_base_jobid, AZUREML_RUN_ID), else None.
pub fn job_token(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let vars = Vars { get };
    vars.raw("DS_RS_JOB_TOKEN")
        // torchrun fills in "none" when no --rdzv-id was given: every job shares
        // it, so it identifies nothing.
        .or_else(|| vars.raw("TORCHELASTIC_RUN_ID").filter(|id| id != "none"))
        .or_else(|| slurm_job_step(&vars))
        .or_else(|| vars.raw("OMPI_MCA_ess_base_jobid"))
        .or_else(|| vars.raw("AZUREML_RUN_ID"))
}

/// Several `srun` steps of one allocation share the job id, so the step id is
/// what tells them apart.
fn slurm_job_step(vars: &Vars) -> Option<String> {
    let job = vars.raw("SLURM_JOB_ID")?;
    Some(match vars.raw("SLURM_STEP_ID") {
        Some(step) => format!("{job}.{step}"),
        None => job,
    })
}

fn half_torchrun(missing: &'static str, present: &str, value: &str) -> EnvError {
    EnvError::Missing {
        var: missing,
        reason: format!("{present}={value:?} is set: a torchrun-style launch sets both"),
    }
}

/// torchrun, DeepSpeed's launcher and Azure ML's PyTorch distribution.
fn torchrun(vars: &Vars) -> Result<RankEnv, EnvError> {
    let rank = vars.require("RANK", "torchrun-style launches set it")?;
    let world = vars.require("WORLD_SIZE", "torchrun-style launches set it")?;
    let local_rank = vars.count("LOCAL_RANK")?.unwrap_or(rank);
    // GROUP_RANK is torchrun's name, CROSS_RANK and LOCAL_SIZE DeepSpeed's launcher's.
    let node_rank = vars.first_count(&["NODE_RANK", "GROUP_RANK", "CROSS_RANK"])?;
    let local_world = match (
        vars.first_count(&["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])?,
        node_rank,
    ) {
        (Some(local_world), _) => local_world,
        (None, None) => world,
        // A node rank hints at several nodes, so the whole world need not be local.
        (None, Some(node)) => {
            return Err(EnvError::Missing {
                var: "LOCAL_WORLD_SIZE",
                reason: format!(
                    "{}={} is set, so the job may span nodes and the number of processes on this one is unknown",
                    node.var, node.value
                ),
            });
        }
    };
    let layout = Layout::new(rank, world, local_rank, local_world, node_rank)?;
    let master = Master {
        scheduler_addr: None,
        default_port: DEFAULT_MASTER_PORT,
        hint: "no other variable names the master",
    };
    master.resolve(vars, layout, EnvSource::Torchrun)
}

/// The four counts OpenMPI exports to every process it starts.
fn open_mpi_layout(vars: &Vars) -> Result<Layout, EnvError> {
    const WHY: &str = "OpenMPI sets it for every process it starts";
    let rank = vars.require("OMPI_COMM_WORLD_RANK", WHY)?;
    let world = vars.require("OMPI_COMM_WORLD_SIZE", WHY)?;
    let local_rank = vars.require("OMPI_COMM_WORLD_LOCAL_RANK", WHY)?;
    let local_world = vars.require("OMPI_COMM_WORLD_LOCAL_SIZE", WHY)?;
    // OMPI_COMM_WORLD_NODE_RANK is not the node's index but this process's rank
    // among all jobs on the node, so the node rank is derived (exact for
    // mpirun's default by-slot mapping with the same count on every node).
    Layout::new(rank, world, local_rank, local_world, None)
}

/// Plain `mpirun`: OpenMPI names no master, so DeepSpeed asks rank 0 over MPI;
/// without MPI that must come from MASTER_ADDR (or loopback on one node).
fn open_mpi(vars: &Vars) -> Result<RankEnv, EnvError> {
    let layout = open_mpi_layout(vars)?;
    let master = Master {
        scheduler_addr: None,
        default_port: DEFAULT_MASTER_PORT,
        hint: "OpenMPI exports no master address",
    };
    master.resolve(vars, layout, EnvSource::OpenMpi)
}

/// Azure ML's MPI distribution, as DeepSpeed's `patch_aml_env_for_torch_nccl_backend`.
fn azure_ml_mpi(vars: &Vars) -> Result<RankEnv, EnvError> {
    let layout = open_mpi_layout(vars)?;
    let master = if layout.is_multi_node() {
        Master {
            scheduler_addr: az_batch_master_host(vars)?,
            default_port: AML_MULTI_NODE_PORT,
            hint: "AZ_BATCH_MASTER_NODE is not set either",
        }
    } else {
        Master {
            scheduler_addr: vars.raw("AZ_BATCHAI_MPI_MASTER_NODE"),
            default_port: AML_SINGLE_NODE_PORT,
            hint: "AZ_BATCHAI_MPI_MASTER_NODE is not set either",
        }
    };
    master.resolve(vars, layout, EnvSource::AzureMlMpi)
}

/// The host of AZ_BATCH_MASTER_NODE ("ip:port"). Its port belongs to Azure
/// Batch's own MPI setup, which is why DeepSpeed does not reuse it.
fn az_batch_master_host(vars: &Vars) -> Result<Option<String>, EnvError> {
    const VAR: &str = "AZ_BATCH_MASTER_NODE";
    let Some(value) = vars.raw(VAR) else {
        return Ok(None);
    };
    match value.split(':').next() {
        Some(host) if !host.is_empty() => Ok(Some(host.to_string())),
        _ => Err(invalid(VAR, &value, "\"host:port\" with a non-empty host")),
    }
}

/// A TensorFlow worker: the rendezvous at worker 0's "host:port" unless MASTER_* say otherwise.
fn tf(vars: &Vars, text: &str) -> Result<RankEnv, EnvError> {
    let (layout, host, port) = tf_config::read(text)?;
    let master = Master {
        scheduler_addr: Some(host),
        default_port: port,
        hint: "TF_CONFIG names worker 0",
    };
    master.resolve(vars, layout, EnvSource::TfConfig)
}

/// An `srun` task. Step-level variables come first: they describe the tasks of
/// this step, while the job-level ones describe the whole allocation (and
/// `srun --preserve-env` leaves the job's SLURM_NTASKS in place).
fn slurm(vars: &Vars) -> Result<RankEnv, EnvError> {
    const WHY: &str = "SLURM_PROCID is set, so srun should have set it too";
    let rank = vars.require("SLURM_PROCID", WHY)?;
    let world = vars
        .first_count(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"])?
        .ok_or_else(|| EnvError::Missing {
            var: "SLURM_NTASKS",
            reason: format!("{WHY} (SLURM_STEP_NUM_TASKS and SLURM_NPROCS are unset as well)"),
        })?;
    let local_rank = vars.require("SLURM_LOCALID", WHY)?;
    let node = vars.require("SLURM_NODEID", WHY)?;
    let local_world = slurm_tasks_on_node(vars, node)?;
    let layout = Layout::new(rank, world, local_rank, local_world, Some(node))?;
    // On one node loopback is enough; the nodelist is read only when needed.
    let scheduler_addr = if layout.is_multi_node() {
        slurm_first_host(vars)?
    } else {
        None
    };
    let master = Master {
        scheduler_addr,
        default_port: DEFAULT_MASTER_PORT,
        hint: "no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST is set",
    };
    master.resolve(vars, layout, EnvSource::Slurm)
}

/// How many tasks of this step run on node `node`.
fn slurm_tasks_on_node(vars: &Vars, node: Count) -> Result<Count, EnvError> {
    // SLURM_NTASKS_PER_NODE is the --ntasks-per-node request: one plain count
    // that holds for every node.
    if let Some((var, value)) = vars.first(&["SLURM_STEP_TASKS_PER_NODE"]) {
        return tasks_per_node_entry(var, &value, node);
    }
    if let Some(count) = vars.count("SLURM_NTASKS_PER_NODE")? {
        return Ok(count);
    }
    if let Some((var, value)) = vars.first(&["SLURM_TASKS_PER_NODE"]) {
        return tasks_per_node_entry(var, &value, node);
    }
    Err(EnvError::Missing {
        var: "SLURM_TASKS_PER_NODE",
        reason: "SLURM_PROCID is set and the number of tasks on this node is needed \
                 (SLURM_STEP_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE are unset as well)"
            .to_string(),
    })
}

/// Entry `node` of a Slurm tasks-per-node list such as "4(x2),3".
fn tasks_per_node_entry(var: &'static str, value: &str, node: Count) -> Result<Count, EnvError> {
    let entries = parse_tasks_per_node(value)
        .map_err(|why| invalid(var, value, &format!("a list like \"4(x2),3\" ({why})")))?;
    let mut first_node = 0;
    for (tasks, nodes) in &entries {
        first_node += nodes;
        if node.value < first_node {
            return Ok(Count { var, value: *tasks });
        }
    }
    Err(EnvError::OutOfRange {
        var: node.var,
        value: node.value,
        bound_var: var,
        bound: first_node,
    })
}

/// "4(x2),3" → [(4, 2), (3, 1)]: (tasks per node, number of such nodes).
fn parse_tasks_per_node(spec: &str) -> Result<Vec<(usize, usize)>, String> {
    let mut total_nodes: usize = 0;
    let mut entries = Vec::new();
    for entry in spec.split(',') {
        let (tasks, nodes) = match entry.split_once("(x") {
            Some((tasks, reps)) => {
                let reps = reps
                    .strip_suffix(')')
                    .ok_or_else(|| format!("{entry:?} lacks its closing ')'"))?;
                (tasks, parse_number(reps)?)
            }
            None => (entry, 1),
        };
        if nodes == 0 {
            return Err(format!("{entry:?} repeats zero times"));
        }
        // Guards the running sum that tasks_per_node_entry computes again.
        total_nodes = total_nodes
            .checked_add(nodes)
            .ok_or_else(|| format!("{entry:?} makes the node count overflow"))?;
        entries.push((parse_number(tasks)?, nodes));
    }
    Ok(entries)
}

fn parse_number(text: &str) -> Result<usize, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not a non-negative integer"))
}

/// The first host of the step's nodelist: node 0, which holds rank 0 under
/// every srun distribution except an arbitrary one.
fn slurm_first_host(vars: &Vars) -> Result<Option<String>, EnvError> {
    let names = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ];
    let Some((var, value)) = vars.first(&names) else {
        return Ok(None);
    };
    let hosts = expand_hostlist(&value)
        .map_err(|why| invalid(var, &value, &format!("a Slurm hostlist ({why})")))?;
    Ok(hosts.into_iter().next())
}

/// Expands a Slurm hostlist: "node[01-03,07],gpu-a1" → node01, node02, node03,
/// node07, gpu-a1. Zero padding follows the width of a range's lower bound.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_outside_brackets(list)? {
        for host in expand_host(item)? {
            if hosts.len() == MAX_HOSTS {
                return Err(format!("more than {MAX_HOSTS} hosts"));
            }
            hosts.push(host);
        }
    }
    Ok(hosts)
}

/// Splits at the commas that separate hosts, not those inside brackets.
fn split_outside_brackets(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            ']' if depth == 1 => depth = 0,
            '[' | ']' => return Err(format!("unbalanced bracket at byte {i}")),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed '['".to_string());
    }
    items.push(&list[start..]);
    Ok(items)
}

/// One comma-free item, possibly with several bracket groups ("r[1-2]n[1-4]").
fn expand_host(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else {
        if item.is_empty() {
            return Err("empty host name".to_string());
        }
        return Ok(vec![item.to_string()]);
    };
    // split_outside_brackets has checked that every '[' is closed.
    let close = open + item[open..].find(']').ok_or("unclosed '['")?;
    let prefix = &item[..open];
    let suffixes = match &item[close + 1..] {
        "" => vec![String::new()],
        rest => expand_host(rest)?,
    };
    let mut hosts = Vec::new();
    for range in item[open + 1..close].split(',') {
        for number in expand_range(range)? {
            for suffix in &suffixes {
                if hosts.len() == MAX_HOSTS {
                    return Err(format!("more than {MAX_HOSTS} hosts"));
                }
                hosts.push(format!("{prefix}{number}{suffix}"));
            }
        }
    }
    Ok(hosts)
}

/// "01-04" → 01, 02, 03, 04; "7" → 7.
fn expand_range(range: &str) -> Result<Vec<String>, String> {
    let (low, high) = range.split_once('-').unwrap_or((range, range));
    let is_number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !is_number(low) || !is_number(high) {
        return Err(format!("{range:?} is not a number or a range like 01-04"));
    }
    let too_long = |_| format!("{range:?} has a bound too large");
    let first: u64 = low.parse().map_err(too_long)?;
    let last: u64 = high.parse().map_err(too_long)?;
    if first > last {
        return Err(format!("{range:?} runs backwards"));
    }
    if last - first >= MAX_HOSTS as u64 {
        return Err(format!("{range:?} names more than {MAX_HOSTS} hosts"));
    }
    let width = low.len();
    Ok((first..=last).map(|n| format!("{n:0width$}")).collect())
}

/// A count read from a variable, with the variable's name kept for errors.
/// Derived counts carry the name of the variable they were derived from.
#[derive(Debug, Clone, Copy)]
struct Count {
    var: &'static str,
    value: usize,
}

/// The counts of one process, checked against each other.
#[derive(Debug, Clone, Copy)]
struct Layout {
    rank: Count,
    world: Count,
    local_rank: Count,
    local_world: Count,
    node_rank: usize,
}

impl Layout {
    /// Validates the counts; a missing node rank is derived assuming every node
    /// runs `local_world` processes with consecutive ranks.
    fn new(
        rank: Count,
        world: Count,
        local_rank: Count,
        local_world: Count,
        node_rank: Option<Count>,
    ) -> Result<Layout, EnvError> {
        for size in [world, local_world] {
            if size.value == 0 {
                return Err(invalid(size.var, "0", "at least 1"));
            }
        }
        below(rank, world)?;
        below(local_rank, local_world)?;
        if local_world.value > world.value {
            return Err(EnvError::LocalExceedsWorld {
                local_var: local_world.var,
                local: local_world.value,
                world_var: world.var,
                world: world.value,
            });
        }
        let node_rank = node_rank.map_or(rank.value / local_world.value, |n| n.value);
        Ok(Layout {
            rank,
            world,
            local_rank,
            local_world,
            node_rank,
        })
    }

    fn is_multi_node(&self) -> bool {
        self.world.value > self.local_world.value
    }
}

fn below(count: Count, bound: Count) -> Result<(), EnvError> {
    if count.value < bound.value {
        return Ok(());
    }
    Err(EnvError::OutOfRange {
        var: count.var,
        value: count.value,
        bound_var: bound.var,
        bound: bound.value,
    })
}

/// Where rank 0 listens, in order: MASTER_ADDR/MASTER_PORT, the scheduler's
/// suggestion, then loopback on a single node (a multi-node job has no default).
struct Master {
    scheduler_addr: Option<String>,
    default_port: u16,
    /// Why the scheduler could not name a master, for the error message.
    hint: &'static str,
}

impl Master {
    fn resolve(self, vars: &Vars, layout: Layout, source: EnvSource) -> Result<RankEnv, EnvError> {
        let master_addr = match vars.raw("MASTER_ADDR").or(self.scheduler_addr) {
            Some(addr) => addr,
            None if !layout.is_multi_node() => LOCALHOST.to_string(),
            None => {
                return Err(EnvError::NoMasterAddr {
                    hint: self.hint,
                    world_var: layout.world.var,
                    world: layout.world.value,
                    local_var: layout.local_world.var,
                    local: layout.local_world.value,
                });
            }
        };
        let master_port = match vars.raw("MASTER_PORT") {
            Some(port) => parse_port(&port)?,
            None => self.default_port,
        };
        Ok(RankEnv {
            rank: layout.rank.value,
            world_size: layout.world.value,
            local_rank: layout.local_rank.value,
            local_world_size: layout.local_world.value,
            node_rank: layout.node_rank,
            master_addr,
            master_port,
            source,
        })
    }
}

fn parse_port(value: &str) -> Result<u16, EnvError> {
    match value.parse::<u16>() {
        Ok(port) if port != 0 => Ok(port),
        _ => Err(invalid("MASTER_PORT", value, "a port number in 1..=65535")),
    }
}

fn invalid(var: &'static str, value: &str, expected: &str) -> EnvError {
    EnvError::Invalid {
        var,
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

/// Reads variables through the caller's lookup.
struct Vars<'a> {
    get: &'a dyn Fn(&str) -> Option<String>,
}

impl Vars<'_> {
    /// The trimmed value; an empty one counts as unset, since `VAR=` in a
    /// launch script usually means "not configured" rather than a value.
    fn raw(&self, var: &str) -> Option<String> {
        let value = (self.get)(var)?;
        let value = value.trim();
        (!value.is_empty()).then(|| value.to_string())
    }

    fn any(&self, vars: &[&str]) -> bool {
        vars.iter().any(|var| self.raw(var).is_some())
    }

    /// The first of `vars` that is set, with its name.
    fn first(&self, vars: &[&'static str]) -> Option<(&'static str, String)> {
        vars.iter()
            .find_map(|&var| self.raw(var).map(|value| (var, value)))
    }

    fn count(&self, var: &'static str) -> Result<Option<Count>, EnvError> {
        self.first_count(&[var])
    }

    fn first_count(&self, vars: &[&'static str]) -> Result<Option<Count>, EnvError> {
        let Some((var, text)) = self.first(vars) else {
            return Ok(None);
        };
        match text.parse() {
            Ok(value) => Ok(Some(Count { var, value })),
            Err(_) => Err(invalid(var, &text, "a non-negative integer")),
        }
    }

    fn require(&self, var: &'static str, why: &str) -> Result<Count, EnvError> {
        self.count(var)?.ok_or_else(|| EnvError::Missing {
            var,
            reason: why.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn detect(pairs: &[(&str, &str)]) -> Result<Option<RankEnv>, EnvError> {
        let map = lookup(pairs);
        RankEnv::from_vars(&|name| map.get(name).cloned())
    }

    fn found(pairs: &[(&str, &str)]) -> RankEnv {
        detect(pairs).unwrap().expect("a distributed job")
    }

    fn error(pairs: &[(&str, &str)]) -> EnvError {
        detect(pairs).unwrap_err()
    }

    fn token(pairs: &[(&str, &str)]) -> Option<String> {
        let map = lookup(pairs);
        job_token(&|name| map.get(name).cloned())
    }

    fn hosts(list: &str) -> Vec<String> {
        expand_hostlist(list).unwrap()
    }

    // ---- no job ----

    #[test]
    fn empty_environment_is_no_job() {
        assert_eq!(detect(&[]).unwrap(), None);
    }

    #[test]
    fn unrelated_and_empty_variables_are_no_job() {
        assert_eq!(
            detect(&[("PATH", "/bin"), ("RANK", ""), ("WORLD_SIZE", "  ")]).unwrap(),
            None
        );
    }

    // ---- torchrun / DeepSpeed launcher ----

    #[test]
    fn torchrun_full_set() {
        let env = found(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]);
        assert_eq!(
            env,
            RankEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                master_addr: "10.0.0.1".into(),
                master_port: 1234,
                source: EnvSource::Torchrun,
            }
        );
    }

    #[test]
    fn torchrun_minimal_defaults_to_one_node() {
        let env = found(&[("RANK", "2"), ("WORLD_SIZE", "4")]);
        assert_eq!(env.local_rank, 2);
        assert_eq!(env.local_world_size, 4);
        assert_eq!(env.node_rank, 0);
        assert_eq!(env.master_addr, LOCALHOST);
        assert_eq!(env.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn torchrun_values_are_trimmed() {
        let env = found(&[("RANK", " 1 "), ("WORLD_SIZE", "2\n")]);
        assert_eq!((env.rank, env.world_size), (1, 2));
    }

    #[test]
    fn torchrun_node_rank_is_derived_from_local_world_size() {
        let env = found(&[
            ("RANK", "6"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "m"),
        ]);
        assert_eq!(env.node_rank, 3);
    }

    #[test]
    fn node_rank_wins_over_group_rank() {
        let env = found(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
            ("GROUP_RANK", "0"),
            ("MASTER_ADDR", "m"),
        ]);
        assert_eq!(env.node_rank, 1);
    }

    #[test]
    fn deepspeed_launcher_local_size_and_cross_rank() {
        // deepspeed.launcher.launch exports LOCAL_SIZE and CROSS_RANK, not
        // LOCAL_WORLD_SIZE and NODE_RANK; nodes may differ in size.
        let env = found(&[
            ("RANK", "4"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_SIZE", "2"),
            ("CROSS_RANK", "1"),
            ("CROSS_SIZE", "2"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "29600"),
        ]);
        assert_eq!((env.local_world_size, env.node_rank), (2, 1));
        assert_eq!(env.master_port, 29600);
    }

    #[test]
    fn node_rank_without_local_world_size_is_an_error() {
        let err = error(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("NODE_RANK", "1")]);
        assert!(matches!(
            err,
            EnvError::Missing {
                var: "LOCAL_WORLD_SIZE",
                ..
            }
        ));
        assert!(err.to_string().contains("NODE_RANK=1"), "{err}");
    }

    #[test]
    fn torchrun_multi_node_without_master_is_an_error() {
        let err = error(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
        ]);
        assert_eq!(
            err,
            EnvError::NoMasterAddr {
                hint: "no other variable names the master",
                world_var: "WORLD_SIZE",
                world: 8,
                local_var: "LOCAL_WORLD_SIZE",
                local: 4,
            }
        );
        let text = err.to_string();
        assert!(
            text.contains("MASTER_ADDR") && text.contains("WORLD_SIZE=8"),
            "{text}"
        );
    }

    // ---- OpenMPI ----

    fn ompi(rank: &str, world: &str, local_rank: &str, local: &str) -> Vec<(&'static str, String)> {
        vec![
            ("OMPI_COMM_WORLD_RANK", rank.into()),
            ("OMPI_COMM_WORLD_SIZE", world.into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", local_rank.into()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", local.into()),
        ]
    }

    fn with<'a>(
        base: &'a [(&'static str, String)],
        extra: &[(&'a str, &'a str)],
    ) -> Vec<(&'a str, &'a str)> {
        base.iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain(extra.iter().copied())
            .collect()
    }

    #[test]
    fn open_mpi_multi_node_with_master_addr() {
        let base = ompi("6", "8", "2", "4");
        let env = found(&with(&base, &[("MASTER_ADDR", "10.1.1.1")]));
        assert_eq!(
            env,
            RankEnv {
                rank: 6,
                world_size: 8,
                local_rank: 2,
                local_world_size: 4,
                node_rank: 1,
                master_addr: "10.1.1.1".into(),
                master_port: DEFAULT_MASTER_PORT,
                source: EnvSource::OpenMpi,
            }
        );
    }

    #[test]
    fn open_mpi_single_node_defaults_to_loopback() {
        let base = ompi("1", "4", "1", "4");
        let env = found(&with(&base, &[]));
        assert_eq!(env.master_addr, LOCALHOST);
        assert_eq!(env.master_port, DEFAULT_MASTER_PORT);
        assert_eq!(env.source, EnvSource::OpenMpi);
    }

    #[test]
    fn open_mpi_node_rank_variable_is_not_the_node_index() {
        let base = ompi("5", "8", "1", "4");
        let env = found(&with(
            &base,
            &[("OMPI_COMM_WORLD_NODE_RANK", "7"), ("MASTER_ADDR", "m")],
        ));
        assert_eq!(env.node_rank, 1);
    }

    #[test]
    fn open_mpi_missing_local_size_is_an_error() {
        let err = error(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ]);
        assert!(matches!(
            err,
            EnvError::Missing {
                var: "OMPI_COMM_WORLD_LOCAL_SIZE",
                ..
            }
        ));
    }

    #[test]
    fn open_mpi_multi_node_without_master_is_an_error() {
        let base = ompi("0", "8", "0", "4");
        let err = error(&with(&base, &[]));
        assert!(matches!(
            err,
            EnvError::NoMasterAddr {
                world_var: "OMPI_COMM_WORLD_SIZE",
                world: 8,
                ..
            }
        ));
    }

    #[test]
    fn dlts_cluster_uses_plain_open_mpi() {
        let base = ompi("0", "2", "0", "2");
        let env = found(&with(
            &base,
            &[
                ("AZUREML_EXPERIMENT_ID", "exp"),
                ("DLTS_JOB_ID", "j"),
                ("AZ_BATCHAI_MPI_MASTER_NODE", "10.0.0.9"),
            ],
        ));
        assert_eq!(env.source, EnvSource::OpenMpi);
        assert_eq!(env.master_addr, LOCALHOST);
    }

    // ---- Azure ML MPI ----

    #[test]
    fn azure_ml_multi_node_uses_batch_master_host_and_port_6105() {
        let base = ompi("3", "8", "3", "4");
        let env = found(&with(
            &base,
            &[
                ("AZUREML_EXPERIMENT_ID", "exp"),
                ("AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"),
            ],
        ));
        assert_eq!(env.source, EnvSource::AzureMlMpi);
        assert_eq!(env.master_addr, "10.0.0.4");
        assert_eq!(env.master_port, AML_MULTI_NODE_PORT);
        assert_eq!(env.node_rank, 0);
    }

    #[test]
    fn azure_ml_single_node_uses_batchai_master_and_port_54965() {
        let base = ompi("1", "4", "1", "4");
        let env = found(&with(
            &base,
            &[
                ("AZUREML_EXPERIMENT_ID", "exp"),
                ("AZ_BATCHAI_MPI_MASTER_NODE", "10.0.0.7"),
                ("AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"),
            ],
        ));
        assert_eq!(env.master_addr, "10.0.0.7");
        assert_eq!(env.master_port, AML_SINGLE_NODE_PORT);
    }

    #[test]
    fn azure_ml_single_node_without_master_falls_back_to_loopback() {
        let base = ompi("0", "2", "0", "2");
        let env = found(&with(&base, &[("AZUREML_EXPERIMENT_ID", "exp")]));
        assert_eq!(env.master_addr, LOCALHOST);
        assert_eq!(env.master_port, AML_SINGLE_NODE_PORT);
    }

    #[test]
    fn azure_ml_master_variables_win() {
        let base = ompi("0", "8", "0", "4");
        let env = found(&with(
            &base,
            &[
                ("AZUREML_EXPERIMENT_ID", "exp"),
                ("AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"),
                ("MASTER_ADDR", "10.9.9.9"),
                ("MASTER_PORT", "7000"),
            ],
        ));
        assert_eq!(env.master_addr, "10.9.9.9");
        assert_eq!(env.master_port, 7000);
    }

    #[test]
    fn azure_ml_multi_node_without_batch_master_is_an_error() {
        let base = ompi("0", "8", "0", "4");
        let err = error(&with(&base, &[("AZUREML_EXPERIMENT_ID", "exp")]));
        assert!(err.to_string().contains("AZ_BATCH_MASTER_NODE"), "{err}");
        assert!(matches!(err, EnvError::NoMasterAddr { .. }));
    }

    #[test]
    fn azure_ml_malformed_batch_master_is_an_error() {
        let base = ompi("0", "8", "0", "4");
        let err = error(&with(
            &base,
            &[
                ("AZUREML_EXPERIMENT_ID", "exp"),
                ("AZ_BATCH_MASTER_NODE", ":6000"),
            ],
        ));
        assert!(matches!(
            err,
            EnvError::Invalid {
                var: "AZ_BATCH_MASTER_NODE",
                ..
            }
        ));
    }

    // ---- Slurm ----

    fn srun(procid: &str, localid: &str, nodeid: &str) -> Vec<(&'static str, String)> {
        vec![
            ("SLURM_PROCID", procid.into()),
            ("SLURM_LOCALID", localid.into()),
            ("SLURM_NODEID", nodeid.into()),
            ("SLURM_JOB_ID", "4242".into()),
        ]
    }

    #[test]
    fn slurm_two_nodes_master_is_first_host() {
        let base = srun("5", "1", "1");
        let env = found(&with(
            &base,
            &[
                ("SLURM_NTASKS", "8"),
                ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ("SLURM_JOB_NODELIST", "node[07-08]"),
            ],
        ));
        assert_eq!(
            env,
            RankEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                master_addr: "node07".into(),
                master_port: DEFAULT_MASTER_PORT,
                source: EnvSource::Slurm,
            }
        );
    }

    #[test]
    fn slurm_uneven_nodes_read_their_own_entry() {
        let base = srun("9", "1", "2");
        let env = found(&with(
            &base,
            &[
                ("SLURM_NTASKS", "11"),
                ("SLURM_TASKS_PER_NODE", "4(x2),3"),
                ("SLURM_NODELIST", "a,b,c"),
            ],
        ));
        assert_eq!((env.local_world_size, env.node_rank), (3, 2));
        assert_eq!(env.master_addr, "a");
    }

    #[test]
    fn slurm_ntasks_per_node_holds_for_every_node() {
        let base = srun("3", "1", "1");
        let env = found(&with(
            &base,
            &[
                ("SLURM_NTASKS", "4"),
                ("SLURM_NTASKS_PER_NODE", "2"),
                ("SLURM_TASKS_PER_NODE", "3,1"),
                ("SLURM_JOB_NODELIST", "n1,n2"),
            ],
        ));
        assert_eq!(env.local_world_size, 2);
    }

    #[test]
    fn slurm_step_variables_win_over_job_variables() {
        let base = srun("1", "1", "0");
        let env = found(&with(
            &base,
            &[
                ("SLURM_STEP_NUM_TASKS", "4"),
                ("SLURM_NTASKS", "16"),
                ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
                ("SLURM_NTASKS_PER_NODE", "8"),
                ("SLURM_STEP_NODELIST", "gpu[3-4]"),
                ("SLURM_JOB_NODELIST", "gpu[1-4]"),
            ],
        ));
        assert_eq!((env.world_size, env.local_world_size), (4, 2));
        assert_eq!(env.master_addr, "gpu3");
    }

    #[test]
    fn slurm_master_variables_win() {
        let base = srun("0", "0", "0");
        let env = found(&with(
            &base,
            &[
                ("SLURM_NTASKS", "8"),
                ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ("SLURM_JOB_NODELIST", "node[1-2]"),
                ("MASTER_ADDR", "login"),
                ("MASTER_PORT", "40000"),
            ],
        ));
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("login", 40000)
        );
    }

    #[test]
    fn slurm_single_node_uses_loopback() {
        let base = srun("1", "1", "0");
        let env = found(&with(
            &base,
            &[
                ("SLURM_NTASKS", "2"),
                ("SLURM_TASKS_PER_NODE", "2"),
                ("SLURM_JOB_NODELIST", "node1"),
            ],
        ));
        assert_eq!(env.master_addr, LOCALHOST);
    }

    #[test]
    fn slurm_node_beyond_tasks_per_node_is_an_error() {
        let base = srun("0", "0", "3");
        let err = error(&with(
            &base,
            &[("SLURM_NTASKS", "8"), ("SLURM_TASKS_PER_NODE", "4(x2)")],
        ));
        assert_eq!(
            err,
            EnvError::OutOfRange {
                var: "SLURM_NODEID",
                value: 3,
                bound_var: "SLURM_TASKS_PER_NODE",
                bound: 2,
            }
        );
    }

    #[test]
    fn slurm_malformed_tasks_per_node_is_an_error() {
        let base = srun("0", "0", "0");
        for spec in ["4(x2", "4(x0)", "x,2", "4(xa)"] {
            let err = error(&with(
                &base,
                &[("SLURM_NTASKS", "8"), ("SLURM_TASKS_PER_NODE", spec)],
            ));
            assert!(
                matches!(err, EnvError::Invalid { var: "SLURM_TASKS_PER_NODE", ref value, .. } if value == spec),
                "{spec}: {err}"
            );
        }
    }

    #[test]
    fn slurm_missing_tasks_per_node_is_an_error() {
        let base = srun("0", "0", "0");
        let err = error(&with(&base, &[("SLURM_NTASKS", "8")]));
        assert!(matches!(
            err,
            EnvError::Missing {
                var: "SLURM_TASKS_PER_NODE",
                ..
            }
        ));
    }

    #[test]
    fn slurm_missing_task_count_is_an_error() {
        let base = srun("0", "0", "0");
        let err = error(&with(&base, &[("SLURM_TASKS_PER_NODE", "1")]));
        assert!(matches!(
            err,
            EnvError::Missing {
                var: "SLURM_NTASKS",
                ..
            }
        ));
    }

    #[test]
    fn slurm_multi_node_without_nodelist_is_an_error() {
        let base = srun("0", "0", "0");
        let err = error(&with(
            &base,
            &[("SLURM_NTASKS", "8"), ("SLURM_TASKS_PER_NODE", "4(x2)")],
        ));
        assert!(matches!(
            err,
            EnvError::NoMasterAddr {
                world_var: "SLURM_NTASKS",
                local_var: "SLURM_TASKS_PER_NODE",
                ..
            }
        ));
    }

    #[test]
    fn slurm_malformed_nodelist_is_an_error() {
        let base = srun("0", "0", "0");
        let err = error(&with(
            &base,
            &[
                ("SLURM_NTASKS", "8"),
                ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ("SLURM_JOB_NODELIST", "node[3-1]"),
            ],
        ));
        assert!(matches!(
            err,
            EnvError::Invalid {
                var: "SLURM_JOB_NODELIST",
                ..
            }
        ));
        assert!(err.to_string().contains("node[3-1]"), "{err}");
    }

    // ---- precedence ----

    #[test]
    fn torchrun_wins_over_schedulers() {
        let base = ompi("3", "4", "3", "4");
        let env = found(&with(
            &base,
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("SLURM_PROCID", "0"),
                ("AZUREML_EXPERIMENT_ID", "exp"),
            ],
        ));
        assert_eq!((env.rank, env.world_size), (1, 2));
        assert_eq!(env.source, EnvSource::Torchrun);
    }

    #[test]
    fn open_mpi_wins_over_slurm() {
        // mpirun inside an sbatch allocation inherits the batch step's SLURM_*.
        let base = ompi("3", "4", "3", "4");
        let env = found(&with(
            &base,
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", "0"),
            ],
        ));
        assert_eq!((env.rank, env.source), (3, EnvSource::OpenMpi));
    }

    // ---- validation errors ----

    #[test]
    fn non_numeric_rank_is_an_error() {
        let err = error(&[("RANK", "one"), ("WORLD_SIZE", "2")]);
        assert_eq!(err, invalid("RANK", "one", "a non-negative integer"));
        assert_eq!(
            err.to_string(),
            "RANK=\"one\" is invalid: expected a non-negative integer"
        );
    }

    #[test]
    fn negative_local_rank_is_an_error() {
        let err = error(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")]);
        assert_eq!(err, invalid("LOCAL_RANK", "-1", "a non-negative integer"));
    }

    #[test]
    fn non_numeric_scheduler_value_is_an_error() {
        let base = ompi("0", "two", "0", "1");
        let err = error(&with(&base, &[]));
        assert_eq!(
            err,
            invalid("OMPI_COMM_WORLD_SIZE", "two", "a non-negative integer")
        );
    }

    #[test]
    fn rank_not_below_world_size_is_an_error() {
        let err = error(&[("RANK", "4"), ("WORLD_SIZE", "4")]);
        assert_eq!(
            err,
            EnvError::OutOfRange {
                var: "RANK",
                value: 4,
                bound_var: "WORLD_SIZE",
                bound: 4,
            }
        );
        assert_eq!(
            err.to_string(),
            "RANK=4 is out of range: expected a value below WORLD_SIZE=4"
        );
    }

    #[test]
    fn local_rank_not_below_local_world_size_is_an_error() {
        let err = error(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "4"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "m"),
        ]);
        assert!(matches!(
            err,
            EnvError::OutOfRange {
                var: "LOCAL_RANK",
                value: 4,
                bound_var: "LOCAL_WORLD_SIZE",
                bound: 4,
            }
        ));
    }

    #[test]
    fn zero_world_size_is_an_error() {
        let err = error(&[("RANK", "0"), ("WORLD_SIZE", "0")]);
        assert_eq!(err, invalid("WORLD_SIZE", "0", "at least 1"));
    }

    #[test]
    fn zero_local_world_size_is_an_error() {
        let err = error(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "0"),
        ]);
        assert_eq!(err, invalid("LOCAL_WORLD_SIZE", "0", "at least 1"));
    }

    #[test]
    fn local_world_larger_than_world_is_an_error() {
        let err = error(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "4"),
        ]);
        assert!(matches!(
            err,
            EnvError::LocalExceedsWorld {
                local: 4,
                world: 2,
                ..
            }
        ));
    }

    #[test]
    fn bad_ports_are_errors() {
        for port in ["0", "65536", "-1", "http", "80a"] {
            let err = error(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", port)]);
            assert_eq!(
                err,
                invalid("MASTER_PORT", port, "a port number in 1..=65535"),
                "{port}"
            );
        }
    }

    #[test]
    fn extreme_ports_are_accepted() {
        for (text, port) in [("1", 1), ("65535", 65535)] {
            let env = found(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", text)]);
            assert_eq!(env.master_port, port);
        }
    }

    #[test]
    fn rank_without_world_size_is_an_error() {
        let err = error(&[("RANK", "3")]);
        assert!(matches!(
            err,
            EnvError::Missing {
                var: "WORLD_SIZE",
                ..
            }
        ));
        assert!(err.to_string().contains("RANK=\"3\""), "{err}");
    }

    #[test]
    fn world_size_without_rank_is_an_error() {
        let base = ompi("0", "1", "0", "1");
        let err = error(&with(&base, &[("WORLD_SIZE", "4")]));
        assert!(matches!(err, EnvError::Missing { var: "RANK", .. }));
    }

    // ---- hostlist ----

    #[test]
    fn hostlist_single_host() {
        assert_eq!(hosts("gpu-a1"), ["gpu-a1"]);
    }

    #[test]
    fn hostlist_comma_list() {
        assert_eq!(hosts("a,b.example.com,c"), ["a", "b.example.com", "c"]);
    }

    #[test]
    fn hostlist_range_keeps_zero_padding() {
        assert_eq!(
            hosts("node[08-11]"),
            ["node08", "node09", "node10", "node11"]
        );
        assert_eq!(hosts("n[8-10]"), ["n8", "n9", "n10"]);
    }

    #[test]
    fn hostlist_several_ranges_and_hosts() {
        assert_eq!(
            hosts("node[01-04,07],gpu-a1"),
            ["node01", "node02", "node03", "node04", "node07", "gpu-a1"]
        );
        assert_eq!(hosts("x[1,3-4]y,z[9]"), ["x1y", "x3y", "x4y", "z9"]);
    }

    #[test]
    fn hostlist_several_bracket_groups() {
        assert_eq!(hosts("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
    }

    #[test]
    fn hostlist_errors() {
        for list in [
            "",
            "a,,b",
            "a,",
            "node[1-2",
            "node1-2]",
            "n[[1]]",
            "n[]",
            "n[a-b]",
            "n[3-1]",
            "n[1-]",
            "n[0-99999999999]",
            "n[0-70000]",
        ] {
            assert!(expand_hostlist(list).is_err(), "{list:?}");
        }
    }

    #[test]
    fn hostlist_cap_counts_all_groups() {
        assert!(expand_hostlist("a[0-999]b[0-999]").is_err());
    }

    // ---- tasks per node ----

    #[test]
    fn tasks_per_node_parses_repeats() {
        assert_eq!(parse_tasks_per_node("4(x2),3").unwrap(), [(4, 2), (3, 1)]);
        assert_eq!(parse_tasks_per_node("8").unwrap(), [(8, 1)]);
    }

    // ---- job token ----

    #[test]
    fn job_token_prefers_explicit_token() {
        let t = token(&[("DS_RS_JOB_TOKEN", "s3cret"), ("SLURM_JOB_ID", "1")]);
        assert_eq!(t.as_deref(), Some("s3cret"));
    }

    #[test]
    fn job_token_from_torchelastic_run_id() {
        let t = token(&[("TORCHELASTIC_RUN_ID", "run-7"), ("SLURM_JOB_ID", "1")]);
        assert_eq!(t.as_deref(), Some("run-7"));
    }

    #[test]
    fn job_token_skips_torchrun_placeholder() {
        let t = token(&[("TORCHELASTIC_RUN_ID", "none"), ("SLURM_JOB_ID", "12")]);
        assert_eq!(t.as_deref(), Some("12"));
    }

    #[test]
    fn job_token_from_slurm_job_and_step() {
        let t = token(&[("SLURM_JOB_ID", "12"), ("SLURM_STEP_ID", "3")]);
        assert_eq!(t.as_deref(), Some("12.3"));
    }

    #[test]
    fn job_token_from_open_mpi_and_azure_ml() {
        let t = token(&[("OMPI_MCA_ess_base_jobid", "99"), ("AZUREML_RUN_ID", "r")]);
        assert_eq!(t.as_deref(), Some("99"));
        assert_eq!(token(&[("AZUREML_RUN_ID", "r")]).as_deref(), Some("r"));
    }

    #[test]
    fn job_token_absent() {
        assert_eq!(token(&[("DS_RS_JOB_TOKEN", "")]), None);
    }
}
