//! Helpers of the end-to-end launcher tests: scratch directories, small configs and models,
//! running `ds-rs` with a deadline, and reading the metrics contract back.
#![allow(dead_code)] // each test file uses its own subset

pub mod cgroup;
pub mod netns;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_ds-rs");

/// A scratch directory removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("ds-rs-{tag}-{}", std::process::id()));
        assert!(
            !dir.to_string_lossy().contains(' '),
            "commands are split on spaces"
        );
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A GPT small enough that a step takes milliseconds, so tests can run many layouts.
pub const SMALL_MODEL: &str = r#"{"V": 512, "T": 32, "d": 64, "H": 2, "L": 2}"#;

/// A ds_config with a fixed global batch of 8, so the accumulation steps follow the rank
/// count (8 / (2 * ranks)) and every layout trains on the same samples per step.
pub fn config(stage: u8, extra: &str) -> String {
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}}}{extra}}}"#
    )
}

/// What a finished command printed.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub took: Duration,
}

/// Starts `ds-rs CMD` (words separated by spaces; scratch paths have none) with its output
/// captured.
pub fn start(cmd: &str) -> Child {
    start_args(&words(cmd))
}

pub fn words(cmd: &str) -> Vec<String> {
    cmd.split_whitespace().map(String::from).collect()
}

/// Starts `ds-rs ARGS` with its output captured.
pub fn start_args(args: &[String]) -> Child {
    spawn_captured(Command::new(BIN).args(args))
}

/// Starts `cmd` with no input and its output captured (for `finish`).
pub fn spawn_captured(cmd: &mut Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `child` at most `limit`; past it the child is killed and the test fails.
pub fn finish(mut child: Child, limit: Duration) -> Finished {
    let t0 = Instant::now();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ds-rs ran past {limit:?}: {}", err_thread.join().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    Finished {
        status,
        stdout: out_thread.join().unwrap(),
        stderr: err_thread.join().unwrap(),
        took,
    }
}

/// No entry in `dir` (or no `dir`).
pub fn is_empty_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none())
}

/// Runs `ds-rs CMD` to the end (at most `limit`).
pub fn run(cmd: &str, limit: Duration) -> Finished {
    finish(start(cmd), limit)
}

/// `train` of the model file `model` for `steps` steps, one held-out batch, metrics in `dir`.
pub fn train(model: &Path, steps: u64, dir: &Path) -> String {
    format!(
        "train --model {} --steps {steps} --eval-batches 1 --metrics-dir {}",
        model.display(),
        dir.display()
    )
}

/// The per-step records of DIR/metrics.jsonl (evaluation lines left out).
pub fn steps(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .collect()
}

pub fn losses(dir: &Path) -> Vec<f64> {
    steps(dir)
        .iter()
        .map(|v| v["loss"].as_f64().unwrap())
        .collect()
}

/// The last held-out loss of DIR/summary.json.
pub fn eval_loss(dir: &Path) -> f64 {
    let text = std::fs::read_to_string(dir.join("summary.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["final_eval_loss"].as_f64().unwrap()
}

/// Each step's loss within `rel` of the reference's.
pub fn assert_same_losses(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: steps {got:?} vs {want:?}");
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            ((g - w) / w).abs() < rel,
            "{what}: step {s}: {g} vs reference {w}"
        );
    }
}

/// Each step's loss and gradient norm (`got`, `want`: (losses, norms)) within `rel` of the
/// reference's, the largest relative differences printed. The norms are compared on their
/// own: clipping by a wrong norm moves the losses only in their last digits.
pub fn assert_same_steps(got: (&[f64], &[f64]), want: (&[f64], &[f64]), rel: f64, what: &str) {
    let worst = |got: &[f64], want: &[f64]| {
        got.iter()
            .zip(want)
            .map(|(g, w)| (g - w).abs() / w.abs())
            .fold(0f64, f64::max)
    };
    println!(
        "{what}: largest relative loss difference {:e}, gradient norm {:e}",
        worst(got.0, want.0),
        worst(got.1, want.1)
    );
    assert_same_losses(got.0, want.0, rel, what);
    assert_same_losses(got.1, want.1, rel, &format!("{what} gradient norms"));
}

/// Live processes (not zombies) whose command line mentions `needle`, with their environment.
pub fn processes_with(needle: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'));
        if cmdline.contains(needle) && !zombie {
            let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            found.push((pid, String::from_utf8_lossy(&env).replace('\0', "\n")));
        }
    }
    found
}

