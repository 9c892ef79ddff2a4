//! Sections DeepSpeed 0.19.8 removed and now rejects outright (deepspeedai/DeepSpeed#8489):
//! a leftover block would otherwise be ignored and silently change what training does.

use crate::error::{ConfigError, Result};
use crate::value::Dict;

const ISSUE: &str = "see https://github.com/deepspeedai/DeepSpeed/issues/8489";

/// Removed top-level keys, in the order DeepSpeed checks them, and why each is gone.
const TOP_LEVEL: [(&str, &str); 11] = [
    ("nebula", "Nebula checkpointing has been removed; checkpoints would silently fall back to local files"),
    ("compression_training", "the DeepSpeed compression library has been removed; the model would train unquantized"),
    ("amp", "NVIDIA Apex AMP integration has been removed; use `fp16`, `bf16` or `torch_autocast`"),
    ("quantize_training", "Mixture-of-Quantization (MoQ) / `quantize_training` has been removed"),
    ("sparse_gradients", "sparse compression of dense embedding gradients has been removed"),
    ("eigenvalue", "eigenvalue-based Mixture-of-Quantization has been removed"),
    ("sparse_attention", "DeepSpeed Sparse Attention has been removed"),
    ("elasticity", "elastic training has been removed; set the batch keys directly"),
    ("graph_harvesting", "graph harvesting has been removed"),
    ("curriculum_learning", "legacy top-level curriculum learning has been removed; use `data_efficiency.data_sampling.curriculum_learning`"),
    ("progressive_layer_drop", "Progressive Layer Dropping has been removed"),
];

const ZERO: [(&str, &str); 3] = [
    ("mics_shard_size", "MiCS ZeRO-3 sharding has been removed"),
    ("mics_hierarchical_params_gather", "MiCS ZeRO-3 sharding has been removed"),
    ("zeropp_loco_param", "LoCo-Zero++ has been removed; remove the key to use ZeRO++ quantized gradients without LoCo"),
];

/// Rejects the first removed key present, whatever its value (even `false` or `{}`).
pub fn reject(root: &Dict) -> Result<()> {
    let removed = |path: String, why: &str| ConfigError::Removed {
        path,
        message: format!("{why} ({ISSUE})"),
    };
    if let Some((key, why)) = TOP_LEVEL.iter().find(|(k, _)| root.contains_key(k)) {
        return Err(removed(key.to_string(), why));
    }
    if let Some(zero) = root.get("zero_optimization").and_then(|z| z.as_dict()) {
        if let Some((key, why)) = ZERO.iter().find(|(k, _)| zero.contains_key(k)) {
            return Err(removed(format!("zero_optimization.{key}"), why));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hjson;

    #[test]
    fn removed_sections_are_rejected_whatever_their_value() {
        for text in [
            r#"{"curriculum_learning": false}"#,
            r#"{"elasticity": {}}"#,
            r#"{"amp": null}"#,
        ] {
            let root = hjson::parse(text).unwrap();
            assert!(
                matches!(
                    reject(root.as_dict().unwrap()),
                    Err(ConfigError::Removed { .. })
                ),
                "{text}"
            );
        }
        let root = hjson::parse(r#"{"zero_optimization": {"zeropp_loco_param": {}}}"#).unwrap();
        let err = reject(root.as_dict().unwrap()).unwrap_err();
        assert_eq!(err.path(), Some("zero_optimization.zeropp_loco_param"));
    }
}
