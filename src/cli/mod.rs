//! The command-line shape of ds-rs, following DeepSpeed's and torchrun's spelling, and the
//! dispatch to each command (the top of the binary: it imports the commands, none imports it).

mod bench_adam;
mod bench_attention;
mod bench_comm;
mod bench_gemm;
mod bench_train;
mod checkpoint;
mod config_check;
mod data;
mod estimate;
mod local_ranks;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::flags::AutotuneMode;

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
    Train(Box<crate::train::TrainArgs>),
    /// A model's loss and perplexity on a token source (one rank; under `launch` for
    /// several).
    Eval(crate::train::eval::EvalArgs),
    /// Search for the fastest configuration (the same as `launch --autotuning tune`).
    Autotune(crate::launch::LaunchArgs),
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
    /// Prepare training data (tokenize into Megatron indexed datasets).
    Data {
        #[command(subcommand)]
        command: data::DataCommand,
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
    Train(Box<bench_train::TrainBenchArgs>),
    /// Causal attention's forward and backward: the flash path against the T x T path.
    Attention(bench_attention::AttentionArgs),
    /// The CPU's instruction sets and its single-core f32 GEMM speed on a step's shapes
    /// (beside PyTorch's with --peer): the ceiling the other figures are read against.
    Gemm(bench_gemm::GemmArgs),
}

/// DS_RS_CHECK_ARGS=1: the command line is parsed (with `launch ... train ARGS`, the train
/// arguments too) and nothing runs. The documentation test checks this way the commands it
/// cannot run here (other hosts, a GPU, an MPI build).
pub const CHECK_ARGS: &str = "DS_RS_CHECK_ARGS";

/// Parses what `launch` would hand to `train`; the rest was parsed already.
pub fn check_args(cli: &Cli) -> anyhow::Result<ExitCode> {
    if let Command::Launch(args) | Command::Autotune(args) = &cli.command {
        if args.program.first().is_some_and(|p| p == "train") {
            crate::flags::parse_args::<crate::train::TrainArgs>("train", &args.program).map_err(
                |e| anyhow::anyhow!("train: {}", e.to_string().lines().next().unwrap_or("")),
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Config {
            command: ConfigCommand::Check(args),
        } => config_check::run(&args),
        Command::Launch(args) => match args.autotuning {
            Some(mode) => crate::autotune::run(&args, mode),
            None => crate::launch::run(&args),
        },
        Command::Train(args) => crate::train::run(&args),
        Command::Eval(args) => crate::train::eval::run(&args),
        Command::Autotune(args) => crate::autotune::run(&args, AutotuneMode::Tune),
        Command::Estimate(args) => estimate::run(&args),
        Command::Bench {
            command: BenchCommand::Comm(args),
        } => bench_comm::run(&args),
        Command::Bench {
            command: BenchCommand::Adam(args),
        } => bench_adam::run(&args),
        Command::Bench {
            command: BenchCommand::Gemm(args),
        } => bench_gemm::run(&args),
        Command::Bench {
            command: BenchCommand::Train(args),
        } => bench_train::run(&args),
        Command::Bench {
            command: BenchCommand::Attention(args),
        } => bench_attention::run(&args),
        Command::Checkpoint { command } => checkpoint::run(&command),
        Command::Data { command } => data::run(&command),
    }
}
