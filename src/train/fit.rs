//! Refuse before starting what will not fit: the memory model of `ds-rs estimate --config`
//! (within -10..+7% of measured peaks) predicts each rank's peak, and when this host's ranks
//! together exceed what the job may use (the cgroup's limit, the memory available), the run
//! stops before any rank starts, with the prediction, the limit, and the changes that would
//! fit, each with its own prediction. `--skip-memory-check` runs anyway.

use std::ops::Range;
use std::path::Path;

use ds_autotune::memory::{estimate, RankEstimate, Run};
use ds_config::zero::{OffloadOptimizerConfig, OffloadParamConfig};
use ds_config::{Config, ZeroStage};
use ds_engine::{JobPlan, LayoutFlags, Overrides};
use ds_models::ModelSpec;

use super::TrainArgs;

const MIB: f64 = (1u64 << 20) as f64;

/// The memory this job may use on this host, and where the figure comes from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Limit {
    pub bytes: u64,
    pub source: String,
}

/// The tighter of the cgroup's limit and the host's available memory.
pub(crate) fn host_limit() -> Option<Limit> {
    let available = meminfo("MemAvailable").map(|bytes| Limit {
        bytes,
        source: "the host's available memory (MemAvailable)".into(),
    });
    let cgroup = cgroup_limit();
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(if c.bytes < a.bytes { c } else { a }),
        (a, c) => a.or(c),
    }
}

fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The smallest memory limit on this process's cgroup and its ancestors (cgroup v2's
/// memory.max, v1's memory.limit_in_bytes).
fn cgroup_limit() -> Option<Limit> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let (root, path, file) = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            Some(("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes"))
        } else if controllers.is_empty() && Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
        {
            Some(("/sys/fs/cgroup", path, "memory.max"))
        } else {
            None
        }
    })?;
    let mut dir = Path::new(root).join(path.trim_start_matches('/'));
    let mut best: Option<Limit> = None;
    loop {
        let limit = std::fs::read_to_string(dir.join(file)).ok();
        // "max" (v2) or a page-rounded huge number (v1): no limit
        if let Some(bytes) = limit
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|b| *b < 1 << 60)
        {
            if best.as_ref().is_none_or(|b| bytes < b.bytes) {
                best = Some(Limit {
                    bytes,
                    source: format!("the cgroup's limit ({})", dir.join(file).display()),
                });
            }
        }
        if dir == Path::new(root) || !dir.pop() {
            return best;
        }
    }
}

/// One way the run could change, and what it then predicts.
struct Change {
    what: String,
    host_bytes: u64,
    rank_bytes: u64,
}

/// Refuses the run when `local` ranks' predicted peaks exceed `limit`.
pub(crate) fn check(
    args: &TrainArgs,
    model: &ModelSpec,
    plan: &JobPlan,
    local: Range<usize>,
    limit: &Limit,
) -> anyhow::Result<()> {
    let ranks = match estimate_run(&plan.config, model, None) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "warning: the memory check could not predict this run ({e:#}); it starts unchecked"
            );
            return Ok(());
        }
    };
    let host = host_bytes(&ranks, &local);
    if host <= limit.bytes {
        return Ok(());
    }
    let worst = local
        .clone()
        .filter_map(|r| ranks.get(r))
        .max_by_key(|r| r.predicted_peak_bytes);
    let worst = worst.expect("a host runs at least one rank");
    let changes = changes(args, model, plan, &local, limit.bytes);
    let mut text = format!(
        "this run would not fit in memory: this host's {} predicted to peak at {:.0} MiB \
         (rank {}: {:.0} MiB, of which model states {:.0}, activations {:.0} x {} in flight), more \
         than the {:.0} MiB of {}.",
        match local.len() {
            1 => "rank is".to_string(),
            n => format!("{n} ranks are"),
        },
        host as f64 / MIB,
        worst.rank,
        worst.predicted_peak_bytes as f64 / MIB,
        worst.model_states() as f64 / MIB,
        worst.activations_bytes as f64 / MIB,
        worst.micro_batches_in_flight,
        limit.bytes as f64 / MIB,
        limit.source
    );
    if changes.is_empty() {
        text.push_str(
            " Neither ZeRO-3, NVMe offload, a smaller micro-batch, --tile, a shorter sequence \
             nor --tp fits it, alone or together: it needs more memory.",
        );
    } else {
        text.push_str(" These would fit:");
        for c in &changes {
            text.push_str(&format!(
                "\n  - {}: {:.0} MiB on this host ({:.0} MiB a rank)",
                c.what,
                c.host_bytes as f64 / MIB,
                c.rank_bytes as f64 / MIB
            ));
        }
    }
    text.push_str("\n(--skip-memory-check starts it anyway)");
    anyhow::bail!(text)
}

/// ZeRO-Infinity: `cfg` at ZeRO-3 with the optimizer states and the parameters on NVMe (the
/// path does not change the estimate).
fn infinity(cfg: &Config) -> Config {
    let mut c = cfg.clone();
    c.zero_optimization.stage = ZeroStage::Weights;
    c.zero_optimization.offload_optimizer = Some(OffloadOptimizerConfig::nvme("/local_nvme"));
    c.zero_optimization.offload_param = Some(OffloadParamConfig::nvme("/local_nvme"));
    c
}

fn estimate_run(
    cfg: &Config,
    model: &ModelSpec,
    micro_batch: Option<usize>,
) -> anyhow::Result<Vec<RankEstimate>> {
    estimate(&Run {
        config: cfg,
        model,
        micro_batch,
    })
}

