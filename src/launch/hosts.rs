//! Which hosts and slots a job runs on: DeepSpeed's hostfile (`hostname slots=N`), its
//! `--include` / `--exclude` filters (`NAME[:SLOT[,SLOT...]][@NAME...]`), then `--num_nodes`
//! and `--num_gpus` / `--nproc_per_node`, applied in DeepSpeed's order (launcher/runner.py).

use std::path::Path;

use anyhow::{bail, Context};

/// One host and the slot indices (GPUs, or CPU ranks) the job uses on it.
/// The most slots (GPUs) one host may list: `slots=N` sizes a list, so N is capped.
pub const MAX_SLOTS: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub slots: Vec<usize>,
}

/// The hosts of a job, in hostfile order; node rank = position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts(pub Vec<Host>);

impl Hosts {
    /// One host with `slots` slots.
    pub fn single(name: &str, slots: usize) -> Hosts {
        Hosts(vec![Host {
            name: name.to_string(),
            slots: (0..slots).collect(),
        }])
    }

    /// Reads a hostfile; errors name the file and line.
    pub fn from_hostfile(path: &Path) -> anyhow::Result<Hosts> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading hostfile {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("hostfile {}", path.display()))
    }

    /// `hostname slots=N` per line; blank lines and `#` comments are skipped.
    pub fn parse(text: &str) -> anyhow::Result<Hosts> {
        let mut hosts: Vec<Host> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let (name, slots) = parse_line(line)
                .with_context(|| format!("line {}: {raw:?}: expected `hostname slots=N`", i + 1))?;
            if hosts.iter().any(|h| h.name == name) {
                bail!("line {}: host {name} is listed twice", i + 1);
            }
            hosts.push(Host {
                name: name.to_string(),
                slots: (0..slots).collect(),
            });
        }
        if hosts.is_empty() {
            bail!("no hosts listed: expected lines of `hostname slots=N`");
        }
        Ok(Hosts(hosts))
    }

    /// Keeps only what `spec` names (`--include`).
    pub fn include(&self, spec: &str) -> anyhow::Result<Hosts> {
        let mut out = Vec::new();
        for (name, slots) in parse_filter(spec).context("--include")? {
            let host = self.find(&name).context("--include")?;
            check_slots(host, &slots).context("--include")?;
            let slots = if slots.is_empty() {
                host.slots.clone()
            } else {
                slots
            };
            out.push(Host { name, slots });
        }
        // The job keeps the hostfile's node order whatever order the filter names them in.
        out.sort_by_key(|h| self.0.iter().position(|o| o.name == h.name));
        Ok(Hosts(out).without_empty())
    }

    /// Removes what `spec` names (`--exclude`); a bare host name removes the host.
    pub fn exclude(&self, spec: &str) -> anyhow::Result<Hosts> {
        let mut out = self.clone();
        for (name, slots) in parse_filter(spec).context("--exclude")? {
            let host = self.find(&name).context("--exclude")?;
            check_slots(host, &slots).context("--exclude")?;
            let kept = out
                .0
                .iter_mut()
                .find(|h| h.name == name)
                .expect("found above");
            if slots.is_empty() {
                kept.slots.clear();
            } else {
                kept.slots.retain(|s| !slots.contains(s));
            }
        }
        Ok(out.without_empty())
    }

    /// `--num_nodes` (first N hosts) and `--num_gpus` (first N slots of each host).
    pub fn limit(mut self, nodes: Option<usize>, per_node: Option<usize>) -> Hosts {
        if let Some(n) = nodes {
            self.0.truncate(n);
        }
        if let Some(n) = per_node {
            for h in &mut self.0 {
                h.slots.truncate(n);
            }
        }
        self.without_empty()
    }

    pub fn world_size(&self) -> usize {
        self.0.iter().map(|h| h.slots.len()).sum()
    }

    /// The global rank of `node`'s first local rank.
    pub fn first_rank(&self, node: usize) -> usize {
        self.0[..node].iter().map(|h| h.slots.len()).sum()
    }

    /// The hosts in the filter syntax, which is also how the head hands the layout to each
    /// node's launcher (`--world_info`).
    pub fn to_spec(&self) -> String {
        let nodes: Vec<String> = self
            .0
            .iter()
            .map(|h| {
                let slots: Vec<String> = h.slots.iter().map(usize::to_string).collect();
                format!("{}:{}", h.name, slots.join(","))
            })
            .collect();
        nodes.join("@")
    }

    /// The inverse of `to_spec`.
    pub fn from_spec(spec: &str) -> anyhow::Result<Hosts> {
        let hosts: Vec<Host> = parse_filter(spec)?
            .into_iter()
            .map(|(name, slots)| Host { name, slots })
            .collect();
        if hosts.is_empty() || hosts.iter().any(|h| h.slots.is_empty()) {
            bail!("{spec:?}: expected NAME:SLOT[,SLOT...] for every node");
        }
        Ok(Hosts(hosts))
    }

    fn find(&self, name: &str) -> anyhow::Result<&Host> {
        self.0
            .iter()
            .find(|h| h.name == name)
            .with_context(|| format!("host {name:?} is not in the hostfile"))
    }

    fn without_empty(mut self) -> Hosts {
        self.0.retain(|h| !h.slots.is_empty());
        self
    }
}

