//! Stage partitioning: which contiguous run of layers each pipeline stage owns, computed as
//! DeepSpeed 0.19.8 computes it (`PipelineModule._partition_layers` in runtime/pipe/module.py,
//! `partition_uniform` and `partition_balanced` in runtime/utils.py).
//!
//! A partition is `stages + 1` layer offsets: stage `s` runs layers `parts[s]..parts[s + 1]`.
//! pipeline/tests/partition.rs compares every function here with DeepSpeed's own output
//! (pipeline/tests/fixtures/gen_partition.py).

use regex::{Regex, RegexBuilder};

/// What partitioning needs to know about one layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// The layer's type name (DeepSpeed: the module's class name), matched by `type:REGEX`.
    pub name: String,
    /// Trainable parameter count, balanced by `parameters`.
    pub params: u64,
}

/// How layers are split into stages: DeepSpeed's `partition_method`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionMethod {
    /// `"parameters"`: balance the trainable parameter counts (PipelineModule's default).
    Parameters,
    /// `"uniform"`: the same number of layers per stage, the first stages taking one more.
    Uniform,
    /// `"type:REGEX"`: balance the number of layers whose name the regex matches. The regex is
    /// searched for anywhere in the name, case-insensitively (Python `re.search` with
    /// `re.IGNORECASE`). It is compiled by the `regex` crate, which differs from Python's `re`
    /// in syntax only: it has no look-around, backreferences, atomic groups or possessive
    /// quantifiers (errors here, valid in Python), treats an unescaped `{` that does not start
    /// a repetition as an error (Python reads it literally), accepts `\z` and `\pL` (errors in
    /// Python 3.11), and folds case by Unicode simple case folding where Python adds a few
    /// special cases. For class names (ASCII identifiers) the two agree on every regex both
    /// accept.
    Type(String),
}

const ACCEPTED: &str =
    "\"parameters\", \"uniform\" or \"type:REGEX\" (and \"best\", read as \"parameters\")";

impl PartitionMethod {
    /// Reads a method string the way `_partition_layers` does.
    ///
    /// DeepSpeed lowercases the whole string first, regex included, so `type:\S` searches for
    /// `\s` (and `\W`, `\D`, `\B` flip the same way); and the regex ends at the next colon
    /// (`method.split(':')[1]`), so `type:a:b` searches for `a`. Both are kept here so that a
    /// DeepSpeed config partitions the same layers.
    ///
    /// `"best"` is the default of DeepSpeed's `pipeline.partition` config key, which 0.19.8
    /// never reads; `_partition_layers("best")` raises NotImplementedError. ds-rs reads it as
    /// `"parameters"`, PipelineModule's default (issue 17).
    pub fn parse(s: &str) -> Result<PartitionMethod, String> {
        let method = s.to_lowercase();
        match method.as_str() {
            "parameters" | "best" => Ok(PartitionMethod::Parameters),
            "uniform" => Ok(PartitionMethod::Uniform),
            _ => match method.strip_prefix("type:") {
                Some(rest) => {
                    let pattern = rest.split_once(':').map_or(rest, |(pattern, _)| pattern);
                    compile(pattern)?;
                    Ok(PartitionMethod::Type(pattern.to_string()))
                }
                None => Err(format!(
                    "unknown pipeline partition method {s:?}: expected {ACCEPTED}"
                )),
            },
        }
    }
}

fn compile(pattern: &str) -> Result<Regex, String> {
    RegexBuilder::new(pattern)
        .case_insensitive(true)
        .build()
        .map_err(|e| {
            format!("invalid regex {pattern:?} in partition method \"type:{pattern}\": {e}")
        })
}

/// Splits `layers` into `stages` contiguous runs by `method`; returns the `stages + 1` offsets.
///
/// Errors: no stages; more stages than layers (DeepSpeed would leave stages empty); a `type:`
/// regex that does not compile or matches no layer.
pub fn partition_layers(
    layers: &[LayerInfo],
    stages: usize,
    method: &PartitionMethod,
) -> Result<Vec<usize>, String> {
    if stages == 0 {
        return Err("cannot partition layers into 0 pipeline stages".to_string());
    }
    if stages > layers.len() {
        return Err(format!(
            "cannot partition {} layers into {stages} pipeline stages: every stage needs at \
             least one layer",
            layers.len()
        ));
    }
    match method {
        PartitionMethod::Uniform => Ok(partition_uniform(layers.len(), stages)),
        PartitionMethod::Parameters => {
            let weights: Vec<u64> = layers.iter().map(|l| l.params).collect();
            Ok(partition_balanced(&weights, stages))
        }
        PartitionMethod::Type(pattern) => {
            let re = compile(pattern)?;
            let weights: Vec<u64> = layers
                .iter()
                .map(|l| u64::from(re.is_match(&l.name)))
                .collect();
            if !weights.contains(&1) {
                let mut names: Vec<&str> = Vec::new();
                for layer in layers {
                    if !names.contains(&layer.name.as_str()) {
                        names.push(&layer.name);
                    }
                }
                return Err(format!(
                    "partition method \"type:{pattern}\" matches none of the {} layers ({})",
                    layers.len(),
                    names.join(", ")
                ));
            }
            Ok(partition_balanced(&weights, stages))
        }
    }
}

