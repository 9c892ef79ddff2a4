//! Training over the MPI backend (`--dist_backend mpi`, the `mpi` feature) against the built-in
//! transport: the same losses from `mpirun` on one host, and from `ds-rs launch --launcher
//! openmpi` on two hosts played by network namespaces; a rank that dies or stops ends the job,
//! named, with nothing left behind. Needs OpenMPI's mpirun (scripts/install-mpi.sh); as root,
//! OMPI_ALLOW_RUN_AS_ROOT lets it run.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns;
use common::*;

const LIMIT: Duration = Duration::from_secs(240);

/// `mpirun` for tests: allowed as root, any number of ranks on this host's 2 cores.
fn mpirun(np: usize, s: &Scratch) -> Command {
    let mut cmd = Command::new("mpirun");
    mpi_env(&mut cmd, s).args(["--oversubscribe", "-np", &np.to_string()]);
    cmd
}

/// What every MPI process of a test gets: root allowed, and OpenMPI's session directory in
/// the scratch directory (by default /tmp/ompi.<host>.<uid>, which a killed job leaves).
fn mpi_env<'a>(cmd: &'a mut Command, s: &Scratch) -> &'a mut Command {
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_orte_tmpdir_base", &s.0)
}

/// Whether mpirun is here; prints why the test cannot run otherwise.
fn have_mpirun() -> bool {
    let ok = Command::new("mpirun").arg("--version").output().is_ok();
    if !ok {
        println!("skipped: no mpirun (scripts/install-mpi.sh installs OpenMPI)");
    }
    ok
}

/// The files of one run: a model, a config of ZeRO `stage`, the metrics directory.
struct Run {
    model: std::path::PathBuf,
    config: std::path::PathBuf,
}

impl Run {
    fn new(s: &Scratch, stage: u8) -> Run {
        Run {
            model: s.write("model.json", SMALL_MODEL),
            config: s.write(&format!("zero{stage}.json"), &config(stage, "")),
        }
    }

    /// `train ...` writing its metrics to `dir`.
    fn train(&self, steps: u64, dir: &Path) -> Vec<String> {
        let mut w = words(&format!(
            "train --config {} --dist_backend mpi",
            self.config.display()
        ));
        w.extend(words(&train(&self.model, steps, dir))[1..].iter().cloned());
        w
    }

    /// The built-in transport's losses, from `ds-rs launch` on `np` local ranks.
    fn built_in(&self, np: usize, steps: u64, dir: &Path) -> Vec<f64> {
        let cmd = format!(
            "launch --nproc_per_node {np} --config {} {}",
            self.config.display(),
            train(&self.model, steps, dir)
        );
        let done = run(&cmd, LIMIT);
        assert!(done.status.success(), "built-in transport: {}", done.stderr);
        losses(dir)
    }
}

#[test]
fn zero_1_and_3_over_mpi_train_like_the_built_in_transport() {
    if !have_mpirun() {
        return;
    }
    for (stage, np) in [(1, 2), (3, 2), (3, 4)] {
        let s = Scratch::new(&format!("mpi-train-z{stage}-{np}"));
        let r = Run::new(&s, stage);
        let want = r.built_in(np, 6, &s.path("ds"));
        let mut cmd = mpirun(np, &s);
        cmd.arg(BIN).args(r.train(6, &s.path("mpi")));
        let done = finish(spawn_captured(&mut cmd), LIMIT);
        assert!(done.status.success(), "mpirun -np {np}: {}", done.stderr);
        let got = losses(&s.path("mpi"));
        let what = format!("ZeRO-{stage}, {np} ranks over MPI");
        if np == 2 {
            // Two operands sum to the same f32 in any order: MPI's reduction and the ring
            // agree bit for bit.
            assert_eq!(got, want, "{what}");
        } else {
            // Four ranks: MPI adds in its own order, the ring in another; f32 rounding apart,
            // the losses agree.
            assert_same_losses(&got, &want, 1e-5, &what);
        }
        println!("{what}: bit-identical: {}; losses {got:?}", got == want);
    }
}

/// The pid of MPI rank `rank` of the job whose command line mentions `needle`.
fn mpi_rank_pid(needle: &str, rank: usize) -> Option<u32> {
    processes_with(needle).into_iter().find_map(|(pid, env)| {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let is_ds_rs = String::from_utf8_lossy(&cmd).starts_with(BIN);
        let is_rank = env
            .lines()
            .any(|l| l == format!("OMPI_COMM_WORLD_RANK={rank}"));
        (is_ds_rs && is_rank).then_some(pid)
    })
}

