//! The fused kernels on a GPU (kernels/fused.cu): LayerNorm, tanh-GELU, the causal softmax and
//! the softmax cross-entropy, forward and backward, and the bias gradient's column sum, each
//! the CPU fast path's arithmetic in one pass. This module says which kernels an operation launches, in what order, with which
//! arguments and scratch; `launch` computes the grids; `cuda` runs the calls on candle's CUDA
//! stream (the custom ops' `cuda_fwd`); `emu` runs them on the host for the tests.
//!
//! Note [kernels on the host]: Constraint: CI and most sessions have no GPU, yet a kernel's indexing, its barriers and the
//! launch the engine computes for it are where its bugs live, and a GPU run is 15 scarce
//! minutes. Solution: kernels/emu/cuda_emu.h compiles fused.cu's and flash.cu's source, unchanged, with g++:
//! every CUDA thread of a block is a fiber, `__syncthreads` and the warp shuffles are barriers
//! between them, `__shared__` is a per-OS-thread static, the tensor cores' mma.sync and
//! ldmatrix run in their PTX fragment layout, and cp.async's copies land as late as PTX allows (at the issuing
//! thread's wait; the destination holds NaN bytes until then). The CPU tests (emu.rs) launch the
//! same calls this module makes for a GPU, through the same `Launcher` trait, and compare with
//! the CPU kernels (the host reference). Pros: the kernels' logic, their reductions and the
//! launch arithmetic are tested in CI; a missing barrier shows as a wrong result (threads run
//! one at a time), a barrier some threads skip as a reported deadlock. Cons: nothing about
//! speed, memory coalescing or the GPU's math library (a few ulp from the host's libm) is
//! tested; scripts/gpu-acceptance.sh runs the same comparisons on a GPU (nn/tests/
//! gpu_kernels.rs) for that.

// The calls serve the cuda build (cuda.rs) and the tests (emu.rs): a CPU build uses neither.
#![cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]

pub(crate) mod flash;
pub(crate) mod gemm;
pub mod launch;
pub mod ptx;

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(test)]
mod emu;
#[cfg(test)]
mod flash_emu;
#[cfg(test)]
mod flash_reference;
#[cfg(feature = "cuda")]
pub(crate) mod lt;

use candle_core::{DType, Device, Result};

use launch::Launch;

/// Whether the fused kernels run on `device`: the CPU's always, a GPU's in the cuda build.
pub(crate) fn fused_on(device: &Device) -> bool {
    device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda())
}

/// A kernel argument, as cuLaunchKernel takes it: a device address or a scalar.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    Ptr(u64),
    U32(u32),
    U64(u64),
    F32(f32),
}

/// Where the calls run: a GPU's stream, or the host emulator.
pub(crate) trait Launcher {
    /// What keeps a scratch allocation alive until the kernels that use it have run.
    type Scratch;
    /// `len` f32 of scratch, uninitialised, and its address.
    fn scratch(&self, len: usize) -> Result<(Self::Scratch, u64)>;
    /// Runs `kernel` (its name in fused.cu) on `at` with `args`.
    fn launch(&self, kernel: &str, at: Launch, args: &[Arg]) -> Result<()>;
}

/// A kernel's entry point for storage `dtype`: `NAME_f32`, `NAME_bf16` or `NAME_f16`.
fn name(base: &str, dtype: DType) -> Result<String> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("fused kernel {base}: unsupported dtype {other:?}"),
    };
    Ok(format!("{base}_{suffix}"))
}

/// Launches `base` for `dtype`, unless the grid is empty (CUDA refuses a grid of 0 blocks).
fn run<L: Launcher>(l: &L, base: &str, dtype: DType, at: Launch, args: &[Arg]) -> Result<()> {
    match at.grid {
        0 => Ok(()),
        _ => l.launch(&name(base, dtype)?, at, args),
    }
}

/// `kernel` for `dtype` with a block per row, over `rows` rows of `width`: the addresses
/// `ptrs`, then `scalars`.
fn run_rows<L: Launcher>(
    l: &L,
    kernel: &str,
    dtype: DType,
    (rows, width): (usize, usize),
    ptrs: &[u64],
    scalars: &[Arg],
) -> Result<()> {
    let args: Vec<Arg> = ptrs
        .iter()
        .map(|&p| Arg::Ptr(p))
        .chain(scalars.iter().copied())
        .collect();
    run(l, kernel, dtype, launch::per_row(rows, width)?, &args)
}

