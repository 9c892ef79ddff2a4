//! The pipe schedules against DeepSpeed 0.19.8's own `TrainSchedule` and
//! `InferenceSchedule` (fixtures/schedules_reference.json, written by
//! fixtures/gen_schedules.py with the peer's Python): the same instruction streams, step by
//! step, for every stage of stages 1-4 x micro-batches 1, 2, 3, 4, 8.

use ds_pipeline::pipe_schedule::{
    inference_schedule, train_buffers, train_schedule, Instruction, StagePlace,
};
use serde_json::Value;

const REFERENCE: &str = include_str!("fixtures/schedules_reference.json");

/// A stream as the fixture writes it: per step, [name, buffer or null].
fn as_json(steps: &[Vec<Instruction>]) -> Value {
    let steps: Vec<Value> = steps
        .iter()
        .map(|step| {
            let cmds = step
                .iter()
                .map(|c| serde_json::json!([c.name(), c.buffer()]));
            Value::Array(cmds.collect())
        })
        .collect();
    Value::Array(steps)
}

fn cases() -> Vec<(StagePlace, Value)> {
    let reference: Value = serde_json::from_str(REFERENCE).unwrap();
    assert_eq!(reference["deepspeed"], "0.19.8");
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5 * (1 + 2 + 3 + 4), "the whole grid");
    cases
        .iter()
        .map(|c| {
            let n = |k: &str| c[k].as_u64().unwrap() as usize;
            let place = StagePlace {
                micro_batches: n("micro_batches"),
                stages: n("stages"),
                stage: n("stage"),
            };
            (place, c.clone())
        })
        .collect()
}

#[test]
fn train_schedule_is_deepspeeds() {
    for (p, case) in cases() {
        assert_eq!(as_json(&train_schedule(p)), case["train"], "{p:?}");
        assert_eq!(train_buffers(p) as u64, case["train_buffers"], "{p:?}");
    }
}

#[test]
fn inference_schedule_is_deepspeeds() {
    for (p, case) in cases() {
        assert_eq!(as_json(&inference_schedule(p)), case["inference"], "{p:?}");
    }
}