/// Starts a long 2-rank MPI run, waits for its first steps, sends `sig` to rank 1, and
/// returns what the job printed and how long it took to end after the signal.
fn signal_rank_1(tag: &str, sig: &str, timeout_s: u32) -> (Finished, Duration) {
    let s = Scratch::new(tag);
    let r = Run::new(&s, 2);
    let metrics = s.path("m");
    let mut cmd = mpirun(2, &s);
    cmd.env("DS_RS_COMM_TIMEOUT", timeout_s.to_string())
        .arg(BIN)
        .args(r.train(100_000, &metrics));
    let child = spawn_captured(&mut cmd);
    wait_for_steps(&metrics, 3);
    let needle = metrics.to_string_lossy().into_owned();
    let pid = mpi_rank_pid(&needle, 1).expect("rank 1's process");
    let t0 = Instant::now();
    signal(pid, sig);
    let done = finish(child, LIMIT);
    let took = t0.elapsed();
    assert!(
        wait_for(Duration::from_secs(10), || processes_with(&needle)
            .is_empty()),
        "left behind: {:?}",
        processes_with(&needle)
    );
    (done, took)
}

#[test]
fn a_killed_rank_ends_the_mpi_job_named() {
    if !have_mpirun() {
        return;
    }
    let (done, took) = signal_rank_1("mpi-kill", "KILL", 30);
    assert!(!done.status.success());
    let all = format!("{}{}", done.stdout, done.stderr);
    assert!(
        all.contains("rank 1") && all.contains("signal 9"),
        "the job's end does not name rank 1 and its signal:\n{all}"
    );
    assert!(
        took < Duration::from_secs(20),
        "ended {took:?} after the kill"
    );
    println!("ended {took:?} after rank 1 was killed");
}

#[test]
fn a_stopped_rank_is_aborted_at_the_timeout_named() {
    if !have_mpirun() {
        return;
    }
    let (done, took) = signal_rank_1("mpi-stop", "STOP", 4);
    assert!(!done.status.success());
    let line = error_lines(&done.stderr)
        .into_iter()
        .find(|l| l.contains("timed out after 4s"))
        .unwrap_or_else(|| panic!("no timeout named:\n{}", done.stderr));
    assert!(line.contains("rank 0"), "{line}");
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(20),
        "ended {took:?} after rank 1 stopped"
    );
    println!("ended {took:?} after rank 1 stopped: {line}");
}

/// OpenMPI's launch agent for hosts played by network namespaces: the host's daemon runs in
/// its namespace under its own hostname (a UTS namespace), so that OpenMPI sees two nodes.
const AGENT: &str = r#"#!/bin/sh
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && $*"
"#;

#[test]
fn two_netns_hosts_train_over_mpi_like_one_host() {
    if !have_mpirun() {
        return;
    }
    let Some(hosts) = netns::two_hosts("mp") else {
        return;
    };
    let s = Scratch::new("mpi-hosts");
    let r = Run::new(&s, 3);
    let want = r.built_in(4, 6, &s.path("ds"));
    let agent = s.write("agent.sh", AGENT);
    Command::new("chmod")
        .arg("+x")
        .arg(&agent)
        .status()
        .unwrap();
    let hostfile = netns::hostfile(&s, &hosts, ["2", "2"]);
    let subnet = subnet_of(&hosts.addrs[0]);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &hosts.names[0], BIN])
        .args(words(&format!(
            "launch --launcher openmpi --hostfile {} --master_addr {}",
            hostfile.display(),
            hosts.addrs[0]
        )))
        .args(r.train(6, &s.path("mpi")))
        .env("OMPI_MCA_plm_rsh_agent", &agent)
        .env("OMPI_MCA_oob_tcp_if_include", &subnet)
        .env("OMPI_MCA_btl_tcp_if_include", &subnet);
    mpi_env(&mut cmd, &s);
    let done = finish(spawn_captured(&mut cmd), LIMIT);
    assert!(done.status.success(), "two hosts over MPI: {}", done.stderr);
    let got = losses(&s.path("mpi"));
    assert_same_losses(&got, &want, 1e-5, "ZeRO-3, 2 hosts x 2 ranks over MPI");
    println!("two netns hosts over MPI: losses {got:?}");
    drop(hosts);
}

/// "10.1.2.1" -> "10.1.2.0/24" (TwoHosts' addresses share a /24).
fn subnet_of(addr: &str) -> String {
    let (net, _) = addr.rsplit_once('.').unwrap();
    format!("{net}.0/24")
}

#[test]
fn ranks_another_launcher_placed_are_refused_rather_than_trained_alone() {
    // ds-rs launch's own local path places the ranks with RANK/WORLD_SIZE; MPI, not started
    // by mpirun, sees a job of one in each process.
    let s = Scratch::new("mpi-misplaced");
    let r = Run::new(&s, 1);
    let mut cmd = Command::new(BIN);
    cmd.args(words("launch --nproc_per_node 2"))
        .args(r.train(2, &s.path("m")));
    let done = finish(spawn_captured(mpi_env(&mut cmd, &s)), LIMIT);
    assert!(!done.status.success());
    let errors = error_lines_anywhere(&done.stderr);
    assert!(
        errors
            .iter()
            .any(|l| l.contains("rank 1 of 2, MPI makes it rank 0 of 1")),
        "{}",
        done.stderr
    );
    assert!(!s.path("m").join("metrics.jsonl").exists(), "it trained");
}

/// Error lines, with or without the launcher's `[rankN] ` prefix.
fn error_lines_anywhere(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.contains("error: ")).collect()
}
