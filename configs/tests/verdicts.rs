//! ds-rs's verdict on each config against DeepSpeed 0.19.8's own (fixtures/README.md says how
//! DeepSpeed's verdicts were produced). Accepted files must resolve to the same values;
//! rejected files must be rejected for the same reason, at the same JSON path.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ds_config::{summary_json, ConfigError, ParallelDims};
use serde_json::Value as Json;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The fields of DeepSpeed's verdict that must match exactly (ints and floats kept apart).
const COMPARED: [&str; 11] = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_stage",
    "zero_offload_optimizer",
    "zero_offload_param",
    "fp16",
    "bf16",
    "gradient_clipping",
    "optimizer",
    "scheduler",
];

/// pydantic model name -> the JSON path of its section.
fn model_prefix(model: &str) -> &'static str {
    match model {
        "DeepSpeedZeroConfig" => "zero_optimization.",
        "DeepSpeedFP16Config" => "fp16.",
        "DeepSpeedBF16Config" => "bf16.",
        "CommsLoggerConfig" => "comms_logger.",
        "HybridEngineConfig" => "hybrid_engine.",
        "CompileConfig" => "compile.",
        "TPTrainingConfig" => "tensor_parallel.",
        "DeepSpeedThroughputTimerConfig" => "timers.throughput.",
        "WeightQuantConfig" => "weight_quantization.",
        _ => "",
    }
}

/// What DeepSpeed's error says about where the problem is: the set of JSON paths it names,
/// or a category for Python errors that name no key.
#[derive(Debug, PartialEq)]
enum Expected {
    Paths(BTreeSet<String>),
    /// A Python TypeError: a value of the wrong type somewhere; `section` is named when the
    /// error says which section could not be unpacked (`Model() argument after ** ...`).
    TypeError {
        section: Option<&'static str>,
    },
    /// A DeepSpeedConfigError: its message mentions the key it is about.
    Mentions(String),
    /// A path ending as given (DeepSpeed's message does not say which of two keys).
    PathSuffix(&'static str),
    AnyRejection,
}

fn expected_from(error: &str) -> Expected {
    let batch = |p: &str| Expected::Paths([p.to_string()].into());
    if let Some(rest) = error.strip_prefix("ValidationError: ") {
        return pydantic_paths(rest);
    }
    if let Some(rest) = error.strip_prefix("TypeError: ") {
        let section = rest.split_once("() argument after **").map(|(model, _)| {
            model_prefix(model.rsplit('.').next().unwrap_or_default()).trim_end_matches('.')
        });
        return Expected::TypeError {
            section: section.filter(|s| !s.is_empty()),
        };
    }
    if error.contains("Invalid communication_data_type") {
        return Expected::PathSuffix("communication_data_type");
    }
    for (needle, path) in [
        ("Either train_batch_size", "train_batch_size"),
        ("Check batch related parameters", "train_batch_size"),
        ("Gradient accumulation steps", "gradient_accumulation_steps"),
        ("Micro batch size per gpu", "train_micro_batch_size_per_gpu"),
        ("Train batch size", "train_batch_size"),
        ("bfloat16 and fp16", "bf16.enabled"),
    ] {
        if error.contains(needle) {
            return batch(path);
        }
    }
    if error.starts_with("DeepSpeedConfigError") {
        return Expected::Mentions(error.replace("::", ".").to_lowercase());
    }
    Expected::AnyRejection
}

/// "N validation errors for Model\nloc\n  msg [...]\n..." -> {prefix + loc}.
fn pydantic_paths(text: &str) -> Expected {
    let mut lines = text.lines();
    let header = lines.next().unwrap_or_default();
    let model = header.rsplit(' ').next().unwrap_or_default();
    let prefix = model_prefix(model);
    let paths: BTreeSet<String> = lines
        .filter(|l| !l.starts_with(' ') && !l.is_empty())
        .map(|l| format!("{prefix}{l}"))
        .collect();
    if paths.is_empty() {
        Expected::AnyRejection
    } else {
        Expected::Paths(paths)
    }
}

fn our_paths(e: &ConfigError) -> BTreeSet<String> {
    // The old spelling `bfloat16` is the same section as `bf16` for DeepSpeed's messages.
    e.paths()
        .into_iter()
        .map(|p| p.replacen("bfloat16.", "bf16.", 1))
        .collect()
}

fn check_one(
    file: &Path,
    world_size: usize,
    tp: usize,
    pp: usize,
    ds: &Json,
) -> Result<(), String> {
    let dims = ParallelDims::new(world_size, tp, pp).map_err(|e| e.to_string())?;
    let ours = ds_config::load(file).and_then(|doc| ds_config::resolve(&doc, &dims));
    let ds_ok = ds["ok"] == Json::Bool(true);
    match (&ours, ds_ok) {
        (Ok(_), true) => {
            let summary = summary_json(&ours);
            let diffs: Vec<String> = COMPARED
                .iter()
                .filter(|k| summary[**k] != ds[**k])
                .map(|k| format!("{k}: ours {} vs DeepSpeed {}", summary[*k], ds[*k]))
                .collect();
            if diffs.is_empty() {
                Ok(())
            } else {
                Err(diffs.join("; "))
            }
        }
        (Ok(_), false) => Err(format!(
            "accepted, but DeepSpeed rejects it: {}",
            ds["error"]
        )),
        (Err(e), true) => Err(format!("rejected ({e}), but DeepSpeed accepts it")),
        (Err(e), false) => same_reason(e, ds["error"].as_str().unwrap_or_default()),
    }
}

fn same_reason(e: &ConfigError, ds_error: &str) -> Result<(), String> {
    let ours = our_paths(e);
    let ok = match expected_from(ds_error) {
        Expected::Paths(want) => want == ours,
        Expected::TypeError { section: Some(sec) } => ours.iter().all(|p| p == sec),
        // DeepSpeed's TypeError names no key; ours must name one.
        Expected::TypeError { section: None } => !ours.is_empty(),
        Expected::PathSuffix(end) => !ours.is_empty() && ours.iter().all(|p| p.ends_with(end)),
        Expected::Mentions(msg) => {
            let last = |p: &String| p.rsplit('.').next().unwrap_or_default().to_lowercase();
            !ours.is_empty() && ours.iter().all(|p| msg.contains(&last(p)))
        }
        Expected::AnyRejection => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "rejected for another reason: ours {ours:?} ({e}) vs DeepSpeed {ds_error:?}"
        ))
    }
}

