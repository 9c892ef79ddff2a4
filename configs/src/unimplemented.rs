//! Settings DeepSpeed acts on, that change what is computed or where memory lives, and that
//! ds-rs accepts (so `config check` keeps DeepSpeed's verdict) but cannot carry out yet.
//! Training with one of them would train something other than what the file asks for, so the
//! commands that act on a config (`train`, `launch`, the engine) refuse it with
//! `Config::check_implemented`; `config check` only warns.

use crate::error::{ConfigError, NotImplemented, Result};
use crate::resolve::Config;

impl Config {
    /// The settings of this config that ds-rs cannot carry out yet: partitioned activation
    /// checkpoints under tensor parallelism, AutoEP's expert parallelism folded over
    /// tensor-parallel lanes.
    pub fn not_implemented(&self) -> Vec<NotImplemented> {
        [self.partition_activations(), self.autoep_folding()]
            .into_iter()
            .flatten()
            .collect()
    }

    /// Err naming every setting of `not_implemented`, on one line.
    pub fn check_implemented(&self) -> Result<()> {
        let found = self.not_implemented();
        match found.is_empty() {
            true => Ok(()),
            false => Err(ConfigError::NotImplemented(found)),
        }
    }

    /// `expert_parallel` with tensor parallelism: DeepSpeed's AutoEP lays expert-parallel
    /// groups across the tensor-parallel lanes with whole experts; ds-rs carves them out of
    /// the data-parallel ranks (DeepSpeed-MoE's layout, `--ep`) and splits each expert over
    /// the tensor-parallel group.
    fn autoep_folding(&self) -> Option<NotImplemented> {
        let size = self.expert_parallel.size();
        (size > 1 && self.dims.tp > 1).then(|| NotImplemented {
            path: "expert_parallel.autoep_size",
            value: size.to_string(),
            feature: "AutoEP's expert parallelism folded over the tensor-parallel lanes (`--ep`, DeepSpeed-MoE's layout, combines with tensor parallelism)",
            off: "1",
        })
    }

    /// `activation_checkpointing.partition_activations` under tensor parallelism: DeepSpeed
    /// splits the checkpointed activations over the tensor-parallel ranks; ds-rs keeps them
    /// whole on each (with one tensor-parallel rank there is nothing to split).
    fn partition_activations(&self) -> Option<NotImplemented> {
        let on = self.activation_checkpointing.partition_activations && self.dims.tp > 1;
        on.then_some(NotImplemented {
            path: "activation_checkpointing.partition_activations",
            value: "true".into(),
            feature: "activation checkpoints partitioned over the tensor-parallel ranks",
            off: "false",
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::{hjson, resolve, Config, ParallelDims};

    fn read(json: &str, tp: usize) -> Config {
        let doc = hjson::parse(json).unwrap();
        resolve(&doc, &ParallelDims::new(2, tp, 1).unwrap()).unwrap()
    }

    fn paths(json: &str) -> Vec<&'static str> {
        read(json, 1)
            .not_implemented()
            .iter()
            .map(|n| n.path)
            .collect()
    }

    const BATCH: &str = r#""train_micro_batch_size_per_gpu": 1"#;

    #[test]
    fn settings_that_ask_for_nothing_pass() {
        for extra in [
            "",
            r#", "pipeline": {"stages": "auto"}"#,
            r#", "pipeline": {"stages": 1, "partition": "parameters"}"#,
            r#", "tensor_parallel": {"autotp_size": 1}"#,
            r#", "tensor_parallel": {"autotp_size": "auto"}"#,
            // tensor and pipeline parallelism are carried out (the layout takes them)
            r#", "tensor_parallel": {"autotp_size": 2}"#,
            r#", "pipeline": {"stages": 2}"#,
            r#", "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                "offload_optimizer": {"device": "none"}}"#,
            r#", "zero_optimization": {"stage": 2, "cpu_offload": false}"#,
            // NVMe is carried out (ds-engine's offload.rs, ds-partition's swap.rs)
            r#", "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}"#,
            r#", "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}"#,
            // the CPU holds every state already (a warning, below)
            r#", "zero_optimization": {"stage": 2, "cpu_offload": true}"#,
            r#", "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}"#,
        ] {
            assert!(paths(&format!("{{{BATCH}{extra}}}")).is_empty(), "{extra}");
        }
    }

    #[test]
    fn partitioned_activations_are_refused_under_tensor_parallelism_only() {
        let json = format!(
            r#"{{{BATCH}, "activation_checkpointing": {{"partition_activations": true}}}}"#
        );
        for (tp, refused) in [(1, false), (2, true)] {
            let e = read(&json, tp).check_implemented();
            assert_eq!(e.is_err(), refused, "tp {tp}");
            if let Err(e) = e {
                let text = e.to_string();
                assert_eq!(
                    e.paths(),
                    ["activation_checkpointing.partition_activations"]
                );
                assert!(!text.contains('\n'), "{text}");
                assert!(text.contains("not implemented yet"), "{text}");
            }
        }
    }

    /// `"cpu"` offload (and the deprecated flags that mean it) moves nothing on the CPU:
    /// one warning per section, naming its key.
    #[test]
    fn cpu_offload_is_one_warning_per_section() {
        let cases = [
            (
                r#""stage": 2, "cpu_offload": true"#,
                vec!["offload_optimizer"],
            ),
            (
                r#""stage": 3, "offload_param": {"device": "cpu"}"#,
                vec!["offload_param"],
            ),
            (
                r#""stage": 3, "offload_param": {"device": "cpu"},
                "offload_optimizer": {"device": "cpu"}"#,
                vec!["offload_optimizer", "offload_param"],
            ),
            (
                r#""stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}"#,
                vec![],
            ),
        ];
        for (zero, keys) in cases {
            let c = read(
                &format!(r#"{{{BATCH}, "zero_optimization": {{{zero}}}}}"#),
                1,
            );
            let warned: Vec<&String> = c
                .warnings
                .iter()
                .filter(|w| w.contains("no effect when training on the CPU"))
                .collect();
            assert_eq!(warned.len(), keys.len(), "{zero}: {:?}", c.warnings);
            for (w, key) in warned.iter().zip(&keys) {
                assert!(
                    w.starts_with(&format!("zero_optimization.{key}.device")),
                    "{w}"
                );
            }
        }
    }
}
