//! `ds-rs launch` across hosts, for real: two network namespaces joined by a veth pair play two
//! hosts with their own addresses, and the remote-exec template is `ip netns exec {host} sh -c`
//! (what ssh does on a cluster). Needs root and iproute2; skipped, saying why, without them.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Two namespaces `<tag>a`, `<tag>b` with 10.X.Y.1 and .2 on a veth pair, removed on drop.
struct TwoHosts {
    names: [String; 2],
    addrs: [String; 2],
}

impl TwoHosts {
    fn new(tag: &str) -> Result<TwoHosts, String> {
        let id = std::process::id();
        let base = format!("dr{}{}", tag, id % 100_000);
        let names = [format!("{base}a"), format!("{base}b")];
        let net = format!("10.{}.{}", 200 + id % 50, (id / 50) % 250);
        let addrs = [format!("{net}.1"), format!("{net}.2")];
        let hosts = TwoHosts { names, addrs };
        let [a, b] = &hosts.names;
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", a],
            vec!["netns", "add", b],
            vec![
                "link", "add", "veth-x", "netns", a, "type", "veth", "peer", "name", "veth-y",
                "netns", b,
            ],
        ];
        for s in steps {
            ip(&s)?;
        }
        for (ns, dev, addr) in [
            (a, "veth-x", &hosts.addrs[0]),
            (b, "veth-y", &hosts.addrs[1]),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces, or None after printing why the test cannot run here.
fn two_hosts(tag: &str) -> Option<TwoHosts> {
    match TwoHosts::new(tag) {
        Ok(h) => Some(h),
        Err(why) => {
            println!("skipped: cannot create network namespaces ({why}); needs root and iproute2");
            None
        }
    }
}

const TEMPLATE: &str = "ip netns exec {host} sh -c";

fn p(path: &std::path::Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn two_hosts_with_two_ranks_each_train_like_one_process() {
    let Some(hosts) = two_hosts("t") else { return };
    let s = Scratch::new("hosts-train");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z3.json", &config(3, ""));
    let hostfile = s.write(
        "hostfile",
        &format!("{} slots=2\n{} slots=2\n", hosts.names[0], hosts.names[1]),
    );
    let (one, four) = (s.path("one"), s.path("four"));
    let f = run(
        &[
            "train",
            "--model",
            p(&model),
            "--config",
            p(&cfg),
            "--steps",
            "4",
            "--eval-batches",
            "1",
            "--metrics-dir",
            p(&one),
        ],
        Duration::from_secs(120),
    );
    assert!(f.status.success(), "{}", f.stderr);
    let f = run(
        &[
            "launch",
            "--hostfile",
            p(&hostfile),
            "--ssh_template",
            TEMPLATE,
            "--master_addr",
            &hosts.addrs[0],
            "--master_port",
            "29561",
            "--config",
            p(&cfg),
            "train",
            "--model",
            p(&model),
            "--steps",
            "4",
            "--eval-batches",
            "1",
            "--metrics-dir",
            p(&four),
        ],
        Duration::from_secs(240),
    );
    assert!(f.status.success(), "{}", f.stderr);
    assert!(f.stdout.contains("4 ranks, ZeRO stage 3"), "{}", f.stdout);
    // The same tolerance as the one-host layouts: only summation order differs.
    assert_same_losses(
        &losses(&four),
        &losses(&one),
        1e-5,
        "2 hosts x 2 ranks, ZeRO-3",
    );
}

#[test]
fn a_rank_killed_on_the_second_host_brings_every_host_down() {
    let Some(hosts) = two_hosts("k") else { return };
    let s = Scratch::new("hosts-kill");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z2.json", &config(2, ""));
    let hostfile = s.write(
        "hostfile",
        &format!("{} slots=2\n{} slots=2\n", hosts.names[0], hosts.names[1]),
    );
    let dir = s.path("metrics");
    let child = start(&[
        "launch",
        "--hostfile",
        p(&hostfile),
        "--ssh_template",
        TEMPLATE,
        "--master_addr",
        &hosts.addrs[0],
        "--master_port",
        "29562",
        "--config",
        p(&cfg),
        "train",
        "--model",
        p(&model),
        "--steps",
        "100000",
        "--metrics-dir",
        p(&dir),
    ]);
    assert!(
        wait_for(Duration::from_secs(120), || !steps(&dir).is_empty()),
        "no step trained"
    );
    signal(rank_pid(p(&dir), 3).expect("rank 3 is running"), "KILL");
    let f = finish(child, Duration::from_secs(15));
    assert!(!f.status.success());
    let b = &hosts.names[1];
    assert!(
        f.stderr
            .contains(&format!("rank 3 on host {b} was killed by SIGKILL")),
        "{}",
        f.stderr
    );
    assert!(
        f.stderr.contains(&format!("node 1 (host {b})")),
        "{}",
        f.stderr
    );
    assert!(
        processes_with(p(&dir)).is_empty(),
        "left behind: {:?}",
        processes_with(p(&dir))
    );
}

#[test]
fn an_unreachable_host_is_named() {
    let Some(hosts) = two_hosts("u") else { return };
    let s = Scratch::new("hosts-unreachable");
    let hostfile = s.write(
        "hostfile",
        &format!("{} slots=1\nno-such-host slots=1\n", hosts.names[0]),
    );
    let f = run(
        &[
            "launch",
            "--hostfile",
            p(&hostfile),
            "--ssh_template",
            TEMPLATE,
            "--master_addr",
            &hosts.addrs[0],
            "--master_port",
            "29563",
            "train",
            "--steps",
            "1",
        ],
        Duration::from_secs(60),
    );
    assert!(!f.status.success());
    let last = error_lines(&f.stderr)
        .last()
        .copied()
        .unwrap_or_default()
        .to_string();
    assert!(last.contains("node 1 (host no-such-host)"), "{}", f.stderr);
}
