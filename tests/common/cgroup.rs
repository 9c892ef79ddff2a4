//! A memory cgroup made by a test (the v1 memory controller where it is mounted, cgroup v2
//! otherwise), limited, removed with its processes when dropped; the tests that need one skip,
//! saying why, where none can be made.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{finish, spawn_captured, wait_for, Finished, BIN};

/// Which cgroup hierarchy a limit lives in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Version {
    V1,
    V2,
}

/// A memory cgroup made by the test; its processes are killed and the directory removed when
/// dropped (also when the test fails).
pub struct Cgroup {
    pub dir: PathBuf,
    pub version: Version,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("writing {value:?} to {}: {e}", path.display()))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The value of `key` in a flat keyed file (memory.events, memory.oom_control).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next()?.parse().ok())
            .flatten()
    })
}

/// This process's cgroup path in the hierarchy whose /proc/self/cgroup line matches `want`.
fn own_path(want: impl Fn(&str, &str) -> bool) -> Option<String> {
    read(Path::new("/proc/self/cgroup")).lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        want(id, controllers).then(|| path.to_string())
    })
}

impl Cgroup {
    /// A fresh memory cgroup limited to `bytes` (swap included where the kernel counts it), or
    /// why none can be made here.
    pub fn new(bytes: u64) -> Result<Cgroup, String> {
        let name = format!(
            "ds-rs-memlimit-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let mut why = Vec::new();
        for (version, parent) in candidates() {
            let dir = parent.join(&name);
            if let Err(e) = std::fs::create_dir(&dir) {
                why.push(format!("mkdir {}: {e}", dir.display()));
                continue;
            }
            let cg = Cgroup { dir, version };
            match cg.limit(bytes) {
                Ok(()) => return Ok(cg),
                Err(e) => why.push(e), // dropped: the directory is removed
            }
        }
        if why.is_empty() {
            why.push(
                "no cgroup v1 memory controller, and no cgroup v2 hierarchy whose memory \
                 controller is handed down to where this test could make a cgroup"
                    .into(),
            );
        }
        Err(why.join("; "))
    }

    fn limit(&self, bytes: u64) -> Result<(), String> {
        let file = |n: &str| self.dir.join(n);
        match self.version {
            Version::V1 => {
                write(&file("memory.limit_in_bytes"), &bytes.to_string())?;
                // No swap may hide the overrun (memsw exists only with swap accounting).
                if file("memory.memsw.limit_in_bytes").exists() {
                    write(&file("memory.memsw.limit_in_bytes"), &bytes.to_string())?;
                }
                let _ = write(&file("memory.swappiness"), "0");
            }
            Version::V2 => {
                if !file("memory.max").exists() {
                    return Err(format!(
                        "{}: no memory.max (memory controller not enabled)",
                        self.dir.display()
                    ));
                }
                write(&file("memory.max"), &bytes.to_string())?;
                if file("memory.swap.max").exists() {
                    write(&file("memory.swap.max"), "0")?;
                }
            }
        }
        Ok(())
    }

    /// The file a process writes its pid to, to join.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    pub fn pids(&self) -> Vec<u32> {
        read(&self.procs())
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Processes the OOM killer killed in this cgroup, and how often usage hit the limit.
    pub fn oom_kills(&self) -> (Option<u64>, Option<u64>) {
        match self.version {
            Version::V1 => {
                // With swap accounting the memory+swap counter is charged first and fails first.
                let count = |f: &str| read(&self.dir.join(f)).trim().parse::<u64>().ok();
                let hits = match (count("memory.failcnt"), count("memory.memsw.failcnt")) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                (
                    keyed(&read(&self.dir.join("memory.oom_control")), "oom_kill"),
                    hits,
                )
            }
            Version::V2 => {
                let events = read(&self.dir.join("memory.events"));
                (keyed(&events, "oom_kill"), keyed(&events, "max"))
            }
        }
    }

    /// The most memory the cgroup was charged (v1 always; v2 where memory.peak exists).
    pub fn peak(&self) -> Option<u64> {
        let f = match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        };
        read(&self.dir.join(f)).trim().parse().ok()
    }

    /// Waits (at most `limit`) until no process is left in the cgroup.
    pub fn wait_empty(&self, limit: Duration) -> bool {
        wait_for(limit, || self.pids().is_empty())
    }
}

/// Where a memory cgroup can be made: the v1 memory controller (under this process's own
/// cgroup, then the hierarchy's root), or cgroup v2 (beside this process's cgroup, whose parent
/// hands the memory controller down, or at the root).
fn candidates() -> Vec<(Version, PathBuf)> {
    let mut out = Vec::new();
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if v1.join("memory.limit_in_bytes").exists() {
        let own = own_path(|_, c| c.split(',').any(|c| c == "memory"));
        if let Some(own) = own.filter(|p| p != "/") {
            out.push((Version::V1, v1.join(own.trim_start_matches('/'))));
        }
        out.push((Version::V1, v1.to_path_buf()));
    }
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let root = Path::new(root);
        if !read(&root.join("cgroup.controllers"))
            .split_whitespace()
            .any(|c| c == "memory")
        {
            continue;
        }
        // The root may hand the controller down; a non-root cgroup with processes cannot.
        let enabled = |dir: &Path| {
            read(&dir.join("cgroup.subtree_control"))
                .split_whitespace()
                .any(|c| c == "memory")
        };
        if let Some(own) = own_path(|id, _| id == "0").filter(|p| p != "/") {
            let own = root.join(own.trim_start_matches('/'));
            if let Some(parent) = own.parent().filter(|p| enabled(p)) {
                out.push((Version::V2, parent.to_path_buf()));
            }
        }
        // (The test does not enable the controller itself: that would outlive it.)
        if enabled(root) {
            out.push((Version::V2, root.to_path_buf()));
        }
    }
    out
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Whatever is still inside was started by this test (the launcher and its ranks).
        let t0 = Instant::now();
        while !self.pids().is_empty() && t0.elapsed() < Duration::from_secs(20) {
            for pid in self.pids() {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .stderr(Stdio::null())
                    .status();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // The kernel releases a cgroup a moment after its last process is reaped.
        let removed = wait_for(Duration::from_secs(10), || {
            std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists()
        });
        if !removed {
            eprintln!("could not remove the cgroup {}", self.dir.display());
        }
    }
}

/// `ds-rs ARGS` started in `cg` (through a shell that joins it, then becomes the launcher),
/// run to the end (at most `limit`).
pub fn run_in(cg: &Cgroup, args: &[String], limit: Duration) -> Finished {
    let child = spawn_captured(
        Command::new("sh")
            .arg("-c")
            .arg(r#"echo $$ > "$0" && exec "$@""#)
            .arg(cg.procs())
            .arg(BIN)
            .args(args),
    );
    finish(child, limit)
}
