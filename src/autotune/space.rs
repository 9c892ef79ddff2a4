//! The search space of a user's ds_config, DeepSpeed's way: a list is a tuning dimension
//! (`"stage": [1, 2]`, `"train_micro_batch_size_per_gpu": [2, 4]`, any other
//! `zero_optimization` key), and the `autotuning` section says how to search. Beyond
//! DeepSpeed, lists in `tensor_parallel.autotp_size`, `pipeline.stages` and an enabled
//! `expert_parallel.autoep_size` make the tensor-, pipeline- and expert-parallel degrees
//! dimensions too.

use anyhow::{bail, Context};
use ds_autotune::tuning::{Dimension, Layout, Metric, Space, TunerKind};
use serde_json::{json, Value as Json};

/// DeepSpeed's default tuning spaces for `fast: false` (autotuning/constants.py
/// DEFAULT_TUNING_SPACE_ZERO_*) over the keys the user's config leaves unset, without the
/// keys whose other value ds-rs does not have:
/// it always reduce-scatters into contiguous gradients and gathers whole partitions
/// (`reduce_scatter`, `contiguous_gradients`, `allgather_partitions`), and stage 3 gathers
/// in `stage3_prefetch_bucket_size` pieces where DeepSpeed's template varies
/// `allgather_bucket_size`.
fn default_settings(stage: u8) -> Vec<Dimension> {
    let sizes = || vec![json!(5e7), json!(5e8), json!(1e9)];
    let dim = |key: &str, values: Vec<Json>| Dimension {
        key: key.into(),
        values,
    };
    let overlap = || dim("overlap_comm", vec![json!(true), json!(false)]);
    match stage {
        1 => vec![
            dim("reduce_bucket_size", sizes()),
            dim("allgather_bucket_size", sizes()),
        ],
        2 => vec![
            overlap(),
            dim("reduce_bucket_size", sizes()),
            dim("allgather_bucket_size", sizes()),
        ],
        3 => vec![
            overlap(),
            dim("reduce_bucket_size", sizes()),
            dim("stage3_prefetch_bucket_size", sizes()),
        ],
        _ => Vec::new(),
    }
}

/// The search space; `fixed`: the train command's own `--tp` / `--pp` / `--ep`, which fix
/// those degrees.
pub fn space_of(
    user: &Json,
    ranks: usize,
    fixed: Fixed,
    name: &dyn Fn() -> String,
) -> anyhow::Result<Space> {
    let at = &user["autotuning"];
    let int = |k: &str, d: i64| at.get(k).and_then(Json::as_i64).unwrap_or(d);
    let text = |k: &str, d: &str| at.get(k).and_then(Json::as_str).unwrap_or(d).to_string();
    let metric = text("metric", "throughput");
    let metric = Metric::parse(&metric).with_context(|| {
        format!(
            "{}: autotuning.metric = {metric:?}: expected one of {:?}",
            name(),
            Metric::NAMES
        )
    })?;
    let tuner = text("tuner_type", "gridsearch");
    let tuner = TunerKind::parse(&tuner).with_context(|| {
        format!(
            "{}: autotuning.tuner_type = {tuner:?}: expected one of {:?}",
            name(),
            TunerKind::NAMES
        )
    })?;
    let fast = at.get("fast").and_then(Json::as_bool).unwrap_or(true);
    let micro = user.get("train_micro_batch_size_per_gpu");
    let micro_batches = match micro {
        Some(Json::Array(v)) => Some(positive_list(v).with_context(|| {
            format!("{}: train_micro_batch_size_per_gpu = {}: a list to tune must hold positive integers", name(), Json::Array(v.clone()))
        })?),
        _ => None,
    };
    let min_micro_batch = match micro.and_then(Json::as_u64) {
        Some(m) if m > 0 => m as usize,
        _ => int("min_train_micro_batch_size_per_gpu", 1).max(1) as usize,
    };
    let user_settings = zero_lists(user);
    // the default space leaves alone what the user set
    let unset = |d: &Dimension| {
        user.pointer(&format!("/zero_optimization/{}", d.key))
            .is_none()
    };
    let settings = std::array::from_fn(|stage| match (&user_settings, fast) {
        (Some(dims), _) => dims.clone(),
        (None, false) => default_settings(stage as u8)
            .into_iter()
            .filter(unset)
            .collect(),
        (None, true) => Vec::new(),
    });
    Ok(Space {
        stages: stages(user).with_context(|| format!("{}: zero_optimization.stage", name()))?,
        layouts: layouts(user, fixed, name)?,
        micro_batches,
        min_micro_batch,
        max_micro_batch: int("max_train_micro_batch_size_per_gpu", 1024).max(1) as usize,
        num_micro_batches: int("num_tuning_micro_batch_sizes", 3).max(1) as usize,
        gas: user
            .get("gradient_accumulation_steps")
            .and_then(Json::as_u64)
            .unwrap_or(1)
            .max(1) as usize,
        max_train_batch_size: at
            .get("max_train_batch_size")
            .and_then(Json::as_u64)
            .map(|n| n as usize),
        ranks,
        fast,
        tuner,
        metric,
        num_trials: int("tuner_num_trials", 50).max(1) as usize,
        early_stopping: int("tuner_early_stopping", 5).max(0) as usize,
        settings,
    })
}

