//! Network faults between two hosts (network namespaces, see common/netns.rs), one rank on
//! each (issue 20, item 3): a partition mid-training ends the job within DS_RS_COMM_TIMEOUT
//! and a few seconds, naming the rank that cannot be reached; a blip shorter than the timeout
//! costs time but not the job, whose losses are then those of a calm run; a rank stopped
//! (SIGSTOP) for longer than the timeout is named like a partition. Nothing is left running.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::netns::*;
use common::*;

/// DS_RS_COMM_TIMEOUT of these jobs, in seconds.
const TIMEOUT: u64 = 4;
/// What "a few seconds" past the timeout may take: the error travels to the launcher, which
/// stops every rank.
const GRACE: Duration = Duration::from_secs(6);

struct Job {
    hosts: TwoHosts,
    s: Scratch,
}

impl Job {
    fn new(tag: &str) -> Option<Job> {
        let hosts = two_hosts(tag)?;
        Some(Job {
            hosts,
            s: Scratch::new(&format!("netfault-{tag}")),
        })
    }

    /// One rank per host training for `steps` steps, metrics in `metrics`.
    fn start(&self, port: u16, steps: u64, metrics: &str) -> Child {
        let model = self.s.write("model.json", SMALL_MODEL);
        let cfg = self.s.write("z2.json", &config(2, ""));
        let file = hostfile(&self.s, &self.hosts, ["1", "1"]);
        let program = train(&model, steps, &self.s.path(metrics));
        let mut cmd = Command::new(BIN);
        cmd.args(launch(&self.hosts, &file, port, &cfg, &program))
            .env("DS_RS_COMM_TIMEOUT", TIMEOUT.to_string());
        spawn_captured(&mut cmd)
    }

    /// A job that trains until stopped, once it has trained 3 steps; its metrics directory.
    fn start_training(&self, port: u16) -> (Child, std::path::PathBuf) {
        let child = self.start(port, 100_000, "metrics");
        let dir = self.s.path("metrics");
        wait_for_steps(&dir, 3);
        (child, dir)
    }

    /// Takes host b's end of the link down (`up: false`) or back up.
    fn link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.hosts.names[1], "link", "set", "veth-y", state]).unwrap();
    }

    fn needle(&self) -> String {
        self.s.0.to_string_lossy().into_owned()
    }
}

/// The job failed, within the timeout and grace of `since`, naming rank `rank` as lost.
fn assert_ended_naming(job: &Job, f: &Finished, since: Instant, rank: usize, what: &str) {
    let took = since.elapsed();
    assert!(
        !f.status.success(),
        "{what}: the job survived: {}",
        f.stderr
    );
    assert!(
        took < Duration::from_secs(TIMEOUT) + GRACE,
        "{what}: ended {took:?} after the fault (timeout {TIMEOUT} s): {}",
        f.stderr
    );
    let named = f
        .stderr
        .lines()
        .any(|l| l.contains("error:") && l.contains(&format!("rank {rank}")));
    assert!(named, "{what}: rank {rank} not named: {}", f.stderr);
    assert!(!f.stderr.contains("panicked"), "{what}: {}", f.stderr);
    let gone = wait_for(Duration::from_secs(5), || {
        processes_with(&job.needle()).is_empty()
    });
    assert!(
        gone,
        "{what}: left behind: {:?}",
        processes_with(&job.needle())
    );
    eprintln!("{what}: ended {took:?} after the fault");
}

#[test]
fn a_partition_ends_the_job_naming_the_unreachable_rank() {
    let Some(job) = Job::new("p") else { return };
    let (child, _) = job.start_training(29571);
    job.link(false);
    let since = Instant::now();
    let f = finish(child, Duration::from_secs(TIMEOUT) + GRACE * 2);
    assert_ended_naming(&job, &f, since, 1, "partition");
}

#[test]
fn a_blip_shorter_than_the_timeout_loses_nothing() {
    let Some(job) = Job::new("b") else { return };
    let steps = 300;
    let calm = finish(job.start(29572, steps, "calm"), Duration::from_secs(120));
    assert!(calm.status.success(), "{}", calm.stderr);
    let dir = job.s.path("blip");
    let child = job.start(29573, steps, "blip");
    wait_for_steps(&dir, 20);
    job.link(false);
    std::thread::sleep(Duration::from_millis(1500));
    job.link(true);
    let f = finish(child, Duration::from_secs(120));
    assert!(f.status.success(), "the blip lost the job: {}", f.stderr);
    assert_eq!(losses(&dir), losses(&job.s.path("calm")));
    // the blip did cut the link: one step waited through it
    let longest = steps_of(&dir).fold(0f64, f64::max);
    assert!(
        longest > 1000.0,
        "no step waited for the link: {longest} ms"
    );
    assert_nothing_left(&job.needle());
}

/// Each step's `step_ms`.
fn steps_of(dir: &std::path::Path) -> impl Iterator<Item = f64> {
    steps(dir)
        .into_iter()
        .map(|v| v["step_ms"].as_f64().unwrap())
}

#[test]
fn a_rank_stopped_past_the_timeout_is_named() {
    let Some(job) = Job::new("s") else { return };
    let (child, dir) = job.start_training(29574);
    let pid = rank_pid(&dir.to_string_lossy(), 1).expect("rank 1 is running");
    signal(pid, "STOP");
    let since = Instant::now();
    let f = finish(child, Duration::from_secs(TIMEOUT) + GRACE * 2);
    let _ = Command::new("kill")
        .args(["-CONT", &pid.to_string()])
        .status();
    assert_ended_naming(&job, &f, since, 1, "SIGSTOP");
}
