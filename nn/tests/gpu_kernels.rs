//! The fused kernels (kernels/fused.cu) on GPU 0 against the CPU kernels, at GPT-2's sizes
//! (feature `cuda`; run by scripts/gpu-acceptance.sh, issue 35). Each op runs on the same
//! values on both devices. Bounds: f32 within 1e-5 * (1 + |cpu|) (one formula, other
//! summation orders, the GPU's libm a few ulp from the host's); bf16 and f16 within one unit
//! in the last place (each rounds one f32 result once, which may fall either side of a
//! rounding boundary). The CPU tests run the same kernels' source under the emulator
//! (src/kernels/gpu/emu.rs); this is what the GPU's compiler and math library make of them.
//!
//! The flash attention kernels (kernels/flash.cu) are held to attention in f64 instead, each
//! element within the bound its roundings allow (src/kernels/gpu/flash_reference.rs).
//!
//! Without a usable GPU each test prints why and passes; with `DS_RS_REQUIRE_GPU=1` it fails.

use candle_core::{DType, Device, Result, Tensor};
use ds_nn::kernels::fused_norm_loss::{
    cross_entropy_and_lse, cross_entropy_backward, cross_entropy_grad, cross_entropy_grad_from_lse,
    cross_entropy_with_probs, layer_norm, layer_norm_backward,
};
use ds_nn::kernels::grad::{gelu_linear_backward, linear, linear_gelu};
use ds_nn::kernels::nn::cross_entropy;
use ds_nn::kernels::ops::{
    causal_softmax, causal_softmax_backward, column_sum, gelu, gelu_backward,
};
use ds_nn::kernels::scatter_rows::sum_into_rows;
use ds_nn::kernels::{rms_swiglu, rotary};

fn gpu() -> Option<Device> {
    let why = match Device::new_cuda(0) {
        Ok(dev) => return Some(dev),
        Err(e) => format!("no usable GPU: {e}"),
    };
    if std::env::var_os("DS_RS_REQUIRE_GPU").is_some_and(|v| v == "1") {
        panic!("DS_RS_REQUIRE_GPU=1 but {why}");
    }
    eprintln!("skipped: {why}");
    None
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Values in [-scale, scale) from a xorshift stream, on the CPU, in `dtype`.
fn values(shape: &[usize], seed: u64, scale: f32, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_device(&Device::Cpu))
        .and_then(|t| t.to_vec1())
        .unwrap()
}

/// Runs `op` on the CPU and on `dev` with the same `inputs`, and holds each output of the
/// GPU's to the CPU's (see the module's bounds). Prints the largest difference.
fn compare(
    what: &str,
    dev: &Device,
    dtype: DType,
    inputs: &[&Tensor],
    op: impl Fn(&[Tensor]) -> Result<Vec<Tensor>>,
) {
    // The CPU side in f32 from the same values, each output rounded once to the GPU's dtype:
    // what a kernel computing in f32 and rounding on the store gives (the CPU's Llama paths
    // are f32 only).
    let upcast: Vec<Tensor> = inputs
        .iter()
        .map(|t| match t.dtype() {
            DType::U32 => (*t).clone(),
            _ => t.to_dtype(DType::F32).unwrap(),
        })
        .collect();
    let moved: Vec<Tensor> = inputs.iter().map(|t| t.to_device(dev).unwrap()).collect();
    let gpu = op(&moved).unwrap();
    let cpu: Vec<Tensor> = op(&upcast)
        .unwrap()
        .iter()
        .zip(&gpu)
        .map(|(c, g)| c.to_dtype(g.dtype()).unwrap())
        .collect();
    assert!(
        gpu.iter().all(|t| t.device().is_cuda()),
        "{what}: an output left the GPU"
    );
    let rel = match dtype {
        DType::BF16 => 2f32.powi(-7),
        DType::F16 => 2f32.powi(-10),
        _ => 1e-5,
    };
    let mut worst = 0f32;
    for (c, g) in cpu.iter().zip(&gpu) {
        for (i, (w, v)) in flat(c).iter().zip(flat(g)).enumerate() {
            let d = (v - w).abs();
            assert!(
                d <= rel * (1.0 + w.abs()),
                "{what} {dtype:?}: element {i}: GPU {v}, CPU {w}"
            );
            worst = worst.max(d / (1.0 + w.abs()));
        }
    }
    println!("kernel {what} {dtype:?}: ok, largest difference {worst:.2e} (bound {rel:.1e})");
}

