//! How the head launcher reaches the other hosts. With ssh (a configurable template) and pdsh
//! it starts one node launcher per host (`ds-rs launch --node_rank I --world_info ...`), which
//! starts that host's ranks; with slurm (srun) and openmpi (mpirun) the scheduler starts the
//! ranks itself and they read its environment. Every remote command runs in the head's
//! working directory with the job's environment exported, as DeepSpeed's runners do.

use std::process::Command;

use anyhow::{bail, Context};

use super::hosts::Hosts;

/// The default `--ssh_template`: non-interactive, so that a host asking for a password fails
/// instead of hanging.
pub const SSH_TEMPLATE: &str = "ssh -o BatchMode=yes -o ConnectTimeout=10 {host}";

/// Variables the ranks need on every host, beyond those the launcher sets: ours, the thread
/// pools', NCCL's and CUDA's, as DeepSpeed exports NCCL_*/PYTHON* and its .deepspeed_env.
const EXPORTED_PREFIXES: [&str; 6] = ["DS_RS_", "NCCL_", "RAYON_", "OMP_", "RUST_", "CUDA_"];

/// `--launcher`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Launcher {
    Ssh,
    Pdsh,
    Slurm,
    Openmpi,
}

/// What the head runs for a multi-host job.
pub struct Remote<'a> {
    pub launcher: Launcher,
    pub ssh_template: &'a str,
    pub hosts: &'a Hosts,
    /// The variables to export on every host.
    pub env: Vec<(String, String)>,
    /// `ds-rs launch --world_info ... PROGRAM ARGS` without --node_rank (ssh, pdsh), or the
    /// rank's own command line (slurm, openmpi).
    pub node_argv: Vec<String>,
    pub rank_argv: Vec<String>,
}

impl Remote<'_> {
    /// One command per host (ssh) or one for the whole job (pdsh, srun, mpirun), each with a
    /// name for messages.
    pub fn commands(&self) -> anyhow::Result<Vec<(String, Command)>> {
        match self.launcher {
            Launcher::Ssh => self.ssh(),
            Launcher::Pdsh => Ok(vec![("pdsh".into(), self.pdsh()?)]),
            Launcher::Slurm => Ok(vec![("srun".into(), self.srun())]),
            Launcher::Openmpi => Ok(vec![("mpirun".into(), self.mpirun())]),
        }
    }

    fn ssh(&self) -> anyhow::Result<Vec<(String, Command)>> {
        let template = shlex::split(self.ssh_template)
            .filter(|t| !t.is_empty())
            .with_context(|| {
                format!("--ssh_template {:?}: not a command line", self.ssh_template)
            })?;
        if !template.iter().any(|w| w.contains("{host}")) {
            bail!(
                "--ssh_template {:?}: expected a {{host}} placeholder",
                self.ssh_template
            );
        }
        let mut out = Vec::new();
        for (node, host) in self.hosts.0.iter().enumerate() {
            let words: Vec<String> = template
                .iter()
                .map(|w| w.replace("{host}", &host.name))
                .collect();
            let mut cmd = Command::new(&words[0]);
            cmd.args(&words[1..])
                .arg(self.shell_line(&node.to_string())?);
            out.push((format!("node {node} (host {})", host.name), cmd));
        }
        Ok(out)
    }

    /// pdsh substitutes `%n` with each host's position in the -w list: the node rank.
    fn pdsh(&self) -> anyhow::Result<Command> {
        let names: Vec<&str> = self.hosts.0.iter().map(|h| h.name.as_str()).collect();
        let mut cmd = Command::new("pdsh");
        cmd.env("PDSH_RCMD_TYPE", "ssh")
            .args(["-S", "-f", "1024", "-w", &names.join(",")])
            .arg(self.shell_line("%n")?);
        Ok(cmd)
    }

    fn srun(&self) -> Command {
        let per_node = self
            .hosts
            .0
            .iter()
            .map(|h| h.slots.len())
            .max()
            .unwrap_or(1);
        let names: Vec<&str> = self.hosts.0.iter().map(|h| h.name.as_str()).collect();
        let exports: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let mut cmd = Command::new("srun");
        cmd.arg(format!("--ntasks={}", self.hosts.world_size()))
            .arg(format!("--ntasks-per-node={per_node}"))
            .arg(format!("--nodelist={}", names.join(",")))
            .arg(format!("--export=ALL,{}", exports.join(",")))
            .args(&self.rank_argv);
        cmd
    }

    fn mpirun(&self) -> Command {
        let hosts: Vec<String> = self
            .hosts
            .0
            .iter()
            .map(|h| format!("{}:{}", h.name, h.slots.len()))
            .collect();
        let mut cmd = Command::new("mpirun");
        cmd.args(["-n", &self.hosts.world_size().to_string()])
            .args(["--host", &hosts.join(",")])
            .args(["--mca", "btl", "^openib"]);
        for (k, v) in &self.env {
            cmd.env(k, v).args(["-x", k]);
        }
        cmd.args(&self.rank_argv);
        cmd
    }

    /// `cd CWD && exec env K=V ... ds-rs launch --node_rank N ...`, quoted for a POSIX shell.
    fn shell_line(&self, node_rank: &str) -> anyhow::Result<String> {
        let cwd = std::env::current_dir().context("reading the working directory")?;
        let mut words = vec!["env".to_string()];
        words.extend(self.env.iter().map(|(k, v)| format!("{k}={v}")));
        words.extend([self.node_argv[0].clone(), "launch".into()]);
        let head = shlex::try_join(words.iter().map(String::as_str))
            .context("quoting the remote command")?;
        let tail = shlex::try_join(self.node_argv[1..].iter().map(String::as_str))
            .context("quoting the remote command")?;
        let cwd = shlex::try_quote(&cwd.to_string_lossy())
            .context("quoting the working directory")?
            .into_owned();
        // The node rank (a number, or pdsh's `%n`) needs no quoting.
        Ok(format!(
            "cd {cwd} && exec {head} --node_rank {node_rank} {tail}"
        ))
    }
}

