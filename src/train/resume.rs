//! Checkpoints in the train job: resuming from the newest one (--resume, or any launcher
//! restart) and saving on schedule.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;

use ds_engine::checkpoint::{self, Manifest};
use ds_engine::Engine;

use super::data::Data;
use super::Run;

impl Run<'_> {
    /// With --save-dir and --resume (or on a launcher restart), loads the newest checkpoint;
    /// returns the step to start from.
    pub(super) fn resume(
        &self,
        engine: &mut Engine,
        data: &Data,
        rank0: bool,
    ) -> anyhow::Result<u64> {
        let restarted = std::env::var("DS_RS_RESTART_COUNT").is_ok_and(|c| c != "0");
        if let Some(path) = self
            .args
            .trainer_plan
            .resume_from
            .as_deref()
            .filter(|_| !restarted)
        {
            let (dir, tag) = super::hf_args::checkpoint_at(path)?;
            return self.resume_at(engine, data, rank0, &dir, tag.as_deref());
        }
        let from_deepspeed = self.args.resume_from_deepspeed.as_deref();
        let Some(dir) = self
            .args
            .save_dir
            .as_deref()
            .filter(|_| self.args.resume || restarted || from_deepspeed.is_some())
        else {
            return Ok(0);
        };
        if let Some(src) = from_deepspeed {
            import_once(engine, src, dir, rank0)?;
        }
        if checkpoint::latest(dir)?.is_none() {
            if rank0 && self.args.resume && !restarted {
                println!(
                    "--resume: {} holds no checkpoint yet; starting from step 0",
                    dir.display()
                );
            }
            return Ok(0);
        }
        self.resume_at(engine, data, rank0, dir, None)
    }

    /// Loads checkpoint `dir/tag` (`tag` None: the newest); returns the step to start from.
    fn resume_at(
        &self,
        engine: &mut Engine,
        data: &Data,
        rank0: bool,
        dir: &Path,
        tag: Option<&str>,
    ) -> anyhow::Result<u64> {
        let t0 = Instant::now();
        let m = engine
            .load_checkpoint(dir, tag)?
            .with_context(|| format!("{}: no checkpoint to resume from", dir.display()))?;
        if let Some(why) = data.resume_conflict(&m.client_state["data"]) {
            anyhow::bail!(
                "{}: resuming would read other samples than the saved run would have ({why}); \
                 start a new --save-dir, or resume with the saved data settings",
                dir.join(&m.tag).display()
            );
        }
        if rank0 {
            checkpoint::remove_leftovers(dir)?;
            println!(
                "resumed from {} (saved at {} ZeRO-{}) at step {}, {}, in {}",
                dir.join(&m.tag).display(),
                m.layout.parallelism(),
                m.layout.zero_stage,
                m.global_steps,
                epoch_note(&data.position(m.global_steps)),
                rate(&m, t0.elapsed())
            );
        }
        Ok(engine.global_steps())
    }

    /// What a checkpoint keeps for this program: where the data stood, and the model's
    /// Hugging Face config.json (for `ds-rs checkpoint export-hf`) when it has one.
    pub(super) fn client_state(&self, data: &Data, step: u64) -> serde_json::Value {
        let mut state = serde_json::json!({"step": step + 1, "data": data.position(step + 1)});
        if let Some(hf) = self.model.hf_config() {
            state["hf_config"] = hf;
        }
        state
    }

    /// Saves after `step` when --save-interval says so, and after the last step.
    pub(super) fn checkpoint(&self, engine: &Engine, data: &Data, step: u64) -> anyhow::Result<()> {
        let Some(dir) = &self.args.save_dir else {
            return Ok(());
        };
        let every = self.save_every;
        let last = step + 1 == self.steps && self.args.trainer_plan.save_last;
        let due = last || (every > 0 && (step + 1).is_multiple_of(every));
        if !due {
            return Ok(());
        }
        let tag = format!("global_step{}", engine.global_steps());
        let state = self.client_state(data, step);
        let t0 = Instant::now();
        let path = engine
            .save_checkpoint(dir, &tag, state)
            .with_context(|| save_failed(dir, &tag))?;
        let rank0 = engine.groups().world().rank() == 0;
        if rank0 {
            let m = Manifest::read(&path)?;
            println!("saved {} in {}", path.display(), rate(&m, t0.elapsed()));
        }
        if self.args.keep_checkpoints > 0 && rank0 {
            checkpoint::prune(dir, self.args.keep_checkpoints)?;
        }
        Ok(())
    }
}

/// Rank 0 imports DeepSpeed checkpoint `src`'s newest tag into `dir` unless `dir` has a
/// checkpoint already; every rank learns whether it succeeded.
fn import_once(engine: &Engine, src: &Path, dir: &Path, rank0: bool) -> anyhow::Result<()> {
    let imported = match rank0 && checkpoint::latest(dir)?.is_none() {
        true => import_latest(src, dir),
        false => Ok(()),
    };
    let failed = engine
        .groups()
        .world()
        .all_gather_u64(&[imported.is_err() as u64])?;
    imported?;
    anyhow::ensure!(
        failed.iter().all(|&f| f == 0),
        "rank 0 could not import {}; see its error",
        src.display()
    );
    Ok(())
}

fn import_latest(src: &Path, dir: &Path) -> anyhow::Result<()> {
    let tag = checkpoint::latest(src)?.with_context(|| {
        format!(
            "{}: no `latest` file: not a DeepSpeed save_dir",
            src.display()
        )
    })?;
    let (ck, path) = ds_engine::checkpoint::deepspeed::import_tag(&src.join(&tag), dir)
        .with_context(|| format!("--resume-from-deepspeed {}", src.display()))?;
    println!(
        "imported DeepSpeed's ZeRO-{} {} checkpoint {} (dp {}, step {}) as {}",
        ck.stage,
        ck.dtype,
        src.join(&tag).display(),
        ck.world,
        ck.counters.global_steps,
        path.display()
    );
    Ok(())
}

/// What a failed save left: `latest` as it was (the save never touches it before it has
/// succeeded everywhere).
fn save_failed(dir: &Path, tag: &str) -> String {
    let kept = match checkpoint::latest(dir) {
        Ok(Some(t)) => format!("{} still names {t}", dir.join(checkpoint::LATEST).display()),
        _ => "no earlier checkpoint".to_string(),
    };
    format!("saving checkpoint {tag} in {} ({kept})", dir.display())
}

/// "0.52 s (93.1 MB, 179 MB/s)" for a checkpoint's shard files.
fn rate(m: &Manifest, took: std::time::Duration) -> String {
    let mb = m.shards.iter().map(|s| s.bytes).sum::<u64>() as f64 / 1e6;
    let s = took.as_secs_f64();
    format!("{s:.2} s ({mb:.1} MB, {:.0} MB/s)", mb / s)
}

/// "epoch 1, sample 37 of 256" from a data position.
fn epoch_note(p: &serde_json::Value) -> String {
    format!(
        "epoch {}, sample {} of {}",
        p["epoch"], p["sample_in_epoch"], p["samples_per_epoch"]
    )
}
