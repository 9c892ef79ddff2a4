//! The CSV monitor read back: file names, header and rows in DeepSpeed's csvMonitor layout.
//! The last test also compares bytes with tests/monitor/csv_reference.py (Python's csv module
//! driven the way csvMonitor drives it) when `DS_RS_PYTHON` names a Python.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use ds_config::monitor::FileMonitorConfig;
use ds_engine::monitor::{Monitor, MonitorError};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ds_monitor_{name}_{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn csv_only(output_path: &Path, job_name: &str) -> (FileMonitorConfig, FileMonitorConfig) {
    let on = FileMonitorConfig {
        enabled: true,
        output_path: output_path.to_string_lossy().into_owned(),
        job_name: job_name.to_string(),
    };
    let off = FileMonitorConfig {
        enabled: false,
        ..on.clone()
    };
    (off, on)
}

/// Every file of a directory, name -> content.
fn files(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        out.insert(name, fs::read_to_string(&path).expect("read"));
    }
    out
}

#[test]
fn files_header_and_rows_follow_deepspeed() {
    let dir = scratch("csv_layout");
    let (tb, csv) = csv_only(&dir, "csv_job");
    let mut m = Monitor::new(&tb, &csv, 0).expect("monitor");
    m.write_events(&[("Train/Samples/train_loss", 2.5, 8)])
        .expect("write");
    m.write_events(&[
        ("Train/Samples/lr", 1e-5, 8),
        ("Train/Samples/loss_scale", 65536.0, 8),
    ])
    .expect("write");
    m.write_events(&[("Train/Samples/train_loss", 0.1 + 0.2, 16)])
        .expect("write");
    m.write_events(&[("my metric", -3.0, 16)]).expect("write");
    assert_eq!(m.csv_dir(), Some(dir.join("csv_job").as_path()));

    let got = files(&dir.join("csv_job"));
    let want: BTreeMap<String, String> = [
        (
            "Train_Samples_train_loss.csv",
            "step,train_loss\r\n8,2.5\r\n16,0.30000000000000004\r\n",
        ),
        ("Train_Samples_lr.csv", "step,lr\r\n8,1e-05\r\n"),
        (
            "Train_Samples_loss_scale.csv",
            "step,loss_scale\r\n8,65536.0\r\n",
        ),
        ("my_metric.csv", "step,my metric\r\n16,-3.0\r\n"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(got, want);
    fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn a_new_monitor_appends_with_a_fresh_header() {
    // DeepSpeed opens with 'a+' and remembers headers per process: a restarted run appends to
    // the old file and writes its header again.
    let dir = scratch("csv_restart");
    let (tb, csv) = csv_only(&dir, "job");
    for step in [8, 16] {
        let mut m = Monitor::new(&tb, &csv, 0).expect("monitor");
        m.write_events(&[("Train/Samples/lr", 0.5, step)])
            .expect("write");
    }
    let text = fs::read_to_string(dir.join("job/Train_Samples_lr.csv")).expect("read");
    assert_eq!(text, "step,lr\r\n8,0.5\r\nstep,lr\r\n16,0.5\r\n");
    fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn an_unusable_output_path_names_the_directory() {
    let dir = scratch("csv_blocked");
    fs::create_dir_all(&dir).expect("dir");
    let blocker = dir.join("not_a_dir");
    fs::write(&blocker, b"file").expect("file");
    let (tb, csv) = csv_only(&blocker, "job");
    let err = Monitor::new(&tb, &csv, 0).expect_err("a file as output_path");
    assert!(matches!(err, MonitorError::CreateDir { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&blocker.join("job").display().to_string()),
        "{text}"
    );
    fs::remove_dir_all(&dir).expect("cleanup");
}

/// Batches for the byte comparison with Python: a sweep over 30 decades plus the values around
/// the points where Python's repr changes layout (1e-4 and 1e16), exact ties between two
/// shortest strings (repr rounds half to even), repeated tags across calls, two events per
/// call, and a tag that needs CSV quoting.
fn reference_batches() -> Vec<Vec<(String, f64, u64)>> {
    let tags = [
        "Train/Samples/train_loss",
        "Train/Samples/lr",
        "Eval/a,b \"q\"",
    ];
    let edges = [
        1e-5, 9.999e-5, 1e-4, 1.0001e-4, 9.999e15, 1e16, 1.5e16, 0.0, -0.0,
    ];
    let ties = [1113178120592002.0 + 0.25, -(233891771783429.0 + 0.625)]; // exact halves
    let mut values: Vec<f64> = edges.iter().chain(&ties).copied().collect();
    let mut x = 1.0e-9_f64;
    for _ in 0..60 {
        values.extend([x, -x / 3.0]);
        x *= 3.7;
    }
    let mut batches = Vec::new();
    for (i, pair) in values.chunks(2).enumerate() {
        let step = i as u64 * 8;
        let batch = pair
            .iter()
            .enumerate()
            .map(|(j, &v)| (tags[(i + j) % tags.len()].to_string(), v, step))
            .collect();
        batches.push(batch);
    }
    batches
}

fn write_reference(python: &str, out_dir: &Path, batches: &[Vec<(String, f64, u64)>]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/monitor/csv_reference.py");
    let json = serde_json::to_string(batches).expect("json");
    let mut child = Command::new(python)
        .arg(&script)
        .arg(out_dir)
        .stdin(Stdio::piped())
        .spawn()
        .expect("run csv_reference.py");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(json.as_bytes())
        .expect("send batches");
    assert!(
        child.wait().expect("wait").success(),
        "csv_reference.py failed"
    );
}

#[test]
fn bytes_match_python_csv_writer() {
    let Ok(python) = std::env::var("DS_RS_PYTHON") else {
        println!("skipped: DS_RS_PYTHON is not set (any python3 will do for this test)");
        return;
    };
    let dir = scratch("csv_python");
    let batches = reference_batches();
    write_reference(&python, &dir.join("python"), &batches);
    let (tb, csv) = csv_only(&dir, "rust");
    let mut m = Monitor::new(&tb, &csv, 0).expect("monitor");
    for batch in &batches {
        let events: Vec<(&str, f64, u64)> =
            batch.iter().map(|(t, v, s)| (t.as_str(), *v, *s)).collect();
        m.write_events(&events).expect("write");
    }
    let python_files = files(&dir.join("python"));
    assert_eq!(python_files.len(), 3);
    assert_eq!(files(&dir.join("rust")), python_files);
    fs::remove_dir_all(&dir).expect("cleanup");
}
