//! DeepSpeed 0.19's AutoEP section, `expert_parallel`, read as `parse_autoep_config` and
//! `validate_autoep_config` read it: `enabled` and `autoep_size` give the expert-parallel size,
//! `preset_model` names the model family. ds-rs trains its own Mixtral and Qwen3-MoE, whose
//! routing follows their config.json, so a key that would change what is computed (a routing
//! override, another model's module patterns) is refused, and one that only tunes DeepSpeed's
//! kernels or communication is a warning. DeepSpeed ignores keys it does not know; so does
//! ds-rs, with a warning.

use serde::Serialize;

use crate::error::{ConfigError, Result};
use crate::value::{Dict, Value};

/// The presets ds-rs trains (DeepSpeed 0.19.8 also knows qwen3_5_moe, deepseek_v2,
/// deepseek_v3 and minimax_m3).
pub const PRESETS: [&str; 2] = ["mixtral", "qwen3_moe"];

/// What ds-rs acts on of `expert_parallel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct ExpertParallel {
    pub enabled: bool,
    pub autoep_size: usize,
    pub preset_model: Option<String>,
    /// `top_k` when not "auto": it must be the model's own.
    pub top_k: Option<usize>,
}

impl ExpertParallel {
    /// The expert-parallel size the section asks for (1 when disabled).
    pub fn size(&self) -> usize {
        match self.enabled {
            true => self.autoep_size,
            false => 1,
        }
    }
}

impl crate::Config {
    /// The config with the expert-parallel size its `expert_parallel` section asks for in
    /// its layout (`dims.ep`), which must divide the data-parallel ranks. Not part of
    /// `resolve`: DeepSpeed's config reader accepts any size, its engine checks the layout.
    pub fn with_expert_parallel(mut self) -> Result<crate::Config> {
        let path = "expert_parallel.autoep_size";
        self.dims = match (self.expert_parallel.size(), self.dims.ep) {
            (1, _) => self.dims,
            (n, 1) => self
                .dims
                .with_ep(n)
                .map_err(|e| ConfigError::conflict(path, e))?,
            (n, ep) if n == ep => self.dims,
            (n, ep) => {
                return Err(ConfigError::conflict(
                    path,
                    format!("{n} disagrees with the layout's expert-parallel size {ep}"),
                ))
            }
        };
        Ok(self)
    }
}

/// Keys that tune DeepSpeed's kernels or communication, with their defaults: the same
/// function either way.
const TUNING: [(&str, &str); 11] = [
    ("use_grouped_mm", "true"),
    ("disable_triton_grouped_mm", "false"),
    ("comm_backend", "\"comm\""),
    ("comm_num_sm", "12"),
    ("comm_qp_margin", "4"),
    ("comm_max_tokens_per_rank", "0"),
    ("async_split_plan", "false"),
    ("validate_folding_routing", "false"),
    ("combine_impl", "\"auto\""),
    ("row_weighting_impl", "\"auto\""),
    ("gate_up_impl", "\"separate\""),
];

/// Keys that override the routing or name another model's modules, with the value that
/// leaves the model as its config.json says.
const ROUTING: [(&str, &str); 18] = [
    ("route_norm", "null"),
    ("route_scale", "1.0"),
    ("score_func", "\"auto\""),
    ("score_apply", "\"auto\""),
    ("routed_scaling_factor", "\"auto\""),
    ("num_expert_groups", "null"),
    ("num_limited_groups", "null"),
    ("has_shared_experts", "null"),
    ("expert_activation", "null"),
    ("moe_layer_pattern", "null"),
    ("expert_pattern", "null"),
    ("router_pattern", "null"),
    ("shared_experts_pattern", "null"),
    ("shared_experts_gate_pattern", "null"),
    ("expert_w1", "null"),
    ("expert_w2", "null"),
    ("expert_w3", "null"),
    ("num_experts_attr", "null"),
];

