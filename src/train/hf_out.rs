//! `train --save-hf DIR`: the trained model as a Hugging Face directory. Every rank saves
//! its part as a checkpoint (each rank writes only what it owns), rank 0 writes the
//! directory from it a tensor at a time (`ds_models::hf_export`, as `ds-rs checkpoint
//! export-hf` does, so the two are the same bytes), and the checkpoint goes.

use std::path::Path;

use anyhow::Context;
use ds_comm::Communicator;
use ds_config::{Config, ZeroStage};
use ds_engine::model::weights::SaveDtype;
use ds_engine::{Engine, Precision};
use ds_models::hf_export::ExportOptions;
use ds_models::ModelSpec;

use super::{Run, TrainArgs};

/// Where the checkpoint an export reads from lives while it is written.
const STAGING: &str = ".ds-rs-export";

/// --save-hf's refusals, before any rank starts.
pub(super) fn check(args: &TrainArgs, model: &ModelSpec, cfg: &Config) -> anyhow::Result<()> {
    if model.hf_config().is_none() {
        anyhow::bail!(
            "--save-hf: --model {} is the built-in GPT, which has no Hugging Face form; use --save-weights",
            args.model
        );
    }
    if let Some(d) = &args.save_hf_dtype {
        SaveDtype::parse(d).map_err(|e| anyhow::anyhow!("--save-hf-dtype: {e}"))?;
    }
    let z = &cfg.zero_optimization;
    if z.stage == ZeroStage::Weights && !z.stage3_gather_16bit_weights_on_model_save {
        anyhow::bail!(
            "--save-hf at ZeRO-3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save: true \
             (DeepSpeed's save_16bit_model refuses otherwise); or save a checkpoint with --save-dir \
             and run `ds-rs checkpoint export-hf`"
        );
    }
    Ok(())
}

/// The run's precision as the default export dtype.
fn default_dtype(p: Precision) -> SaveDtype {
    match p {
        Precision::BF16 => SaveDtype::Bf16,
        Precision::F16 => SaveDtype::F16,
        Precision::F32 => SaveDtype::F32,
    }
}

/// Writes `dir` after the last step (a collective: every rank calls it).
pub(super) fn save(
    run: &Run,
    engine: &Engine,
    data: &super::data::Data,
    comm: &Communicator,
    dir: &Path,
) -> anyhow::Result<()> {
    let config = run
        .model
        .hf_config()
        .context("--save-hf: no Hugging Face form")?;
    let dtype = match &run.args.save_hf_dtype {
        Some(d) => SaveDtype::parse(d).map_err(anyhow::Error::msg)?,
        None => default_dtype(engine.settings().precision),
    };
    let staging = dir.join(STAGING);
    let tag = format!("global_step{}", engine.global_steps());
    let state = run.client_state(data, run.steps.saturating_sub(1));
    let saved = engine
        .save_checkpoint(&staging, &tag, state)
        .with_context(|| format!("--save-hf: saving the weights under {}", staging.display()))?;
    let mut result = Ok(());
    if comm.rank() == 0 {
        let opts = ExportOptions {
            dtype,
            max_shard_bytes: run.args.save_hf_shard_bytes,
        };
        result = export_hf_from(&saved, dir, &config, &opts).map(|e| {
            println!(
                "saved the Hugging Face model in {} ({} tensors, {} file{}, {:.1} MB, {})",
                dir.display(),
                e.tensors,
                e.files.len(),
                if e.files.len() == 1 { "" } else { "s" },
                e.bytes as f64 / 1e6,
                dtype.torch_name()
            )
        });
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing {}", staging.display()))?;
    }
    // no rank leaves before the directory is written
    comm.world().barrier()?;
    result
}

/// Hugging Face directory `out` from checkpoint `tag_dir` (a tag's directory): ds-models names
/// and writes the tensors, read from the checkpoint one at a time.
pub(crate) fn export_hf_from(
    tag_dir: &Path,
    out: &Path,
    config: &serde_json::Value,
    opts: &ds_models::hf_export::ExportOptions,
) -> anyhow::Result<ds_models::hf_export::Exported> {
    use ds_models::hf_export::{export, TensorStream};
    let m = ds_engine::checkpoint::Manifest::read(tag_dir)?;
    let stream = TensorStream {
        source: tag_dir.display().to_string(),
        tensors: m
            .params
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect(),
        read: Box::new(|put| {
            ds_engine::checkpoint::each_tensor(tag_dir, |p, values| {
                put(&p.name, values)
                    .map_err(|e| ds_engine::checkpoint::CheckpointError::Invalid(e.to_string()))
            })
            .map(drop)
            .map_err(|e| ds_models::ModelError::from_message(e.to_string()))
        }),
    };
    Ok(export(stream, out, config, opts)?)
}

/// Where run_clm.py's `trainer.save_model()` goes (`--output_dir`), when this model and
/// config can be exported; otherwise rank 0 says why not, as the Trainer does when it falls
/// back to the checkpoint alone.
pub(super) fn model_export(
    args: &TrainArgs,
    model: &ModelSpec,
    cfg: &Config,
    rank0: bool,
) -> Option<std::path::PathBuf> {
    let dir = args.trainer_plan.save_model.clone()?;
    match check(args, model, cfg) {
        Ok(()) => Some(dir),
        Err(why) => {
            if rank0 {
                println!(
                    "the trained model is not written to {} as a Hugging Face directory: {why}",
                    dir.display()
                );
            }
            None
        }
    }
}
