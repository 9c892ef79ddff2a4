//! The Trainer's run arguments (src/flags/trainer_run.rs) folded into `train`'s own flags, so
//! that the rest of `train` reads one set: `--deepspeed` is `--config`, `--output_dir` the
//! save directory, the metrics directory and the exported model's, `--save_steps` the save
//! interval, and so on, with the Trainer's defaults and precedence where they differ from
//! ds-rs's own (run_clm.py's resume from a non-empty output directory, `--max_steps` over
//! `--num_train_epochs`, no checkpoint after the last step).

use std::path::{Path, PathBuf};

use anyhow::bail;
use ds_engine::checkpoint;

use super::TrainArgs;
use crate::flags::Strategy;

/// The Trainer's default `save_steps`.
const TRAINER_SAVE_STEPS: u64 = 500;

/// What the Trainer's arguments ask that `train`'s own flags cannot say; the defaults are
/// those of a run given only ds-rs's flags.
#[derive(Debug, Clone)]
pub(crate) struct TrainerPlan {
    /// A checkpoint after the last step (the Trainer saves only on its schedule).
    pub save_last: bool,
    /// Save / evaluate at the end of each epoch (the interval needs the data's size).
    pub save_each_epoch: bool,
    pub eval_each_epoch: bool,
    /// Evaluate after the last step (`--do_eval false` with `--eval_strategy no`: never).
    pub final_eval: bool,
    /// Resume from this checkpoint (a directory of them, or one tag in one).
    pub resume_from: Option<PathBuf>,
    /// Write the Trainer's TensorBoard scalars (train/loss, eval/loss, ...) here; an empty
    /// path is the metrics directory's runs/.
    pub tensorboard: Option<PathBuf>,
    /// Export the trained model here when the model has a Hugging Face form (run_clm.py's
    /// `trainer.save_model()` into --output_dir).
    pub save_model: Option<PathBuf>,
}

impl Default for TrainerPlan {
    fn default() -> Self {
        TrainerPlan {
            save_last: true,
            save_each_epoch: false,
            eval_each_epoch: false,
            final_eval: true,
            resume_from: None,
            tensorboard: None,
            save_model: None,
        }
    }
}

impl TrainArgs {
    /// This command line with the Trainer's arguments folded into ds-rs's flags; folding a
    /// folded command line changes nothing.
    pub(crate) fn resolved(&self) -> anyhow::Result<TrainArgs> {
        let mut a = self.clone();
        let t = std::mem::take(&mut a.trainer);
        a.trainer.logging_steps = t.logging_steps;
        one_of(&mut a.config, "--config", t.deepspeed, "--deepspeed")?;
        if let Some(m) = t.model_name_or_path {
            a.model = m;
        }
        if let Some(d) = t.train_file {
            a.data = d;
        }
        one_of(
            &mut a.eval_data,
            "--eval-data",
            t.validation_file,
            "--validation_file",
        )?;
        one_of(&mut a.seq_len, "--seq-len", t.block_size, "--block_size")?;
        one_of(
            &mut a.epochs,
            "--epochs",
            t.num_train_epochs,
            "--num_train_epochs",
        )?;
        if t.do_train == Some(false) || (t.do_train.is_none() && t.do_eval == Some(true)) {
            bail!(
                "--do_eval without --do_train: `ds-rs train` trains; `ds-rs eval` evaluates a \
                 model or checkpoint on its own"
            );
        }
        a.trainer_plan.final_eval = t.do_eval != Some(false);
        fold_eval(&mut a, t.eval_strategy, t.eval_steps)?;
        fold_output_dir(
            &mut a,
            t.output_dir,
            t.overwrite_output_dir.unwrap_or(false),
        )?;
        fold_save(&mut a, t.save_strategy, t.save_steps)?;
        let limit = t.save_total_limit;
        one_of_count(
            &mut a.keep_checkpoints,
            "--keep-checkpoints",
            limit,
            "--save_total_limit",
        )?;
        fold_resume(&mut a, t.resume_from_checkpoint.as_deref())?;
        fold_report(&mut a, &t.report_to, t.logging_dir)?;
        Ok(a)
    }
}

/// `ours` takes `theirs` when given; both given and different is an error naming both.
fn one_of<T: PartialEq + std::fmt::Debug>(
    ours: &mut Option<T>,
    our_flag: &str,
    theirs: Option<T>,
    their_flag: &str,
) -> anyhow::Result<()> {
    match (ours.as_ref(), theirs) {
        (Some(o), Some(t)) if *o != t => {
            bail!(
                "{our_flag} {o:?} and {their_flag} {t:?} say the same thing differently; give one"
            )
        }
        (_, Some(t)) => *ours = Some(t),
        _ => {}
    }
    Ok(())
}

