//! `config check` fills "auto" values exactly as transformers' HfTrainerDeepSpeedConfig does:
//! the fixture configs/tests/fixtures/hf_auto/hf_auto.jsonl holds transformers 5.24's own
//! filled configs (and its mismatch errors) for every "auto" config of the real corpus under
//! four argument sets (gen_hf_auto.py regenerates it with the peer venv). ds-rs is given the
//! same arguments, every one as a flag (so HF's check of defaults applies too).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{finish, spawn_captured, BIN};
use serde_json::Value as Json;

const FIXTURE: &str = "configs/tests/fixtures/hf_auto/hf_auto.jsonl";
const REAL: &str = "configs/tests/fixtures/real";

/// The flags of one fixture case: HF's argument names are ds-rs's flags.
fn flags(case: &Json) -> Vec<String> {
    let args = case["args"].as_object().unwrap();
    let mut out = vec![
        "--world-size".to_string(),
        case["world_size"].to_string(),
        "--hidden-size".to_string(),
        case["hidden_size"].to_string(),
    ];
    for (k, v) in args {
        let value = match v {
            Json::String(s) => s.clone(),
            other => other.to_string(),
        };
        out.push(format!("--{k}"));
        out.push(value);
    }
    out
}

/// The config keys HF's mismatch lines name ("- ds KEY=VALUE vs hf ...").
fn hf_mismatch_keys(case: &Json) -> BTreeSet<String> {
    case["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let l = l.as_str().unwrap().trim_start_matches("- ds ");
            l.split('=').next().unwrap().to_string()
        })
        .collect()
}

/// The one deliberate difference: HF computes `train_batch_size` over the world size, and
/// DeepSpeed's batch rule (which ds-rs's verdicts follow) over the data-parallel ranks, the
/// world divided by `tensor_parallel.autotp_size`; under AutoTP HF's value is one DeepSpeed
/// then rejects, so ds-rs fills the one it accepts.
fn with_data_parallel_batch(case: &Json) -> Json {
    let mut want = case["config"].clone();
    let tp = want["tensor_parallel"]["autotp_size"]
        .as_i64()
        .unwrap_or(1)
        .max(1);
    if tp > 1 {
        let (m, g) = (
            &want["train_micro_batch_size_per_gpu"],
            &want["gradient_accumulation_steps"],
        );
        let dp = case["world_size"].as_i64().unwrap() / tp;
        want["train_batch_size"] = Json::from(m.as_i64().unwrap() * g.as_i64().unwrap() * dp);
    }
    want
}

#[test]
fn auto_values_are_filled_as_transformers_fills_them() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/{FIXTURE}")).unwrap();
    let (mut filled, mut mismatched, mut skipped) = (0, 0, 0);
    for line in text.lines() {
        let case: Json = serde_json::from_str(line).unwrap();
        let what = format!("{} / {}", case["file"], case["case"]);
        if case.get("error").is_some() {
            // transformers itself fails on this file (accelerate reads a legacy
            // `"zero_optimization": false` as a section): nothing to compare
            skipped += 1;
            continue;
        }
        let file = format!("{root}/{REAL}/{}", case["file"].as_str().unwrap());
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(["config", "check", "--json", &file])
            .args(flags(&case));
        let out = finish(spawn_captured(&mut cmd), Duration::from_secs(30));
        let got: Json = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("{what}: {e}: {}", out.stdout));
        if case["ok"] == Json::Bool(true) {
            assert_eq!(got["ok"], Json::Bool(true), "{what}: {}", got["error"]);
            let want = with_data_parallel_batch(&case);
            assert_eq!(got["ds_config"], want, "{what}");
            filled += 1;
        } else {
            let paths: BTreeSet<String> = got["paths"]
                .as_array()
                .unwrap_or_else(|| panic!("{what}: expected HF's mismatch, got {got}"))
                .iter()
                .map(|p| p.as_str().unwrap().to_string())
                .collect();
            assert_eq!(paths, hf_mismatch_keys(&case), "{what}: {}", got["error"]);
            mismatched += 1;
        }
    }
    // 37 "auto" configs x 4 argument sets, as gen_hf_auto.py reported
    assert_eq!((filled, mismatched, skipped), (88, 56, 4));
}
