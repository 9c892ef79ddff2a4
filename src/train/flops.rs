//! ds_config `flops_profiler`: at `profile_step`, rank 0 prints the model's FLOPs, parameters
//! and latencies, overall and per layer, in the layout of DeepSpeed's profiler
//! (deepspeed/profiling/flops_profiler), to `output_file` or stdout. FLOPs come from each
//! layer's own count (`Layer::forward_flops`); backward is counted as twice the forward.

use std::fmt::Write as _;
use std::time::Duration;

use ds_config::monitor::FlopsProfilerConfig;
use ds_engine::Timings;

/// What the report is about besides the timings.
pub struct ProfileInput<'a> {
    pub step: u64,
    pub world: usize,
    pub dp: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    /// Per layer: name, parameters, forward FLOPs of one micro-batch.
    pub layers: &'a [(String, usize, Option<u64>)],
    pub timings: &'a Timings,
}

/// Writes the report where the config says.
pub fn emit(cfg: &FlopsProfilerConfig, input: &ProfileInput) -> anyhow::Result<()> {
    let text = report(cfg, input);
    match &cfg.output_file {
        Some(path) => std::fs::write(path, text)
            .map_err(|e| anyhow::anyhow!("flops_profiler.output_file {path}: {e}")),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

pub fn report(cfg: &FlopsProfilerConfig, p: &ProfileInput) -> String {
    let t = p.timings;
    let micro = p.grad_accum.max(1) as f64;
    let fwd_flops: u64 = p.layers.iter().filter_map(|l| l.2).sum::<u64>() * p.grad_accum as u64;
    let params: usize = p.layers.iter().map(|l| l.1).sum();
    let (fwd, bwd, step) = (secs(t.forward), secs(t.backward), secs(t.step));
    let iter = fwd + bwd + step;
    let f = fwd_flops as f64;
    let mut out = String::new();
    let mut line = |k: &str, v: String| {
        let _ = writeln!(out, "{k:<62}{v}");
    };
    line(
        "\n-------------------------- DeepSpeed Flops Profiler --------------------------",
        String::new(),
    );
    line(
        &format!("Profile Summary at step {}:", p.step),
        String::new(),
    );
    line("world size:", p.world.to_string());
    line("data parallel size:", p.dp.to_string());
    line("model parallel size:", "1".into());
    line(
        "batch size per GPU:",
        (p.micro_batch * p.grad_accum).to_string(),
    );
    line("params per GPU:", num(params as f64, ""));
    line(
        "params of model = params per GPU * mp_size:",
        num(params as f64, ""),
    );
    line("fwd MACs per GPU:", num(f / 2.0, "MACs"));
    line("fwd flops per GPU:", num(f, ""));
    line(
        "fwd flops of model = fwd flops per GPU * mp_size:",
        num(f, ""),
    );
    line("fwd latency:", ms(fwd));
    line(
        "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
        num(f / fwd, "FLOPS"),
    );
    line("bwd latency:", ms(bwd));
    line(
        "bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency:",
        num(2.0 * f / bwd, "FLOPS"),
    );
    line(
        "fwd+bwd FLOPS per GPU = 3 * fwd flops per GPU / (fwd+bwd latency):",
        num(3.0 * f / (fwd + bwd), "FLOPS"),
    );
    line("step latency:", ms(step));
    line("iter latency:", ms(iter));
    line(
        "FLOPS per GPU = 3 * fwd flops per GPU / iter latency:",
        num(3.0 * f / iter, "FLOPS"),
    );
    line(
        "samples/second:",
        format!(
            "{:.2}",
            (p.micro_batch as f64 * micro * p.world as f64) / iter
        ),
    );
    if cfg.detailed {
        detailed(&mut out, p, params, fwd_flops, fwd);
    }
    out.push_str(
        "------------------------------------------------------------------------------\n",
    );
    out
}

/// One line per layer: params, share, MACs, share, fwd latency, share, fwd FLOPS, bwd latency.
fn detailed(out: &mut String, p: &ProfileInput, params: usize, fwd_flops: u64, fwd: f64) {
    let _ = writeln!(
        out,
        "\n------------------------------ Detailed Profile per GPU ------------------------------"
    );
    let _ = writeln!(
        out,
        "Each layer's profile is listed after its name in the following order:"
    );
    let _ = writeln!(out, "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS, bwd latency\n");
    let pct = |a: f64, b: f64| if b > 0.0 { 100.0 * a / b } else { 0.0 };
    for (i, (name, n, flops)) in p.layers.iter().enumerate() {
        let lf = secs(p.timings.layer_forward.get(i).copied().unwrap_or_default());
        let lb = secs(p.timings.layer_backward.get(i).copied().unwrap_or_default());
        let fl = flops.map(|x| (x * p.grad_accum as u64) as f64);
        let macs = fl.map_or("n/a".into(), |x| num(x / 2.0, "MACs"));
        let share = fl.map_or("n/a".into(), |x| {
            format!("{:.2}%", pct(x, fwd_flops as f64))
        });
        let rate = fl.map_or("n/a".into(), |x| num(x / lf, "FLOPS"));
        let _ = writeln!(
            out,
            "  ({i}) {name}: {}, {:.2}% Params, {macs}, {share} MACs, {}, {:.2}% latency, {rate}, bwd {}",
            num(*n as f64, ""),
            pct(*n as f64, params as f64),
            ms(lf),
            pct(lf, fwd),
            ms(lb),
        );
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", 1e3 * s)
}

/// DeepSpeed's number format: 3 significant figures with K, M, G, T prefixes.
fn num(x: f64, unit: &str) -> String {
    let (v, prefix) = match x.abs() {
        a if a >= 1e12 => (x / 1e12, "T"),
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "K"),
        _ => (x, ""),
    };
    let sep = if prefix.is_empty() && unit.is_empty() {
        ""
    } else {
        " "
    };
    format!("{v:.2}{sep}{prefix}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(layers: &[(String, usize, Option<u64>)], timings: &Timings) -> String {
        let cfg = FlopsProfilerConfig {
            enabled: true,
            recompute_fwd_factor: 0.0,
            profile_step: 1,
            module_depth: -1,
            top_modules: 1,
            detailed: true,
            output_file: None,
        };
        report(
            &cfg,
            &ProfileInput {
                step: 1,
                world: 2,
                dp: 2,
                micro_batch: 4,
                grad_accum: 2,
                layers,
                timings,
            },
        )
    }

    #[test]
    fn rates_follow_from_counts_and_latencies() {
        // Two layers of 3e9 and 1e9 forward FLOPs per micro-batch, 2 micro-batches: 8e9 in all.
        let layers = vec![
            ("a".to_string(), 1000, Some(3_000_000_000)),
            ("b".to_string(), 3000, None),
        ];
        let timings = Timings {
            forward: Duration::from_millis(400),
            backward: Duration::from_millis(800),
            step: Duration::from_millis(800),
            layer_forward: vec![Duration::from_millis(300), Duration::from_millis(100)],
            layer_backward: vec![Duration::from_millis(600), Duration::from_millis(200)],
            pipe_wait: Duration::ZERO,
            swap: Default::default(),
        };
        let text = profile(&layers, &timings);
        let value = |key: &str| {
            let l = text
                .lines()
                .find(|l| l.starts_with(key))
                .unwrap_or_else(|| panic!("{key}: {text}"));
            l[62..].trim().to_string()
        };
        assert_eq!(value("fwd flops per GPU:"), "6.00 G"); // 3e9 x 2 micro-batches
        assert_eq!(value("fwd MACs per GPU:"), "3.00 GMACs");
        assert_eq!(value("fwd FLOPS per GPU"), "15.00 GFLOPS"); // 6e9 / 0.4 s
        assert_eq!(value("FLOPS per GPU = 3"), "9.00 GFLOPS"); // 18e9 / 2 s
        assert_eq!(value("samples/second:"), "8.00"); // 4 x 2 x 2 ranks / 2 s
        assert!(text.contains("(0) a: 1.00 K, 25.00% Params, 3.00 GMACs, 100.00% MACs, 300.00 ms, 75.00% latency, 20.00 GFLOPS, bwd 600.00 ms"), "{text}");
        assert!(text.contains("(1) b: 3.00 K, 75.00% Params, n/a"), "{text}");
    }
}
