//! The GPU side of the ZeRO buffers against their host side, on GPU 0 (feature `cuda`; run by
//! scripts/gpu-acceptance.sh): every loop of a step that runs as a kernel where its buffers
//! are a GPU's (ds-partition's `vector`, the engine's Adam) must leave the bits the host loop
//! leaves, because both round each element once, the same way, and the kernels are built
//! without FMA contraction. The sum of squares adds in another order, so it is held to
//! 1e-12 relative (f64 sums of f32 squares over a million elements: ~1e-16 per add).
//! Also: a layer's parameters materialised device to device, and gradients staged into a GPU
//! buffer, are the values put in; ZeRO-2's buckets and ZeRO-3's gathers in GPU memory give
//! the host's bits.
//!
//! Without a usable GPU each test prints why and passes; with `DS_RS_REQUIRE_GPU=1` it fails.

use candle_core::{Device, Tensor};
use ds_comm::testkit::run_ranks;
use ds_comm::Element;
use ds_config::ZeroStage;
use ds_engine::device::{gpu_placement, tensor_from_buffer, with_staged_grads};
use ds_engine::optim::{Adam, AdamParams, Group, Optimizer, TypedGrads};
use ds_partition::gpu::{gpu_of, Span};
use ds_partition::{
    vector, FlatBuf, PartitionError, Placement, Placements, ReduceConfig, Stage3Config, Zero,
    ZeroOptions,
};
use half::{bf16, f16};

/// Odd lengths: empty, below a block, across many blocks of the grid-stride loop.
const LENS: [usize; 4] = [0, 5, 4099, 1_048_583];

fn gpu() -> Option<(Device, Placement)> {
    let why = match Device::new_cuda(0) {
        Ok(dev) => {
            let place = gpu_placement(&dev).expect("a CUDA device has a GPU placement");
            return Some((dev, place));
        }
        Err(e) => format!("no usable GPU: {e}"),
    };
    if std::env::var_os("DS_RS_REQUIRE_GPU").is_some_and(|v| v == "1") {
        panic!("DS_RS_REQUIRE_GPU=1 but {why}");
    }
    eprintln!("skipped: {why}");
    None
}

/// Values in ±4 with a fractional part every dtype must round: element i of stream `seed`.
fn pattern(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let x = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (x as f32 / (1u64 << 24) as f32) * 8.0 - 4.0 + 1.0 / 3.0
        })
        .collect()
}

