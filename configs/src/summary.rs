//! The `config check --json` object: a contract other tools parse, so its keys are fixed.

use serde_json::{json, Map, Value as Json};

use crate::error::Result;
use crate::resolve::Config;

/// `{"ok": true, ...}` for a resolved config, `{"ok": false, "error": ...}` for an error.
pub fn summary_json(result: &Result<Config>) -> Json {
    match result {
        Ok(c) => ok_summary(c),
        Err(e) => json!({ "ok": false, "error": e.to_string(), "paths": e.paths() }),
    }
}

fn ok_summary(c: &Config) -> Json {
    let z = &c.zero_optimization;
    let device = |d: Option<crate::OffloadDevice>| d.and_then(|d| d.name());
    let auto_filled: Map<String, Json> = c.auto_filled.iter().cloned().collect();
    json!({
        "ok": true,
        "train_batch_size": c.train_batch_size.to_json(),
        "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu.to_json(),
        "gradient_accumulation_steps": c.gradient_accumulation_steps.to_json(),
        "zero_stage": u8::from(z.stage),
        "zero_offload_optimizer": device(z.offload_optimizer.as_ref().map(|o| o.device)),
        "zero_offload_param": device(z.offload_param.as_ref().map(|o| o.device)),
        "fp16": c.fp16.enabled,
        "bf16": c.bf16.enabled,
        "gradient_clipping": c.scalars.gradient_clipping,
        "optimizer": c.optimizer.as_ref().map(|o| o.type_name.clone()),
        "scheduler": c.scheduler.as_ref().map(|s| s.type_name.clone()),
        "steps_per_print": c.scalars.steps_per_print,
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": z.allgather_bucket_size,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "warnings": c.warnings,
        "auto_filled": auto_filled,
        "ds_config": c.document,
    })
}