/// DeepSpeed's `partition_uniform`: `num_items` in `num_parts` runs whose lengths differ by at
/// most one, longer runs first. With no more items than parts, part `p` starts at
/// `min(p, num_items)`: one item each, then empty parts.
///
/// # Panics
/// If `num_parts` is 0 (DeepSpeed divides by zero).
pub fn partition_uniform(num_items: usize, num_parts: usize) -> Vec<usize> {
    assert!(num_parts > 0, "partition_uniform needs at least one part");
    if num_items <= num_parts {
        return (0..=num_parts).map(|p| p.min(num_items)).collect();
    }
    let chunk = num_items / num_parts;
    let residual = num_items - chunk * num_parts;
    (0..=num_parts)
        .map(|p| p * chunk + p.min(residual))
        .collect()
}

/// DeepSpeed's `partition_balanced`: contiguous, non-empty runs chosen by dynamic programming
/// to minimise the spread (largest run sum minus smallest) — see Note [partition_balanced in
/// float64]. With no more weights than parts it is `partition_uniform`.
///
/// # Panics
/// If `num_parts` is 0 and there are weights.
pub fn partition_balanced(weights: &[u64], num_parts: usize) -> Vec<usize> {
    let (n, m) = (weights.len(), num_parts);
    if n <= m {
        return partition_uniform(n, m);
    }
    assert!(m > 0, "partition_balanced needs at least one part");
    let prefix = prefix_sums(weights);
    // Row-major (n + 1) x (m + 1) tables: entry (i, j) is the best split of the first i
    // weights into j runs; `position` is where its last run starts.
    let at = |i: usize, j: usize| i * (m + 1) + j;
    let mut dp_max = vec![f64::INFINITY; (n + 1) * (m + 1)];
    let mut dp_min = dp_max.clone();
    let mut dp_cost = dp_max.clone();
    let mut position = vec![0usize; (n + 1) * (m + 1)];
    dp_max[at(0, 0)] = 0.0;
    dp_cost[at(0, 0)] = 0.0;
    for i in 1..=n {
        for j in 1..=i.min(m) {
            for k in 0..i {
                let run = prefix[i] - prefix[k];
                let max_sum = py_max(dp_max[at(k, j - 1)], run);
                let min_sum = py_min(dp_min[at(k, j - 1)], run);
                let cost = max_sum - min_sum;
                if dp_cost[at(i, j)] >= cost {
                    dp_cost[at(i, j)] = cost;
                    dp_max[at(i, j)] = max_sum;
                    dp_min[at(i, j)] = min_sum;
                    position[at(i, j)] = k;
                }
            }
        }
    }
    let mut parts = vec![n];
    for j in (1..=m).rev() {
        let end = *parts.last().expect("invariant: parts starts with n");
        parts.push(position[at(end, j)]);
    }
    parts.reverse();
    parts
}

// Note [partition_balanced in float64]
// DeepSpeed keeps the prefix sums and the DP tables in numpy float64 (`np.cumsum` of the int
// weights, stored into a float64 array), so sums above 2^53 round, and which split wins a tie
// depends on that rounding. To give the same offsets bit for bit, the prefix sums here are
// exact integers rounded once to f64 (as numpy's int64 -> float64 cast does), and every table
// entry is f64 computed in DeepSpeed's order. Unreached entries stay +inf as in numpy
// (including dp_min[0][0], which DeepSpeed never sets), and `>=` keeps the last k of equal
// cost. numpy's int64 cumsum wraps past 2^63 - 1; these sums do not, so totals that large
// (no model has them) are where the two could part.

/// `prefix[i]` = sum of the first `i` weights, summed exactly and then rounded to f64.
fn prefix_sums(weights: &[u64]) -> Vec<f64> {
    let mut total: u128 = 0;
    let mut prefix = Vec::with_capacity(weights.len() + 1);
    prefix.push(0.0);
    for &w in weights {
        total += u128::from(w);
        prefix.push(total as f64);
    }
    prefix
}

/// Python's `max(a, b)`: `a` unless `b` is strictly larger.
fn py_max(a: f64, b: f64) -> f64 {
    if b > a {
        b
    } else {
        a
    }
}

