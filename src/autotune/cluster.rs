//! Where trials run: the cluster cut into disjoint groups of hosts and slots, one trial per
//! group at a time (DeepSpeed's autotuning ResourceManager). A trial takes `--num_nodes` hosts
//! (default: all) and `--num_gpus` / `--nproc_per_node` slots on each (default: every slot);
//! a cluster with room for several such groups runs that many trials side by side, each its
//! own `ds-rs launch --include ...` with its own rendezvous port.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::launch::LaunchArgs;

/// Launcher options a group sets itself for each trial.
pub const GROUP_FLAGS: [&str; 8] = [
    "--include",
    "--exclude",
    "--num_nodes",
    "--num_gpus",
    "--nproc_per_node",
    "--master_addr",
    "--master_port",
    "--force_multi",
];

/// The share of the cluster one trial runs on.
#[derive(Debug, Clone)]
pub struct Group {
    /// `--include` spec and the launcher options that place a trial here; empty for a
    /// one-host cluster, where trials run as the user's own options say.
    pub flags: Vec<String>,
    /// The hosts and slots, for records.
    pub place: String,
    /// Ranks per host (the ranks that share a host's cores).
    pub per_host: usize,
}

/// The groups of this cluster, and the ranks of one trial.
pub fn groups(args: &LaunchArgs) -> anyhow::Result<(Vec<Group>, usize)> {
    let (cluster, nodes, per_node) = args.trial_shape()?;
    let nodes = nodes.unwrap_or(cluster.0.len());
    if nodes > cluster.0.len() {
        bail!(
            "--num_nodes {nodes}: the cluster has {} hosts",
            cluster.0.len()
        );
    }
    let fewest = cluster.0.iter().map(|h| h.slots.len()).min().unwrap_or(0);
    let per_node = per_node.unwrap_or(fewest);
    let multi = cluster.0.len() > 1;
    if !multi && per_node >= fewest {
        // the whole host: trials run as the user's own options say
        let only = Group {
            flags: Vec::new(),
            place: cluster.0[0].name.clone(),
            per_host: fewest,
        };
        return Ok((vec![only], fewest));
    }
    let mut out = Vec::new();
    for hosts in cluster.0.chunks_exact(nodes) {
        let room = hosts.iter().map(|h| h.slots.len()).min().unwrap_or(0);
        for part in 0..room / per_node.max(1) {
            let spec: Vec<String> = hosts
                .iter()
                .map(|h| {
                    let slots = &h.slots[part * per_node..(part + 1) * per_node];
                    let list: Vec<String> = slots.iter().map(usize::to_string).collect();
                    format!("{}:{}", h.name, list.join(","))
                })
                .collect();
            let spec = spec.join("@");
            let mut flags = vec!["--include".to_string(), spec.clone()];
            // a trial on other hosts than this one starts through the remote-exec path
            if multi {
                flags.push("--force_multi".into());
            }
            out.push(Group {
                flags,
                place: spec,
                per_host: per_node,
            });
        }
    }
    if out.is_empty() {
        bail!("no host has {per_node} slots for a trial (--num_gpus / --nproc_per_node)");
    }
    Ok((out, nodes * per_node))
}

/// Gives each group of a multi-host cluster its rendezvous: a port of its own (the user's
/// `--master_port` or DeepSpeed's 29500, plus the group's index), and with a user's
/// `--master_addr` (the first host's address) the address of the group's own first host,
/// asked of that host (`hostname -I`) through the remote-exec template.
pub fn rendezvous(groups: &mut [Group], args: &LaunchArgs) -> anyhow::Result<()> {
    let (base_addr, base_port, template) = args.rendezvous();
    let first_host = |g: &Group| g.place.split([':', '@']).next().unwrap_or("").to_string();
    let Some(head) = groups.first().map(first_host) else {
        return Ok(());
    };
    for (i, g) in groups.iter_mut().enumerate() {
        // on one host the launcher finds a free port of its own
        if !g.flags.iter().any(|f| f == "--force_multi") {
            continue;
        }
        g.flags
            .extend(["--master_port".into(), (base_port + i as u16).to_string()]);
        let Some(addr) = &base_addr else { continue };
        let host = first_host(g);
        let addr = match host == head {
            true => addr.clone(),
            false => address_of(&host, template)
                .with_context(|| format!("finding the address of host {host}"))?,
        };
        g.flags.extend(["--master_addr".into(), addr]);
    }
    Ok(())
}

/// The first address `hostname -I` prints on `host`, reached with the remote-exec template.
fn address_of(host: &str, template: &str) -> anyhow::Result<String> {
    let words = shlex::split(template).context("--ssh_template is not a command line")?;
    let words: Vec<String> = words.iter().map(|w| w.replace("{host}", host)).collect();
    let Some((program, rest)) = words.split_first() else {
        bail!("--ssh_template is empty");
    };
    let mut child = Command::new(program)
        .args(rest)
        .arg("hostname -I")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("no answer within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().next() {
        Some(a) if out.status.success() => Ok(a.to_string()),
        _ => bail!(
            "`hostname -I` gave no address: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    }
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.place)
    }
}
