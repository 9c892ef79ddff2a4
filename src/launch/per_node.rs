//! torchrun's per-node start: `ds-rs launch --nnodes N --node_rank R --master_addr A
//! --nproc_per_node K PROGRAM` on every node, each starting its own K ranks, with no head that
//! reaches the others by ssh. The ranks meet at A, where node 0's rank 0 listens.

use std::process::ExitCode;

use anyhow::bail;

use super::{cluster_per_node, report, Host, Hosts, Job, LaunchArgs, StopFlag};

/// Starts this node's ranks of an `nnodes`-node job and supervises them.
pub(super) fn run(args: &LaunchArgs, nnodes: usize, stop: &StopFlag) -> anyhow::Result<ExitCode> {
    let hosts = plan(args, nnodes)?;
    let node = args.node_rank.unwrap_or(0);
    let job = Job::new(args, hosts)?;
    Ok(report(job.run_node(node, stop)?, args))
}

/// The job's nodes, `--nproc_per_node` ranks each; the flags a per-node start cannot act on
/// are errors naming them.
fn plan(args: &LaunchArgs, nnodes: usize) -> anyhow::Result<Hosts> {
    if nnodes == 0 {
        bail!("--nnodes must be at least 1");
    }
    let node = match args.node_rank {
        Some(r) if r < nnodes => r,
        Some(r) => bail!(
            "--node_rank {r}: out of range for --nnodes {nnodes} (0 to {})",
            nnodes - 1
        ),
        None if nnodes == 1 => 0,
        None => bail!(
            "--nnodes {nnodes} needs --node_rank: this node's position, 0 to {}",
            nnodes - 1
        ),
    };
    if nnodes > 1 && args.master_addr.is_none() {
        bail!(
            "--nnodes {nnodes} needs --master_addr: the address of node 0, where rank 0 listens \
             (the same on every node)"
        );
    }
    let head_only = [
        ("--hostfile", args.hostfile.is_some()),
        ("--include", !args.include.is_empty()),
        ("--exclude", !args.exclude.is_empty()),
        ("--num_nodes", args.num_nodes.is_some()),
        ("--force_multi", args.force_multi),
        ("--max_restarts", args.max_restarts > 0),
        ("--world_info", args.world_info.is_some()),
        ("--autotuning", args.autotuning.is_some()),
    ];
    if let Some((flag, _)) = head_only.iter().find(|(_, given)| *given) {
        bail!(
            "{flag} acts on a launch from one head node; with --nnodes each node starts only its \
             own ranks (node {node} of {nnodes})"
        );
    }
    let per_node = cluster_per_node(args)?.unwrap_or(1);
    Ok(Hosts(
        (0..nnodes)
            .map(|i| Host {
                name: format!("node{i}"),
                slots: (0..per_node).collect(),
            })
            .collect(),
    ))
}

/// The secret the nodes share without a head to hand one out: --rdzv_id, else
/// DS_RS_JOB_TOKEN or the scheduler's job id; None lets each rank warn that any host reaching
/// the address could join.
pub(super) fn token(args: &LaunchArgs) -> Option<String> {
    args.rdzv_id
        .clone()
        .or_else(|| ds_comm::env::job_token(&|name| std::env::var(name).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(words: &str) -> LaunchArgs {
        let words = std::iter::once("launch").chain(words.split_whitespace());
        crate::flags::parse_args::<LaunchArgs>("launch", words)
            .unwrap()
            .0
    }

    /// Node R of N holds ranks R*K .. R*K+K-1 of a world of N*K.
    #[test]
    fn each_node_holds_its_block_of_ranks() {
        let args =
            launch("--nnodes 3 --node_rank 2 --master_addr 10.0.0.1 --nproc_per_node 4 true");
        let hosts = plan(&args, 3).unwrap();
        assert_eq!(hosts.world_size(), 12);
        assert_eq!(hosts.first_rank(2), 8);
        assert_eq!(hosts.0[2].slots.len(), 4);
    }

    /// What a per-node start needs, or cannot act on, is named.
    #[test]
    fn missing_and_head_only_flags_are_named() {
        let cases = [
            ("--nnodes 2 --master_addr a true", "--node_rank"),
            (
                "--nnodes 2 --node_rank 2 --master_addr a true",
                "out of range",
            ),
            ("--nnodes 2 --node_rank 1 true", "--master_addr"),
            (
                "--nnodes 2 --node_rank 1 --master_addr a --max_restarts 2 true",
                "--max_restarts",
            ),
            (
                "--nnodes 2 --node_rank 0 --master_addr a --hostfile h true",
                "--hostfile",
            ),
        ];
        for (words, named) in cases {
            let e = plan(&launch(words), 2).unwrap_err().to_string();
            assert!(e.contains(named), "{words}: {e}");
        }
    }
}