/// [`one_of`] for a count whose 0 means "not given".
fn one_of_count<T: PartialEq + Default + std::fmt::Debug + Copy>(
    ours: &mut T,
    our_flag: &str,
    theirs: Option<T>,
    their_flag: &str,
) -> anyhow::Result<()> {
    let mut o = (*ours != T::default()).then_some(*ours);
    one_of(&mut o, our_flag, theirs, their_flag)?;
    *ours = o.unwrap_or_default();
    Ok(())
}

fn fold_eval(
    a: &mut TrainArgs,
    strategy: Option<Strategy>,
    steps: Option<u64>,
) -> anyhow::Result<()> {
    match (strategy, steps) {
        (None, None) => {}
        (None | Some(Strategy::No | Strategy::Epoch), Some(n)) => {
            bail!("--eval_steps {n} acts only with --eval_strategy steps")
        }
        (Some(Strategy::No), None) => a.eval_interval = 0,
        (Some(Strategy::Epoch), None) => {
            a.eval_interval = 0;
            a.trainer_plan.eval_each_epoch = true;
        }
        // the Trainer's eval_steps defaults to logging_steps
        (Some(Strategy::Steps), n) => {
            a.eval_interval = n.or(a.trainer.logging_steps).unwrap_or(TRAINER_SAVE_STEPS)
        }
    }
    Ok(())
}

/// `--output_dir`: the save directory, the metrics directory and the model's; a directory
/// holding a checkpoint is resumed from unless `--overwrite_output_dir`, and one holding
/// anything else is refused without it, as run_clm.py does.
fn fold_output_dir(a: &mut TrainArgs, dir: Option<PathBuf>, overwrite: bool) -> anyhow::Result<()> {
    let Some(dir) = dir else {
        if overwrite {
            bail!("--overwrite_output_dir needs --output_dir: the directory it would train into");
        }
        return Ok(());
    };
    one_of(
        &mut a.save_dir,
        "--save-dir",
        Some(dir.clone()),
        "--output_dir",
    )?;
    a.metrics_dir.get_or_insert_with(|| dir.clone());
    a.trainer_plan.save_model = Some(dir.clone());
    a.trainer_plan.save_last = false;
    let restarted = std::env::var("DS_RS_RESTART_COUNT").is_ok_and(|c| c != "0");
    if overwrite || restarted || a.resume {
        return Ok(());
    }
    if checkpoint::latest(&dir)?.is_some() {
        a.resume = true;
    } else if has_entries(&dir) {
        bail!(
            "--output_dir {} is not empty and holds no checkpoint to resume from; \
             --overwrite_output_dir trains into it anyway",
            dir.display()
        );
    }
    Ok(())
}

