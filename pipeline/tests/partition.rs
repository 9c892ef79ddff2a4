//! Stage partitions against DeepSpeed 0.19.8's own functions. The fixture is written by
//! `/opt/peer/bin/python pipeline/tests/fixtures/gen_partition.py`, which calls
//! `partition_uniform`, `partition_balanced` and `PipelineModule._partition_layers` themselves.

use ds_pipeline::partition::{
    partition_balanced, partition_layers, partition_uniform, LayerInfo, PartitionMethod,
};
use serde_json::Value;

fn reference() -> Value {
    serde_json::from_str(include_str!("fixtures/partition_reference.json"))
        .expect("partition_reference.json is JSON")
}

fn usize_of(v: &Value) -> usize {
    v.as_u64().expect("a count") as usize
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array().expect("a list").iter().map(usize_of).collect()
}

fn cases<'a>(reference: &'a Value, key: &str) -> &'a [Value] {
    let cases = reference[key].as_array().expect("a list of cases");
    assert!(!cases.is_empty(), "no {key} cases in the fixture");
    cases
}

fn layers(reference: &Value, name: &str) -> Vec<LayerInfo> {
    let list = reference["layer_lists"][name]
        .as_array()
        .expect("a layer list");
    list.iter()
        .map(|l| LayerInfo {
            name: l["name"].as_str().expect("a name").to_string(),
            params: l["params"].as_u64().expect("a count"),
        })
        .collect()
}

#[test]
fn partition_uniform_matches_deepspeed() {
    let reference = reference();
    for case in cases(&reference, "uniform") {
        let (items, parts) = (usize_of(&case["items"]), usize_of(&case["parts"]));
        assert_eq!(
            partition_uniform(items, parts),
            usizes(&case["result"]),
            "partition_uniform({items}, {parts})"
        );
    }
}

#[test]
fn partition_balanced_matches_deepspeed() {
    let reference = reference();
    for case in cases(&reference, "balanced") {
        let weights: Vec<u64> = case["weights"]
            .as_array()
            .expect("weights")
            .iter()
            .map(|w| w.as_u64().expect("a weight"))
            .collect();
        let parts = usize_of(&case["parts"]);
        assert_eq!(
            partition_balanced(&weights, parts),
            usizes(&case["result"]),
            "partition_balanced({weights:?}, {parts})"
        );
    }
}

/// Every accepted method string on every layer list, through `parse` and `partition_layers`;
/// where `_partition_layers` raised ("found no valid layers"), ds-rs must fail too.
#[test]
fn partition_layers_matches_deepspeed_partition_layers() {
    let reference = reference();
    for case in cases(&reference, "layers") {
        let list = case["layers"].as_str().expect("a layer list name");
        let method = case["method"].as_str().expect("a method");
        let stages = usize_of(&case["stages"]);
        let got = PartitionMethod::parse(method)
            .and_then(|m| partition_layers(&layers(&reference, list), stages, &m));
        let what = format!("{list} into {stages} stages by {method:?}");
        match case.get("parts") {
            Some(parts) => assert_eq!(got, Ok(usizes(parts)), "{what}"),
            None => {
                let err = got.expect_err(&what);
                assert!(err.contains("matches none of the"), "{what}: {err}");
            }
        }
    }
}

/// DeepSpeed raises NotImplementedError for these; ds-rs rejects them too, except "best",
/// which issue 17 reads as "parameters".
#[test]
fn methods_deepspeed_rejects() {
    let reference = reference();
    for case in cases(&reference, "rejected") {
        let method = case["method"].as_str().expect("a method");
        match method {
            "best" => assert_eq!(
                PartitionMethod::parse(method),
                Ok(PartitionMethod::Parameters)
            ),
            _ => assert!(
                PartitionMethod::parse(method).is_err(),
                "{method:?} was accepted"
            ),
        }
    }
}