/// Read as-is, checked where ds-rs can: `top_k_attr` names an attribute of another model.
const OTHER: [&str; 6] = [
    "enabled",
    "autoep_size",
    "expert_tensor_parallel_size",
    "preset_model",
    "top_k",
    "load_balance_coeff",
];

/// Reads `expert_parallel` (absent, null or false: disabled); warnings go to `warnings`.
pub fn read(root: &Dict, warnings: &mut Vec<String>) -> Result<ExpertParallel> {
    let d = match root.get("expert_parallel") {
        None => return Ok(ExpertParallel::default()),
        Some(v) if !v.truthy() => return Ok(ExpertParallel::default()),
        Some(Value::Dict(d)) => d,
        Some(other) => return Err(ConfigError::invalid("expert_parallel", other, "an object")),
    };
    let path = |k: &str| format!("expert_parallel.{k}");
    if let Some(v) = d.get("load_balance_coeff").filter(|v| **v != Value::Null) {
        // DeepSpeed: `_raise_unsupported_load_balance_coeff`
        return Err(ConfigError::invalid(
            &path("load_balance_coeff"),
            v,
            "null (DeepSpeed 0.19.8 does not support the auxiliary-loss-free balancing bias)",
        ));
    }
    for key in ["validate_folding_routing", "async_split_plan"] {
        if let Some(v) = d.get(key).filter(|v| !matches!(v, Value::Bool(_))) {
            return Err(ConfigError::invalid(&path(key), v, "a boolean"));
        }
    }
    let enabled = d.get("enabled").is_some_and(Value::truthy);
    let positive = |key: &str| -> Result<usize> {
        match d.get(key) {
            None => Ok(1),
            Some(Value::Int(n)) if *n >= 1 => Ok(*n as usize),
            Some(v) => Err(ConfigError::invalid(&path(key), v, "a positive integer")),
        }
    };
    let autoep_size = positive("autoep_size")?;
    let etp = positive("expert_tensor_parallel_size")?;
    if enabled && etp != 1 {
        // as DeepSpeed 0.19.8's validate_folding_global
        return Err(ConfigError::invalid(
            &path("expert_tensor_parallel_size"),
            Value::Int(etp as i64),
            "1 (DeepSpeed reserves it for expert-internal tensor parallelism, not supported yet)",
        ));
    }
    let preset_model = match d.get("preset_model") {
        None | Some(Value::Null) => None,
        Some(Value::Str(s)) if PRESETS.contains(&s.as_str()) => Some(s.clone()),
        Some(v) => {
            return Err(ConfigError::invalid(
                &path("preset_model"),
                v,
                format!("one of the presets ds-rs trains: {}", PRESETS.join(", ")),
            ))
        }
    };
    let top_k = match d.get("top_k") {
        None => None,
        Some(Value::Str(s)) if s == "auto" => None,
        Some(Value::Int(n)) if *n >= 1 => Some(*n as usize),
        Some(v) => {
            return Err(ConfigError::invalid(
                &path("top_k"),
                v,
                "\"auto\" or a positive integer",
            ))
        }
    };
    for (key, default) in ROUTING {
        if let Some(v) = d.get(key).filter(|v| !same(v, default)) {
            return Err(ConfigError::invalid(
                &path(key),
                v,
                format!("{default}: ds-rs routes Mixtral and Qwen3-MoE as their config.json says and names their modules itself"),
            ));
        }
    }
    for (key, default) in TUNING {
        if let Some(v) = d.get(key).filter(|v| !same(v, default)) {
            warnings.push(format!(
                "{}: {v} tunes DeepSpeed's AutoEP kernels or communication; ds-rs computes the same function its own way and ignores it",
                path(key)
            ));
        }
    }
    let known = |k: &str| {
        OTHER.contains(&k)
            || k == "top_k_attr"
            || ROUTING.iter().chain(&TUNING).any(|(t, _)| *t == k)
    };
    for key in d.keys().filter(|k| !known(k)) {
        warnings.push(format!(
            "{}: not a key DeepSpeed 0.19.8 reads; ignored",
            path(key)
        ));
    }
    if let Some(v) = d.get("top_k_attr").filter(|v| **v != Value::Null) {
        return Err(ConfigError::invalid(
            &path("top_k_attr"),
            v,
            "null: ds-rs reads top-k from the model's config.json",
        ));
    }
    Ok(ExpertParallel {
        enabled,
        autoep_size,
        preset_model,
        top_k,
    })
}

