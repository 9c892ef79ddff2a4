//! One-rank NCCL smoke test through [`NcclComm`] on GPU 0: all_reduce (sum, avg, max),
//! all_gather, reduce_scatter (sum, max), broadcast and barrier, on f32, bf16 and f16, for
//! lengths from 0 to 4 MiB, each result read back to the host and checked element by element
//! against a reference computed here.
//!
//! With one rank a reduction is the identity, and NCCL does nothing at all for an in-place one,
//! so that part only shows the call is accepted. What shows data really moves is the
//! out-of-place collectives: their output starts as a sentinel that no input holds, and sits
//! (like every buffer here) inside guard elements that must stay untouched. Their output is read
//! on the compute stream without waiting on the communicator first, so a wrong result there also
//! catches broken ordering between the comm stream and the compute stream (cudarc's events).
//!
//! Where no GPU is usable (no libcuda, cuInit or the device count fails, no device, no
//! libnccl.so) every test prints why and passes; with `DS_RS_REQUIRE_GPU=1` it fails instead,
//! so a run on a GPU host cannot pass by skipping. Run it with `--nocapture` to see either.
#![cfg(feature = "nccl")]

use std::ffi::CStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use ds_comm::nccl::{NcclComm, NcclElement, NcclError};
use ds_comm::{Element, ReduceOp};
use half::{bf16, f16};

/// Empty (the collectives return at once and must touch nothing), then odd sizes from one
/// element up to 4 MiB of f32, none a multiple of a warp, a page or a ring slice.
const LENS: [usize; 6] = [0, 1, 3, 1_000, 65_537, 1_048_583];
/// Sentinel elements on each side of every device buffer; the collectives work on the view
/// between them, which also starts at an odd offset.
const GUARD: usize = 17;
/// Absent from every input ([`pattern`] stays within ±63.5) and exact in every dtype.
const SENTINEL: f32 = 1000.0;
const TIMEOUT: Duration = Duration::from_secs(120);
const NO_NCCL: &str = "libnccl.so cannot be loaded (pip's nvidia-nccl ships only libnccl.so.2: \
                       link libnccl.so to it in a folder on LD_LIBRARY_PATH)";
/// Tests run on threads; one at a time on the device keeps their communicators apart.
static DEVICE: Mutex<()> = Mutex::new(());

#[test]
fn one_rank_collectives_f32() {
    collectives::<f32>("f32");
}

#[test]
fn one_rank_collectives_bf16() {
    collectives::<bf16>("bf16");
}

#[test]
fn one_rank_collectives_f16() {
    collectives::<f16>("f16");
}

#[test]
fn one_rank_rejects_bad_arguments() {
    let Some(compute) = gpu("bad arguments") else {
        return;
    };
    let _device = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    let comm = one_rank(&compute);
    let input = compute.clone_htod(&pattern::<f32>(0, 7)).unwrap();
    let mut short = compute.clone_htod(&pattern::<f32>(0, 6)).unwrap();
    let failures = [
        comm.all_gather(&input, &mut short),
        comm.reduce_scatter(&input, &mut short, ReduceOp::Sum),
        comm.broadcast(&mut short, 1),
        comm.send(&input, 0),
    ];
    let messages: Vec<String> = failures.map(|r| r.unwrap_err().to_string()).into();
    assert_eq!(
        messages,
        [
            "NCCL all_gather on rank 0: output has length 6, expected 7",
            "NCCL reduce_scatter on rank 0: input has length 7, expected 6",
            "NCCL broadcast on rank 0: invalid root 1 for world size 1",
            "NCCL send on rank 0: invalid peer (self) 0 for world size 1",
        ]
    );
    comm.barrier().unwrap();
    comm.abort();
    let err = comm.all_reduce(&mut short, ReduceOp::Sum).unwrap_err();
    assert!(matches!(err, NcclError::Aborted { .. }), "{err}");
    println!("nccl-smoke bad-arguments: ok: 4 rejections, barrier, abort");
}

