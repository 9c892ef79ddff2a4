//! Hugging Face model directories out: config.json and safetensors under transformers'
//! names, shapes and a chosen dtype, sharded with `model.safetensors.index.json` above a size,
//! written from a stream of tensors one at a time (a ds-rs checkpoint's, read by the binary
//! through ds-engine's checkpoints: no process holds the model).

use std::path::Path;

use ds_nn::model::weights::{SaveDtype, StreamingWriter, HF_INDEX, HF_WEIGHTS};
use serde_json::Value;

use crate::{err, Arch, ModelError, ModelSpec};

/// How to write the directory.
#[derive(Debug, Clone, Copy)]
pub struct ExportOptions {
    pub dtype: SaveDtype,
    /// A shard file holds tensors up to this many bytes (a larger tensor is a shard alone);
    /// one shard is written as `model.safetensors`, several with an index.
    pub max_shard_bytes: u64,
}

/// transformers' default `max_shard_size` (5 GB).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    pub files: Vec<String>,
    pub tensors: usize,
    pub bytes: u64,
}

/// A model's tensors in their stored order, read one at a time.
pub struct TensorStream<'a> {
    /// Where they come from, for messages (a checkpoint's directory).
    pub source: String,
    /// Each tensor's name and shape, in the order `read` hands them over.
    pub tensors: Vec<(String, Vec<usize>)>,
    /// Calls its argument with each tensor's name and values, in that order.
    #[allow(clippy::type_complexity)]
    pub read: Box<
        dyn FnOnce(&mut dyn FnMut(&str, &[f32]) -> Result<(), ModelError>) -> Result<(), ModelError>
            + 'a,
    >,
}

/// Writes Hugging Face directory `out` from the tensors of `stream` and the model's `config`
/// (config.json's object): the tensors in the stream's order, a tied LM head left out as
/// save_pretrained leaves it.
pub fn export(
    stream: TensorStream,
    out: &Path,
    config: &Value,
    opts: &ExportOptions,
) -> Result<Exported, ModelError> {
    let layout = FileLayout::of(config)?;
    let transposed = &layout.transposed;
    let keep = |name: &str| !layout.tied.iter().any(|(copy, _)| copy == name);
    let shapes: std::collections::HashMap<&str, &[usize]> = stream
        .tensors
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let tensors: Vec<(String, Vec<usize>)> = stream
        .tensors
        .iter()
        .filter(|(name, _)| keep(name))
        .map(|(name, shape)| match transposed.contains(name) {
            true => (name.clone(), shape.iter().rev().copied().collect()),
            false => (name.clone(), shape.clone()),
        })
        .collect();
    for (copy, owner) in &layout.tied {
        if !tensors.iter().any(|(n, _)| n == owner) {
            return Err(err(format!(
                "{}: {copy} is tied to {owner}, which the checkpoint does not hold",
                stream.source
            )));
        }
    }
    let shards = plan_shards(&tensors, opts);
    let names = shard_names(shards.len());
    prepare_dir(out)?;
    write_config(out, config, opts.dtype)?;
    let mut exported = Exported {
        files: names.clone(),
        tensors: tensors.len(),
        bytes: 0,
    };
    let mut k = 0; // the next exported tensor
    let mut writer: Option<StreamingWriter> = None;
    let shard_of = |k: usize| shards.iter().position(|r| r.contains(&k));
    (stream.read)(&mut |name, values| {
        if !keep(name) {
            return Ok(());
        }
        let s = shard_of(k).expect("invariant: every tensor is in a shard");
        if shards[s].start == k {
            let part: Vec<(String, Vec<usize>)> = tensors[shards[s].clone()].to_vec();
            let path = out.join(&names[s]);
            writer = Some(StreamingWriter::create(
                &path,
                &part,
                opts.dtype,
                &[("format", "pt")],
            )?);
        }
        let w = writer.as_mut().expect("invariant: a shard is open");
        match transposed.contains(name) {
            true => {
                let shape = shapes[name];
                w.put(&transpose(values, shape[0], shape[1]))?
            }
            false => w.put(values)?,
        }
        exported.bytes += (values.len() * opts.dtype.width()) as u64;
        if shards[s].end == k + 1 {
            writer
                .take()
                .expect("invariant: a shard is open")
                .finish()?;
        }
        k += 1;
        Ok(())
    })?;
    if names.len() > 1 {
        write_index(out, &tensors, &shards, &names, exported.bytes)?;
    }
    Ok(exported)
}

