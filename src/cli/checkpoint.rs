//! `ds-rs checkpoint`: consolidate a sharded checkpoint into one safetensors model (DeepSpeed's
//! zero_to_fp32) and inspect checkpoints (tags, layout, sizes, checksums). No ranks needed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use ds_engine::checkpoint::{self, deepspeed, universal, Manifest};
use ds_engine::model::weights;

#[derive(clap::Subcommand, Debug)]
pub enum CheckpointCommand {
    /// Write the whole model, every shard verified, as one safetensors file.
    Consolidate(ConsolidateArgs),
    /// List the checkpoints of a directory and verify their files.
    Inspect(InspectArgs),
    /// Write a Hugging Face model directory (config.json, safetensors) from a checkpoint of
    /// a Llama-family model, a tensor at a time.
    ExportHf(ExportHfArgs),
    /// Convert a DeepSpeed ZeRO checkpoint (stage 1-3, any data-parallel size) into a ds-rs
    /// checkpoint that resumes in any layout: weights, Adam's moments and step, the step
    /// counters, the scheduler's position and the loss scaler.
    ImportDeepspeed(ImportArgs),
    /// Write a checkpoint as DeepSpeed's universal checkpoint (what ds_to_universal.py
    /// makes), which DeepSpeed resumes in any of its layouts with
    /// `"checkpoint": {"load_universal": true}`.
    ExportUniversal(ExportUniversalArgs),
}

#[derive(clap::Args, Debug)]
pub struct ExportUniversalArgs {
    /// The checkpoint directory (the --save-dir of the run).
    dir: PathBuf,
    /// The directory to write (DeepSpeed's load_dir: `latest_universal` and the tag).
    out: PathBuf,
    /// The tag (default: the one `latest` names).
    #[arg(long)]
    tag: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct ImportArgs {
    /// The DeepSpeed checkpoint directory (engine.save_checkpoint's save_dir, with `latest`).
    src: PathBuf,
    /// The ds-rs checkpoint directory to write (a run's --save-dir).
    dst: PathBuf,
    /// The DeepSpeed tag (default: the one `latest` names); the ds-rs tag is the same.
    #[arg(long)]
    tag: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct ExportHfArgs {
    /// The checkpoint directory (the --save-dir of the run).
    dir: PathBuf,
    /// The Hugging Face directory to write.
    out: PathBuf,
    /// The tag (default: the one `latest` names).
    #[arg(long)]
    tag: Option<String>,
    /// fp32 (the master weights exactly), bf16 or fp16.
    #[arg(long, default_value = "fp32")]
    dtype: String,
    /// Shard files of at most this many bytes (with an index when there are several).
    #[arg(long, default_value_t = ds_models::hf_export::DEFAULT_MAX_SHARD_BYTES)]
    shard_bytes: u64,
}

#[derive(clap::Args, Debug)]
pub struct ConsolidateArgs {
    /// The checkpoint directory (the --save-dir of the run).
    dir: PathBuf,
    /// The tag (default: the one `latest` names).
    #[arg(long)]
    tag: Option<String>,
    #[arg(long)]
    out: PathBuf,
    /// fp32 (the master weights exactly) or bf16.
    #[arg(long, default_value = "fp32")]
    dtype: String,
}

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    dir: PathBuf,
}

pub fn run(cmd: &CheckpointCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        CheckpointCommand::Consolidate(a) => consolidate(a),
        CheckpointCommand::Inspect(a) => inspect(&a.dir),
        CheckpointCommand::ExportHf(a) => export_hf(a),
        CheckpointCommand::ImportDeepspeed(a) => import_deepspeed(a),
        CheckpointCommand::ExportUniversal(a) => export_universal(a),
    }
}

fn export_hf(a: &ExportHfArgs) -> anyhow::Result<ExitCode> {
    let dtype = weights::SaveDtype::parse(&a.dtype).map_err(|e| anyhow::anyhow!("--dtype: {e}"))?;
    let dir = tag_dir(&a.dir, a.tag.as_deref())?;
    let m = Manifest::read(&dir)?;
    let config = m.client_state.get("hf_config").cloned().with_context(|| {
        format!(
            "{}: the checkpoint names no Hugging Face config (a built-in GPT run, or one saved before ds-rs kept it)",
            dir.display()
        )
    })?;
    let opts = ds_models::hf_export::ExportOptions {
        dtype,
        max_shard_bytes: a.shard_bytes,
    };
    let e = crate::train::hf_out::export_hf_from(&dir, &a.out, &config, &opts)?;
    println!(
        "{}: {} tensors of step {} -> {} ({} file{}, {:.1} MB, {})",
        dir.display(),
        e.tensors,
        m.global_steps,
        a.out.display(),
        e.files.len(),
        if e.files.len() == 1 { "" } else { "s" },
        e.bytes as f64 / 1e6,
        dtype.torch_name()
    );
    Ok(ExitCode::SUCCESS)
}

fn tag_dir(dir: &Path, tag: Option<&str>) -> anyhow::Result<PathBuf> {
    let tag = match tag {
        Some(t) => t.to_string(),
        None => checkpoint::latest(dir)?
            .with_context(|| format!("{}: no `latest` file; name a --tag", dir.display()))?,
    };
    Ok(dir.join(tag))
}