fn collectives<T: NcclElement>(dtype: &str) {
    let Some(compute) = gpu(dtype) else {
        return;
    };
    let _device = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    let comm = one_rank(&compute);
    assert_eq!((comm.rank(), comm.size(), comm.ordinal()), (0, 1, 0));
    for (n, &len) in LENS.iter().enumerate() {
        let seed = 16 * n as u64;
        for (k, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
            .into_iter()
            .enumerate()
        {
            all_reduce::<T>(&compute, &comm, seed + k as u64, len, op);
        }
        all_gather::<T>(&compute, &comm, seed + 4, len);
        reduce_scatter::<T>(&compute, &comm, seed + 5, len, ReduceOp::Sum);
        reduce_scatter::<T>(&compute, &comm, seed + 6, len, ReduceOp::Max);
        broadcast::<T>(&compute, &comm, seed + 7, len);
    }
    comm.barrier().unwrap();
    println!(
        "nccl-smoke {dtype}: ok: all_reduce sum/avg/max, all_gather, reduce_scatter sum/max, \
         broadcast, barrier; lengths {LENS:?}"
    );
}

fn all_reduce<T: NcclElement>(
    compute: &Arc<CudaStream>,
    comm: &NcclComm,
    seed: u64,
    len: usize,
    op: ReduceOp,
) {
    let mine = pattern::<T>(seed, len);
    let mut buf = upload(compute, &mine);
    comm.all_reduce(&mut buf.slice_mut(GUARD..GUARD + len), op)
        .unwrap();
    comm.synchronize().unwrap();
    let what = format!("all_reduce {op:?} len {len}");
    check(compute, &buf, &reduce(&[mine], op), &what);
}

fn all_gather<T: NcclElement>(compute: &Arc<CudaStream>, comm: &NcclComm, seed: u64, len: usize) {
    let world = comm.size();
    let all: Vec<Vec<T>> = (0..world)
        .map(|r| pattern(seed + 1000 * r as u64, len))
        .collect();
    let input = upload(compute, &all[comm.rank()]);
    let mut output = upload(compute, &vec![T::from_f32(SENTINEL); world * len]);
    comm.all_gather(
        &input.slice(GUARD..GUARD + len),
        &mut output.slice_mut(GUARD..GUARD + world * len),
    )
    .unwrap();
    // Read on the compute stream with no synchronize first: see the module docs.
    check(
        compute,
        &output,
        &all.concat(),
        &format!("all_gather len {len}"),
    );
    comm.synchronize().unwrap();
}

/// Every rank holds `world * len` values; rank r keeps block r of their reduction.
fn reduce_scatter<T: NcclElement>(
    compute: &Arc<CudaStream>,
    comm: &NcclComm,
    seed: u64,
    len: usize,
    op: ReduceOp,
) {
    let world = comm.size();
    let all: Vec<Vec<T>> = (0..world)
        .map(|r| pattern(seed + 1000 * r as u64, world * len))
        .collect();
    let input = upload(compute, &all[comm.rank()]);
    let mut output = upload(compute, &vec![T::from_f32(SENTINEL); len]);
    comm.reduce_scatter(
        &input.slice(GUARD..GUARD + world * len),
        &mut output.slice_mut(GUARD..GUARD + len),
        op,
    )
    .unwrap();
    let reduced = reduce(&all, op);
    let want = &reduced[comm.rank() * len..][..len];
    check(
        compute,
        &output,
        want,
        &format!("reduce_scatter {op:?} len {len}"),
    );
    comm.synchronize().unwrap();
}

fn broadcast<T: NcclElement>(compute: &Arc<CudaStream>, comm: &NcclComm, seed: u64, len: usize) {
    let root = 0;
    let mine = pattern::<T>(seed + 1000 * comm.rank() as u64, len);
    let roots = pattern::<T>(seed + 1000 * root as u64, len);
    let mut buf = upload(compute, &mine);
    comm.broadcast(&mut buf.slice_mut(GUARD..GUARD + len), root)
        .unwrap();
    comm.synchronize().unwrap();
    check(compute, &buf, &roots, &format!("broadcast len {len}"));
}

/// `--dist_backend nccl` on a rank that computes on the CPU: a clear error, not a crash (no GPU
/// needed; CI runs it).
#[test]
fn nccl_backend_needs_a_gpu() {
    // as `train` builds them: from the rank environment (none here: a job of one)
    let mut opts = ds_comm::options_for(ds_comm::Backend::Nccl).expect("the nccl build takes it");
    assert_eq!(opts.backend, ds_comm::Backend::Nccl);
    opts.gpu = None;
    let e = ds_comm::init(&opts)
        .err()
        .expect("a job on the CPU joined NCCL");
    assert!(e.to_string().contains("--device cuda"), "{e}");
    println!("nccl-smoke backend-needs-gpu: ok");
}

/// `--dist_backend nccl` through ds-comm's groups on one rank: collectives on GPU memory (CUDA
/// managed memory, as ds-partition's GPU buffers) go to NCCL, host memory to the links; with
/// one rank each leaves its buffer as it was, so this checks the path (the bootstrap, the
/// pointer test, the element types, the waits), not the arithmetic.
#[test]
fn group_collectives_on_gpu_memory() {
    let Some(_compute) = gpu("groups") else {
        return;
    };
    let _one = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    let mut opts = ds_comm::InitOptions::new(0, 1, "127.0.0.1", 0);
    opts.backend = ds_comm::Backend::Nccl;
    opts.gpu = Some(0);
    let comm = ds_comm::init(&opts).expect("joining NCCL on GPU 0");
    assert_eq!(comm.backend(), ds_comm::Backend::Nccl);
    let g = comm.world();
    let n = 1_048_583;
    let want = pattern::<bf16>(7, n);
    let bytes = n * std::mem::size_of::<bf16>();
    // SAFETY: a managed allocation of `bytes`, freed below; every element is written first.
    let ptr = unsafe {
        cudarc::driver::result::malloc_managed(
            bytes,
            cudarc::driver::sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL,
        )
    }
    .expect("managed memory");
    // SAFETY: `ptr` holds `n` bf16, host-addressable (managed), owned here until freed.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut bf16, n) };
    buf.copy_from_slice(&want);
    g.all_reduce(buf, ReduceOp::Sum).unwrap();
    g.all_reduce(buf, ReduceOp::Avg).unwrap();
    g.broadcast(buf, 0).unwrap();
    g.all_gather_v(buf, &[n]).unwrap();
    g.reduce_scatter_v(buf, &[n], ReduceOp::Sum).unwrap();
    assert!(
        buf == want.as_slice(),
        "a one-rank collective changed GPU memory"
    );
    let mut host = want.clone();
    g.all_reduce(&mut host, ReduceOp::Max).unwrap();
    assert_eq!(host, want);
    g.barrier().unwrap();
    // SAFETY: allocated above, no longer used.
    unsafe { cudarc::driver::result::free_sync(ptr) }.unwrap();
    println!("nccl-smoke groups: ok");
}

/// The compute stream of GPU 0, or `None` (after saying why) where no GPU is usable.
fn gpu(test: &str) -> Option<Arc<CudaStream>> {
    match probe() {
        Ok(stream) => Some(stream),
        Err(why) if std::env::var_os("DS_RS_REQUIRE_GPU").is_some_and(|v| v == "1") => {
            panic!("DS_RS_REQUIRE_GPU=1 but {why}")
        }
        Err(why) => {
            eprintln!("nccl-smoke {test}: skipped: {why}");
            None
        }
    }
}

fn probe() -> Result<Arc<CudaStream>, String> {
    // cudarc panics on its first call when it cannot open a library, so look first.
    if !loadable(&[c"libcuda.so", c"libcuda.so.1"]) {
        return Err("no CUDA driver library (libcuda.so / libcuda.so.1) can be loaded".into());
    }
    let count = CudaContext::device_count()
        .map_err(|e| format!("cuInit or cuDeviceGetCount failed: {e}"))?;
    if count < 1 {
        return Err("the CUDA driver sees no device".into());
    }
    // cudarc looks for libnccl.so (and libnccl.so.1/.9-.13), never the wheels' libnccl.so.2.
    if !loadable(&[c"libnccl.so"]) {
        return Err(NO_NCCL.into());
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("no context on GPU 0: {e}"))?;
    let name = ctx.name().unwrap_or_else(|e| format!("? ({e})"));
    eprintln!("nccl-smoke: GPU 0 of {count}: {name}");
    Ok(ctx.default_stream())
}

/// Whether the dynamic loader can open one of `names`, as cudarc will.
fn loadable(names: &[&CStr]) -> bool {
    names.iter().any(|name| {
        // SAFETY: `name` is NUL-terminated; a handle that opened is closed again at once.
        unsafe {
            let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            !handle.is_null() && libc::dlclose(handle) == 0
        }
    })
}

/// A one-rank communicator forked from `compute`, as ds-rs forks one from candle's stream.
fn one_rank(compute: &Arc<CudaStream>) -> NcclComm {
    let id = NcclComm::unique_id().unwrap();
    NcclComm::from_stream(compute, &id, 0, 1, TIMEOUT).unwrap()
}

/// `data` on the device between [`GUARD`] sentinels on each side.
fn upload<T: NcclElement>(stream: &Arc<CudaStream>, data: &[T]) -> CudaSlice<T> {
    let guard = [T::from_f32(SENTINEL); GUARD];
    stream
        .clone_htod(&[&guard[..], data, &guard[..]].concat())
        .unwrap()
}

/// Copies `buf` to the host on `stream` and checks it holds `want` between untouched guards.
fn check<T: NcclElement>(stream: &Arc<CudaStream>, buf: &CudaSlice<T>, want: &[T], what: &str) {
    let got = stream.clone_dtoh(buf).unwrap();
    assert_eq!(got.len(), want.len() + 2 * GUARD, "{what}: length");
    let (head, rest) = got.split_at(GUARD);
    let (body, tail) = rest.split_at(want.len());
    for (i, g) in head.iter().chain(tail).enumerate() {
        assert_eq!(g.to_f32(), SENTINEL, "{what}: guard {i} overwritten");
    }
    for (i, (g, w)) in body.iter().zip(want).enumerate() {
        assert!(
            g.to_f32() == w.to_f32(),
            "{what}[{i}]: got {}, want {}",
            g.to_f32(),
            w.to_f32()
        );
    }
}

/// Pseudo-random multiples of 1/4 in [-63.5, 63.5]: at most 8 significant bits, so exact in
/// bf16 and f16, and sums of a few ranks stay exact too.
fn pattern<T: Element>(seed: u64, len: usize) -> Vec<T> {
    (0..len as u64)
        .map(|i| {
            let h = (i ^ (seed << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            T::from_f32(((h % 509) as f32 - 254.0) * 0.25)
        })
        .collect()
}

/// Element-wise reduction of the ranks' contributions, in f64, rounded once to `T`.
fn reduce<T: Element>(contributions: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let len = contributions[0].len();
    (0..len)
        .map(|i| {
            let values = contributions.iter().map(|c| c[i].to_f32() as f64);
            let v = match op {
                ReduceOp::Sum => values.sum(),
                ReduceOp::Avg => values.sum::<f64>() / contributions.len() as f64,
                ReduceOp::Max => values.fold(f64::NEG_INFINITY, f64::max),
            };
            T::from_f32(v as f32)
        })
        .collect()
}
