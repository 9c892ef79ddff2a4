//! kernels/flash.cu on the host (Note [kernels on the host]): the flash module's calls on the
//! emulator, against attention in f64 from its definition (flash_reference.rs) within the
//! bounds the kernels' roundings allow, in both orders of warps.

use candle_core::{DType, Device, Tensor};

use super::emu::{emulate_outputs, values};
use super::flash::{self, FlashShape};
use super::flash_reference::Case;
use super::offset;

fn from_f32(v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn run(c: &Case) {
    let (d, dtype) = (c.h * c.hd, c.dtype);
    let (inputs, qkv, q_strides, kv_strides) = if c.fused {
        assert_eq!(c.g, c.h);
        let qkv = values(&[c.b, c.t, 3 * d], 1, 2.0, dtype);
        let split = c.split_fused(&qkv);
        let strides = [c.t * 3 * d, c.hd, 3 * d];
        (vec![qkv], split, strides, strides)
    } else {
        let q = values(&[c.b, c.h, c.t, c.hd], 1, 2.0, dtype);
        let k = values(&[c.b, c.g, c.t, c.hd], 2, 2.0, dtype);
        let v = values(&[c.b, c.g, c.t, c.hd], 3, 1.0, dtype);
        let s = |heads| [heads * c.t * c.hd, c.t * c.hd, c.hd];
        (
            vec![q.clone(), k.clone(), v.clone()],
            [q, k, v],
            s(c.h),
            s(c.g),
        )
    };
    // q, k and v's addresses among the inputs' (one fused buffer, or three)
    let qkv_at = |a: &[u64]| match c.fused {
        true => [0, d, 2 * d].map(|o| offset(a[0], o, dtype)),
        false => [a[0], a[1], a[2]],
    };
    let shape = FlashShape {
        batch: c.b,
        heads: c.h,
        kv_heads: c.g,
        t: c.t,
        hd: c.hd,
        q_strides,
        kv_strides,
        scale: c.scale(),
        window: c.window,
    };
    assert!(shape.supported(dtype));
    let dout = values(&[c.b, c.t, c.h, c.hd], 4, 1.0, dtype);
    let want = c.reference(&qkv, &dout);

    let fwd_outputs = [(dtype, c.b * c.t * d), (DType::F32, c.b * c.h * c.t)];
    let input_refs: Vec<&Tensor> = inputs.iter().collect();
    let fwd = emulate_outputs(&input_refs, &fwd_outputs, |l, a, o| {
        flash::forward(l, dtype, qkv_at(a), [o[0], o[1]], &shape)
    });
    let name = |x: &str| format!("{} {dtype:?}", c.name(x));
    let worst_out = want.out.check(&name("out"), &fwd[0]);
    let worst_lse = want.lse.check(&name("lse"), &fwd[1]);

    let out = from_f32(&fwd[0], &[c.b, c.t, d], dtype);
    let lse = from_f32(&fwd[1], &[c.b * c.h * c.t], DType::F32);
    let mut bwd_inputs = input_refs.clone();
    bwd_inputs.extend([&out, &dout, &lse]);
    let n = inputs.len();
    let grads: [Vec<f32>; 3] = if c.fused {
        let g = emulate_outputs(&bwd_inputs, &[(dtype, c.b * c.t * 3 * d)], |l, a, o| {
            let dqkv = [0, d, 2 * d].map(|x| offset(o[0], x, dtype));
            flash::backward(l, dtype, ptrs(qkv_at(a), &a[n..]), dqkv, &shape)
        });
        let dqkv = from_f32(&g[0], &[c.b, c.t, 3 * d], DType::F32);
        c.split_fused(&dqkv)
            .map(|t| t.flatten_all().unwrap().to_vec1().unwrap())
    } else {
        let lens = [&qkv[0], &qkv[1], &qkv[2]].map(|t| (dtype, t.elem_count()));
        let g = emulate_outputs(&bwd_inputs, &lens, |l, a, o| {
            let out = [o[0], o[1], o[2]];
            flash::backward(l, dtype, ptrs(qkv_at(a), &a[n..]), out, &shape)
        });
        [g[0].clone(), g[1].clone(), g[2].clone()]
    };
    let worst = [
        worst_out,
        worst_lse,
        want.dq.check(&name("dq"), &grads[0]),
        want.dk.check(&name("dk"), &grads[1]),
        want.dv.check(&name("dv"), &grads[2]),
    ];
    println!(
        "{}: the largest differences as a fraction of their bounds, out lse dq dk dv: {worst:.3?}",
        name("flash")
    );
}

/// The backward's six input addresses: q, k, v, then out, dout, lse.
fn ptrs([q, k, v]: [u64; 3], rest: &[u64]) -> [u64; 6] {
    [q, k, v, rest[0], rest[1], rest[2]]
}

#[test]
fn flash_attention_with_grouped_heads_matches_f64_attention() {
    // 83 positions: several key and query tiles, the last ones partial
    run(&Case {
        b: 2,
        h: 4,
        g: 2,
        t: 83,
        hd: 32,
        window: 0,
        fused: false,
        dtype: DType::BF16,
    });
}

#[test]
fn flash_attention_reads_the_fused_projection_in_place() {
    for dtype in [DType::BF16, DType::F16] {
        run(&Case {
            b: 1,
            h: 2,
            g: 2,
            t: 70,
            hd: 64,
            window: 0,
            fused: true,
            dtype,
        });
    }
}

#[test]
fn flash_attention_with_a_sliding_window_and_the_largest_heads() {
    // a window shorter than a tile and one longer: tiles wholly outside it are skipped
    for window in [5, 40] {
        run(&Case {
            b: 1,
            h: 2,
            g: 1,
            t: 90,
            hd: 128,
            window,
            fused: false,
            dtype: DType::BF16,
        });
    }
}

#[test]
fn flash_attention_over_tiles_that_need_no_mask() {
    // 200 positions at head size 64: most tiles lie wholly below the diagonal, where the kernels
    // test no element; a window of 100 spans whole tiles and cuts others.
    for window in [0, 100] {
        run(&Case {
            b: 1,
            h: 2,
            g: 1,
            t: 200,
            hd: 64,
            window,
            fused: false,
            dtype: DType::BF16,
        });
    }
}

#[test]
fn flash_attention_declines_what_it_has_no_kernel_for() {
    let shape = FlashShape {
        batch: 1,
        heads: 4,
        kv_heads: 4,
        t: 16,
        hd: 64,
        q_strides: [4 * 16 * 64, 16 * 64, 64],
        kv_strides: [4 * 16 * 64, 16 * 64, 64],
        scale: 0.125,
        window: 0,
    };
    assert!(shape.supported(DType::BF16));
    assert!(
        !shape.supported(DType::F32),
        "f32 would run on tf32 tensor cores"
    );
    assert!(!FlashShape { hd: 80, ..shape }.supported(DType::BF16));
    assert!(!FlashShape {
        kv_heads: 3,
        ..shape
    }
    .supported(DType::F16));
    assert!(
        !FlashShape {
            scale: -0.125,
            ..shape
        }
        .supported(DType::BF16),
        "the running maxima assume a positive scale"
    );
    let odd = FlashShape {
        q_strides: [4 * 16 * 64, 16 * 64, 68],
        ..shape
    };
    assert!(!odd.supported(DType::BF16), "rows not 16-byte aligned");
    let far = FlashShape {
        kv_strides: [1 << 40, 1 << 30, 1 << 25],
        ..shape
    };
    assert!(!far.supported(DType::BF16), "a tile's keys span 4 GiB");
}