#[test]
fn layer_norm_forward_and_backward() {
    let Some(dev) = gpu() else { return };
    let (rows, d) = (2048, 768);
    for dtype in DTYPES {
        let x = values(&[rows, d], 1, 3.0, dtype);
        let (w, b) = (values(&[d], 2, 1.0, dtype), values(&[d], 3, 0.5, dtype));
        let dy = values(&[rows, d], 4, 1.0, dtype);
        compare("layer_norm", &dev, dtype, &[&x, &w, &b], |t| {
            Ok(vec![layer_norm(&t[0], &t[1], &t[2], 1e-5)?])
        });
        compare(
            "layer_norm_backward",
            &dev,
            dtype,
            &[&x, &w, &b, &dy],
            |t| {
                let (dx, dw, db) = layer_norm_backward(&t[0], &t[1], &t[2], &t[3], 1e-5)?;
                Ok(vec![dx, dw, db])
            },
        );
    }
}

#[test]
fn gelu_forward_and_backward() {
    let Some(dev) = gpu() else { return };
    let n = 2048 * 3072;
    for dtype in DTYPES {
        let (x, dy) = (values(&[n], 5, 4.0, dtype), values(&[n], 6, 1.0, dtype));
        compare("gelu", &dev, dtype, &[&x], |t| Ok(vec![gelu(&t[0])?]));
        compare("gelu_backward", &dev, dtype, &[&x, &dy], |t| {
            Ok(vec![gelu_backward(&t[0], &t[1])?])
        });
    }
}

#[test]
fn bias_gradient_column_sum() {
    let Some(dev) = gpu() else { return };
    // c_fc's bias gradient at micro-batch 2 x 1024 positions
    let (rows, k) = (2048, 3072);
    for dtype in DTYPES {
        let dy = values(&[rows, k], 10, 1.0, dtype);
        let like = Tensor::zeros(k, dtype, &Device::Cpu).unwrap();
        compare("column_sum", &dev, dtype, &[&dy, &like], |t| {
            Ok(vec![column_sum(&t[0], &t[1])?])
        });
    }
}

#[test]
fn causal_softmax_forward_and_backward() {
    let Some(dev) = gpu() else { return };
    let shape = [2, 12, 256, 256];
    for dtype in DTYPES {
        let (x, dy) = (values(&shape, 7, 8.0, dtype), values(&shape, 8, 1.0, dtype));
        compare("causal_softmax", &dev, dtype, &[&x], |t| {
            Ok(vec![causal_softmax(&t[0], 0.125)?])
        });
        let y = causal_softmax(&x, 0.125).unwrap();
        compare("softmax_backward", &dev, dtype, &[&y, &dy], |t| {
            Ok(vec![causal_softmax_backward(&t[0], &t[1], 0.125)?])
        });
    }
}

