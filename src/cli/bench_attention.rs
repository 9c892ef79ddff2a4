//! `ds-rs bench attention`: causal attention's forward and backward at one shape, through the
//! two paths a model can take: `flash` (kernels/flash_attention.rs: the CPU's blockwise f32
//! attention, or the GPU's flash kernels in bf16/f16) and `matmul` (the T x T scores through
//! the matrix products and the fused causal softmax, as the models run it otherwise). The
//! peer is PyTorch's scaled_dot_product_attention at the same shape
//! (scripts/bench/attention_torch.py). FLOPs follow FlashAttention's count: 4 B H T^2 hd for
//! the forward's two products, halved by the causal mask, and 2.5 times that for the backward.

use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use ds_engine::device::DeviceChoice;
use ds_engine::kernels::flash_attention;
use ds_engine::kernels::ops::{causal_softmax, causal_softmax_backward};

#[derive(clap::Args, Debug, Clone)]
pub struct AttentionArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = DeviceChoice::parse)]
    device: DeviceChoice,
    /// f32, bf16 or f16 (default: f32 on the CPU, bf16 on a GPU).
    #[arg(long)]
    dtype: Option<String>,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 12)]
    heads: usize,
    /// Key/value heads (grouped-query attention); default: as many as the query heads.
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    #[arg(long, default_value_t = 10)]
    iters: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// One JSON object per path instead of the table.
    #[arg(long)]
    json: bool,
}

/// One shape's tensors: q [B, H, T, hd], k and v [B, G, T, hd], and the output's gradient.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    scale: f32,
}

pub fn run(args: &AttentionArgs) -> anyhow::Result<ExitCode> {
    let dev = args.device.open(0)?;
    let dtype = match args.dtype.as_deref() {
        None if dev.is_cpu() => DType::F32,
        None => DType::BF16,
        Some(s) => s
            .parse::<DType>()
            .map_err(|_| anyhow::anyhow!("--dtype {s:?}: expected f32, bf16 or f16"))?,
    };
    let g = args.kv_heads.unwrap_or(args.heads);
    if g == 0 || !args.heads.is_multiple_of(g) {
        anyhow::bail!("--kv-heads {g} must divide --heads {}", args.heads);
    }
    let inputs = inputs(args, g, dtype, &dev)?;
    let (b, h, t, hd) = (args.batch, args.heads, args.seq_len, args.head_dim);
    let forward_flops = 4.0 * (b * h * t * t * hd) as f64 / 2.0;
    let flops = forward_flops * 3.5;
    if !args.json {
        println!("B={b} H={h} G={g} T={t} hd={hd} {dtype:?} on {dev:?}");
        println!(
            "{:>8} {:>10} {:>10} {:>10}",
            "path", "median ms", "min ms", "TFLOP/s"
        );
    }
    for path in ["flash", "matmul"] {
        let step = |x: &Inputs| match path {
            "flash" => flash(x),
            _ => matmul(x).map(Some),
        };
        let Some(times) = time(args, &dev, &inputs, step)? else {
            let why = "no blockwise kernel for this device, dtype and head size";
            match args.json {
                true => println!(
                    "{}",
                    serde_json::json!({"bench": "attention", "path": path, "skipped": why})
                ),
                false => println!("{path:>8} skipped: {why}"),
            }
            continue;
        };
        let (median, min) = (times[times.len() / 2], times[0]);
        let tflops = flops / (median * 1e-3) / 1e12;
        if args.json {
            let row = serde_json::json!({"bench": "attention", "path": path, "batch": b,
                "heads": h, "kv_heads": g, "seq_len": t, "head_dim": hd,
                "dtype": format!("{dtype:?}").to_lowercase(), "median_ms": median, "min_ms": min,
                "tflops": tflops});
            println!("{row}");
        } else {
            println!("{path:>8} {median:>10.3} {min:>10.3} {tflops:>10.2}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn inputs(args: &AttentionArgs, g: usize, dtype: DType, dev: &Device) -> Result<Inputs> {
    let (b, h, t, hd) = (args.batch, args.heads, args.seq_len, args.head_dim);
    let random =
        |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, dev).and_then(|x| x.to_dtype(dtype));
    Ok(Inputs {
        q: random(&[b, h, t, hd])?,
        k: random(&[b, g, t, hd])?,
        v: random(&[b, g, t, hd])?,
        dout: random(&[b, t, h * hd])?,
        scale: 1.0 / (hd as f32).sqrt(),
    })
}

/// Each timed iteration's milliseconds, sorted; None where `step` declines the shape.
fn time(
    args: &AttentionArgs,
    dev: &Device,
    x: &Inputs,
    step: impl Fn(&Inputs) -> Result<Option<Vec<Tensor>>>,
) -> Result<Option<Vec<f64>>> {
    let mut times = Vec::with_capacity(args.iters);
    for i in 0..args.warmup + args.iters.max(1) {
        dev.synchronize()?;
        let start = Instant::now();
        if step(x)?.is_none() {
            return Ok(None);
        }
        dev.synchronize()?;
        if i >= args.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(Some(times))
}

/// The blockwise path: forward keeping the log-sum-exp, backward recomputing the probabilities.
fn flash(x: &Inputs) -> Result<Option<Vec<Tensor>>> {
    let Some((out, lse)) = flash_attention::forward_grouped(&x.q, &x.k, &x.v, x.scale, None)?
    else {
        return Ok(None);
    };
    let qkv = (&x.q, &x.k, &x.v);
    let grads = flash_attention::backward_grouped(qkv, &out, &lse, &x.dout, x.scale, None)?;
    Ok(grads.map(|g| g.to_vec()))
}

/// The T x T path: scores, the causal softmax and the product with v, and their backward, with
/// k and v repeated over the query heads that share them.
fn matmul(x: &Inputs) -> Result<Vec<Tensor>> {
    let (b, h, t, hd) = x.q.dims4()?;
    let n = h / x.k.dim(1)?;
    let repeat = |kv: &Tensor| -> Result<Tensor> {
        let (b, g, t, hd) = kv.dims4()?;
        kv.unsqueeze(2)?
            .broadcast_as((b, g, n, t, hd))?
            .reshape((b, h, t, hd))
    };
    let (k, v) = (repeat(&x.k)?, repeat(&x.v)?);
    let probs = causal_softmax(&x.q.matmul(&k.t()?)?, x.scale as f64)?;
    let out = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h * hd))?;
    let dheads = x
        .dout
        .reshape((b, t, h, hd))?
        .transpose(1, 2)?
        .contiguous()?;
    let dprobs = dheads.matmul(&v.t()?)?;
    let dv = probs.t()?.matmul(&dheads)?;
    let dscores = causal_softmax_backward(&probs, &dprobs, x.scale as f64)?;
    let dq = dscores.matmul(&k)?;
    let dk = dscores.t()?.matmul(&x.q)?;
    let group = |d: Tensor| -> Result<Tensor> {
        let g = h / n;
        d.reshape((b, g, n, t, hd))?.sum(2)
    };
    Ok(vec![out, dq, group(dk)?, group(dv)?])
}