/// The address `elements` of `dtype` past `base`.
fn offset(base: u64, elements: usize, dtype: DType) -> u64 {
    base + (elements * dtype.size_in_bytes()) as u64
}

/// Rows of `d` in `x` normalised into `y`: `(x - mean) * rstd * w + b`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm<L: Launcher>(
    l: &L,
    dtype: DType,
    [x, w, b]: [u64; 3],
    y: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let kernels = ["layer_norm_fwd_packs", "layer_norm_fwd"];
    let (kernel, pass) = norm_forward_pass(kernels, dtype, &[x, w, b, y], (rows, d))?;
    let args = [x, w, b, y].map(Arg::Ptr);
    let scalars = [Arg::U32(d as u32), Arg::F32(eps)];
    run(l, kernel, dtype, pass, &[&args[..], &scalars].concat())
}

/// A norm forward's launch, a block a row: `packs`, a Pack a thread held in registers, where
/// the rows of `d` at `addresses` allow it, else `elementwise`.
fn norm_forward_pass(
    [packs, elementwise]: [&'static str; 2],
    dtype: DType,
    addresses: &[u64],
    (rows, d): (usize, usize),
) -> Result<(&'static str, launch::Launch)> {
    let pass = launch::per_row(rows, d)?;
    Ok(
        match row_packs(dtype, addresses, d).and_then(launch::pack_a_thread) {
            Some(block) => (packs, launch::Launch { block, ..pass }),
            None => (elementwise, pass),
        },
    )
}

/// LayerNorm's gradients packed as the CPU kernel packs them: dx (rows x d), dweight (d),
/// dbias (d), all in `dtype`, at `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [x, w, dy]: [u64; 3],
    out: u64,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let kernels = ["layer_norm_bwd_packs", "layer_norm_bwd"];
    let (kernel, r) = norm_backward_pass(kernels, dtype, &[x, w, dy, out], (rows, d), 2 * d)?;
    let (_scratch, partial) = l.scratch(r.scratch)?;
    let (rows32, d32) = (Arg::U32(rows as u32), Arg::U32(d as u32));
    let args = [x, w, dy, out, partial].map(Arg::Ptr);
    run(
        l,
        kernel,
        dtype,
        r.pass,
        &[&args[..], &[rows32, d32, Arg::F32(eps)]].concat(),
    )?;
    let dwdb = offset(out, rows * d, dtype);
    sum_partials(l, dtype, r, partial, dwdb, 2 * d)
}