#[test]
fn cross_entropy_and_its_gradient() {
    let Some(dev) = gpu() else { return };
    let (rows, v) = (512, 50257);
    let logits = values(&[rows, v], 9, 6.0, DType::F32);
    let targets: Vec<u32> = (0..rows as u32).map(|i| i * 7919 % v as u32).collect();
    let targets = Tensor::new(targets, &Device::Cpu).unwrap();
    compare(
        "cross_entropy",
        &dev,
        DType::F32,
        &[&logits, &targets],
        |t| {
            let (loss, probs) = cross_entropy_with_probs(&t[0], &t[1])?;
            Ok(vec![loss, probs])
        },
    );
    compare(
        "cross_entropy_loss",
        &dev,
        DType::F32,
        &[&logits, &targets],
        |t| Ok(vec![cross_entropy(&t[0], &t[1])?]),
    );
    compare(
        "cross_entropy_grad",
        &dev,
        DType::F32,
        &[&logits, &targets],
        |t| Ok(vec![cross_entropy_grad(&t[0], &t[1], 1.0 / rows as f64)?]),
    );
    let (_, probs) = cross_entropy_with_probs(&logits, &targets).unwrap();
    compare(
        "cross_entropy_backward",
        &dev,
        DType::F32,
        &[&probs, &targets],
        |t| {
            Ok(vec![cross_entropy_backward(
                &t[0],
                &t[1],
                1.0 / rows as f64,
            )?])
        },
    );
}

/// The loss a GPU keeps as its logits (in their dtype) and their log-sum-exp, and the
/// gradient from them, against the CPU's f32 kernels on the same values: GPT-2's vocabulary
/// (rows an element a thread) and the padded one the gpt2 preset trains (16 bytes a thread).
#[test]
fn cross_entropy_kept_as_logits_and_lse() {
    let Some(dev) = gpu() else { return };
    for v in [50257, 50304] {
        loss_kept_as_logits_and_lse(&dev, v);
    }
}

fn loss_kept_as_logits_and_lse(dev: &Device, v: usize) {
    let rows = 512;
    let targets: Vec<u32> = (0..rows as u32).map(|i| i * 7919 % v as u32).collect();
    let targets = Tensor::new(targets, &Device::Cpu).unwrap();
    let scale = 1.0 / rows as f64;
    for dtype in [DType::F32, DType::BF16] {
        let logits = values(&[rows, v], 9, 6.0, dtype);
        let on_gpu = [&logits, &targets].map(|t| t.to_device(dev).unwrap());
        assert!(
            cross_entropy_and_lse(&on_gpu[0], &on_gpu[1])
                .unwrap()
                .is_some(),
            "the GPU's kernels take {dtype:?} logits"
        );
        compare(
            &format!("cross_entropy_and_lse v {v}"),
            dev,
            dtype,
            &[&logits, &targets],
            |t| match cross_entropy_and_lse(&t[0], &t[1])? {
                Some((loss, lse)) => {
                    let grad = cross_entropy_grad_from_lse(&t[0], &lse, &t[1], scale)?
                        .expect("on the GPU, as the loss");
                    Ok(vec![loss, lse, grad])
                }
                // the CPU: its f32 kernels, the reference
                None => Ok(vec![
                    cross_entropy(&t[0], &t[1])?,
                    t[0].log_sum_exp(1)?,
                    cross_entropy_grad(&t[0], &t[1], scale)?,
                ]),
            },
        );
    }
}

/// GPT-2's MLP linears with cuBLASLt's epilogues (bias; bias and GELU keeping the
/// pre-activation; the input gradient through GELU's derivative) against the CPU's f32
/// composition on the same values. That they ran, and not candle's matmul, bias and GELU
/// kernels: in bf16 and f16 the fused results round once where the composition rounds after
/// each kernel, so many elements differ from candle's composition on the same GPU.
#[test]
fn linear_epilogues_bias_gelu_and_its_gradient() {
    let Some(dev) = gpu() else { return };
    let (rows, d, mlp) = (2048, 768, 3072);
    for dtype in DTYPES {
        let x = values(&[rows, d], 11, 1.0, dtype);
        let (w, b) = (
            values(&[mlp, d], 12, 0.1, dtype),
            values(&[mlp], 13, 0.5, dtype),
        );
        let (w2, dy) = (
            values(&[d, mlp], 14, 0.05, dtype),
            values(&[rows, d], 15, 1.0, dtype),
        );
        let f = values(&[rows, mlp], 16, 3.0, dtype);
        let g = gelu(&f).unwrap();
        compare("linear_bias", &dev, dtype, &[&x, &w, &b], |t| {
            Ok(vec![linear(&t[0], &t[1], Some(&t[2]))?])
        });
        compare("linear_gelu", &dev, dtype, &[&x, &w, &b], |t| {
            let (f, g) = linear_gelu(&t[0], &t[1], &t[2])?;
            Ok(vec![f, g])
        });
        compare(
            "gelu_linear_backward",
            &dev,
            dtype,
            &[&g, &f, &w2, &dy],
            |t| {
                let grads = gelu_linear_backward(&t[0], &t[1], &t[2], &t[3])?;
                Ok(vec![grads.dx, grads.dw])
            },
        );
        if dtype != DType::F32 {
            fused_ran(&dev, [&x, &w, &b], [&g, &f, &w2, &dy]);
        }
    }
}

