//! TensorFlow's `TF_CONFIG`, which Azure ML sets for its TensorFlow distribution (as do
//! TensorFlow's own multi-worker launchers): the cluster's workers as "host:port" and this
//! process's task, `{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}`.
//! ds-rs trains on the workers: the world is the worker list, the rank the task's index, and
//! the rendezvous worker 0's address. Workers on one host are that host's local ranks.

use serde_json::Value;

use super::{Count, EnvError, Layout};

const VAR: &str = "TF_CONFIG";

/// The layout `TF_CONFIG` describes, and worker 0's host and port.
pub(super) fn read(text: &str) -> Result<(Layout, String, u16), EnvError> {
    let bad = |field: &str, expected: String| EnvError::Invalid {
        var: VAR,
        value: text.chars().take(200).collect(),
        expected: format!("{field}: {expected}"),
    };
    let root: Value = serde_json::from_str(text)
        .map_err(|e| bad("(the text)", format!("JSON of a TensorFlow cluster ({e})")))?;
    let cluster = root
        .get("cluster")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("cluster", "an object of task lists".into()))?;
    if let Some((role, _)) = cluster
        .iter()
        .find(|(role, list)| *role != "worker" && !list.as_array().is_some_and(Vec::is_empty))
    {
        return Err(bad(
            &format!("cluster.{role}"),
            "no tasks: ds-rs trains on workers only (a chief, parameter servers or an \
             evaluator have no part in data parallelism)"
                .into(),
        ));
    }
    let workers = cluster
        .get("worker")
        .and_then(Value::as_array)
        .filter(|w| !w.is_empty())
        .ok_or_else(|| bad("cluster.worker", "a non-empty list of \"host:port\"".into()))?;
    let mut hosts = Vec::with_capacity(workers.len());
    for (i, w) in workers.iter().enumerate() {
        let field = format!("cluster.worker[{i}]");
        let addr = w
            .as_str()
            .ok_or_else(|| bad(&field, "a \"host:port\" string".into()))?;
        hosts.push(
            host_port(addr).ok_or_else(|| bad(&field, format!("\"host:port\", not {addr:?}")))?,
        );
    }
    let task = root
        .get("task")
        .ok_or_else(|| bad("task", "an object".into()))?;
    match task.get("type").and_then(Value::as_str) {
        Some("worker") => {}
        other => return Err(bad("task.type", format!("\"worker\", not {other:?}"))),
    }
    let index = task
        .get("index")
        .and_then(Value::as_u64)
        .and_then(|i| usize::try_from(i).ok())
        .filter(|&i| i < hosts.len())
        .ok_or_else(|| {
            bad(
                "task.index",
                format!("an index into the {} workers", hosts.len()),
            )
        })?;
    let layout = layout(&hosts, index)?;
    let (host, port) = hosts.swap_remove(0);
    Ok((layout, host, port))
}

/// "host:port" into its parts; an IPv6 host keeps its brackets ("[::1]"), as the rendezvous
/// address is written "host:port" again.
fn host_port(addr: &str) -> Option<(String, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let port = port.parse().ok().filter(|&p| p != 0)?;
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    let plain = !host.is_empty() && !host.contains([':', '[', ']']);
    (bracketed || plain).then(|| (host.to_string(), port))
}

/// Ranks by worker index; a host's workers are its local ranks in index order, and hosts are
/// numbered in the order their first worker appears.
fn layout(hosts: &[(String, u16)], index: usize) -> Result<Layout, EnvError> {
    let me = &hosts[index].0;
    let on_my_host = |i: &usize| hosts[*i].0 == *me;
    let local_rank = (0..index).filter(on_my_host).count();
    let local_world = (0..hosts.len()).filter(on_my_host).count();
    let mut seen: Vec<&str> = Vec::new();
    for (h, _) in &hosts[..=index] {
        if !seen.contains(&h.as_str()) {
            seen.push(h);
        }
    }
    let count = |value| Count { var: VAR, value };
    Layout::new(
        count(index),
        count(hosts.len()),
        count(local_rank),
        count(local_world),
        Some(count(seen.len() - 1)),
    )
}

#[cfg(test)]
mod tests {
    use super::super::{EnvSource, RankEnv};
    use super::*;

    fn detect(tf: &str, extra: &[(&str, &str)]) -> Result<Option<RankEnv>, EnvError> {
        let get = |name: &str| match name {
            VAR => Some(tf.to_string()),
            _ => extra
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string()),
        };
        RankEnv::from_vars(&get)
    }

    fn cluster(workers: &[&str], index: usize) -> String {
        let list: Vec<String> = workers.iter().map(|w| format!("{w:?}")).collect();
        format!(
            r#"{{"cluster": {{"worker": [{}]}}, "task": {{"type": "worker", "index": {index}}}}}"#,
            list.join(", ")
        )
    }

    #[test]
    fn workers_are_ranks_and_worker_0_is_the_rendezvous() {
        let workers = [
            "10.0.0.4:2222",
            "10.0.0.4:2223",
            "10.0.0.5:2222",
            "10.0.0.5:2223",
        ];
        let got: Vec<RankEnv> = (0..4)
            .map(|i| detect(&cluster(&workers, i), &[]).unwrap().unwrap())
            .collect();
        for (i, e) in got.iter().enumerate() {
            assert_eq!(
                (
                    e.rank,
                    e.world_size,
                    e.local_rank,
                    e.local_world_size,
                    e.node_rank
                ),
                (i, 4, i % 2, 2, i / 2),
                "worker {i}"
            );
            assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.4", 2222));
            assert_eq!(e.source, EnvSource::TfConfig);
        }
    }

    #[test]
    fn master_variables_and_torchrun_ones_win() {
        let tf = cluster(&["a:1", "b:1"], 1);
        let e = detect(&tf, &[("MASTER_ADDR", "c"), ("MASTER_PORT", "9")])
            .unwrap()
            .unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("c", 9));
        let torchrun = [("RANK", "0"), ("WORLD_SIZE", "1")];
        let e = detect(&tf, &torchrun).unwrap().unwrap();
        assert_eq!(e.source, EnvSource::Torchrun);
    }

    #[test]
    fn a_malformed_tf_config_names_the_field() {
        let cases = [
            ("{", "(the text)"),
            (r#"{"task": {"type": "worker", "index": 0}}"#, "cluster:"),
            (
                r#"{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.worker:",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", 7]}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.worker[1]:",
            ),
            (
                r#"{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.worker[0]:",
            ),
            (
                r#"{"cluster": {"worker": ["a:0"]}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.worker[0]:",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.ps:",
            ),
            (r#"{"cluster": {"worker": ["a:1"]}}"#, "task:"),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}"#,
                "task.type:",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}"#,
                "task.index:",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}"#,
                "task.index:",
            ),
        ];
        for (tf, field) in cases {
            let err = detect(tf, &[]).unwrap_err().to_string();
            assert!(
                err.starts_with("TF_CONFIG=") && err.contains(field),
                "{tf}: {err}"
            );
        }
    }

    #[test]
    fn an_empty_chief_list_and_ipv6_hosts_are_fine() {
        let tf = r#"{"cluster": {"worker": ["[::1]:5000"], "chief": []}, "task": {"type": "worker", "index": 0}}"#;
        let e = detect(tf, &[]).unwrap().unwrap();
        assert_eq!(
            (e.master_addr.as_str(), e.master_port, e.world_size),
            ("[::1]", 5000, 1)
        );
    }
}
