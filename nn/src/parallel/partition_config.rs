//! DeepSpeed's `tensor_parallel.partition_config` (AutoTP's layer specs): which parameters of
//! a user's model are split, and how, by name patterns (`re.match`, the first matching spec
//! wins, as in DeepSpeed's `AutoTPConfig.find_matching_spec`).
//!
//! A spec's `partition_type` is `column` (a linear's output rows, weight [out, in] split
//! along dim 0, its bias with it), `row` (its input columns, dim 1; the bias stays whole) or
//! `skip` (replicated). `shape: [k, -1]` with `partition_dim: 0` is a fused weight of k equal
//! parts (q|k|v), each split on its own. The layer computes with the slices: it reads local
//! shapes and marks its regions with `Tp::copy_to_region` / `Tp::reduce_from_region`.

use regex::Regex;
use serde_json::Value as Json;

use super::Split;
use crate::model::ParamSpec;
use crate::{NnError, Result};

const PATH: &str = "tensor_parallel.partition_config";

/// One layer spec: its patterns and the split of a weight it matches.
struct LayerSpec {
    patterns: Vec<Regex>,
    sources: Vec<String>,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Column { blocks: usize },
    Row,
    Skip,
}

/// The layer specs of a `partition_config`.
pub struct PartitionConfig {
    specs: Vec<LayerSpec>,
}

impl PartitionConfig {
    /// Reads `partition_config`; errors name the JSON path.
    pub fn parse(v: &Json) -> Result<PartitionConfig> {
        let specs = match v.get("layer_specs") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, s)| LayerSpec::parse(s, &format!("{PATH}.layer_specs[{i}]")))
                .collect::<Result<_>>()?,
            Some(other) => return Err(invalid(&format!("{PATH}.layer_specs"), other, "a list")),
        };
        Ok(PartitionConfig { specs })
    }

    /// Gives each parameter of `specs` the split of the first layer spec matching its name
    /// (a bias follows its weight). A pattern that matches no parameter is an error, and so is
    /// a split that contradicts the one a layer declares itself (its code computes with that
    /// one).
    pub fn apply(&self, specs: &mut [ParamSpec]) -> Result<()> {
        for (i, spec) in self.specs.iter().enumerate() {
            for (p, src) in spec.patterns.iter().zip(&spec.sources) {
                if !specs.iter().any(|s| p.is_match(&s.name)) {
                    let names: Vec<&str> = specs.iter().take(4).map(|s| s.name.as_str()).collect();
                    return Err(NnError::Invalid(format!(
                        "{PATH}.layer_specs[{i}].patterns: {src:?} matches no parameter of the model \
                         (its names look like {names:?})"
                    )));
                }
            }
        }
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        for (k, spec) in specs.iter_mut().enumerate() {
            let Some((weight, kind)) = self.rule_for(&names, k) else {
                continue;
            };
            let split = kind.split(spec, weight)?;
            let declared = spec.split;
            if !declared.is_replicated() && declared != split {
                return Err(NnError::Invalid(format!(
                    "{PATH}: parameter {} is split {declared:?} by its layer, the config asks for {split:?}",
                    spec.name
                )));
            }
            spec.split = split;
        }
        Ok(())
    }

    /// The kind for parameter `k`: of the first spec matching its name, or for a `.bias`
    /// the one matching its `.weight`; with whether `k` is the weight itself.
    fn rule_for(&self, names: &[String], k: usize) -> Option<(bool, Kind)> {
        let name = &names[k];
        if let Some(kind) = self.first_match(name) {
            return Some((true, kind));
        }
        let weight = format!("{}.weight", name.strip_suffix(".bias")?);
        names.contains(&weight).then_some(())?;
        self.first_match(&weight).map(|kind| (false, kind))
    }

    fn first_match(&self, name: &str) -> Option<Kind> {
        self.specs
            .iter()
            .find(|s| s.patterns.iter().any(|p| p.is_match(name)))
            .map(|s| s.kind)
    }
}

impl LayerSpec {
    fn parse(v: &Json, path: &str) -> Result<LayerSpec> {
        let sources: Vec<String> = match v.get("patterns") {
            Some(Json::Array(ps)) if !ps.is_empty() => ps
                .iter()
                .map(|p| {
                    p.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| invalid(&format!("{path}.patterns"), p, "strings"))
                })
                .collect::<Result<_>>()?,
            other => {
                return Err(invalid(
                    &format!("{path}.patterns"),
                    other.unwrap_or(&Json::Null),
                    "a non-empty list of regular expressions",
                ))
            }
        };
        let patterns = sources
            .iter()
            .map(|p| {
                // re.match: anchored at the start, not the end
                Regex::new(&format!("^(?:{p})")).map_err(|e| {
                    NnError::Invalid(format!(
                        "{path}.patterns: {p:?} is not a regular expression: {e}"
                    ))
                })
            })
            .collect::<Result<_>>()?;
        let kind = match v
            .get("partition_type")
            .and_then(Json::as_str)
            .map(str::to_lowercase)
        {
            Some(t) if t == "row" => Kind::Row,
            Some(t) if t == "skip" => Kind::Skip,
            Some(t) if t == "column" => Kind::Column {
                blocks: fused_parts(v, path)?,
            },
            None if v.get("partition_type").is_none() => Kind::Column {
                blocks: fused_parts(v, path)?,
            },
            _ => {
                return Err(invalid(
                    &format!("{path}.partition_type"),
                    &v["partition_type"],
                    "\"column\", \"row\" or \"skip\"",
                ))
            }
        };
        if kind == Kind::Row && v.get("shape").is_some_and(|s| !s.is_null()) {
            return Err(invalid(
                &format!("{path}.shape"),
                &v["shape"],
                "no shape for a row-parallel layer",
            ));
        }
        Ok(LayerSpec {
            patterns,
            sources,
            kind,
        })
    }
}

