//! Settings DeepSpeed acts on, that change what is computed or where memory lives, and that
//! ds-rs accepts (so `config check` keeps DeepSpeed's verdict) but cannot carry out yet.
//! Training with one of them would train something other than what the file asks for, so the
//! commands that act on a config (`train`, `launch`, the engine) refuse it with
//! `Config::check_implemented`; `config check` only warns.

use std::fmt;

use crate::error::{ConfigError, Result};
use crate::resolve::Config;
use crate::zero::OffloadDevice;

/// One such setting, named by its JSON path.
#[derive(Debug, Clone, PartialEq)]
pub struct NotImplemented {
    pub path: &'static str,
    /// The value found, as JSON.
    pub value: String,
    /// What the value asks for.
    pub feature: &'static str,
    /// The issue that implements it.
    pub issue: u32,
    /// The value that asks for nothing.
    pub off: &'static str,
}

impl NotImplemented {
    /// `path = value: feature is not implemented yet in ds-rs (issue N)`.
    pub fn describe(&self) -> String {
        format!(
            "{} = {}: {} is not implemented yet in ds-rs (issue {})",
            self.path, self.value, self.feature, self.issue
        )
    }
}

/// The refusal: what is missing and how to do without it (several join with ". ").
impl fmt::Display for NotImplemented {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; remove it or set it to {}",
            self.describe(),
            self.off
        )
    }
}

impl Config {
    /// The settings of this config that ds-rs cannot carry out yet: offload, partitioned
    /// activation checkpoints.
    pub fn not_implemented(&self) -> Vec<NotImplemented> {
        let mut found = Vec::new();
        found.extend(self.offload());
        found.extend(self.partition_activations());
        found
    }

    /// Err naming every setting of `not_implemented`, on one line.
    pub fn check_implemented(&self) -> Result<()> {
        let found = self.not_implemented();
        match found.is_empty() {
            true => Ok(()),
            false => Err(ConfigError::NotImplemented(found)),
        }
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
            issue: 17,
            off: "false",
        })
    }

    /// `offload_optimizer` / `offload_param` to any device (the deprecated `cpu_offload` and
    /// `cpu_offload_param` flags land here too, as in DeepSpeed).
    fn offload(&self) -> Vec<NotImplemented> {
        let z = &self.zero_optimization;
        let optimizer = z.offload_optimizer.as_ref().map(|o| o.device);
        let param = z.offload_param.as_ref().map(|o| o.device);
        [
            (
                "zero_optimization.offload_optimizer.device",
                optimizer,
                "optimizer state offload (ZeRO-Offload)",
            ),
            (
                "zero_optimization.offload_param.device",
                param,
                "parameter offload (ZeRO-Infinity)",
            ),
        ]
        .into_iter()
        .filter_map(|(path, device, feature)| {
            // NVMe is carried out (ds-partition's swap.rs, ds-engine's offload.rs)
            if device == Some(OffloadDevice::Nvme) {
                return None;
            }
            let name = device?.name()?;
            Some(NotImplemented {
                path,
                value: format!("\"{name}\""),
                feature,
                issue: 19,
                off: "\"none\"",
            })
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::{hjson, resolve, ParallelDims};

    fn paths(json: &str) -> Vec<&'static str> {
        let doc = hjson::parse(json).unwrap();
        let c = resolve(&doc, &ParallelDims::new(1, 1, 1).unwrap()).unwrap();
        c.not_implemented().iter().map(|n| n.path).collect()
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
        ] {
            assert!(paths(&format!("{{{BATCH}{extra}}}")).is_empty(), "{extra}");
        }
    }

    #[test]
    fn each_setting_is_named_by_its_path() {
        let cases = [
            (
                r#""zero_optimization": {"stage": 2, "cpu_offload": true}"#,
                "zero_optimization.offload_optimizer.device",
            ),
            (
                r#""zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}"#,
                "zero_optimization.offload_param.device",
            ),
        ];
        for (extra, path) in cases {
            assert_eq!(paths(&format!("{{{BATCH}, {extra}}}")), [path], "{extra}");
        }
        // partitioned activation checkpoints matter only with tensor parallelism
        let doc = hjson::parse(&format!(
            r#"{{{BATCH}, "activation_checkpointing": {{"partition_activations": true}}}}"#
        ))
        .unwrap();
        for (tp, refused) in [(1, false), (2, true)] {
            let c = resolve(&doc, &ParallelDims::new(2, tp, 1).unwrap()).unwrap();
            let found: Vec<_> = c.not_implemented().iter().map(|n| n.path).collect();
            let want = ["activation_checkpointing.partition_activations"];
            assert_eq!(
                found.as_slice(),
                if refused { &want[..] } else { &[] },
                "tp {tp}"
            );
        }
    }

    #[test]
    fn several_settings_make_one_line_naming_each() {
        let json = format!(
            r#"{{{BATCH},
            "zero_optimization": {{"stage": 3, "offload_optimizer": {{"device": "cpu"}},
            "offload_param": {{"device": "cpu"}}}}}}"#
        );
        let doc = hjson::parse(&json).unwrap();
        let c = resolve(&doc, &ParallelDims::new(1, 1, 1).unwrap()).unwrap();
        let e = c.check_implemented().unwrap_err();
        let text = e.to_string();
        assert!(!text.contains('\n'), "{text}");
        assert_eq!(
            e.paths(),
            [
                "zero_optimization.offload_optimizer.device",
                "zero_optimization.offload_param.device"
            ]
        );
        assert!(
            text.starts_with(
                "zero_optimization.offload_optimizer.device = \"cpu\": optimizer state offload"
            ),
            "{text}"
        );
        assert!(text.contains(r#"offload_param.device = "cpu""#), "{text}");
    }
}
