//! DeepSpeed-MoE's expert-parallel and expert-data-parallel groups against DeepSpeed 0.19.8's
//! own rank lists (fixtures/expert_groups/gen_expert_groups.py): 232 layouts of up to 32
//! ranks with tensor and pipeline parallelism, every ep that divides dp, in both orders.

use ds_comm::topology::{expert_parallel_ranks, TopologyError};
use serde_json::Value;

fn lists(v: &Value) -> Vec<Vec<usize>> {
    let list = |g: &Value| {
        g.as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap() as usize)
            .collect()
    };
    v.as_array().unwrap().iter().map(list).collect()
}

#[test]
fn expert_groups_equal_deepspeeds() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/expert_groups/expert_groups.json"
    );
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(cases.len(), 232);
    for c in &cases {
        let n = |k: &str| c[k].as_u64().unwrap() as usize;
        let data_first = c["data_before_expert"].as_bool().unwrap();
        let (world, tp, pp, ep) = (n("world"), n("tp"), n("pp"), n("ep"));
        let got = expert_parallel_ranks(world, tp, pp, ep, data_first).unwrap();
        let at = format!("world {world} tp {tp} pp {pp} ep {ep} data first {data_first}");
        assert_eq!(
            got.expert_parallel,
            lists(&c["expert_parallel"]),
            "{at}: expert parallel"
        );
        assert_eq!(
            got.expert_data_parallel,
            lists(&c["expert_data_parallel"]),
            "{at}: expert data parallel"
        );
    }
}

#[test]
fn an_ep_that_does_not_divide_dp_is_an_error_naming_both() {
    let e = expert_parallel_ranks(8, 2, 1, 3, false).unwrap_err();
    assert_eq!(e, TopologyError::ExpertDegree { ep: 3, dp: 4 });
    assert!(
        e.to_string().contains("expert parallel size 3")
            && e.to_string().contains("4 data-parallel"),
        "{e}"
    );
}
