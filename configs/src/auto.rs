//! HF-style `"auto"` values, filled the way the HF Trainer's DeepSpeed integration fills them
//! (transformers 5.24 integrations/deepspeed.py: `HfTrainerDeepSpeedConfig`'s
//! `trainer_config_process` and `trainer_config_finalize`), from the training arguments.
//!
//! DeepSpeed itself does not fill them: a batch key left "auto" is an error, and an "auto"
//! inside a typed section takes the default (see Note ["auto" inside sections]).

// Note [given and default]
// HF compares every argument, given or defaulted, with the number a config holds, so a config
// with `"train_micro_batch_size_per_gpu": 4` fails under the Trainer unless the user also
// passes `--per_device_train_batch_size 4`. ds-rs checks only the arguments the user gave: a
// flag that contradicts the config is an error naming both, and an argument left out takes
// the config's number where it has one (the batch also derives from the triad as DeepSpeed
// does), else HF's default. With every argument given, the filled values and the mismatches
// are exactly HF's (tests/hf_auto.rs holds them to transformers' own output).

use serde_json::Value as Json;

use crate::batch::{GRAD_ACCUM, MICRO_BATCH, TRAIN_BATCH_SIZE};
use crate::error::{ConfigError, Mismatch, Result};
use crate::training_args::{TrainingArgs, DEFAULT_GRAD_ACCUM, DEFAULT_MICRO_BATCH};
use crate::value::{py_float_repr, Dict, Value};

/// What the training command knows besides its arguments.
#[derive(Debug, Clone, Copy)]
pub struct FillContext {
    /// The data-parallel size `train_batch_size` is computed for.
    pub data_parallel: i64,
    /// The model's hidden size: sets ZeRO's bucket sizes.
    pub hidden_size: Option<i64>,
    /// The steps this run trains (the schedule's total when `--max_steps` is not given).
    pub run_steps: Option<i64>,
}

/// One "auto" that was replaced: its JSON path and the value it became.
pub type Filled = (String, Json);

/// How HF treats a key: `fill_match` (fill "auto", else compare with the argument) or
/// `fill_only`.
enum Check {
    Only,
    /// The flags the value comes from, and whether the user gave one.
    Match {
        arg: String,
        given: bool,
    },
}

struct Entry {
    path: &'static str,
    value: Option<Value>,
    check: Check,
}