/// The variables of this process that every host's ranks get.
pub fn exported_env() -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| EXPORTED_PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect();
    vars.extend(deepspeed_env_file());
    vars
}

/// DeepSpeed's `.deepspeed_env` (KEY=VALUE lines) in the working or home directory.
fn deepspeed_env_file() -> Vec<(String, String)> {
    let dirs = [
        std::env::current_dir().ok(),
        std::env::var_os("HOME").map(Into::into),
    ];
    let Some(text) = dirs
        .iter()
        .flatten()
        .find_map(|d: &std::path::PathBuf| std::fs::read_to_string(d.join(".deepspeed_env")).ok())
    else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| l.trim().split_once('='))
        .filter(|(k, _)| !k.is_empty() && !k.starts_with('#'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(launcher: Launcher, hosts: &Hosts) -> Remote<'_> {
        Remote {
            launcher,
            ssh_template: "ip netns exec {host} sh -c",
            hosts,
            env: vec![("DS_RS_JOB_TOKEN".into(), "t0k".into())],
            node_argv: vec![
                "/opt/ds rs".into(),
                "--world_info".into(),
                "a:0,1@b:0,1".into(),
            ],
            rank_argv: vec!["/opt/ds-rs".into(), "train".into()],
        }
    }

    fn argv(cmd: &Command) -> Vec<String> {
        std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn ssh_template_runs_the_node_launcher_in_a_shell_on_each_host() {
        let hosts = Hosts::from_spec("a:0,1@b:0,1").unwrap();
        let cmds = remote(Launcher::Ssh, &hosts).commands().unwrap();
        assert_eq!(cmds.len(), 2);
        let words = argv(&cmds[1].1);
        assert_eq!(&words[..5], ["ip", "netns", "exec", "b", "sh"]);
        let line = &words[6];
        // The shell must see the executable as one word, and node rank 1.
        let parsed = shlex::split(line.split_once("&& exec ").unwrap().1).unwrap();
        assert_eq!(
            parsed[..4],
            ["env", "DS_RS_JOB_TOKEN=t0k", "/opt/ds rs", "launch"]
        );
        assert_eq!(parsed[4..6], ["--node_rank", "1"]);
        assert_eq!(cmds[1].0, "node 1 (host b)");
    }

    #[test]
    fn schedulers_start_the_ranks_themselves() {
        let hosts = Hosts::from_spec("a:0,1@b:0,1").unwrap();
        let srun = argv(&remote(Launcher::Slurm, &hosts).srun());
        assert!(srun.contains(&"--ntasks=4".to_string()), "{srun:?}");
        assert!(srun.iter().any(|w| w == "--export=ALL,DS_RS_JOB_TOKEN=t0k"));
        let mpirun = argv(&remote(Launcher::Openmpi, &hosts).mpirun());
        assert!(
            mpirun.windows(2).any(|w| w == ["--host", "a:2,b:2"]),
            "{mpirun:?}"
        );
        let pdsh = argv(&remote(Launcher::Pdsh, &hosts).pdsh().unwrap());
        assert!(pdsh.last().unwrap().contains("--node_rank %n"), "{pdsh:?}");
    }

    #[test]
    fn a_template_without_host_is_refused() {
        let hosts = Hosts::from_spec("a:0").unwrap();
        let mut r = remote(Launcher::Ssh, &hosts);
        r.ssh_template = "ssh";
        assert!(r.commands().is_err());
    }
}