/// No live process of the job whose command line mentions `needle` is left.
pub fn assert_nothing_left(needle: &str) {
    let left = processes_with(needle);
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The pid of the rank `rank` of the job whose command line mentions `needle` (not a launcher).
pub fn rank_pid(needle: &str, rank: usize) -> Option<u32> {
    processes_with(needle).into_iter().find_map(|(pid, env)| {
        let is_rank = env.lines().any(|l| l == format!("RANK={rank}"));
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let launcher = String::from_utf8_lossy(&cmd)
            .split('\0')
            .any(|w| w == "launch");
        (is_rank && !launcher).then_some(pid)
    })
}

/// Waits until `cond` holds, at most `limit`.
pub fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Waits (at most 2 minutes) until the job writing `dir` has logged `n` steps.
pub fn wait_for_steps(dir: &Path, n: usize) {
    let logged = wait_for(Duration::from_secs(120), || steps(dir).len() >= n);
    assert!(logged, "fewer than {n} steps trained in {}", dir.display());
}

pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill -{sig} {pid}");
}

/// The lines of `text` that start with "error:".
pub fn error_lines(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.starts_with("error:")).collect()
}

/// The f32 tensors of a safetensors file (`--save-weights`, `checkpoint consolidate`) by name.
pub fn read_weights(path: &Path) -> std::collections::HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let v = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, v)
        })
        .collect()
}

/// The custom-loop example's executable (engine/examples/custom_loop.rs), built once by cargo with this test's profile (`cargo test` builds
/// into target/debug with the `test` profile, `cargo test --release` into target/release).
/// Selecting ds-rs beside ds-engine gives the dependencies the features this test was built
/// with, so cargo reuses them instead of compiling candle a second time.
pub fn custom_loop_example() -> &'static PathBuf {
    example_exe("custom_loop")
}

/// The engine example `name` (engine/examples), built once per test binary in this profile.
pub fn example_exe(name: &str) -> &'static PathBuf {
    static BUILT: OnceLock<std::sync::Mutex<std::collections::HashMap<String, &'static PathBuf>>> =
        OnceLock::new();
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap();
    if let Some(exe) = built.get(name) {
        return exe;
    }
    let me = std::env::current_exe().unwrap();
    // .../target/<profile dir>/deps/<test>-<hash>
    let dir = me.parent().and_then(|d| d.parent()).unwrap();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "test".to_string(),
        Some(other) => other.to_string(),
    };
    let out = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--profile", &profile])
        .args(["-p", "ds-rs", "-p", "ds-engine"])
        .args([
            "--example",
            name,
            "--message-format=json-render-diagnostics",
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "building the example {name} failed");
    let exe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == name)
        .find_map(|v| v["executable"].as_str().map(PathBuf::from));
    let exe: &'static PathBuf = Box::leak(Box::new(exe.expect("cargo named no such executable")));
    built.insert(name.to_string(), exe);
    exe
}

/// A tmpfs mounted on a scratch directory, unmounted on drop.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn mount(dir: PathBuf, options: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(&dir)
            .output()
            .map_err(|e| e.to_string())?;
        match out.status.success() {
            true => Ok(Tmpfs(dir)),
            false => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// The scalars of a TensorBoard event file as TensorBoard's own reader sees them
/// (engine/tests/monitor/read_events.py), by tag: `(step, value)` in the order EventAccumulator
/// gives them, the value the stored f32; or None, having said why, when DS_RS_PYTHON (a
/// Python with the tensorboard package) is not set.
pub fn tensorboard_scalars(
    file: &Path,
) -> Option<std::collections::BTreeMap<String, Vec<(u64, f32)>>> {
    let Ok(python) = std::env::var("DS_RS_PYTHON") else {
        println!(
            "skipped reading the events back: DS_RS_PYTHON (a Python with tensorboard) is not set"
        );
        return None;
    };
    let reader = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/tests/monitor/read_events.py");
    let out = Command::new(python).arg(reader).arg(file).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut by_tag = std::collections::BTreeMap::<String, Vec<(u64, f32)>>::new();
    for e in read["accumulator"].as_array().unwrap() {
        let value = f32::from_bits(e["bits"].as_u64().unwrap() as u32);
        let tag = e["tag"].as_str().unwrap().to_string();
        by_tag
            .entry(tag)
            .or_default()
            .push((e["step"].as_u64().unwrap(), value));
    }
    Some(by_tag)
}
