//! Reads the event file back with TensorBoard's own Python readers (tests/monitor/read_events.py)
//! and compares with what was written. Needs `DS_RS_PYTHON`, a Python with the `tensorboard`
//! package; without it the test prints why and passes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use ds_config::monitor::FileMonitorConfig;
use ds_engine::monitor::Monitor;
use serde_json::Value;

/// Two write_events calls shaped like DeepSpeed's (backward, then step), plus edge values:
/// step 0, a step past 2^32, a value that rounds in f32, tiny, huge, negative, NaN, infinite,
/// a 200-byte tag (multi-byte protobuf lengths) and a tag with a space.
fn batches() -> Vec<Vec<(String, f64, u64)>> {
    let long_tag = format!("Custom/{}", "x".repeat(200));
    let ev = |tag: &str, value: f64, step: u64| (tag.to_string(), value, step);
    vec![
        vec![ev("Train/Samples/train_loss", 10.375, 0)],
        vec![
            ev("Train/Samples/lr", 1e-5, 8),
            ev("Train/Samples/loss_scale", 65536.0, 8),
        ],
        vec![ev("Train/Samples/train_loss", 0.1 + 0.2, 16)],
        vec![
            ev("Train/Samples/lr", 2.5e-7, 16),
            ev("Train/Samples/loss_scale", 32768.0, 16),
            ev("Train/Samples/elapsed_time_ms_step", -1.0e-30, 16),
            ev("Train/Samples/train_loss", f64::NAN, 5_000_000_000),
            ev("Train/Samples/grad norm", f64::INFINITY, 5_000_000_000),
            ev(&long_tag, 3.0e38, 5_000_000_000),
        ],
    ]
}

fn python() -> Option<String> {
    std::env::var("DS_RS_PYTHON").ok().filter(|p| !p.is_empty())
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds_monitor_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// Writes every batch through a TensorBoard-only monitor; returns the event file.
fn write_run(dir: &Path) -> PathBuf {
    let on = FileMonitorConfig {
        enabled: true,
        output_path: dir.to_string_lossy().into_owned(),
        job_name: "tb_job".to_string(),
    };
    let off = FileMonitorConfig {
        enabled: false,
        ..on.clone()
    };
    let mut monitor = Monitor::new(&on, &off, 0).expect("monitor");
    for batch in batches() {
        let events: Vec<(&str, f64, u64)> =
            batch.iter().map(|(t, v, s)| (t.as_str(), *v, *s)).collect();
        monitor.write_events(&events).expect("write_events");
    }
    let file = monitor
        .tensorboard_file()
        .expect("event file")
        .to_path_buf();
    assert_eq!(file.parent(), Some(dir.join("tb_job").as_path()));
    file
}

fn read_back(python: &str, file: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/monitor/read_events.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(file)
        .output()
        .expect("run read_events.py");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "read_events.py failed: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("read_events.py output: {stdout}");
    serde_json::from_str(&stdout).expect("JSON from read_events.py")
}

/// One scalar as read back must be the written one: same tag and step, and the f32 TensorBoard
/// stores (bit for bit; any NaN for a NaN).
fn check_scalar(got: &Value, (tag, value, step): &(String, f64, u64)) {
    assert_eq!(got["tag"].as_str(), Some(tag.as_str()), "{got}");
    assert_eq!(got["step"].as_u64(), Some(*step), "{got}");
    let bits = got["bits"].as_u64().expect("bits") as u32;
    if value.is_nan() {
        assert!(f32::from_bits(bits).is_nan(), "{got}");
    } else {
        assert_eq!(bits, (*value as f32).to_bits(), "{tag}: {got}");
    }
}

#[test]
fn tensorboard_reads_back_what_was_written() {
    let Some(python) = python() else {
        println!("skipped: DS_RS_PYTHON is not set (a python with the tensorboard package)");
        return;
    };
    let dir = scratch("tb_python");
    let started = now();
    let file = write_run(&dir);
    let finished = now();
    let json = read_back(&python, &file);
    let expected: Vec<(String, f64, u64)> = batches().into_iter().flatten().collect();

    assert_eq!(json["file_version"], "brain.Event:2");
    assert_eq!(json["records"].as_u64(), Some(1 + expected.len() as u64));
    assert_eq!(json["canonical"], true, "protobuf bytes are not canonical");

    let events = json["events"].as_array().expect("events");
    assert_eq!(events.len(), expected.len());
    for (got, want) in events.iter().zip(&expected) {
        check_scalar(got, want);
        let wall = got["wall_time"].as_f64().expect("wall_time");
        assert!(
            started - 1.0 <= wall && wall <= finished + 1.0,
            "wall_time {wall}"
        );
    }

    // The accumulator groups by tag (sorted here) and keeps each tag's file order.
    let mut by_tag = expected.clone();
    by_tag.sort_by(|a, b| a.0.cmp(&b.0));
    let scalars = json["accumulator"].as_array().expect("accumulator");
    assert_eq!(scalars.len(), by_tag.len());
    for (got, want) in scalars.iter().zip(&by_tag) {
        check_scalar(got, want);
    }
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn a_corrupted_crc_is_caught_by_the_reader() {
    // Guards the check above: the reader really verifies CRCs, so passing means ours are right.
    let Some(python) = python() else {
        println!("skipped: DS_RS_PYTHON is not set (a python with the tensorboard package)");
        return;
    };
    let dir = scratch("tb_corrupt");
    let file = write_run(&dir);
    let mut bytes = std::fs::read(&file).expect("read");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01; // the final record's data CRC
    std::fs::write(&file, &bytes).expect("write");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/monitor/read_events.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(&file)
        .output()
        .expect("run read_events.py");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a flipped CRC bit went unnoticed");
    assert!(stderr.contains("crc32"), "unexpected failure: {stderr}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}
