//! HF-style `"auto"` values, filled the way the HF Trainer's DeepSpeed integration fills them
//! (transformers/integrations/deepspeed.py: `trainer_config_process` and
//! `trainer_config_finalize`), from what the training command knows.
//!
//! DeepSpeed itself does not fill them: a batch key left "auto" is an error, and an "auto"
//! inside a typed section takes the default (see Note ["auto" inside sections]).

use serde_json::Value as Json;

use crate::value::{Dict, Value};

/// What a training command knows and can put in place of "auto". `None` leaves it "auto".
#[derive(Debug, Clone, Default)]
pub struct AutoValues {
    pub micro_batch: Option<i64>,
    pub grad_accum: Option<i64>,
    /// The data-parallel size `train_batch_size` is computed for.
    pub data_parallel: Option<i64>,
    pub grad_clip: Option<f64>,
    pub lr: Option<f64>,
    pub betas: Option<(f64, f64)>,
    pub eps: Option<f64>,
    pub weight_decay: Option<f64>,
    pub warmup_steps: Option<i64>,
    pub total_steps: Option<i64>,
    pub fp16: Option<bool>,
    pub bf16: Option<bool>,
    /// The model's hidden size: sets ZeRO's bucket sizes.
    pub hidden_size: Option<i64>,
}

/// One "auto" that was replaced: its JSON path and the value it became.
pub type Filled = (String, Json);

/// Replaces the "auto" values that `vals` can supply, and returns what each became.
pub fn fill(root: &mut Dict, vals: &AutoValues) -> Vec<Filled> {
    let mut filled = Vec::new();
    let mut put = |path: &str, v: Option<Value>| {
        if let Some(v) = v {
            if replace_auto(root, path, v.clone()) {
                filled.push((path.to_string(), v.to_json()));
            }
        }
    };
    let int = |x: Option<i64>| x.map(Value::Int);
    let float = |x: Option<f64>| x.map(Value::Float);
    let tbs = vals
        .micro_batch
        .zip(vals.grad_accum)
        .zip(vals.data_parallel)
        // A product past i64 is left "auto", and resolve names that path.
        .and_then(|((m, g), d)| m.checked_mul(g)?.checked_mul(d));
    put("train_micro_batch_size_per_gpu", int(vals.micro_batch));
    put("gradient_accumulation_steps", int(vals.grad_accum));
    put("train_batch_size", int(tbs));
    put("gradient_clipping", float(vals.grad_clip));
    put("optimizer.params.lr", float(vals.lr));
    put(
        "optimizer.params.betas",
        vals.betas
            .map(|(a, b)| Value::List(vec![Value::Float(a), Value::Float(b)])),
    );
    put("optimizer.params.eps", float(vals.eps));
    put("optimizer.params.weight_decay", float(vals.weight_decay));
    put("scheduler.params.warmup_min_lr", Some(Value::Int(0)));
    put("scheduler.params.warmup_max_lr", float(vals.lr));
    put("scheduler.params.warmup_num_steps", int(vals.warmup_steps));
    put("scheduler.params.total_num_steps", int(vals.total_steps));
    put("fp16.enabled", vals.fp16.map(Value::Bool));
    put("bf16.enabled", vals.bf16.map(Value::Bool));
    if let Some(h) = vals.hidden_size {
        // Sizes past i64 are left "auto", as above.
        let square = h.checked_mul(h);
        put("zero_optimization.reduce_bucket_size", int(square));
        put(
            "zero_optimization.stage3_prefetch_bucket_size",
            int(square.map(|s| (0.9 * s as f64) as i64)),
        );
        put(
            "zero_optimization.stage3_param_persistence_threshold",
            int(h.checked_mul(10)),
        );
    }
    filled
}

/// Sets `path` to `v` if it currently holds "auto"; true when it did.
fn replace_auto(root: &mut Dict, path: &str, v: Value) -> bool {
    let mut parts: Vec<&str> = path.split('.').collect();
    let last = parts.pop().expect("invariant: a path has a last part");
    let mut d = root;
    for p in parts {
        match d.0.iter_mut().find(|(k, _)| k == p) {
            Some((_, Value::Dict(inner))) => d = inner,
            _ => return false,
        }
    }
    match d.0.iter_mut().find(|(k, _)| k == last) {
        Some((_, slot)) if slot.is_auto() => {
            *slot = v;
            true
        }
        _ => false,
    }
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
mod tests {
    use super::*;
    use crate::hjson;

    fn dict(text: &str) -> Dict {
        hjson::parse(text).unwrap().as_dict().unwrap().clone()
    }

    #[test]
    fn fills_like_the_hf_trainer() {
        let mut d = dict(
            r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": 4, "optimizer": {"params": {"lr": "auto"}},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                  "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}"#,
        );
        let vals = AutoValues {
            micro_batch: Some(2),
            grad_accum: Some(4),
            data_parallel: Some(2),
            lr: Some(3e-4),
            hidden_size: Some(64),
            ..AutoValues::default()
        };
        let filled = fill(&mut d, &vals);
        let get = |p: &str| filled.iter().find(|(k, _)| k == p).map(|(_, v)| v.clone());
        assert_eq!(get("train_batch_size"), Some(Json::from(16)));
        assert_eq!(
            get("gradient_accumulation_steps"),
            None,
            "not auto, left alone"
        );
        assert_eq!(get("optimizer.params.lr"), Some(Json::from(3e-4)));
        // HF: hidden^2, int(0.9 * hidden^2), 10 * hidden.
        assert_eq!(
            get("zero_optimization.reduce_bucket_size"),
            Some(Json::from(4096))
        );
        assert_eq!(
            get("zero_optimization.stage3_prefetch_bucket_size"),
            Some(Json::from(3686))
        );
        assert_eq!(
            get("zero_optimization.stage3_param_persistence_threshold"),
            Some(Json::from(640))
        );
        assert!(remaining(&d).is_empty(), "{:?}", remaining(&d));
    }

    #[test]
    fn unknown_sources_stay_auto() {
        let mut d = dict(r#"{"train_batch_size": "auto", "fp16": {"enabled": "auto"}}"#);
        assert!(fill(&mut d, &AutoValues::default()).is_empty());
        assert_eq!(remaining(&d), ["train_batch_size", "fp16.enabled"]);
    }
}