fn has_entries(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

fn fold_save(
    a: &mut TrainArgs,
    strategy: Option<Strategy>,
    steps: Option<u64>,
) -> anyhow::Result<()> {
    let interval = match (strategy, steps) {
        (Some(Strategy::No | Strategy::Epoch), Some(n)) => {
            bail!("--save_steps {n} acts only with --save_strategy steps")
        }
        (Some(Strategy::No), None) => Some(0),
        (Some(Strategy::Epoch), None) => {
            a.trainer_plan.save_each_epoch = true;
            Some(0)
        }
        // the Trainer saves every 500 steps unless told otherwise; ds-rs's own default is
        // only after the last step
        (_, n) => {
            let own = (a.save_interval != 0).then_some(a.save_interval);
            one_of(&mut n.clone(), "--save_steps", own, "--save-interval")?;
            n.or(own)
                .or((!a.trainer_plan.save_last).then_some(TRAINER_SAVE_STEPS))
        }
    };
    if a.save_dir.is_none() && (strategy.is_some() || steps.is_some()) {
        bail!(
            "--save_strategy and --save_steps need --output_dir: the directory checkpoints go to"
        );
    }
    if let Some(n) = interval {
        a.save_interval = n;
    }
    Ok(())
}

/// `--resume_from_checkpoint`: true (or no value) resumes from --output_dir's newest, a
/// path from the checkpoint it names.
fn fold_resume(a: &mut TrainArgs, value: Option<&str>) -> anyhow::Result<()> {
    let Some(v) = value else {
        return Ok(());
    };
    match crate::flags::hf_bool(v) {
        Ok(false) => {}
        Ok(true) if a.save_dir.is_none() => bail!(
            "--resume_from_checkpoint without a PATH needs --output_dir: the directory whose \
             newest checkpoint it resumes"
        ),
        Ok(true) => a.resume = true,
        Err(_) => a.trainer_plan.resume_from = Some(PathBuf::from(v)),
    }
    Ok(())
}

fn fold_report(
    a: &mut TrainArgs,
    to: &[String],
    logging_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    let mut tensorboard = false;
    for name in to {
        match name.as_str() {
            "tensorboard" | "all" => tensorboard = true,
            "none" => {}
            other => bail!(
                "--report_to {other}: ds-rs reports to tensorboard (and its own metrics.jsonl); \
                 give --report_to tensorboard or none"
            ),
        }
    }
    match (tensorboard, logging_dir) {
        (true, dir) => a.trainer_plan.tensorboard = Some(dir.unwrap_or_default()),
        (false, Some(_)) => bail!("--logging_dir acts only with --report_to tensorboard"),
        (false, None) => {}
    }
    Ok(())
}

/// Where `--resume_from_checkpoint PATH` loads from: PATH's newest checkpoint when PATH holds
/// `latest`, else PATH itself as one checkpoint of its parent directory.
pub(super) fn checkpoint_at(path: &Path) -> anyhow::Result<(PathBuf, Option<String>)> {
    if path.join(checkpoint::LATEST).is_file() {
        return Ok((path.to_path_buf(), None));
    }
    let tag = path.file_name().and_then(|n| n.to_str());
    match (path.parent(), tag) {
        (Some(parent), Some(tag)) if path.join(checkpoint::MANIFEST).is_file() => {
            Ok((parent.to_path_buf(), Some(tag.to_string())))
        }
        _ => bail!(
            "--resume_from_checkpoint {}: neither a directory of checkpoints (with `{}`) nor \
             one checkpoint (with {})",
            path.display(),
            checkpoint::LATEST,
            checkpoint::MANIFEST
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folded(words: &[&str]) -> anyhow::Result<TrainArgs> {
        let words = std::iter::once("train").chain(words.iter().copied());
        let (args, _) = crate::flags::parse_args::<TrainArgs>("train", words)?;
        args.resolved()
    }

    /// Each Trainer spelling lands on ds-rs's flag; folding twice changes nothing.
    #[test]
    fn trainer_spellings_land_on_the_own_flags() {
        let a = folded(&[
            "--deepspeed",
            "ds.json",
            "--model_name_or_path",
            "m",
            "--train_file",
            "t.txt",
            "--validation_file",
            "v.txt",
            "--block_size",
            "64",
            "--num_train_epochs",
            "2",
            "--save_total_limit",
            "3",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "5",
        ])
        .unwrap();
        assert_eq!(a.config.as_deref(), Some(Path::new("ds.json")));
        assert_eq!((a.model.as_str(), a.data.as_str()), ("m", "t.txt"));
        assert_eq!(a.eval_data.as_deref(), Some("v.txt"));
        assert_eq!((a.seq_len, a.epochs), (Some(64), Some(2.0)));
        assert_eq!((a.keep_checkpoints, a.eval_interval), (3, 5));
        let again = a.resolved().unwrap();
        assert_eq!(format!("{again:?}"), format!("{a:?}"));
    }

    /// The Trainer's defaults under --output_dir: a checkpoint every 500 steps and none after
    /// the last; --save_strategy no: none at all; a ds-rs --save-interval is kept.
    #[test]
    fn output_dir_takes_the_trainers_save_schedule() {
        let dir = std::env::temp_dir().join(format!("ds-rs-fold-{}", std::process::id()));
        let out = dir.to_str().unwrap();
        let a = folded(&["--output_dir", out]).unwrap();
        assert_eq!(a.save_dir.as_deref(), Some(dir.as_path()));
        assert_eq!((a.save_interval, a.trainer_plan.save_last), (500, false));
        let a = folded(&["--output_dir", out, "--save_strategy", "no"]).unwrap();
        assert_eq!(a.save_interval, 0);
        let a = folded(&["--output_dir", out, "--save-interval", "4"]).unwrap();
        assert_eq!(a.save_interval, 4);
        let e = folded(&[
            "--output_dir",
            out,
            "--save-interval",
            "4",
            "--save_steps",
            "3",
        ]);
        assert!(e.unwrap_err().to_string().contains("--save_steps"));
    }

    /// Both spellings given differently are an error naming both.
    #[test]
    fn the_two_spellings_disagreeing_is_an_error() {
        let e = folded(&["--config", "a.json", "--deepspeed", "b.json"]).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("--config") && e.contains("--deepspeed"), "{e}");
        assert!(folded(&["--config", "a.json", "--deepspeed", "a.json"]).is_ok());
    }
}