fn values<T: Element>(seed: u64, n: usize) -> Vec<T> {
    pattern(seed, n).into_iter().map(T::from_f32).collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

fn vector_ops<T: Element>(name: &str) {
    let Some((_dev, place)) = gpu() else {
        return;
    };
    for n in LENS {
        let (a, b, m) = (values::<T>(1, n), values::<T>(2, n), pattern(3, n));
        let mut host = a.clone();
        let mut dev = FlatBuf::from_vec(&place, a.clone()).unwrap();
        let src = FlatBuf::from_vec(&place, b.clone()).unwrap();
        let master = FlatBuf::from_vec(&place, m.clone()).unwrap();
        assert!(
            n == 0 || !dev.on_host(),
            "{name}: a GPU buffer in host memory"
        );

        vector::accumulate(&mut host, &b).unwrap();
        vector::accumulate(&mut dev, &src).unwrap();
        assert_eq!(bits(&dev), bits(&host), "{name} n={n}: accumulate");

        vector::scale(&mut host, Some(0.37)).unwrap();
        vector::scale(&mut dev, Some(0.37)).unwrap();
        assert_eq!(bits(&dev), bits(&host), "{name} n={n}: scale");

        let (h, d) = (
            vector::sum_squares(&host).unwrap(),
            vector::sum_squares(&dev).unwrap(),
        );
        assert!(
            (h - d).abs() <= 1e-12 * h.abs(),
            "{name} n={n}: sum of squares {d} vs {h}"
        );

        vector::convert_into(&mut host, &m).unwrap();
        vector::convert_into(&mut dev, &master).unwrap();
        assert_eq!(bits(&dev), bits(&host), "{name} n={n}: convert");

        // copies in every direction: the same elements
        let mut back = vec![T::default(); n];
        vector::copy(&mut back, &dev).unwrap();
        assert_eq!(bits(&back), bits(&host), "{name} n={n}: copy from the GPU");
        let mut other = FlatBuf::<T>::zeroed(&place, n).unwrap();
        vector::copy(&mut other, &dev).unwrap();
        assert_eq!(bits(&other), bits(&host), "{name} n={n}: copy on the GPU");
        vector::copy(&mut other, &a).unwrap();
        assert_eq!(bits(&other), bits(&a), "{name} n={n}: copy to the GPU");

        vector::zero(&mut dev).unwrap();
        assert!(
            dev.iter().all(|x| x.to_f32().to_bits() == 0),
            "{name} n={n}: zero"
        );
    }
    // an overflow is seen: inf in one element makes the sum not finite
    let mut inf = values::<T>(4, 4099);
    inf[4000] = T::from_f32(f32::INFINITY);
    let dev = FlatBuf::from_vec(&place, inf).unwrap();
    assert!(
        !vector::sum_squares(&dev).unwrap().is_finite(),
        "{name}: inf lost"
    );
}

#[test]
fn vector_kernels_match_the_host_loops_f32() {
    vector_ops::<f32>("f32");
}

#[test]
fn vector_kernels_match_the_host_loops_bf16() {
    vector_ops::<bf16>("bf16");
}

#[test]
fn vector_kernels_match_the_host_loops_f16() {
    vector_ops::<f16>("f16");
}

fn adam_steps<T: Element>(name: &str) {
    let Some((_dev, place)) = gpu() else {
        return;
    };
    let n = 1_048_583;
    for adam_w_mode in [true, false] {
        let hp = AdamParams {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            adam_w_mode,
            bias_correction: true,
        };
        let mut host = Adam::new(hp, n);
        let mut dev = Adam::placed(hp, n, &place).unwrap();
        let mut p_host = pattern(5, n);
        let mut p_dev = FlatBuf::from_vec(&place, p_host.clone()).unwrap();
        let k = 0.5f32; // the unscale / clip factor both paths apply first
        for step in 0..3 {
            let g = values::<T>(10 + step, n);
            let g_dev = FlatBuf::from_vec(&place, g.clone()).unwrap();
            let lr = 1e-3 * (step + 1) as f64;
            let g32: Vec<f32> = g.iter().map(|x| x.to_f32() * k).collect();
            host.begin(lr);
            host.update(0, &mut p_host, &g32, Group::DEFAULT);
            dev.begin(lr);
            let ran = dev
                .update_on_gpu(0, &mut p_dev, TypedGrads::of(&g_dev), k, Group::DEFAULT)
                .unwrap();
            assert!(ran, "{name}: Adam did not run on the GPU");
            assert_eq!(
                bits(&p_dev),
                bits(&p_host),
                "{name} AdamW={adam_w_mode} step {step}"
            );
        }
        let (sh, sd) = (host.state(), dev.state());
        for ((nh, bh), (_, bd)) in sh.buffers.iter().zip(&sd.buffers) {
            assert_eq!(bits(bd), bits(bh), "{name}: {nh}");
        }
    }
}

#[test]
fn adam_kernel_matches_the_host_adam_f32() {
    adam_steps::<f32>("f32");
}

#[test]
fn adam_kernel_matches_the_host_adam_bf16() {
    adam_steps::<bf16>("bf16");
}

#[test]
fn adam_kernel_matches_the_host_adam_f16() {
    adam_steps::<f16>("f16");
}

/// Parameters materialised from a GPU buffer and gradients staged into one: the same values.
#[test]
fn tensors_and_gpu_buffers_copy_on_the_device() {
    let Some((dev, place)) = gpu() else {
        return;
    };
    let v = values::<bf16>(7, 4099);
    let buf = FlatBuf::from_vec(&place, v.clone()).unwrap();
    let t = tensor_from_buffer(&buf[3..], &dev)
        .unwrap()
        .expect("copied on the GPU");
    assert_eq!(t.to_vec1::<bf16>().unwrap(), v[3..].to_vec());
    let host = vec![bf16::ONE; 4];
    assert!(
        tensor_from_buffer(&host, &dev).unwrap().is_none(),
        "host memory copied on the GPU"
    );

    let a = Tensor::from_slice(&v[..100], (10, 10), &dev).unwrap();
    let b = Tensor::from_slice(&v[100..107], 7, &dev).unwrap();
    let (on_gpu, copied) = with_staged_grads::<bf16, _, ds_engine::EngineError>(&[a, b], |s| {
        Ok((gpu_of(Span::of(s)).is_some(), s.to_vec()))
    })
    .unwrap()
    .expect("staged on the GPU");
    assert!(on_gpu, "the staged gradients are in GPU memory");
    assert_eq!(copied, &v[..107]);
    // the kept buffer serves a smaller layer next: its front only, the new values
    let c = Tensor::from_slice(&v[200..250], 50, &dev).unwrap();
    let again =
        with_staged_grads::<bf16, _, ds_engine::EngineError>(&[c], |s| Ok(s.to_vec())).unwrap();
    assert_eq!(again.expect("staged"), &v[200..250]);
}

/// A GPU buffer streamed to the host in pieces (the offloaded step's gradients) and host
/// values rounded into one piece by piece (its publish), through two page-locked buffers
/// each way: every piece arrives whole, in order, with its own values.
#[test]
fn pieces_stream_between_the_host_and_gpu_buffers() {
    let Some((_dev, place)) = gpu() else {
        return;
    };
    const PIECE: usize = 1 << 20;
    for n in [0, 5, 3 * PIECE + 7] {
        let v = values::<bf16>(9, n);
        let buf = FlatBuf::from_vec(&place, v.clone()).unwrap();
        let (mut seen, mut starts) = (Vec::new(), Vec::new());
        vector::for_each_host_piece(&buf, PIECE, |at, piece| {
            starts.push(at);
            seen.extend_from_slice(piece);
            Ok(())
        })
        .unwrap();
        assert_eq!(bits(&seen), bits(&v), "n={n}: streamed down");
        let want: Vec<usize> = (0..n).step_by(PIECE).collect();
        assert_eq!(starts, want, "n={n}: pieces");
    }
    // past two of the publish's 4M-element pieces: both buffers reused
    for n in [5, 9 * PIECE + 3] {
        let m = pattern(10, n);
        let mut up = FlatBuf::<bf16>::zeroed(&place, n).unwrap();
        vector::convert_into(&mut up, &m).unwrap();
        let want: Vec<bf16> = m.iter().map(|x| bf16::from_f32(*x)).collect();
        assert_eq!(bits(&up), bits(&want), "n={n}: rounded up");
    }
}

/// ZeRO-2's gradient buckets and ZeRO-3's gathered parameters where the shards live, a GPU's
/// (the layout `--dist_backend nccl` gives them), on 2 ranks in threads sharing GPU 0 (the
/// built-in transport then reduces the GPU buffers through their host addresses, where NCCL
/// would reduce them on the device): the reduced gradients and the gathered parameters are
/// the host placement's bits, and every buffer involved was the GPU's.
#[test]
fn zero_2_and_3_buckets_and_gathers_in_gpu_memory_match_the_host() {
    let Some((_dev, gpu_place)) = gpu() else {
        return;
    };
    let on_gpu = Placements {
        params: gpu_place.clone(),
        grads: gpu_place.clone(),
        optimizer: gpu_place,
    };
    for stage in [ZeroStage::Gradients, ZeroStage::Weights] {
        let host = zero_on_two_ranks(stage, Placements::host());
        let gpu = zero_on_two_ranks(stage, on_gpu.clone());
        for (rank, (h, g)) in host.iter().zip(&gpu).enumerate() {
            assert!(g.on_gpu, "{stage:?} rank {rank}: a buffer in host memory");
            assert_eq!(h.grads, g.grads, "{stage:?} rank {rank}: reduced gradients");
            assert_eq!(
                h.params, g.params,
                "{stage:?} rank {rank}: gathered parameters"
            );
        }
    }
}

/// What one rank's stores gave: the bits of its reduced gradients and of parameter ranges
/// asked for, and whether the shard, the gradients and each gathered range were on a GPU.
struct ZeroRun {
    grads: Vec<u32>,
    params: Vec<Vec<u32>>,
    on_gpu: bool,
}

fn zero_on_two_ranks(stage: ZeroStage, places: Placements) -> Vec<ZeroRun> {
    // an odd size: the shards differ in length and a bucket straddles them
    const NUMEL: usize = 100_003;
    let layers = [0..7_000, 7_000..40_000, 40_000..40_001, 40_001..NUMEL];
    let opts = ZeroOptions {
        stage,
        reduce: ReduceConfig {
            bucket_size: 20_000,
            overlap_comm: true,
            // scales before and after the sum: both kernels run on the buckets
            predivide_factor: 4.0,
        },
        allgather_bucket_size: 30_000,
        stage3: Stage3Config {
            prefetch_bucket_size: 70_000,
            max_live_parameters: 200_000,
            param_persistence_threshold: 10,
        },
    };
    run_ranks(2, std::time::Duration::from_secs(120), move |comm| {
        let rank = comm.rank();
        let mut init = |r: std::ops::Range<usize>, dst: &mut [f32]| {
            let v = pattern(11, NUMEL);
            dst.copy_from_slice(&v[r]);
            Ok::<_, PartitionError>(())
        };
        let mut z = Zero::<bf16>::new(NUMEL, opts, comm.world(), &mut init, None, &places)?;
        z.plan_buckets(&layers);
        let on_gpu = |s: &[bf16]| s.is_empty() || gpu_of(Span::of(s)).is_some();
        let mut all_on_gpu = true;
        // two micro-steps: a GPU keeps its last bucket's buffer for the next backward
        for micro in 0..2u64 {
            for (i, r) in layers.iter().enumerate().rev() {
                if let Some(next) = i.checked_sub(1) {
                    z.prefetch(layers[next].clone())?;
                }
                let g = values::<bf16>(20 + 2 * rank as u64 + micro, r.len());
                let (a, b) = g.split_at(g.len() / 3);
                z.add_grad(r.clone(), &[a, b])?;
            }
            z.finish_backward(micro == 1)?;
        }
        all_on_gpu &= on_gpu(z.owned_grads());
        let grads = bits(z.owned_grads());
        let mut params = Vec::new();
        for r in layers.iter().chain([0..NUMEL, 6_990..40_010].iter()) {
            let values = z.params(r.clone())?;
            all_on_gpu &= on_gpu(&values);
            params.push(bits(&values));
        }
        Ok::<_, PartitionError>(ZeroRun {
            grads,
            params,
            on_gpu: all_on_gpu,
        })
    })
    .unwrap_or_else(|e| panic!("{stage:?}: {e}"))
}
