//! `ds-rs bench gemm`: the machine's ceiling for a training step's matrix products, so that
//! every speed figure can be read against it. Prints the CPU's vector instruction sets and the
//! single-core f32 GFLOP/s of the linear layers' products of a model's step (x W^T through
//! `kernels::grad::linear`, as training calls it); with `--peer PYTHON`, PyTorch's on the same
//! shapes, one thread (scripts/bench/gemm_torch.py), and the ratio.

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::Context;
use candle_core::{Device, Tensor};

#[derive(clap::Args, Debug, Clone)]
pub struct GemmArgs {
    /// The model whose linear layers' shapes to time (as `train --model` takes it).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Rows of each product: micro-batch x sequence [default: 8 x the model's sequence].
    #[arg(long)]
    rows: Option<usize>,
    /// Timed repetitions of each product (after 3 untimed).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// A Python with torch: PyTorch's single-thread products on the same shapes beside ds-rs's.
    #[arg(long)]
    peer: Option<PathBuf>,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One product: x [rows, k] times W^T, W [n, k].
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Shape {
    name: &'static str,
    rows: usize,
    k: usize,
    n: usize,
}

impl Shape {
    fn flops(&self) -> f64 {
        2.0 * (self.rows * self.k * self.n) as f64
    }
}

pub fn run(args: &GemmArgs) -> anyhow::Result<ExitCode> {
    // one core: candle and the gemm crate read the thread count from here at each product
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let model = ds_models::ModelSpec::resolve(&args.model, None)?;
    let (d, v) = (model.hidden_size(), model.vocab_size());
    let rows = args.rows.unwrap_or(8 * model.seq_len);
    let ffn = model
        .hf_config()
        .and_then(|c| c["intermediate_size"].as_u64())
        .map_or(4 * d, |f| f as usize);
    let shapes = [
        Shape {
            name: "qkv",
            rows,
            k: d,
            n: 3 * d,
        },
        Shape {
            name: "attention out",
            rows,
            k: d,
            n: d,
        },
        Shape {
            name: "mlp up",
            rows,
            k: d,
            n: ffn,
        },
        Shape {
            name: "mlp down",
            rows,
            k: ffn,
            n: d,
        },
        Shape {
            name: "lm head",
            rows,
            k: d,
            n: v,
        },
    ];
    let isa = instruction_sets();
    let ours: Vec<f64> = shapes
        .iter()
        .map(|s| time_ours(s, args.iters))
        .collect::<anyhow::Result<_>>()?;
    let peer = match &args.peer {
        Some(python) => Some(time_peer(python, &shapes, args.iters)?),
        None => None,
    };
    let gflops = |secs: &[f64]| {
        shapes.iter().map(Shape::flops).sum::<f64>() / secs.iter().sum::<f64>() / 1e9
    };
    if args.json {
        let v = serde_json::json!({
            "isa": isa, "model": args.model, "shapes": shapes,
            "ds_rs_seconds": ours, "ds_rs_gflops": gflops(&ours),
            "torch_seconds": peer, "torch_gflops": peer.as_deref().map(gflops),
        });
        println!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "CPU: {}; vector instructions: {}",
        cpu_name(),
        isa.join(" ")
    );
    println!(
        "single-core f32 products of --model {} ({rows} rows), GFLOP/s:",
        args.model
    );
    for (i, s) in shapes.iter().enumerate() {
        let torch = peer.as_ref().map_or(String::new(), |p| {
            format!(
                "   torch {:7.1}   ratio {:.2}x",
                s.flops() / p[i] / 1e9,
                p[i] / ours[i]
            )
        });
        println!(
            "  {:<14} [{} x {}] x [{} x {}]^T   ds-rs {:7.1}{torch}",
            s.name,
            s.rows,
            s.k,
            s.n,
            s.k,
            s.flops() / ours[i] / 1e9
        );
    }
    let torch = peer.as_deref().map_or(String::new(), |p| {
        format!(
            "   torch {:.1}   ratio {:.2}x",
            gflops(p),
            p.iter().sum::<f64>() / ours.iter().sum::<f64>()
        )
    });
    println!("  all            ds-rs {:.1}{torch}", gflops(&ours));
    Ok(ExitCode::SUCCESS)
}

/// The median seconds of one product of `s` through the training path.
fn time_ours(s: &Shape, iters: usize) -> anyhow::Result<f64> {
    let x = Tensor::randn(0f32, 1.0, (s.rows, s.k), &Device::Cpu)?;
    let w = Tensor::randn(0f32, 1.0, (s.n, s.k), &Device::Cpu)?;
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 3 {
        let t = Instant::now();
        let y = ds_engine::kernels::grad::linear(&x, &w, None)?;
        drop(y);
        if i >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// PyTorch's median seconds per shape, from scripts/bench/gemm_torch.py.
fn time_peer(python: &std::path::Path, shapes: &[Shape], iters: usize) -> anyhow::Result<Vec<f64>> {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/bench/gemm_torch.py");
    let spec = serde_json::to_string(shapes)?;
    let out = Command::new(python)
        .arg(&script)
        .args([&spec, &iters.to_string()])
        .output()
        .with_context(|| format!("--peer {}: running {}", python.display(), script.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "--peer {}: {}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("failed")
    );
    let secs: Vec<f64> = serde_json::from_slice(&out.stdout).context("gemm_torch.py's output")?;
    anyhow::ensure!(
        secs.len() == shapes.len(),
        "gemm_torch.py timed {} shapes of {}",
        secs.len(),
        shapes.len()
    );
    Ok(secs)
}

/// The vector instruction sets this CPU offers, of those a GEMM can use.
fn instruction_sets() -> Vec<&'static str> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! has {
            ($($f:tt),*) => {
                $(if std::arch::is_x86_feature_detected!($f) {
                    out.push($f);
                })*
            };
        }
        has!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16"
        );
        // AMX's detection is not stable in std yet: the kernel's flags say it
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags"))
            .unwrap_or("");
        for amx in ["amx_tile", "amx_bf16"] {
            if flags.split_whitespace().any(|f| f == amx) {
                out.push(amx);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            out.push("neon");
        }
    }
    out
}

/// The CPU's model name (/proc/cpuinfo), for the record.
fn cpu_name() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    info.lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