/// A norm backward's first pass over `rows` rows of `d` (its arrays at `addresses`) with
/// `columns` column sums: `packs`, a Pack a thread with its sums in registers, where the rows
/// allow it, else `elementwise` with the sums in shared memory; and the reduction's launches.
fn norm_backward_pass(
    [packs, elementwise]: [&'static str; 2],
    dtype: DType,
    addresses: &[u64],
    (rows, d): (usize, usize),
    columns: usize,
) -> Result<(&'static str, launch::ColumnReduce)> {
    Ok(
        match row_packs(dtype, addresses, d).and_then(launch::pack_a_thread) {
            Some(block) => {
                let mut r = launch::column_reduce(rows, d, columns)?;
                r.pass.block = block;
                (packs, r)
            }
            None => (elementwise, launch::norm_reduce(rows, d, columns)?),
        },
    )
}

/// The second pass of a column reduction: the `r.pass.grid` scratch rows at `partial` added
/// into `width` elements of `dtype` at `out`.
fn sum_partials<L: Launcher>(
    l: &L,
    dtype: DType,
    r: launch::ColumnReduce,
    partial: u64,
    out: u64,
    width: usize,
) -> Result<()> {
    let args = [
        Arg::Ptr(partial),
        Arg::Ptr(out),
        Arg::U32(r.pass.grid),
        Arg::U32(width as u32),
    ];
    run(l, "sum_partials", dtype, r.sum, &args)
}

/// The column sums of `dy` [rows, k] (a bias gradient) into `out` (k elements of `dtype`).
pub(crate) fn column_sum<L: Launcher>(
    l: &L,
    dtype: DType,
    dy: u64,
    out: u64,
    rows: usize,
    k: usize,
) -> Result<()> {
    // 16 bytes at a time where dy's rows allow it (fused.cu's column_sum_packs)
    let packs = row_packs(dtype, &[dy], k);
    let mut r = launch::column_reduce(rows, k, k)?;
    if let Some(packs) = packs {
        r.pass.block = launch::thread_per_pack(packs);
    }
    let (_scratch, partial) = l.scratch(r.scratch)?;
    let args = [
        Arg::Ptr(dy),
        Arg::Ptr(partial),
        Arg::U32(rows as u32),
        Arg::U32(k as u32),
    ];
    let kernel = match packs {
        Some(_) => "column_sum_packs",
        None => "column_sum_pass",
    };
    run(l, kernel, dtype, r.pass, &args)?;
    sum_partials(l, dtype, r, partial, out, k)
}

/// `out` [rows, width]: row r the sum of `src`'s rows at the positions `order[first[r]..
/// first[r + 1]]` (scatter_rows.rs's grouping of the indices), zero where there are none.
pub(crate) fn sum_rows_by_index<L: Launcher>(
    l: &L,
    dtype: DType,
    [src, order, first]: [u64; 3],
    out: u64,
    (rows, width): (usize, usize),
) -> Result<()> {
    run_rows(
        l,
        "sum_rows_by_index",
        dtype,
        (rows, width),
        &[src, order, first, out],
        &[Arg::U32(width as u32)],
    )
}

/// tanh-GELU of `n` elements at `x` into `y`.
pub(crate) fn gelu<L: Launcher>(l: &L, dtype: DType, x: u64, y: u64, n: usize) -> Result<()> {
    let args = [Arg::Ptr(x), Arg::Ptr(y), Arg::U64(n as u64)];
    run(l, "gelu_fwd", dtype, launch::elementwise(n), &args)
}

/// `dy * gelu'(x)` of `n` elements into `dx`.
pub(crate) fn gelu_backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [x, dy]: [u64; 2],
    dx: u64,
    n: usize,
) -> Result<()> {
    let args = [Arg::Ptr(x), Arg::Ptr(dy), Arg::Ptr(dx), Arg::U64(n as u64)];
    run(l, "gelu_bwd", dtype, launch::elementwise(n), &args)
}

/// The causal softmax of `rows` rows of square [.., t, t] scores times `scale`.
pub(crate) fn causal_softmax<L: Launcher>(
    l: &L,
    dtype: DType,
    x: u64,
    y: u64,
    rows: usize,
    t: usize,
    scale: f32,
) -> Result<()> {
    let scalars = [Arg::U32(t as u32), Arg::F32(scale)];
    run_rows(l, "causal_softmax_fwd", dtype, (rows, t), &[x, y], &scalars)
}

/// A softmax's backward from its output: `scale * y * (dy - sum(dy * y))` per row of `n`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [y, dy]: [u64; 2],
    dx: u64,
    rows: usize,
    n: usize,
    scale: f32,
) -> Result<()> {
    let scalars = [Arg::U32(n as u32), Arg::F32(scale)];
    run_rows(l, "softmax_bwd", dtype, (rows, n), &[y, dy, dx], &scalars)
}

/// The cross-entropy of f32 `logits` [rows, v] against u32 `targets`, packed as the CPU kernel
/// packs it (f32): the rows' softmax (rows x v), then the mean loss (1), at `out`.
pub(crate) fn cross_entropy_probs<L: Launcher>(
    l: &L,
    [logits, targets]: [u64; 2],
    out: u64,
    rows: usize,
    v: usize,
) -> Result<()> {
    let (_scratch, row_loss) = l.scratch(rows.max(1))?;
    let ptrs = [logits, targets, out, row_loss];
    let scalars = [Arg::U32(v as u32)];
    run_rows(
        l,
        "cross_entropy_fwd",
        DType::F32,
        (rows, v),
        &ptrs,
        &scalars,
    )?;
    mean_of_rows(l, row_loss, offset(out, rows * v, DType::F32), rows)
}

