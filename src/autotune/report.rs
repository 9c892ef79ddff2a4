//! The search's outputs in DeepSpeed's layout: `results_dir/summary.txt` (the tuning space,
//! every experiment, the best metric and name, the total time), `ds_config_optimal.json`,
//! `cmd_optimal.txt`, and ds-rs's `records.json` (every trial, pruned and failed ones
//! included, with both models' predictions) and `autotune.png`.

use std::time::Duration;

use anyhow::Context;
use ds_autotune::tuning::{best, Metric, Outcome, Record};

use super::trial::command_line;
use super::Tuner;

/// A trial's result in words.
pub fn outcome_text(t: &Tuner, o: &Outcome) -> String {
    match (o, t.space.metric) {
        (Outcome::Ran { metric, .. }, Metric::Latency) => format!("latency {:.4} s/step", -metric),
        (Outcome::Ran { metric, .. }, Metric::Flops) => format!("{metric:.4} TFLOP/s"),
        (Outcome::Ran { metric, .. }, Metric::Throughput) => {
            format!("throughput {metric:.2} samples/s")
        }
        (Outcome::Failed(why), _) => format!("failed: {why}"),
        (Outcome::Pruned(why), _) => format!("pruned: {why}"),
    }
}

pub fn write(t: &Tuner, records: &[Record], took: Duration) -> anyhow::Result<()> {
    let file = |name: &str, text: String| {
        let p = t.results.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    file("records.json", serde_json::to_string_pretty(records)?)?;
    chart(t, records)?;
    let mut summary = heading(t);
    for (i, r) in records.iter().enumerate() {
        let e = &r.experiment;
        let measured = match r.outcome {
            Outcome::Ran { step_s, .. } => format!("{step_s:.3}"),
            _ => "-".into(),
        };
        summary += &format!(
            "| {i} | {} | {} | {}x{} (ep {}, sp {}) | {} | {} | {} | {:.3} | {measured} | {} |\n",
            e.name,
            e.stage,
            e.layout.tp,
            e.layout.pp,
            e.layout.ep,
            e.layout.sp,
            e.micro_batch,
            e.gas,
            r.predicted_peak_bytes >> 20,
            r.predicted_step_s,
            outcome_text(t, &r.outcome)
        );
    }
    let pruned = records
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Pruned(_)))
        .count();
    summary += &format!(
        "\nexperiments: {} ({} run, {pruned} pruned by the memory model); total time {:.0} s\n",
        records.len(),
        records.len() - pruned,
        took.as_secs_f64()
    );
    if let Some(b) = best(records) {
        summary += &format!(
            "best: {} ({})\n",
            b.experiment.name,
            outcome_text(t, &b.outcome)
        );
        let optimal = t.results.join("ds_config_optimal.json");
        file(
            "ds_config_optimal.json",
            serde_json::to_string_pretty(&t.trial_config(&b.experiment))?,
        )?;
        let cmd = t.launch(&optimal, &t.user_program, None);
        file("cmd_optimal.txt", command_line(&cmd) + "\n")?;
    }
    file("summary.txt", summary)
}

/// The summary's first lines: what was searched, how, and on what.
fn heading(t: &Tuner) -> String {
    let s = &t.space;
    let mode = match s.fast {
        true => "fast".to_string(),
        false => format!("{} tuner", s.tuner.name()),
    };
    let places: Vec<&str> = t.groups.iter().map(|g| g.place.as_str()).collect();
    format!(
        "ds-rs autotuning ({mode}, metric {}): {}, {} ranks a trial, {} MiB per rank\n\
         tuning space: ZeRO stages {:?}, tp x pp (ep, sp) {:?}, micro-batches {}, ZeRO settings {}\n\
         trials side by side: {} ({})\n\
         time model rates per rank: {:.1} GFLOP/s, memory {:.1} GB/s, all-reduce {:.2} GB/s + {:.0} us a call\n\n\
         | # | experiment | stage | tp x pp (ep, sp) | micro-batch | gas | predicted peak MiB | predicted step s | measured step s | result |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        s.metric.name(),
        t.workload.describe(&t.user_program),
        t.ranks,
        t.memory_per_rank >> 20,
        s.stages,
        s.layouts
            .iter()
            .map(|l| format!("{}x{} ({}, {})", l.tp, l.pp, l.ep, l.sp))
            .collect::<Vec<_>>(),
        match &s.micro_batches {
            Some(list) => format!("{list:?}"),
            None => format!("up to {} (memory model)", s.max_micro_batch),
        },
        match s.fast {
            true => "not tuned (fast)".to_string(),
            false => settings_text(t),
        },
        t.groups.len(),
        places.join(" | "),
        t.rates.flops_per_s / 1e9,
        t.rates.memory_bytes_per_s / 1e9,
        t.rates.bus_bytes_per_s.min(1e12) / 1e9,
        t.rates.collective_s * 1e6,
    )
}

fn settings_text(t: &Tuner) -> String {
    let per_stage: Vec<String> = t
        .space
        .stages
        .iter()
        .map(|&stage| {
            let dims: Vec<String> = t.space.settings[stage as usize]
                .iter()
                .map(|d| format!("{} {}", d.key, serde_json::Value::from(d.values.clone())))
                .collect();
            format!("z{stage}: {}", dims.join(", "))
        })
        .collect();
    per_stage.join("; ")
}

/// `autotune.png`: each trial's metric (gaps where it failed or was pruned), its predicted and
/// measured step time, and its predicted peak beside the memory per rank, by trial number
/// (summary.txt's `#`).
fn chart(t: &Tuner, records: &[Record]) -> anyhow::Result<()> {
    let by_trial = |f: &dyn Fn(&Record) -> f64| -> Vec<(f64, f64)> {
        records
            .iter()
            .enumerate()
            .map(|(i, r)| (i as f64, f(r)))
            .collect()
    };
    let metric = by_trial(&|r| match r.outcome {
        Outcome::Ran { metric, .. } if t.space.metric == Metric::Latency => -metric,
        Outcome::Ran { metric, .. } => metric,
        _ => f64::NAN,
    });
    let measured = by_trial(&|r| match r.outcome {
        Outcome::Ran { step_s, .. } => step_s,
        _ => f64::NAN,
    });
    let predicted = by_trial(&|r| r.predicted_step_s);
    let peak = by_trial(&|r| r.predicted_peak_bytes as f64 / (1u64 << 20) as f64);
    let limit = t.memory_per_rank as f64 / (1u64 << 20) as f64;
    let series = [
        crate::train::chart::Series {
            title: "each trial's metric (gaps: failed or pruned)",
            y_label: t.space.metric.name(),
            points: &metric,
            floor: None,
        },
        crate::train::chart::Series {
            title: "measured step time (s)",
            y_label: "s",
            points: &measured,
            floor: None,
        },
        crate::train::chart::Series {
            title: "the time model's predicted step time (s)",
            y_label: "s",
            points: &predicted,
            floor: None,
        },
        crate::train::chart::Series {
            title: "predicted peak RSS of the largest rank (MiB)",
            y_label: "MiB",
            points: &peak,
            floor: Some((limit, "memory per rank")),
        },
    ];
    crate::train::chart::write_png_over(
        &t.results.join("autotune.png"),
        "ds-rs autotuning",
        "trial (# in summary.txt)",
        &series,
    )?;
    Ok(())
}