fn parse_line(line: &str) -> anyhow::Result<(&str, usize)> {
    let mut words = line.split_whitespace();
    let (Some(name), Some(slots), None) = (words.next(), words.next(), words.next()) else {
        bail!("wrong number of fields");
    };
    let n = slots
        .strip_prefix("slots=")
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .with_context(|| format!("{slots:?} is not slots=N with N >= 1"))?;
    if n > MAX_SLOTS {
        bail!("slots={n}: more than {MAX_SLOTS} slots on one host");
    }
    Ok((name, n))
}

/// `NAME[:SLOT[,SLOT...]]` separated by `@`; a bare name means every slot (empty list).
fn parse_filter(spec: &str) -> anyhow::Result<Vec<(String, Vec<usize>)>> {
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    for node in spec.split('@') {
        let (name, slots) = match node.split_once(':') {
            Some((name, list)) => (name, parse_slots(list, node)?),
            None => (node, Vec::new()),
        };
        if name.is_empty() {
            bail!("{spec:?}: empty host name in {node:?}");
        }
        if out.iter().any(|(n, _)| n == name) {
            bail!("{spec:?}: host {name} is named twice");
        }
        out.push((name.to_string(), slots));
    }
    Ok(out)
}

fn parse_slots(list: &str, node: &str) -> anyhow::Result<Vec<usize>> {
    let mut slots = Vec::new();
    for s in list.split(',') {
        let slot = s
            .trim()
            .parse::<usize>()
            .with_context(|| format!("{node:?}: slot {s:?} is not a number"))?;
        if slots.contains(&slot) {
            bail!("{node:?}: slot {slot} is named twice");
        }
        slots.push(slot);
    }
    Ok(slots)
}