/// The mean cross-entropy of f32 `logits` [rows, v] against u32 `targets` into `out` (one f32).
pub(crate) fn cross_entropy<L: Launcher>(
    l: &L,
    inputs: [u64; 2],
    out: u64,
    rows: usize,
    v: usize,
) -> Result<()> {
    let (_scratch, lse) = l.scratch(rows.max(1))?;
    cross_entropy_and_lse(l, DType::F32, inputs, [out, lse], rows, v)
}

/// The mean cross-entropy of `logits` [rows, v] (`dtype`) against u32 `targets` into `mean`
/// (one f32) and each row's log-sum-exp into `lse` (rows f32), one pass over the logits; the
/// gradient then comes from the logits and `lse` (`cross_entropy_grad`).
pub(crate) fn cross_entropy_and_lse<L: Launcher>(
    l: &L,
    dtype: DType,
    [logits, targets]: [u64; 2],
    [mean, lse]: [u64; 2],
    rows: usize,
    v: usize,
) -> Result<()> {
    let (_scratch, row_loss) = l.scratch(rows.max(1))?;
    let ptrs = [logits, targets, row_loss, lse];
    let scalars = [Arg::U32(v as u32)];
    run_rows(l, "cross_entropy_lse", dtype, (rows, v), &ptrs, &scalars)?;
    mean_of_rows(l, row_loss, mean, rows)
}

/// The mean of `rows` f32 row losses at `row_loss` into `mean`.
fn mean_of_rows<L: Launcher>(l: &L, row_loss: u64, mean: u64, rows: usize) -> Result<()> {
    let args = [Arg::Ptr(row_loss), Arg::Ptr(mean), Arg::U32(rows as u32)];
    run(
        l,
        "mean_of_rows",
        DType::F32,
        launch::mean_of_rows(rows),
        &args,
    )
}

/// The cross-entropy's gradient `(softmax(logits) - onehot(targets)) * scale` straight from
/// `logits` [rows, v] into `dlogits`, both `dtype`, the softmax never in memory: from the
/// rows' log-sum-exp at `lse` (`cross_entropy_and_lse`'s), or computed again without it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_grad<L: Launcher>(
    l: &L,
    dtype: DType,
    [logits, targets]: [u64; 2],
    lse: Option<u64>,
    dlogits: u64,
    rows: usize,
    v: usize,
    scale: f32,
) -> Result<()> {
    // a null `lse` tells the kernel to compute it
    let ptrs = [logits, lse.unwrap_or(0), targets, dlogits];
    let scalars = [Arg::U32(v as u32), Arg::F32(scale)];
    run_rows(l, "cross_entropy_grad", dtype, (rows, v), &ptrs, &scalars)
}

/// The cross-entropy's gradient `(probs - onehot(targets)) * scale` from the f32 softmax
/// `probs` [rows, v], into `dlogits` in `dtype`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [probs, targets]: [u64; 2],
    dlogits: u64,
    rows: usize,
    v: usize,
    scale: f32,
) -> Result<()> {
    let ptrs = [probs, targets, dlogits];
    let scalars = [Arg::U32(v as u32), Arg::F32(scale)];
    run_rows(l, "cross_entropy_bwd", dtype, (rows, v), &ptrs, &scalars)
}

/// RMSNorm of rows of `d`: `w * (x * root)` into `y` (`dtype`) and each row's
/// `root = 1 / sqrt(mean(x^2) + eps)` into `roots` (f32), for the backward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm<L: Launcher>(
    l: &L,
    dtype: DType,
    [x, w]: [u64; 2],
    [y, roots]: [u64; 2],
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let kernels = ["rms_norm_fwd_packs", "rms_norm_fwd"];
    let (kernel, pass) = norm_forward_pass(kernels, dtype, &[x, w, y], (rows, d))?;
    let args = [x, w, y, roots].map(Arg::Ptr);
    let scalars = [Arg::U32(d as u32), Arg::F32(eps)];
    run(l, kernel, dtype, pass, &[&args[..], &scalars].concat())
}