/// Replaces the "auto" values the arguments supply and returns what each became; an error
/// lists every given argument that contradicts a number of the config.
pub fn fill(root: &mut Dict, args: &TrainingArgs, ctx: &FillContext) -> Result<Vec<Filled>> {
    let entries = entries(root, args, ctx);
    let mut filled = Vec::new();
    let mut mismatches = Vec::new();
    for e in entries {
        let Some(slot) = slot(root, e.path) else {
            continue;
        };
        match (slot, &e.value) {
            (Some(v), Some(new)) if v.is_auto() => {
                *v = new.clone();
                filled.push((e.path.to_string(), new.to_json()));
            }
            (Some(v), Some(new)) => {
                if let Check::Match { arg, given: true } = &e.check {
                    if *v != Value::Null && !py_eq(v, new) {
                        mismatches.push(Mismatch {
                            path: e.path.to_string(),
                            config: show(v),
                            arg: arg.clone(),
                            value: show(new),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    match mismatches.is_empty() {
        true => Ok(filled),
        false => Err(ConfigError::Mismatch(mismatches)),
    }
}

/// The keys HF fills, in the order it visits them, with the value each takes here.
fn entries(root: &Dict, args: &TrainingArgs, ctx: &FillContext) -> Vec<Entry> {
    let (micro, accum) = effective_batch(root, args, ctx.data_parallel);
    let batch_given = args.per_device_train_batch_size.is_some();
    let accum_given = args.gradient_accumulation_steps.is_some();
    let lr_given = args.learning_rate.is_some();
    let m = |arg: &str, given| Check::Match {
        arg: arg.to_string(),
        given,
    };
    let float = |x: f64| Some(Value::Float(x));
    let (b1, b2) = args.betas();
    let total = args.max_steps.or(ctx.run_steps);
    let mut e = vec![
        entry(MICRO_BATCH, Some(Value::Int(micro)), m("--per_device_train_batch_size", batch_given)),
        entry(GRAD_ACCUM, Some(Value::Int(accum)), m("--gradient_accumulation_steps", accum_given)),
        entry(
            TRAIN_BATCH_SIZE,
            // a product past i64 is left "auto", and resolve names that path
            micro.checked_mul(accum).and_then(|x| x.checked_mul(ctx.data_parallel)).map(Value::Int),
            m(
                &format!(
                    "--per_device_train_batch_size x --gradient_accumulation_steps x data-parallel size {}",
                    ctx.data_parallel
                ),
                batch_given || accum_given,
            ),
        ),
        entry("gradient_clipping", float(args.max_grad_norm()), m("--max_grad_norm", args.max_grad_norm.is_some())),
        entry("optimizer.params.lr", float(args.lr()), m("--learning_rate", lr_given)),
        entry(
            "optimizer.params.betas",
            Some(Value::List(vec![Value::Float(b1), Value::Float(b2)])),
            m("--adam_beta1, --adam_beta2", args.adam_beta1.is_some() || args.adam_beta2.is_some()),
        ),
        entry("optimizer.params.eps", float(args.eps()), m("--adam_epsilon", args.adam_epsilon.is_some())),
        entry(
            "optimizer.params.weight_decay",
            float(args.weight_decay()),
            m("--weight_decay", args.weight_decay.is_some()),
        ),
        entry("scheduler.params.warmup_min_lr", Some(Value::Int(0)), Check::Only),
        entry("scheduler.params.warmup_max_lr", float(args.lr()), m("--learning_rate", lr_given)),
        entry("fp16.enabled", Some(Value::Bool(args.fp16 == Some(true))), m("--fp16", args.fp16.is_some())),
        entry("bf16.enabled", Some(Value::Bool(args.bf16 == Some(true))), m("--bf16", args.bf16.is_some())),
    ];
    e.extend(hidden_size_entries(root, ctx.hidden_size));
    e.push(entry(
        "scheduler.params.total_num_steps",
        total.map(Value::Int),
        m("--max_steps", args.max_steps.is_some()),
    ));
    e.push(entry(
        "scheduler.params.warmup_num_steps",
        // deepspeed >= 0.19.6 rejects 0 warmup steps; HF keeps the filled value positive
        args.warmup(total).map(|w| Value::Int(w.max(1))),
        m("--warmup_steps", args.warmup_steps.is_some()),
    ));
    e
}

fn entry(path: &'static str, value: Option<Value>, check: Check) -> Entry {
    Entry { path, value, check }
}

/// ZeRO's bucket sizes from the model's hidden size, when one of them is "auto"; the stage-3
/// pair only at stage 3 (HF's `is_zero3`).
fn hidden_size_entries(root: &Dict, hidden: Option<i64>) -> Vec<Entry> {
    let Some(h) = hidden else {
        return Vec::new();
    };
    // sizes past i64 are left "auto", as above
    let square = h.checked_mul(h);
    let mut e = vec![entry(
        "zero_optimization.reduce_bucket_size",
        square.map(Value::Int),
        Check::Only,
    )];
    let stage3 = matches!(
        root.get("zero_optimization").and_then(|z| z.as_dict()?.get("stage")),
        Some(v) if v.as_f64() == Some(3.0) && !matches!(v, Value::Bool(_))
    );
    if stage3 {
        e.push(entry(
            "zero_optimization.stage3_prefetch_bucket_size",
            square.map(|s| Value::Int((0.9 * s as f64) as i64)),
            Check::Only,
        ));
        e.push(entry(
            "zero_optimization.stage3_param_persistence_threshold",
            h.checked_mul(10).map(Value::Int),
            Check::Only,
        ));
    }
    e
}

/// The micro-batch and accumulation an argument left out takes: the config's number, else
/// what DeepSpeed's triad rule derives from the others (when it divides evenly), else HF's
/// default. See Note [given and default].
fn effective_batch(root: &Dict, args: &TrainingArgs, dp: i64) -> (i64, i64) {
    let num = |key: &str| match root.get(key) {
        Some(Value::Int(n)) if *n > 0 => Some(*n),
        _ => None,
    };
    let exact = |total: i64, by: i64| (by > 0 && total % by == 0).then(|| total / by);
    let tbs = num(TRAIN_BATCH_SIZE);
    let accum_known = args.gradient_accumulation_steps.or(num(GRAD_ACCUM));
    let micro = args
        .per_device_train_batch_size
        .or(num(MICRO_BATCH))
        .or_else(|| exact(tbs?, accum_known.unwrap_or(1).checked_mul(dp)?))
        .unwrap_or(DEFAULT_MICRO_BATCH);
    let accum = accum_known
        .or_else(|| exact(tbs?, micro.checked_mul(dp)?))
        .unwrap_or(DEFAULT_GRAD_ACCUM);
    (micro, accum)
}

/// The slot of `path` when its parent section exists (HF's `find_config_node`): the value,
/// or None when the key is absent.
fn slot<'a>(root: &'a mut Dict, path: &str) -> Option<Option<&'a mut Value>> {
    let mut parts: Vec<&str> = path.split('.').collect();
    let last = parts.pop().expect("invariant: a path has a last part");
    let mut d = root;
    for p in parts {
        match d.0.iter_mut().find(|(k, _)| k == p) {
            Some((_, Value::Dict(inner))) => d = inner,
            _ => return None,
        }
    }
    Some(d.0.iter_mut().find(|(k, _)| k == last).map(|(_, v)| v))
}

/// Python's `==` on config values: numbers by value (True == 1 == 1.0), lists element-wise.
fn py_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| py_eq(a, b))
        }
        (Value::Str(x), Value::Str(y)) => x == y,
        _ => matches!((a.as_f64(), b.as_f64()), (Some(x), Some(y)) if x == y),
    }
}

/// A value as Python prints it in HF's message.
fn show(v: &Value) -> String {
    match v {
        Value::Float(f) => py_float_repr(*f),
        Value::List(l) => format!("[{}]", l.iter().map(show).collect::<Vec<_>>().join(", ")),
        Value::Bool(b) => if *b { "True" } else { "False" }.to_string(),
        Value::Str(s) => format!("'{s}'"),
        other => other.to_json().to_string(),
    }
}

/// Given flags that fill nothing and that nothing else uses (HF's Trainer ignores them the
/// same way): a warning each, naming the key that would take the flag.
pub fn unused_flags(root: &Dict, args: &TrainingArgs) -> Vec<String> {
    let section = |key: &str| root.get(key).and_then(Value::as_dict);
    let has = |d: Option<&Dict>, key: &str| d.is_some_and(|d| d.contains_key(key));
    let params = |key: &str| section(key).and_then(|d| d.get("params")?.as_dict());
    let (optimizer, scheduler) = (section("optimizer"), section("scheduler"));
    let mut unused = Vec::new();
    // with no optimizer section these build the program's AdamW
    if optimizer.is_some() {
        let p = params("optimizer");
        let given = [
            ("--learning_rate", args.learning_rate.is_some(), "lr"),
            (
                "--adam_beta1/--adam_beta2",
                args.adam_beta1.or(args.adam_beta2).is_some(),
                "betas",
            ),
            ("--adam_epsilon", args.adam_epsilon.is_some(), "eps"),
            (
                "--weight_decay",
                args.weight_decay.is_some(),
                "weight_decay",
            ),
        ];
        for (flag, on, key) in given {
            if on && !has(p, key) {
                unused.push((flag, format!("optimizer.params.{key}")));
            }
        }
    }
    if args.max_grad_norm.is_some() && !root.contains_key("gradient_clipping") {
        unused.push(("--max_grad_norm", "gradient_clipping".into()));
    }
    for (flag, on, key) in [("--bf16", args.bf16, "bf16"), ("--fp16", args.fp16, "fp16")] {
        let named = key == "bf16" && root.contains_key("bfloat16");
        if on == Some(true) && !root.contains_key(key) && !named {
            unused.push((flag, format!("{key}.enabled")));
        }
    }
    // with no scheduler section these shape the program's schedule, when it builds one
    // (--max_steps is never without effect: it is the run's length too)
    let program_schedule = args.builds_schedule(optimizer.is_some(), scheduler.is_some());
    if !program_schedule {
        let p = params("scheduler");
        if args.warmup_steps.is_some() && !has(p, "warmup_num_steps") {
            unused.push(("--warmup_steps", "scheduler.params.warmup_num_steps".into()));
        }
    }
    if scheduler.is_some() && args.lr_scheduler_type.is_some() {
        unused.push((
            "--lr_scheduler_type",
            "scheduler (the config's section decides)".into(),
        ));
    }
    unused
        .into_iter()
        .map(|(flag, key)| {
            format!("{flag}: no effect: the config has no {key} to take it (Hugging Face's Trainer ignores it too); write \"auto\" there to let the flag decide")
        })
        .collect()
}

/// Every JSON path still holding "auto", in document order.
pub fn remaining(root: &Dict) -> Vec<String> {
    fn walk(d: &Dict, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in d.iter() {
            let path = if prefix.is_empty() {
                k.to_string()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                Value::Dict(inner) => walk(inner, &path, out),
                v if v.is_auto() => out.push(path),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(root, "", &mut out);
    out
}

#[cfg(test)]
mod tests;