fn host_bytes(ranks: &[RankEstimate], local: &Range<usize>) -> u64 {
    local
        .clone()
        .filter_map(|r| ranks.get(r))
        .map(|r| r.predicted_peak_bytes)
        .sum()
}

/// The changes, in the order a user would reach for them, that fit in `limit`.
fn changes(
    args: &TrainArgs,
    model: &ModelSpec,
    plan: &JobPlan,
    local: &Range<usize>,
    limit: u64,
) -> Vec<Change> {
    let cfg = &plan.config;
    let mut out = Vec::new();
    let consider =
        |out: &mut Vec<Change>, what: String, ranks: anyhow::Result<Vec<RankEstimate>>| {
            let Ok(ranks) = ranks else { return };
            let host_bytes = host_bytes(&ranks, local);
            let rank_bytes = local
                .clone()
                .filter_map(|r| ranks.get(r))
                .map(|r| r.predicted_peak_bytes)
                .max()
                .unwrap_or(0);
            if host_bytes <= limit {
                out.push(Change {
                    what,
                    host_bytes,
                    rank_bytes,
                });
            }
        };
    if cfg.zero_stage() != ZeroStage::Weights {
        let mut z3 = cfg.clone();
        z3.zero_optimization.stage = ZeroStage::Weights;
        consider(
            &mut out,
            "ZeRO-3: \"zero_optimization\": {\"stage\": 3}".into(),
            estimate_run(&z3, model, None),
        );
    }
    let z = &cfg.zero_optimization;
    if z.offload_optimizer
        .as_ref()
        .is_none_or(|o| o.device.name() != Some("nvme"))
    {
        consider(&mut out,
            "ZeRO-Infinity: ZeRO-3 with \"offload_optimizer\" and \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": DIR}"
                .into(),
            estimate_run(&infinity(cfg), model, None),
        );
    }
    let settings = ds_engine::Settings::from_config(cfg, false);
    if let Ok(s) = settings {
        let mut m = s.micro_batch / 2;
        while m >= 1 {
            let ranks = estimate_run(cfg, model, Some(m));
            if ranks.as_ref().is_ok_and(|r| host_bytes(r, local) <= limit) {
                let ga = s.grad_accum * s.micro_batch / m;
                consider(&mut out,
                    format!("a smaller micro-batch, the same global batch: --per_device_train_batch_size {m} --gradient_accumulation_steps {ga}"),
                    ranks,
                );
                break;
            }
            m /= 2;
        }
    }
    if model.tile.is_none() {
        let tiled = model.clone().with_tile(Some(256));
        consider(
            &mut out,
            "the MLPs and the loss 256 positions at a time: --tile 256".into(),
            estimate_run(cfg, &tiled, None),
        );
    }
    let mut seq = model.seq_len / 2;
    while seq >= 128 {
        if let Ok(shorter) = ModelSpec::resolve(&args.model, Some(seq)) {
            let shorter = shorter.with_tile(model.tile);
            let ranks = estimate_run(cfg, &shorter, None);
            if ranks.as_ref().is_ok_and(|r| host_bytes(r, local) <= limit) {
                consider(
                    &mut out,
                    format!("a shorter sequence: --seq-len {seq}"),
                    ranks,
                );
                break;
            }
        }
        seq /= 2;
    }
    // another layout of the same ranks: tensor parallelism, or for long sequences Ulysses
    let replan = |layout: LayoutFlags| {
        let overrides = Overrides {
            layout,
            training: args.training.to_args().ok(),
            run_steps: Some(super::DEFAULT_STEPS),
        };
        let source = super::config_source(args.config.as_deref());
        JobPlan::new(source, cfg.dims.world_size, &overrides, Some(model))
    };
    if cfg.dims.tp == 1 {
        let tp = LayoutFlags {
            tp: Some(2),
            ..args.layout.flags()
        };
        if let Ok(p) = replan(tp) {
            let ranks = estimate_run(&p.config, model, None);
            consider(
                &mut out,
                "tensor parallelism (half the replicas: a smaller global batch): --tp 2".into(),
                ranks,
            );
        }
    }
    if cfg.dims.sp == 1 {
        // the fewest sequence-parallel ranks that fit
        for sp in [2, 4, 8]
            .into_iter()
            .filter(|sp| cfg.dims.dp().is_multiple_of(*sp))
        {
            let layout = LayoutFlags {
                sp: Some(sp),
                ..args.layout.flags()
            };
            let Ok(p) = replan(layout) else { continue };
            let ranks = estimate_run(&p.config, model, None);
            if ranks.as_ref().is_ok_and(|r| host_bytes(r, local) <= limit) {
                let what = format!(
                    "each sequence split over {sp} ranks (Ulysses; 1/{sp} of the replicas: a smaller global batch): --sp {sp}"
                );
                consider(&mut out, what, ranks);
                break;
            }
        }
    }
    if out.is_empty() {
        // nothing alone: everything that shrinks a rank, together
        let tiled = model.clone().with_tile(Some(256));
        consider(
            &mut out,
            "all together: ZeRO-3 with the optimizer states and parameters on NVMe, \
             --per_device_train_batch_size 1 with the accumulation steps raised to keep the \
             global batch, and --tile 256"
                .into(),
            estimate_run(&infinity(cfg), &tiled, Some(1)),
        );
    }
    out
}
