//! DeepSpeed's universal checkpoint written from a ds-rs checkpoint, a parameter at a time,
//! so that DeepSpeed (`"checkpoint": {"load_universal": true}`) resumes a ds-rs run in any of
//! its layouts. What DeepSpeed 0.19.8 reads, found by loading (ZeRO-1/2 and ZeRO-3 targets):
//! - `DIR/latest_universal`: the tag (a plain `latest` is not read under load_universal);
//! - `TAG/zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt`: `{"param": tensor}` in the parameter's
//!   shape; `TAG/zero/NAME/step.pt`: Adam's step, an int; every `.pt` there is an optimizer
//!   state, so nothing else may sit beside them;
//! - `TAG/zero/optimizer_state.pt`: `ds_version` and `param_groups` (its `lr` is the next
//!   step's: the fresh scheduler's would be the first step's) and, for a ZeRO-3 target, the
//!   step in `optimizer_state_dict`;
//! - `TAG/mp_rank_00_model_states.pt` (and rank 0's `zero_pp_rank_0_mp_rank_00_...` for a
//!   ZeRO-3 target): `global_steps`, `skipped_steps`, `global_samples`, `dp_world_size`,
//!   `mp_world_size` 1 and the scheduler's `last_batch_iteration`. The module's weights are
//!   not read: they come from `fp32.pt`.
//!
//! Only plain values and fp32 tensors are pickled (torch.load's weights_only accepts them).

use std::path::{Path, PathBuf};

use super::torch::write::{save, Py, Tensor};
use super::{check_tag, each_tensor_state, Manifest};
use crate::{CheckpointError, Result};

/// The optimizer state a universal checkpoint carries: Adam's.
const ADAM: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// The DeepSpeed version whose reader this layout follows (its loader checks the field).
const DS_VERSION: &str = "0.19.8";

/// What the step counters and the schedule say at the checkpoint.
pub struct Resume {
    /// The lr of the next optimizer step (the schedule after the applied steps).
    pub lr: f64,
    /// Whether the run had a scheduler whose position DeepSpeed restores.
    pub scheduled: bool,
    /// Samples per optimizer step (DeepSpeed's train_batch_size).
    pub batch: u64,
}

/// Writes checkpoint `dir` (a tag's directory) as DeepSpeed universal checkpoint `out/TAG`
/// and `out/latest_universal`; returns the tag's directory.
pub fn export(dir: &Path, out: &Path, resume: &Resume) -> Result<(Manifest, PathBuf)> {
    let m = Manifest::read(dir)?;
    if m.optimizer_buffers != ADAM {
        return Err(CheckpointError::file(
            dir.join(super::MANIFEST),
            format!(
                "optimizer state {:?}: DeepSpeed's universal checkpoints carry Adam's {ADAM:?}",
                m.optimizer_buffers
            ),
        ));
    }
    check_tag(&m.tag)?;
    for p in &m.params {
        if p.name.is_empty() || p.name.contains('/') || p.name.starts_with('.') {
            return Err(CheckpointError::Invalid(format!(
                "parameter {:?}: not a name DeepSpeed's universal checkpoint can use as a directory",
                p.name
            )));
        }
    }
    let (tag_dir, partial) = (out.join(&m.tag), out.join(format!(".{}.partial", m.tag)));
    if tag_dir.exists() {
        return Err(CheckpointError::file(
            &tag_dir,
            "exists already; nothing was overwritten",
        ));
    }
    let made = std::fs::create_dir_all(out)
        .and_then(|_| match partial.exists() {
            true => std::fs::remove_dir_all(&partial),
            false => Ok(()),
        })
        .and_then(|_| std::fs::create_dir_all(partial.join("zero")));
    made.map_err(|e| CheckpointError::file(&partial, e))?;
    let written = write_all(dir, &m, &partial, resume).and_then(|_| {
        std::fs::rename(&partial, &tag_dir).map_err(|e| CheckpointError::file(&tag_dir, e))?;
        super::files::write_atomic(&out.join("latest_universal"), m.tag.as_bytes())
    });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    written.map(|_| (m, tag_dir))
}

fn write_all(dir: &Path, m: &Manifest, to: &Path, resume: &Resume) -> Result<()> {
    let step = Py::Int(m.optimizer_step as i64);
    each_tensor_state(dir, true, |p, master, buffers| {
        let param_dir = to.join("zero").join(&p.name);
        std::fs::create_dir_all(&param_dir).map_err(|e| CheckpointError::file(&param_dir, e))?;
        let wrapped = Py::dict([("param", Py::Tensor(0))]);
        let states = std::iter::once(("fp32", master))
            .chain(buffers.iter().map(|(n, v)| (n.as_str(), &v[..])));
        for (name, values) in states {
            let t = Tensor {
                shape: p.shape.clone(),
                values,
            };
            save(&param_dir.join(format!("{name}.pt")), &wrapped, &[t])?;
        }
        save(&param_dir.join("step.pt"), &step, &[])
    })?;
    let group = Py::dict([("lr", Py::Float(resume.lr))]);
    let optimizer = Py::dict([
        ("ds_version", Py::str(DS_VERSION)),
        ("param_groups", Py::List(vec![group.clone()])),
        (
            "optimizer_state_dict",
            Py::dict([
                (
                    "state",
                    Py::Dict(vec![(Py::Int(0), Py::dict([("step", step.clone())]))]),
                ),
                ("param_groups", Py::List(vec![group])),
            ]),
        ),
    ]);
    save(&to.join("zero/optimizer_state.pt"), &optimizer, &[])?;
    let applied = m.global_steps - m.skipped_steps;
    let mut states = vec![
        ("global_steps", Py::Int(m.global_steps as i64)),
        ("skipped_steps", Py::Int(m.skipped_steps as i64)),
        (
            "global_samples",
            Py::Int((m.global_steps * resume.batch) as i64),
        ),
        ("dp_world_size", Py::Int(m.layout.dp as i64)),
        ("mp_world_size", Py::Int(1)),
        ("ds_version", Py::str(DS_VERSION)),
    ];
    if resume.scheduled {
        let last = applied as i64 - 1;
        states.push((
            "lr_scheduler",
            Py::dict([("last_batch_iteration", Py::Int(last))]),
        ));
    }
    let model_states = Py::dict(states);
    save(&to.join("mp_rank_00_model_states.pt"), &model_states, &[])?;
    save(
        &to.join("zero_pp_rank_0_mp_rank_00_model_states.pt"),
        &model_states,
        &[],
    )
}