/// The parameters whose files hold them transposed (GPT-2's Conv1D weights), by name.
/// How the model's parameters go into its files, from the parameters the model declares:
/// which are stored transposed (GPT-2's Conv1D), and which are tied copies (copy, owner),
/// left out as save_pretrained leaves them.
struct FileLayout {
    transposed: std::collections::HashSet<String>,
    tied: Vec<(String, String)>,
}

impl FileLayout {
    fn of(config: &Value) -> Result<FileLayout, ModelError> {
        let arch =
            Arch::from_hf_json(config).map_err(|e| err(format!("the model's config: {e}")))?;
        let spec = ModelSpec {
            name: "the exported model".into(),
            arch,
            seq_len: 1,
            weights: None,
            source_config: None,
            tile: None,
        };
        let params = spec
            .build(&ds_nn::parallel::Tp::none())
            .map_err(err)?
            .params();
        Ok(FileLayout {
            transposed: params
                .iter()
                .filter(|p| p.stored_transposed)
                .map(|p| p.name.clone())
                .collect(),
            tied: params
                .into_iter()
                .filter_map(|p| p.tied.map(|owner| (p.name, owner)))
                .collect(),
        })
    }
}

/// A [rows, cols] matrix's transpose.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = v[r * cols + c];
        }
    }
    t
}

/// Consecutive tensors grouped into shards of at most `max_shard_bytes` each.
fn plan_shards(
    tensors: &[(String, Vec<usize>)],
    opts: &ExportOptions,
) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, (_, shape)) in tensors.iter().enumerate() {
        let len = (shape.iter().product::<usize>() * opts.dtype.width()) as u64;
        if i > start && bytes + len > opts.max_shard_bytes {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += len;
    }
    shards.push(start..tensors.len());
    shards
}

/// transformers' file names: `model.safetensors`, or `model-00001-of-00003.safetensors`...
fn shard_names(n: usize) -> Vec<String> {
    match n {
        1 => vec![HF_WEIGHTS.to_string()],
        _ => (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect(),
    }
}

/// Creates `out`, removing an earlier export's weights (a stale `model.safetensors` would
/// shadow a new sharded index in transformers' loader).
fn prepare_dir(out: &Path) -> Result<(), ModelError> {
    let io = |e: std::io::Error| err(format!("{}: {e}", out.display()));
    std::fs::create_dir_all(out).map_err(io)?;
    for entry in std::fs::read_dir(out).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let stale =
            name == HF_INDEX || (name.starts_with("model") && name.ends_with(".safetensors"));
        if stale {
            std::fs::remove_file(&path).map_err(io)?;
        }
    }
    Ok(())
}

fn write_config(out: &Path, config: &Value, dtype: SaveDtype) -> Result<(), ModelError> {
    let mut c = config.clone();
    c["dtype"] = dtype.torch_name().into();
    write_json(&out.join("config.json"), &c)
}

fn write_index(
    out: &Path,
    tensors: &[(String, Vec<usize>)],
    shards: &[std::ops::Range<usize>],
    names: &[String],
    total: u64,
) -> Result<(), ModelError> {
    let mut map = serde_json::Map::new();
    for (s, r) in shards.iter().enumerate() {
        for (name, _) in &tensors[r.clone()] {
            map.insert(name.clone(), names[s].clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    write_json(&out.join(HF_INDEX), &index)
}

fn write_json(path: &Path, v: &Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(v).expect("invariant: JSON values serialise");
    std::fs::write(path, text + "\n").map_err(|e| err(format!("{}: {e}", path.display())))
}