/// Asserts that the epilogue path ran: its outputs differ from candle's composition
/// (matmul, then bias, then GELU or its derivative, each rounded) on the same GPU.
fn fused_ran(dev: &Device, fwd: [&Tensor; 3], bwd: [&Tensor; 4]) {
    let [x, w, b] = fwd.map(|t| t.to_device(dev).unwrap());
    let [g, f, w2, dy] = bwd.map(|t| t.to_device(dev).unwrap());
    let product = x.matmul(&w.t().unwrap()).unwrap();
    let composed = product.broadcast_add(&b).unwrap();
    let dg = dy.matmul(&w2).unwrap();
    let pairs = [
        ("bias", linear(&x, &w, Some(&b)).unwrap(), composed.clone()),
        (
            "gelu",
            linear_gelu(&x, &w, &b).unwrap().1,
            gelu(&composed).unwrap(),
        ),
        (
            "dgelu",
            gelu_linear_backward(&g, &f, &w2, &dy).unwrap().dx,
            gelu_backward(&f, &dg).unwrap(),
        ),
    ];
    for (what, fused, composed) in pairs {
        let differ = flat(&fused)
            .iter()
            .zip(flat(&composed))
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        println!(
            "epilogue {what}: {differ} of {} elements differ from candle's kernels",
            fused.elem_count()
        );
        assert!(
            differ > 0,
            "{what}: the epilogue did not run (candle's kernels' bits)"
        );
    }
}

/// The embedding table's gradient (rows summed by index) at GPT-2's vocabulary, against the
/// CPU's f32 index_add on the same values: frequent tokens (a few hundred positions each),
/// rare ones, and most rows absent (zero). In bf16 it must differ from candle's index_add on
/// the GPU, which keeps a bf16 running sum: the kernel ran.
#[test]
fn embedding_gradient_rows_summed_by_index() {
    let Some(dev) = gpu() else { return };
    let (n, vocab, d) = (4096, 50304, 768);
    // a skewed stream: token 7 every 16th position, the rest spread over 997 others
    let ids: Vec<u32> = (0..n as u32)
        .map(|p| if p % 16 == 0 { 7 } else { p * 7919 % 997 * 50 })
        .collect();
    let ids = Tensor::new(ids, &Device::Cpu).unwrap();
    for dtype in DTYPES {
        let dy = values(&[n, d], 17, 1.0, dtype);
        compare("sum_rows_by_index", &dev, dtype, &[&ids, &dy], |t| {
            Ok(vec![sum_into_rows(&t[0], &t[1], vocab)?])
        });
        if dtype == DType::BF16 {
            let (ids, dy) = (ids.to_device(&dev).unwrap(), dy.to_device(&dev).unwrap());
            let ours = flat(&sum_into_rows(&ids, &dy, vocab).unwrap());
            let zeros = Tensor::zeros((vocab, d), dtype, &dev).unwrap();
            let candle = flat(&zeros.index_add(&ids, &dy, 0).unwrap());
            let differ = ours
                .iter()
                .zip(&candle)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            let differ = differ.count();
            println!("sum_rows_by_index: {differ} elements differ from candle's bf16 index_add");
            assert!(
                differ > 0,
                "the kernel did not run (candle's index_add's bits)"
            );
        }
    }
}