/// `shape: [k, -1]` with `partition_dim` 0 (or none): k fused parts; no shape: 1.
fn fused_parts(v: &Json, path: &str) -> Result<usize> {
    let shape = match v.get("shape") {
        None | Some(Json::Null) => return Ok(1),
        Some(s) => s,
    };
    let dim = v.get("partition_dim").and_then(Json::as_u64).unwrap_or(0);
    match (shape.as_array().map(Vec::as_slice), dim) {
        (Some([k, rest]), 0) if rest.as_i64() == Some(-1) && k.as_u64().is_some_and(|k| k > 0) => {
            Ok(k.as_u64().expect("checked above") as usize)
        }
        _ => Err(invalid(
            &format!("{path}.shape"),
            shape,
            "[k, -1] with partition_dim 0 (k equal fused parts); ds-rs splits no other shape yet",
        )),
    }
}

impl Kind {
    /// The split of `spec` (`weight`: it is the matched weight, else its bias).
    fn split(self, spec: &ParamSpec, weight: bool) -> Result<Split> {
        let dims = spec.shape.len();
        let split = match (self, weight) {
            (Kind::Skip, _) | (Kind::Row, false) => Split::Replicated,
            (Kind::Column { blocks }, false) => Split::Dim { dim: 0, blocks },
            (Kind::Column { blocks }, true) if dims == 2 => Split::Dim { dim: 0, blocks },
            (Kind::Row, true) if dims == 2 => Split::dim(1),
            _ => {
                return Err(NnError::Invalid(format!(
                    "{PATH}: parameter {} has shape {:?}; column and row splits are for linear weights [out, in]",
                    spec.name, spec.shape
                )))
            }
        };
        Ok(split)
    }
}

fn invalid(path: &str, found: &Json, expected: &str) -> NnError {
    NnError::Invalid(format!("{path}: expected {expected}, got {found}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Init;

    fn specs() -> Vec<ParamSpec> {
        let n = Init::Zeros;
        vec![
            ParamSpec::new("emb.weight", &[64, 32], n),
            ParamSpec::new("attn.qkv.weight", &[96, 32], n),
            ParamSpec::new("attn.qkv.bias", &[96], n),
            ParamSpec::new("attn.o.weight", &[32, 32], n),
            ParamSpec::new("attn.o.bias", &[32], n),
        ]
    }

    fn applied(json: &str) -> Result<Vec<Split>> {
        let cfg = PartitionConfig::parse(&serde_json::from_str(json).unwrap())?;
        let mut s = specs();
        cfg.apply(&mut s)?;
        Ok(s.into_iter().map(|s| s.split).collect())
    }

    #[test]
    fn column_splits_a_weight_and_its_bias_row_only_the_weight() {
        let got = applied(
            r#"{"layer_specs": [
                {"patterns": [".*\\.o\\.weight$"], "partition_type": "row"},
                {"patterns": [".*qkv\\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0}]}"#,
        )
        .unwrap();
        let fused = Split::Dim { dim: 0, blocks: 3 };
        let want = [
            Split::Replicated,
            fused,
            fused,
            Split::dim(1),
            Split::Replicated,
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn patterns_are_anchored_at_the_start_as_re_match() {
        // "qkv" alone does not match "attn.qkv.weight" under re.match
        let e = applied(r#"{"layer_specs": [{"patterns": ["qkv"], "partition_type": "column"}]}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer_specs[0].patterns") && e.contains("matches no parameter"),
            "{e}"
        );
    }

    #[test]
    fn bad_specs_name_their_path() {
        for (json, path) in [
            (
                r#"{"layer_specs": [{"patterns": ["emb"], "partition_type": "diagonal"}]}"#,
                "layer_specs[0].partition_type",
            ),
            (
                r#"{"layer_specs": [{"patterns": ["("], "partition_type": "row"}]}"#,
                "layer_specs[0].patterns",
            ),
            (
                r#"{"layer_specs": [{"patterns": ["attn.qkv.bias"], "partition_type": "row"}]}"#,
                "attn.qkv.bias",
            ),
            (
                r#"{"layer_specs": {"patterns": []}}"#,
                "partition_config.layer_specs",
            ),
        ] {
            let e = applied(json).unwrap_err().to_string();
            assert!(e.contains(path), "{json}: {e}");
        }
    }
}
