//! Two hosts played by network namespaces joined by a veth pair, each with its own address;
//! the remote-exec template is `ip netns exec {host} sh -c` (what ssh does on a cluster).
//! Needs root and iproute2; `two_hosts` says why it cannot run without them.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{words, Scratch};

/// Two namespaces `<tag>a`, `<tag>b` with 10.X.Y.1 and .2 on a veth pair, removed on drop.
pub struct TwoHosts {
    pub names: [String; 2],
    pub addrs: [String; 2],
}

impl TwoHosts {
    pub fn new(tag: &str) -> Result<TwoHosts, String> {
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

pub fn ip(args: &[&str]) -> Result<(), String> {
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
pub fn two_hosts(tag: &str) -> Option<TwoHosts> {
    match TwoHosts::new(tag) {
        Ok(h) => Some(h),
        Err(why) => {
            println!("skipped: cannot create network namespaces ({why}); needs root and iproute2");
            None
        }
    }
}

pub const TEMPLATE: &str = "ip netns exec {host} sh -c";

/// `ds-rs launch` over the two namespaces from `hostfile`, rendezvous at the first host's
/// address on `port`, then `program`.
pub fn launch(
    hosts: &TwoHosts,
    hostfile: &Path,
    port: u16,
    config: &Path,
    program: &str,
) -> Vec<String> {
    let mut args = words(&format!(
        "launch --hostfile {} --master_addr {} --master_port {port} --config {}",
        hostfile.display(),
        hosts.addrs[0],
        config.display()
    ));
    args.extend(["--ssh_template".into(), TEMPLATE.into()]);
    args.extend(words(program));
    args
}

pub fn hostfile(s: &Scratch, hosts: &TwoHosts, slots: [&str; 2]) -> PathBuf {
    let [a, b] = &hosts.names;
    s.write(
        "hostfile",
        &format!("{a} slots={}\n{b} slots={}\n", slots[0], slots[1]),
    )
}