#[test]
fn llama_rms_norm_swiglu_and_rotary() {
    let Some(dev) = gpu() else { return };
    // a 1B Llama's widths: hidden 2048, MLP 5632, 32 heads of 64
    let (rows, d, f) = (2048, 2048, 5632);
    let fused = |o: Result<Option<(Tensor, Tensor)>>| o.map(|v| v.expect("a fused path"));
    for dtype in DTYPES {
        let x = values(&[rows, d], 11, 2.0, dtype);
        let w = values(&[d], 12, 1.0, dtype);
        let dy = values(&[rows, d], 13, 1.0, dtype);
        compare("rms_norm", &dev, dtype, &[&x, &w], |t| {
            let (y, r) = fused(rms_swiglu::rms_norm(&t[0], &t[1], 1e-6))?;
            Ok(vec![y, r])
        });
        compare("rms_norm_backward", &dev, dtype, &[&x, &w, &dy], |t| {
            let (_, r) = fused(rms_swiglu::rms_norm(&t[0], &t[1], 1e-6))?;
            let (dx, dw) = fused(rms_swiglu::rms_norm_backward(&t[0], &r, &t[1], &t[2]))?;
            Ok(vec![dx, dw])
        });
        let (g, u) = (
            values(&[rows, f], 14, 5.0, dtype),
            values(&[rows, f], 15, 2.0, dtype),
        );
        let dg = values(&[rows, f], 16, 1.0, dtype);
        compare("swiglu", &dev, dtype, &[&g, &u], |t| {
            Ok(vec![
                rms_swiglu::swiglu(&t[0], &t[1])?.expect("a fused path")
            ])
        });
        compare("swiglu_backward", &dev, dtype, &[&g, &u, &dg], |t| {
            let (a, b) = fused(rms_swiglu::swiglu_backward(&t[0], &t[1], &t[2]))?;
            Ok(vec![a, b])
        });
        let q = values(&[2, 32, 256, 64], 17, 2.0, dtype);
        let (cos, sin) = (
            values(&[256, 64], 18, 1.0, dtype),
            values(&[256, 64], 19, 1.0, dtype),
        );
        compare("rotary", &dev, dtype, &[&q, &cos, &sin], |t| {
            let y = rotary::apply(&t[0], &t[1], &t[2])?.expect("a fused path");
            let back = rotary::apply_backward(&t[0], &t[1], &t[2])?.expect("a fused path");
            Ok(vec![y, back])
        });
    }
}

#[test]
fn users_rms_norm_and_rope_train_on_the_gpu() {
    use ds_nn::kernels::nn::{rms_norm, rope};
    let Some(dev) = gpu() else { return };
    // candle's autograd through the custom ops: the outputs and the input gradients
    let grads = |t: &[Tensor], f: &dyn Fn(&Tensor) -> Result<Tensor>| -> Result<Vec<Tensor>> {
        let x = candle_core::Var::from_tensor(&t[0])?;
        let y = f(x.as_tensor())?;
        let g = (&y * &t[1])?.sum_all()?.backward()?;
        Ok(vec![y, g.get(x.as_tensor()).expect("x's gradient").clone()])
    };
    for dtype in DTYPES {
        let (x, w) = (
            values(&[64, 512], 20, 2.0, dtype),
            values(&[512], 21, 1.0, dtype),
        );
        let up = values(&[64, 512], 22, 1.0, dtype);
        compare("user rms_norm", &dev, dtype, &[&x, &up, &w], |t| {
            grads(t, &|x| rms_norm(x, &t[2], 1e-6))
        });
        let q = values(&[2, 4, 32, 64], 23, 2.0, dtype);
        let up = values(&[2, 4, 32, 64], 24, 1.0, dtype);
        let (cos, sin) = (
            values(&[32, 32], 25, 1.0, dtype),
            values(&[32, 32], 26, 1.0, dtype),
        );
        compare("user rope", &dev, dtype, &[&q, &up, &cos, &sin], |t| {
            grads(t, &|x| rope(x, &t[2], &t[3]))
        });
    }
}

