//! The command-line shape of ds-rs, following DeepSpeed's and torchrun's spelling.

mod bench_adam;
mod bench_comm;
mod bench_train;
mod checkpoint;
mod config_check;
mod estimate;
mod local_ranks;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "ds-rs",
    version,
    about = "DeepSpeed-compatible distributed training on candle"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start the ranks of a job on this host or on the hosts of a hostfile.
    Launch(crate::launch::LaunchArgs),
    /// Train a model (one rank; run it under `launch` for several).
    Train(crate::train::TrainArgs),
    /// Search for the fastest configuration for a model on this cluster.
    Autotune(Pending),
    /// Inspect DeepSpeed config files.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Estimate the memory a model needs per rank (DeepSpeed's ZeRO-2/3 estimators).
    Estimate(estimate::EstimateArgs),
    /// Measure communication, kernels and training throughput.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
    /// Inspect and consolidate checkpoints.
    Checkpoint {
        #[command(subcommand)]
        command: checkpoint::CheckpointCommand,
    },
}

#[derive(Subcommand, Debug)]
enum ConfigCommand {
    /// Read a ds_config as DeepSpeed 0.19.8 does and print the resolved configuration.
    Check(config_check::CheckArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Bandwidth and latency of the collectives, as nccl-tests prints them.
    Comm(bench_comm::CommArgs),
    /// One fused AdamW step on CPU, as the peer's adam_cpu.py measures DeepSpeed's.
    Adam(bench_adam::AdamArgs),
    /// Training throughput of the built-in GPT, as the peer benchmark measures it.
    Train(bench_train::TrainBenchArgs),
}

/// The arguments of a command that a later release provides.
#[derive(clap::Args, Debug)]
struct Pending {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    rest: Vec<String>,
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let name = match cli.command {
        Command::Config {
            command: ConfigCommand::Check(args),
        } => return config_check::run(&args),
        Command::Launch(args) => return crate::launch::run(&args),
        Command::Train(args) => return crate::train::run(&args),
        Command::Autotune(_) => "autotune",
        Command::Estimate(args) => return estimate::run(&args),
        Command::Bench {
            command: BenchCommand::Comm(args),
        } => return bench_comm::run(&args),
        Command::Bench {
            command: BenchCommand::Adam(args),
        } => return bench_adam::run(&args),
        Command::Bench {
            command: BenchCommand::Train(args),
        } => return bench_train::run(&args),
        Command::Checkpoint { command } => return checkpoint::run(&command),
    };
    eprintln!("error: `ds-rs {name}` is not available yet in this build");
    Ok(ExitCode::from(2))
}
