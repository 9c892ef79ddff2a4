//! `ds-rs bench adam`: one fused AdamW step over a flat fp32 shard, measured as the peer's
//! ../shared/bench/adam_cpu.py measures torch's and DeepSpeed's (threads: RAYON_NUM_THREADS);
//! with `--dtype bf16|fp16` also the step's two conversions of a 16-bit model (its gradients
//! into the update, the update into its parameters) against the `half` crate's loops.

use std::process::ExitCode;

use ds_engine::optim::{bench_adam, bench_convert, ConvertResult};
use half::{bf16, f16};

#[derive(clap::Args, Debug, Clone)]
pub struct AdamArgs {
    /// Parameter counts to time (e.g. 10M 50M).
    #[arg(long, num_args = 1.., default_values = ["10M", "50M"], value_parser = parse_count)]
    params: Vec<usize>,
    #[arg(long, default_value_t = 10)]
    iters: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// One JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
    /// The model's compute dtype: bf16 and fp16 also time the step's conversions.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16", "fp16"])]
    dtype: String,
}

fn parse_count(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.trim().to_ascii_uppercase() {
        t if t.ends_with('M') => (t[..t.len() - 1].to_string(), 1_000_000),
        t if t.ends_with('K') => (t[..t.len() - 1].to_string(), 1_000),
        t => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .map(|n| n * mult)
        .ok_or_else(|| format!("not a positive parameter count: {s:?} (e.g. 10M, 500K)"))
}

pub fn run(args: &AdamArgs) -> anyhow::Result<ExitCode> {
    if !args.json {
        println!(
            "{:>12} {:>8} {:>10} {:>10} {:>10} {:>8}",
            "params", "threads", "median ms", "min ms", "max ms", "GB/s"
        );
    }
    for &n in &args.params {
        let r = bench_adam(n, args.iters, args.warmup);
        let conversions = match args.dtype.as_str() {
            "bf16" => Some(bench_convert::<bf16>(
                n,
                args.iters,
                args.warmup,
                bf16::to_f32,
                bf16::from_f32,
            )),
            "fp16" => Some(bench_convert::<f16>(
                n,
                args.iters,
                args.warmup,
                f16::to_f32,
                f16::from_f32,
            )),
            _ => None,
        };
        if args.json {
            let row = serde_json::json!({"bench": "adam", "n_params": r.n_params, "threads": r.threads,
                "median_ms": r.median_ms, "min_ms": r.min_ms, "max_ms": r.max_ms, "effective_gbs": r.effective_gbs});
            println!("{row}");
        } else {
            println!(
                "{:>12} {:>8} {:>10.2} {:>10.2} {:>10.2} {:>8.2}",
                r.n_params, r.threads, r.median_ms, r.min_ms, r.max_ms, r.effective_gbs
            );
        }
        if let Some(c) = conversions {
            print_conversions(&c, &args.dtype, args.json);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The conversions' row: each median beside `half`'s and the ratio (half's time over ours).
fn print_conversions(c: &ConvertResult, dtype: &str, json: bool) {
    if json {
        let row = serde_json::json!({"bench": "convert", "dtype": dtype, "n_params": c.n_params,
            "threads": c.threads, "grads_ms": c.grads_ms, "half_grads_ms": c.half_grads_ms,
            "publish_ms": c.publish_ms, "half_publish_ms": c.half_publish_ms});
        println!("{row}");
        return;
    }
    println!(
        "{:>12}   {dtype} gradients to f32 {:.2} ms (half {:.2}: {:.2}x), f32 to {dtype} parameters {:.2} ms (half {:.2}: {:.2}x)",
        "",
        c.grads_ms,
        c.half_grads_ms,
        c.half_grads_ms / c.grads_ms,
        c.publish_ms,
        c.half_publish_ms,
        c.half_publish_ms / c.publish_ms
    );
}