fn consolidate(a: &ConsolidateArgs) -> anyhow::Result<ExitCode> {
    let dtype = match a.dtype.as_str() {
        "fp32" => weights::SaveDtype::F32,
        "bf16" => weights::SaveDtype::Bf16,
        d => anyhow::bail!("--dtype {d}: expected fp32 or bf16"),
    };
    let dir = tag_dir(&a.dir, a.tag.as_deref())?;
    if deepspeed::is_deepspeed(&dir) {
        let ck = deepspeed::DeepSpeedCheckpoint::open(&dir)?;
        deepspeed::write_weights(&ck, &a.out, dtype)?;
        println!(
            "{}: {} parameters ({} tensors) of a DeepSpeed ZeRO-{} checkpoint (dp {}) at step {} -> {} ({})",
            dir.display(),
            ck.params.iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>(),
            ck.params.len(),
            ck.stage,
            ck.world,
            ck.counters.global_steps,
            a.out.display(),
            a.dtype
        );
        return Ok(ExitCode::SUCCESS);
    }
    let m = checkpoint::write_weights(&dir, &a.out, dtype)?;
    println!(
        "{}: {} parameters ({} tensors) of {} at step {} -> {} ({})",
        dir.display(),
        m.parameters(),
        m.params.len(),
        m.tag,
        m.global_steps,
        a.out.display(),
        a.dtype
    );
    Ok(ExitCode::SUCCESS)
}

fn import_deepspeed(a: &ImportArgs) -> anyhow::Result<ExitCode> {
    let dir = tag_dir(&a.src, a.tag.as_deref())?;
    let (ck, out) = deepspeed::import_tag(&dir, &a.dst)?;
    let m = Manifest::read(&out)?;
    println!(
        "{}: DeepSpeed ZeRO-{} {} checkpoint of dp {} at step {} -> {} ({})",
        dir.display(),
        ck.stage,
        ck.dtype,
        ck.world,
        ck.counters.global_steps,
        out.display(),
        describe(&m)
    );
    Ok(ExitCode::SUCCESS)
}

fn export_universal(a: &ExportUniversalArgs) -> anyhow::Result<ExitCode> {
    let dir = tag_dir(&a.dir, a.tag.as_deref())?;
    let m = Manifest::read(&dir)?;
    let resume =
        universal_resume(&m).with_context(|| format!("{}: the run's config", dir.display()))?;
    let (m, out) = universal::export(&dir, &a.out, &resume)?;
    println!(
        "{}: {} parameters ({} tensors) with Adam's state at step {} -> DeepSpeed universal checkpoint {} (next lr {:e}); \
         DeepSpeed loads it with \"checkpoint\": {{\"load_universal\": true}} and load_dir {}",
        dir.display(),
        m.parameters(),
        m.params.len(),
        m.global_steps,
        out.display(),
        resume.lr,
        a.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// The next step's lr, whether DeepSpeed restores a scheduler, and the global batch, from the
/// ds_config of the run (the manifest keeps ds-rs's resolved config, whose `document` is the
/// file as resolved, or an imported DeepSpeed run's ds_config itself), resolved again for
/// the layout that saved it.
fn universal_resume(m: &Manifest) -> anyhow::Result<universal::Resume> {
    let c = &m.config;
    let document = match c.get("document") {
        Some(d) => d,
        None => c,
    };
    let l = &m.layout;
    let mut dims = ds_config::ParallelDims::new(l.world_size, l.tp, l.pp)?;
    if l.ep > 1 {
        dims = dims.with_ep(l.ep).map_err(anyhow::Error::msg)?;
    }
    if let Some(sp) = c["dims"]["sp"].as_u64().filter(|&sp| sp > 1) {
        dims = dims.with_sp(sp as usize).map_err(anyhow::Error::msg)?;
    }
    let scheduled = document.get("scheduler").is_some_and(|s| !s.is_null());
    if !scheduled && !c["training"]["lr_scheduler_type"].is_null() {
        anyhow::bail!(
            "the lr schedule came from --lr_scheduler_type, which a DeepSpeed load does not \
             restore (Hugging Face's Trainer steps it); give the ds_config a scheduler section"
        );
    }
    let doc = ds_config::hjson::parse(&document.to_string())?;
    let config = ds_config::resolve(&doc, &dims)?;
    let schedule = ds_engine::lr_schedule(&config)?;
    Ok(universal::Resume {
        lr: schedule.lr_at(m.global_steps - m.skipped_steps),
        scheduled,
        batch: config
            .train_batch_size
            .to_json()
            .as_f64()
            .map_or(0, |b| b as u64),
    })
}

fn inspect(dir: &Path) -> anyhow::Result<ExitCode> {
    let latest = checkpoint::latest(dir)?;
    let tags = checkpoint::tags(dir)?;
    if tags.is_empty() {
        anyhow::bail!("{}: no complete checkpoint", dir.display());
    }
    let mut bad = 0;
    for (_, tag) in &tags {
        let mark = if latest.as_deref() == Some(tag.as_str()) {
            " (latest)"
        } else {
            ""
        };
        match checkpoint::verify(&dir.join(tag)) {
            Ok(m) => println!("{tag}{mark}: {}", describe(&m)),
            Err(e) => {
                bad += 1;
                println!("{tag}{mark}: CORRUPT: {e}");
            }
        }
    }
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn describe(m: &Manifest) -> String {
    let bytes: u64 = m.shards.iter().map(|s| s.bytes).sum();
    format!(
        "step {} ({} skipped), {} parameters, {} ZeRO-{} {}, {} shard files, {:.1} MB, checksums ok",
        m.global_steps,
        m.skipped_steps,
        m.parameters(),
        m.layout.parallelism(),
        m.layout.zero_stage,
        m.layout.dtype,
        m.shards.len(),
        bytes as f64 / 1e6
    )
}