fn stages(user: &Json) -> anyhow::Result<Vec<u8>> {
    let stage_of = |v: &Json| v.as_u64().filter(|&s| s <= 3).map(|s| s as u8);
    Ok(match user.pointer("/zero_optimization/stage") {
        None => vec![0],
        Some(Json::String(s)) if s == "all" => vec![0, 1, 2, 3],
        Some(Json::Array(v)) => v
            .iter()
            .map(stage_of)
            .collect::<Option<_>>()
            .context("a ZeRO stage 0-3")?,
        Some(v) => vec![stage_of(v).context("a ZeRO stage 0-3")?],
    })
}

/// The `zero_optimization` keys other than the stage given as lists (None: no list).
fn zero_lists(user: &Json) -> Option<Vec<Dimension>> {
    let zero = user.get("zero_optimization")?.as_object()?;
    let dims: Vec<Dimension> = zero
        .iter()
        .filter(|(k, _)| *k != "stage")
        .filter_map(|(k, v)| match v {
            Json::Array(values) if !values.is_empty() => Some(Dimension {
                key: k.clone(),
                values: values.clone(),
            }),
            _ => None,
        })
        .collect();
    (!dims.is_empty()).then_some(dims)
}

/// The degrees the train command's flags fix.
pub type Fixed = ds_engine::LayoutFlags;

/// Tensor- x pipeline- x expert- x sequence-parallel degrees: the train command's flags, else
/// the config's integers or lists (the expert-parallel size where its section is enabled).
fn layouts(user: &Json, fixed: Fixed, name: &dyn Fn() -> String) -> anyhow::Result<Vec<Layout>> {
    let degrees = |flag: Option<usize>, pointer: &str| -> anyhow::Result<Vec<usize>> {
        if let Some(n) = flag {
            return Ok(vec![n]);
        }
        match user.pointer(pointer) {
            Some(Json::Array(v)) => positive_list(v).with_context(|| {
                format!(
                    "{}: {} = {}: a list to tune must hold positive integers",
                    name(),
                    pointer[1..].replace('/', "."),
                    Json::Array(v.clone())
                )
            }),
            Some(v) => Ok(vec![v.as_u64().map_or(1, |n| n.max(1) as usize)]),
            None => Ok(vec![1]),
        }
    };
    let tps = degrees(fixed.tp, "/tensor_parallel/autotp_size")?;
    let pps = degrees(fixed.pp, "/pipeline/stages")?;
    let eps = match user.pointer("/expert_parallel/enabled") {
        Some(Json::Bool(true)) => degrees(fixed.ep, "/expert_parallel/autoep_size")?,
        _ => vec![fixed.ep.unwrap_or(1)],
    };
    let sps = degrees(fixed.sp, "/sequence_parallel_size")?;
    let mut all = Vec::new();
    for &pp in &pps {
        for &tp in &tps {
            for &ep in &eps {
                all.extend(sps.iter().map(|&sp| Layout { tp, pp, ep, sp }));
            }
        }
    }
    Ok(all)
}

fn positive_list(v: &[Json]) -> anyhow::Result<Vec<usize>> {
    let list: Vec<usize> = v
        .iter()
        .filter_map(Json::as_u64)
        .map(|n| n as usize)
        .collect();
    if list.is_empty() || list.len() != v.len() || list.contains(&0) {
        bail!("not a list of positive integers");
    }
    Ok(list)
}

/// Replaces every list inside `c` by its first element (DeepSpeed's `get_first_config`).
pub fn first_of_lists(c: &mut Json) {
    match c {
        Json::Object(o) => o.values_mut().for_each(first_of_lists),
        Json::Array(v) if !v.is_empty() && !v.iter().all(Json::is_string) => {
            *c = v[0].clone();
            first_of_lists(c);
        }
        _ => {}
    }
}