fn check_slots(host: &Host, slots: &[usize]) -> anyhow::Result<()> {
    match slots.iter().find(|s| !host.slots.contains(s)) {
        Some(s) => bail!("host {} has no slot {s}", host.name),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(text: &str) -> Hosts {
        Hosts::parse(text).expect("valid hostfile")
    }

    #[test]
    fn reads_deepspeed_hostfiles_with_comments() {
        let h = hosts("# cluster\nworker-0 slots=4\n\nworker-1   slots=2 # spare\n");
        assert_eq!(h.0[0].name, "worker-0");
        assert_eq!(h.0[0].slots, vec![0, 1, 2, 3]);
        assert_eq!(h.0[1].slots, vec![0, 1]);
        assert_eq!(h.world_size(), 6);
        assert_eq!(h.first_rank(1), 4);
    }

    #[test]
    fn bad_lines_are_named() {
        for (text, needle) in [
            ("worker-0 slots=4\nworker-1 slots=x\n", "line 2"),
            ("worker-0 4\n", "line 1"),
            ("worker-0 slots=0\n", "line 1"),
            ("a slots=1\na slots=2\n", "listed twice"),
            ("# nothing\n", "no hosts"),
        ] {
            let err = format!("{:#}", Hosts::parse(text).unwrap_err());
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn include_and_exclude_follow_deepspeed() {
        let h = hosts("w0 slots=4\nw1 slots=4\nw2 slots=4\n");
        let inc = h.include("w2@w1:0,2").unwrap();
        assert_eq!(inc.to_spec(), "w1:0,2@w2:0,1,2,3");
        let exc = h.exclude("w1@w2:3").unwrap();
        assert_eq!(exc.to_spec(), "w0:0,1,2,3@w2:0,1,2");
        assert!(format!("{:#}", h.include("w9").unwrap_err()).contains("w9"));
        assert!(format!("{:#}", h.exclude("w0:7").unwrap_err()).contains("no slot 7"));
    }

    #[test]
    fn limits_and_spec_round_trip() {
        let h = hosts("w0 slots=4\nw1 slots=4\nw2 slots=4\n").limit(Some(2), Some(3));
        assert_eq!(h.to_spec(), "w0:0,1,2@w1:0,1,2");
        assert_eq!(Hosts::from_spec(&h.to_spec()).unwrap(), h);
        assert!(Hosts::from_spec("w0").is_err());
    }
}

#[cfg(test)]
mod fuzz {
    //! Hostile hostfiles and `--include/--exclude` specs (and the node spec the launcher hands
    //! to remote nodes): every input ends in `Ok` or one error, and never makes a slot list
    //! longer than the cap. `PROPTEST_CASES` raises the case count (scripts/fuzz.sh).

    use super::*;
    use proptest::prelude::*;

    fn config() -> ProptestConfig {
        let cases = std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(256);
        ProptestConfig {
            cases,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    const TOKENS: &[&str] = &[
        "worker-1",
        "worker-2",
        "h",
        " ",
        "\t",
        "\n",
        "#",
        "slots=",
        "slots=1",
        "slots=8",
        "slots=0",
        "slots=-1",
        "slots=4096",
        "slots=4097",
        "slots=99999999999999999999",
        "slots=18446744073709551615",
        "slots=1000000000000",
        ":",
        ",",
        "@",
        "0",
        "1",
        "7",
        "18446744073709551615",
        "é",
        "\u{0}",
        "\r\n",
    ];

    fn soup() -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(TOKENS), 0..24).prop_map(|t| t.concat())
    }

    /// At most MAX_SLOTS slots on a host, each named once.
    /// Well-formed lines `name slots=N`, with hostile N and repeated names.
    fn lines() -> impl Strategy<Value = String> {
        let name = prop::sample::select(&["worker-1", "worker-2", "h", "é"][..]);
        let n = prop_oneof![
            Just("1000000000000".to_string()),
            Just(usize::MAX.to_string()),
            Just("4097".to_string()),
            Just("0".to_string()),
            (1usize..9).prop_map(|n| n.to_string()),
        ];
        prop::collection::vec((name, n), 1..4).prop_map(|l| {
            l.iter()
                .map(|(name, n)| format!("{name} slots={n}  # comment\n"))
                .collect()
        })
    }

    fn small(h: &Hosts) -> bool {
        h.0.iter().all(|h| {
            let mut s = h.slots.clone();
            s.sort_unstable();
            s.dedup();
            s.len() == h.slots.len() && s.len() <= MAX_SLOTS
        })
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn hostfiles_parse_or_fail(text in prop_oneof![soup(), lines(), ".{0,80}"]) {
            if let Ok(h) = Hosts::parse(&text) {
                prop_assert!(!h.0.is_empty() && small(&h));
            }
        }

        #[test]
        fn include_exclude_and_node_specs(spec in prop_oneof![soup(), ".{0,40}"]) {
            let h = Hosts::parse("worker-1 slots=8\nworker-2 slots=4\nh slots=1").unwrap();
            for r in [h.include(&spec), h.exclude(&spec), Hosts::from_spec(&spec)] {
                match r {
                    Ok(r) => prop_assert!(small(&r) && r.world_size() <= h.world_size().max(MAX_SLOTS * 64)),
                    Err(e) => {
                        let text = format!("{e:#}");
                        prop_assert!(!text.is_empty());
                    }
                }
            }
        }
    }
}