#[test]
fn real_configs_get_deepspeeds_verdict() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for n in [1, 2, 8] {
        let verdicts = fixtures().join(format!("deepspeed-verdicts/real.ws{n}.jsonl"));
        for line in std::fs::read_to_string(&verdicts)
            .expect("verdict file")
            .lines()
        {
            let v: Json = serde_json::from_str(line).expect("verdict line is JSON");
            let name = v["file"].as_str().expect("file name");
            let file = fixtures().join("real").join(name);
            if let Err(why) = check_one(&file, n, 1, 1, &v["deepspeed"]) {
                failures.push(format!("{name} at world size {n}: {why}"));
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 119, "every real config at every world size");
    assert!(
        failures.is_empty(),
        "{} of {checked} verdicts differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Cases where ds-rs knowingly differs from DeepSpeed, and why (configs/ARCHITECTURE.md, Decisions).
const KNOWN_DEVIATIONS: [(&str, &str); 4] = [
    (
        "633_file_root_base64.json",
        "a file holding a base64-encoded config is not decoded",
    ),
    (
        "646_file_lone_surrogate.json",
        "a lone UTF-16 surrogate cannot be held in a Rust string",
    ),
    (
        "047_batch_tbs_huge.json",
        "integers beyond 64 bits are rejected; Python keeps a big int",
    ),
    (
        "201_zero_s3_model_persist_2p64.json",
        "integers beyond 64 bits are rejected; Python keeps a big int",
    ),
];

#[test]
fn synthetic_configs_get_deepspeeds_verdict() {
    let verdicts = fixtures().join("oracle/verdicts.jsonl");
    let text =
        std::fs::read_to_string(&verdicts).expect("oracle/verdicts.jsonl (see oracle/README.md)");
    let mut failures = Vec::new();
    let mut checked = 0;
    for line in text.lines() {
        let v: Json = serde_json::from_str(line).expect("verdict line is JSON");
        let name = v["file"].as_str().expect("file name");
        let (n, tp, pp) = (v["world_size"].as_u64(), v["tp"].as_u64(), v["pp"].as_u64());
        let (Some(n), Some(tp), Some(pp)) = (n, tp, pp) else {
            panic!("bad layout in {line}")
        };
        let file = fixtures().join("oracle/cases").join(name);
        let outcome = check_one(&file, n as usize, tp as usize, pp as usize, &v["deepspeed"]);
        let known = KNOWN_DEVIATIONS.iter().any(|(f, _)| *f == name);
        match (outcome, known) {
            (Err(why), false) => failures.push(format!("{name} at ws={n} tp={tp} pp={pp}: {why}")),
            (Ok(()), true) => failures.push(format!(
                "{name} now matches DeepSpeed: remove it from KNOWN_DEVIATIONS"
            )),
            _ => {}
        }
        checked += 1;
    }
    assert!(checked > 0, "no synthetic verdicts found");
    assert!(
        failures.is_empty(),
        "{} of {checked} verdicts differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