/// Python's `min(a, b)`: `a` unless `b` is strictly smaller.
fn py_min(a: f64, b: f64) -> f64 {
    if b < a {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(spec: &[(&str, u64)]) -> Vec<LayerInfo> {
        spec.iter()
            .map(|&(name, params)| LayerInfo {
                name: name.to_string(),
                params,
            })
            .collect()
    }

    #[test]
    fn parse_reads_deepspeed_method_strings() {
        assert_eq!(
            PartitionMethod::parse("parameters"),
            Ok(PartitionMethod::Parameters)
        );
        assert_eq!(
            PartitionMethod::parse("Parameters"),
            Ok(PartitionMethod::Parameters)
        );
        assert_eq!(
            PartitionMethod::parse("best"),
            Ok(PartitionMethod::Parameters)
        );
        assert_eq!(
            PartitionMethod::parse("UNIFORM"),
            Ok(PartitionMethod::Uniform)
        );
        assert_eq!(
            PartitionMethod::parse("type:Block"),
            Ok(PartitionMethod::Type("block".to_string()))
        );
        assert_eq!(
            PartitionMethod::parse("TYPE:"),
            Ok(PartitionMethod::Type(String::new()))
        );
    }

    #[test]
    fn parse_lowercases_the_regex_and_stops_at_the_next_colon_like_deepspeed() {
        assert_eq!(
            PartitionMethod::parse(r"type:\S+"),
            Ok(PartitionMethod::Type(r"\s+".to_string()))
        );
        assert_eq!(
            PartitionMethod::parse("type:Block:ignored"),
            Ok(PartitionMethod::Type("block".to_string()))
        );
    }

    #[test]
    fn parse_rejects_an_unknown_method_naming_it_and_the_accepted_ones() {
        for method in ["profile", "balanced", "", "type"] {
            let err = PartitionMethod::parse(method).unwrap_err();
            assert!(err.contains(&format!("{method:?}")), "{err}");
            for accepted in ["\"parameters\"", "\"uniform\"", "\"type:REGEX\""] {
                assert!(err.contains(accepted), "{err}");
            }
        }
    }

    #[test]
    fn parse_rejects_an_invalid_regex() {
        let err = PartitionMethod::parse("type:(block").unwrap_err();
        assert!(err.contains("invalid regex \"(block\""), "{err}");
    }

    #[test]
    fn more_stages_than_layers_is_an_error_naming_both() {
        let three = layers(&[("Embeddings", 10), ("Block", 10), ("Head", 10)]);
        for method in [PartitionMethod::Parameters, PartitionMethod::Uniform] {
            let err = partition_layers(&three, 4, &method).unwrap_err();
            assert!(err.contains("3 layers into 4 pipeline stages"), "{err}");
        }
        let err = partition_layers(&[], 1, &PartitionMethod::Uniform).unwrap_err();
        assert!(err.contains("0 layers into 1 pipeline stages"), "{err}");
        assert_eq!(
            partition_layers(&three, 3, &PartitionMethod::Uniform),
            Ok(vec![0, 1, 2, 3])
        );
    }

    #[test]
    fn zero_stages_is_an_error() {
        let one = layers(&[("Block", 10)]);
        let err = partition_layers(&one, 0, &PartitionMethod::Parameters).unwrap_err();
        assert!(err.contains("0 pipeline stages"), "{err}");
    }

    #[test]
    fn type_regex_matching_no_layer_is_an_error_naming_the_layers() {
        let gpt = layers(&[
            ("Embeddings", 10),
            ("Block", 10),
            ("Head", 10),
            ("Block", 10),
        ]);
        let method = PartitionMethod::Type("transformer".to_string());
        let err = partition_layers(&gpt, 2, &method).unwrap_err();
        assert!(
            err.contains("\"type:transformer\" matches none of the 4 layers"),
            "{err}"
        );
        assert!(err.contains("(Embeddings, Block, Head)"), "{err}");
    }

    #[test]
    fn invalid_type_regex_is_an_error() {
        let gpt = layers(&[("Block", 10), ("Block", 10)]);
        let err = partition_layers(&gpt, 2, &PartitionMethod::Type("[".to_string())).unwrap_err();
        assert!(err.contains("invalid regex \"[\""), "{err}");
    }

    #[test]
    fn type_regex_is_case_insensitive_even_when_built_directly() {
        let gpt = layers(&[("Embeddings", 1), ("Block", 1), ("Block", 1), ("Head", 1)]);
        let method = PartitionMethod::Type("BLOCK".to_string());
        assert_eq!(partition_layers(&gpt, 2, &method), Ok(vec![0, 2, 4]));
    }

    #[test]
    fn balanced_runs_tile_the_layers_and_are_never_empty() {
        for n in 1..=12usize {
            let weights: Vec<u64> = (0..n as u64).map(|i| (i * 7919) % 13).collect();
            for m in 1..=n {
                let parts = partition_balanced(&weights, m);
                assert_eq!(parts.len(), m + 1);
                assert_eq!(
                    (parts[0], parts[m]),
                    (0, n),
                    "{weights:?} into {m}: {parts:?}"
                );
                assert!(
                    parts.windows(2).all(|w| w[0] < w[1]),
                    "{weights:?} into {m}: {parts:?}"
                );
            }
        }
    }
}