#[path = "../src/kernels/gpu/flash_reference.rs"]
mod flash_reference;

use flash_reference::Case;

/// The flash kernels (kernels/flash.cu) through `flash_attention` on the GPU against attention
/// in f64 from its definition, each element within the bound its roundings allow
/// (src/kernels/gpu/flash_reference.rs); prints the largest difference as a fraction of its
/// element's bound.
fn flash_case(dev: &Device, c: &Case) {
    use ds_nn::kernels::flash_attention as fa;
    let (d, dtype) = (c.h * c.hd, c.dtype);
    let scale = c.scale();
    let window = (c.window > 0).then_some(c.window);
    let on = |t: &Tensor| t.to_device(dev).unwrap();
    let dout = values(&[c.b, c.t, d], 4, 1.0, dtype);
    let declined = "the flash kernels declined a case they are built for";
    let (qkv, out, lse, grads) = if c.fused {
        let qkv = values(&[c.b, c.t, 3 * d], 1, 2.0, dtype);
        let (out, lse) = fa::forward(&on(&qkv), c.h, scale).unwrap().expect(declined);
        let dqkv = fa::backward(&on(&qkv), &out, &lse, &on(&dout), c.h, scale)
            .unwrap()
            .expect(declined);
        (c.split_fused(&qkv), out, lse, c.split_fused(&dqkv))
    } else {
        let q = values(&[c.b, c.h, c.t, c.hd], 1, 2.0, dtype);
        let k = values(&[c.b, c.g, c.t, c.hd], 2, 2.0, dtype);
        let v = values(&[c.b, c.g, c.t, c.hd], 3, 1.0, dtype);
        let (gq, gk, gv) = (on(&q), on(&k), on(&v));
        let (out, lse) = fa::forward_grouped(&gq, &gk, &gv, scale, window)
            .unwrap()
            .expect(declined);
        let grads = fa::backward_grouped((&gq, &gk, &gv), &out, &lse, &on(&dout), scale, window)
            .unwrap()
            .expect(declined);
        ([q, k, v], out, lse, grads)
    };
    let want = c.reference(&qkv, &dout);
    let pairs = [
        ("out", &want.out, &out),
        ("lse", &want.lse, &lse),
        ("dq", &want.dq, &grads[0]),
        ("dk", &want.dk, &grads[1]),
        ("dv", &want.dv, &grads[2]),
    ];
    for (what, expect, got) in pairs {
        let name = c.name(&format!("flash_{what}"));
        let worst = expect.check(&name, &flat(got));
        println!(
            "kernel {name} {dtype:?}: ok, largest difference {worst:.2} (bound 1, the element's own)"
        );
    }
}

#[test]
fn flash_attention_forward_and_backward() {
    let Some(dev) = gpu() else { return };
    // GPT-2's heads of 64 over 1024 positions, read from the fused projection
    let gpt = Case {
        b: 1,
        h: 4,
        g: 4,
        t: 1024,
        hd: 64,
        window: 0,
        fused: true,
        dtype: DType::BF16,
    };
    flash_case(&dev, &gpt);
    // Llama 3.2 1B's head size and grouping (32 heads over 8), fewer heads
    let llama = Case {
        h: 8,
        g: 2,
        t: 512,
        fused: false,
        ..gpt
    };
    flash_case(&dev, &llama);
    // the largest heads, f16, a sliding window
    let window = Case {
        h: 2,
        g: 1,
        t: 300,
        hd: 128,
        window: 100,
        dtype: DType::F16,
        ..llama
    };
    flash_case(&dev, &window);
}
