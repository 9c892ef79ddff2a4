//! The flags several commands share, in one place: `--dist_backend`, `--device`, the parallel
//! degrees, Hugging Face's training arguments, `--autotuning`. A command's own flags live with the command.

mod layout;
mod trainer_run;
mod training_args;

use clap::{Args, FromArgMatches};
use ds_comm::Backend;
use ds_engine::device::DeviceChoice;

pub(crate) use layout::LayoutArgs;
pub(crate) use trainer_run::{hf_bool, Strategy, TrainerRunArgs};
pub(crate) use training_args::TrainingArgsCli;

/// Every long flag of `cmd` and its subcommands answers to both its dash and its underscore
/// spelling (`--save-dir` and `--save_dir`, `--max_steps` and `--max-steps`): ds-rs's own
/// flags are dashed, Hugging Face's and DeepSpeed's underscored, and no user should have to
/// know which is which. The other spelling is a hidden alias, so `--help` shows one.
pub(crate) fn both_spellings(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let Some(long) = a.get_long() else {
            return a;
        };
        let other = match (long.contains('-'), long.contains('_')) {
            (true, false) => long.replace('-', "_"),
            (false, true) => long.replace('_', "-"),
            _ => return a,
        };
        if a.get_all_aliases()
            .unwrap_or_default()
            .contains(&other.as_str())
        {
            return a;
        }
        // clap keeps names as &'static str; a few bytes per flag, once per process
        a.alias(&*Box::leak(other.into_boxed_str()))
    })
    .mut_subcommands(both_spellings)
}

/// `A`'s flags parsed from `words` (the command's name first), in both spellings.
pub(crate) fn parse_args<A: Args + FromArgMatches>(
    name: &'static str,
    words: impl IntoIterator<Item = impl Into<std::ffi::OsString> + Clone>,
) -> Result<(A, clap::ArgMatches), clap::Error> {
    let matches =
        both_spellings(A::augment_args(clap::Command::new(name))).try_get_matches_from(words)?;
    Ok((A::from_arg_matches(&matches)?, matches))
}

/// `--autotuning`: tune only, or tune and then run the best configuration.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutotuneMode {
    Tune,
    Run,
}

/// `--dist_backend`, DeepSpeed's name for what moves the data between ranks.
#[derive(clap::Args, Debug, Clone)]
pub struct BackendArg {
    /// ds: the built-in shared memory and TCP transport; mpi: MPI's collectives, in a job
    /// started by mpirun (built with --features mpi); nccl: collectives on GPU memory through
    /// NCCL, the rest over the built-in transport (the cuda build, --device cuda).
    #[arg(
        long = "dist_backend",
        alias = "dist-backend",
        env = ds_comm::BACKEND_VAR,
        default_value = "ds",
        value_parser = parse_backend
    )]
    pub dist_backend: Backend,
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    let b = Backend::parse(s).map_err(|e| e.to_string())?;
    b.check_built().map_err(|e| e.to_string())?;
    Ok(b)
}

/// `--device`: where this rank's layers compute.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArg {
    /// cpu, cuda (the GPU LOCAL_RANK names) or cuda:N. Default: cuda in a build with the cuda
    /// feature that sees a GPU, else cpu.
    #[arg(long, value_parser = DeviceChoice::parse)]
    pub device: Option<DeviceChoice>,
}

impl DeviceArg {
    fn choice(&self) -> DeviceChoice {
        self.device.unwrap_or_else(DeviceChoice::default_for_build)
    }

    pub fn open(&self) -> anyhow::Result<ds_engine::Device> {
        Ok(self.choice().open(local_rank())?)
    }

    /// The GPU this rank computes on (None on the CPU): where `--dist_backend nccl` runs.
    pub fn gpu_ordinal(&self) -> Option<usize> {
        match self.choice() {
            DeviceChoice::Cpu => None,
            DeviceChoice::Cuda(n) => Some(n.unwrap_or_else(local_rank)),
        }
    }
}

/// This rank's index on its host (0 outside a job).
fn local_rank() -> usize {
    match ds_comm::env::RankEnv::from_env() {
        Ok(Some(e)) => e.local_rank,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::LaunchArgs;
    use crate::train::TrainArgs;

    /// ds-rs's dashed flags in underscores and Hugging Face's underscored ones in dashes parse
    /// to the same values as their own spellings.
    #[test]
    fn every_flag_answers_to_both_spellings() {
        let own = [
            "train",
            "--save-dir",
            "ck",
            "--seq-len",
            "48",
            "--max_steps",
            "7",
        ];
        let other = [
            "train",
            "--save_dir",
            "ck",
            "--seq_len",
            "48",
            "--max-steps",
            "7",
        ];
        for words in [own, other] {
            let (_, m) = parse_args::<TrainArgs>("train", words).unwrap();
            let dir = m.get_one::<std::path::PathBuf>("save_dir");
            assert_eq!(dir, Some(&"ck".into()), "{words:?}");
            assert_eq!(m.get_one::<usize>("seq_len"), Some(&48), "{words:?}");
            assert_eq!(m.get_one::<i64>("max_steps"), Some(&7), "{words:?}");
        }
        // the launcher's flags had both already: the added aliases leave them alone
        let words = ["launch", "--nproc-per-node", "3", "true"];
        let (_, m) = parse_args::<LaunchArgs>("launch", words).unwrap();
        assert_eq!(m.get_one::<usize>("nproc_per_node"), Some(&3));
    }

    /// No added spelling collides with another flag's name (clap's own check of a command).
    #[test]
    fn the_added_spellings_collide_with_nothing() {
        use clap::CommandFactory;
        both_spellings(crate::cli::Cli::command()).debug_assert();
    }
}