/// Whether `v` is the JSON value `default` spells.
fn same(v: &Value, default: &str) -> bool {
    let want: serde_json::Value = serde_json::from_str(default).expect("invariant: valid JSON");
    let got = v.to_json();
    match (got.as_f64(), want.as_f64()) {
        (Some(a), Some(b)) => a == b,
        _ => got == want,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    fn read_json(text: &str) -> (Result<ExpertParallel>, Vec<String>) {
        let Value::Dict(root) = hjson::parse(text).unwrap() else {
            unreachable!()
        };
        let mut warnings = Vec::new();
        (read(&root, &mut warnings), warnings)
    }

    #[test]
    fn the_size_comes_from_enabled_and_autoep_size() {
        let (ep, w) = read_json(
            r#"{"expert_parallel": {"enabled": true, "autoep_size": 4, "preset_model": "mixtral", "top_k": "auto", "comm_backend": "comm"}}"#,
        );
        let ep = ep.unwrap();
        assert_eq!(
            (ep.size(), ep.preset_model.as_deref()),
            (4, Some("mixtral"))
        );
        assert!(w.is_empty(), "{w:?}");
        let (off, _) = read_json(r#"{"expert_parallel": {"enabled": false, "autoep_size": 4}}"#);
        assert_eq!(off.unwrap().size(), 1);
    }

    #[test]
    fn what_would_change_the_function_is_refused_by_name() {
        for (text, needle) in [
            (r#"{"preset_model": "deepseek_v3"}"#, "mixtral, qwen3_moe"),
            (r#"{"route_scale": 2.5}"#, "expert_parallel.route_scale"),
            (
                r#"{"load_balance_coeff": 0.001}"#,
                "expert_parallel.load_balance_coeff",
            ),
            (
                r#"{"expert_tensor_parallel_size": 2}"#,
                "expert_tensor_parallel_size",
            ),
            (r#"{"autoep_size": 0}"#, "expert_parallel.autoep_size"),
            (r#"{"top_k": "many"}"#, "expert_parallel.top_k"),
        ] {
            let text = format!(
                r#"{{"expert_parallel": {{"enabled": true, {}}}"#,
                &text[1..]
            );
            let e = read_json(&text).0.unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    /// `with_expert_parallel` puts the section's size in the layout (the training job and a
    /// program's `Job` call it), checked against the data-parallel ranks; `resolve` alone
    /// accepts any size, as DeepSpeed's config reader does.
    #[test]
    fn the_layout_takes_the_size() {
        let text = |size: usize| {
            format!(
                r#"{{"train_micro_batch_size_per_gpu": 1,
                "expert_parallel": {{"enabled": true, "autoep_size": {size}}}}}"#
            )
        };
        let dims = crate::ParallelDims::new(4, 1, 1).unwrap();
        let resolve = |size| {
            crate::resolve(&hjson::parse(&text(size)).unwrap(), &dims)?.with_expert_parallel()
        };
        assert_eq!(resolve(2).unwrap().dims.ep, 2);
        let e = resolve(3).unwrap_err().to_string();
        assert!(
            e.contains("expert_parallel.autoep_size") && e.contains("does not divide"),
            "{e}"
        );
    }

    #[test]
    fn tuning_and_unknown_keys_are_warnings() {
        let (ep, w) = read_json(
            r#"{"expert_parallel": {"enabled": true, "autoep_size": 2, "use_grouped_mm": false, "colour": 1}}"#,
        );
        assert_eq!(ep.unwrap().size(), 2);
        assert!(w.iter().any(|w| w.contains("use_grouped_mm")), "{w:?}");
        assert!(w.iter().any(|w| w.contains("colour")), "{w:?}");
    }
}