/// RMSNorm's gradients from the input, its roots (f32) and `dy`: dx (rows x d) into `dx`,
/// dweight (d) into `dw`, both `dtype`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [x, roots, w, dy]: [u64; 4],
    [dx, dw]: [u64; 2],
    rows: usize,
    d: usize,
) -> Result<()> {
    let kernels = ["rms_norm_bwd_packs", "rms_norm_bwd"];
    let (kernel, r) = norm_backward_pass(kernels, dtype, &[x, w, dy, dx], (rows, d), d)?;
    let (_scratch, partial) = l.scratch(r.scratch)?;
    let args = [x, roots, w, dy, dx, partial].map(Arg::Ptr);
    let scalars = [Arg::U32(rows as u32), Arg::U32(d as u32)];
    run(l, kernel, dtype, r.pass, &[&args[..], &scalars].concat())?;
    sum_partials(l, dtype, r, partial, dw, d)
}

/// `silu(gate) * up` of `n` elements into `y`.
pub(crate) fn swiglu<L: Launcher>(
    l: &L,
    dtype: DType,
    [gate, up]: [u64; 2],
    y: u64,
    n: usize,
) -> Result<()> {
    let args = [
        Arg::Ptr(gate),
        Arg::Ptr(up),
        Arg::Ptr(y),
        Arg::U64(n as u64),
    ];
    let (kernel, items) = match row_packs(dtype, &[gate, up, y], n) {
        Some(packs) => ("swiglu_fwd_packs", packs),
        None => ("swiglu_fwd", n),
    };
    run(l, kernel, dtype, launch::elementwise(items), &args)
}

/// SwiGLU's gradients of `n` elements: dgate then dup, one after the other at `out`.
pub(crate) fn swiglu_backward<L: Launcher>(
    l: &L,
    dtype: DType,
    [gate, up, dy]: [u64; 3],
    out: u64,
    n: usize,
) -> Result<()> {
    let args = [gate, up, dy, out].map(Arg::Ptr);
    let (kernel, items) = match row_packs(dtype, &[gate, up, dy, out], n) {
        Some(packs) => ("swiglu_bwd_packs", packs),
        None => ("swiglu_bwd", n),
    };
    let at = launch::elementwise(items);
    run(
        l,
        kernel,
        dtype,
        at,
        &[&args[..], &[Arg::U64(n as u64)]].concat(),
    )
}

/// The Packs (16 bytes: fused.cu's `Pack`) in rows of `n` elements of `dtype` at each of
/// `addresses`, when the `_packs` kernels may move them so: every address on a 16-byte
/// boundary (candle's allocations are on 256) and `n` a whole number of Packs. None: the
/// element-wise kernels.
fn row_packs(dtype: DType, addresses: &[u64], n: usize) -> Option<usize> {
    let pack = 16 / dtype.size_in_bytes();
    let fits = n.is_multiple_of(pack) && addresses.iter().all(|a| a.is_multiple_of(16));
    fits.then_some(n / pack)
}

/// Rotary embeddings of `n` elements of x [.., t, hd] with tables [t, hd] into `y`; with
/// `transpose`, the backward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rotary<L: Launcher>(
    l: &L,
    dtype: DType,
    [x, cos, sin]: [u64; 3],
    y: u64,
    n: usize,
    (t, hd): (usize, usize),
    transpose: bool,
) -> Result<()> {
    if hd % 2 != 0 || t == 0 {
        candle_core::bail!("rotary: tables of [{t}, {hd}] (the head size must be even)");
    }
    let args = [x, cos, sin, y].map(Arg::Ptr);
    let shape = [t, hd, transpose as usize].map(|v| Arg::U32(v as u32));
    let (kernel, items, count) = match rotary_pairs(dtype, &[x, cos, sin, y], n, hd) {
        Some(pairs) => ("rotary_packs", pairs, Arg::U32(pairs as u32)),
        None => ("rotary", n, Arg::U64(n as u64)),
    };
    let at = launch::elementwise(items);
    run(
        l,
        kernel,
        dtype,
        at,
        &[&args[..], &[count], &shape].concat(),
    )
}

/// The pairs of Packs (one of a row's first half, the one it rotates with in its second) in
/// `n` elements of rows of `hd`, when rotary_packs may take them: every address on a 16-byte
/// boundary, each half row whole Packs, and the pairs' count within u32. None: the
/// element-wise kernel.
fn rotary_pairs(dtype: DType, addresses: &[u64], n: usize, hd: usize) -> Option<usize> {
    let half_packs = row_packs(dtype, addresses, hd / 2)?;
    let pairs = n / hd * half_packs;
    (pairs <= u32::MAX as usize).then_some(pairs)
}
