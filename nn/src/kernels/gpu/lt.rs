//! cuBLASLt's matmuls with their epilogues, on candle's stream (feature `cuda`; gemm.rs
//! describes the products). A linear's product with its bias, or with its bias and GELU
//! keeping the pre-activation, and the input gradient through GELU's derivative: each is one
//! pass over the output where candle's matmul, a broadcast bias kernel and a GELU kernel
//! made three (llm.c's matmuls take the same epilogues).
//!
//! Each call returns None where the epilogues do not apply (another dtype than bf16/f16, a
//! tensor autograd tracks, an unaligned view, a shape cuBLASLt has no algorithm for,
//! DS_RS_MATMUL=candle); the caller then runs candle's ops. A call cuBLASLt refuses turns the
//! epilogues off for the process with a warning, and candle's ops carry on: a faster path
//! that fails must not stop a run that the slower one completes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Result, Shape, Tensor};

use super::cuda;
use super::gemm::{Epilogue, Gemm};
use crate::device::gpu::{stream_key, StreamKey};

/// The environment variable that keeps candle's matmul and separate bias and GELU kernels on
/// a GPU (`candle`): the comparison scripts/gpu-acceptance.sh measures.
pub const MATMUL_ENV: &str = "DS_RS_MATMUL";

/// cuBLASLt's workspace per stream: NVIDIA's recommendation for Hopper (4 MiB before it).
const WORKSPACE: usize = 32 << 20;

/// The alignment every address must have for this path (the algorithms are chosen for it
/// or for more, see `alignment`).
const MIN_ALIGN: u32 = 16;

/// y [rows, out] = x2 [rows, inp] w [out, inp]^T + b.
pub(crate) fn linear(x2: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    let Some((rows, inp, out)) = linear_shape(x2, w, b)? else {
        return Ok(None);
    };
    let g = Gemm::linear(rows, inp, out);
    let outs = run(g, Epilogue::Bias, [w, x2], b, &[(rows, out)])?;
    Ok(outs.map(|mut o| o.remove(0)))
}

/// (f, gelu(f)) with f = x2 w^T + b, each [rows, out].
pub(crate) fn linear_gelu(x2: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    let Some((rows, inp, out)) = linear_shape(x2, w, b)? else {
        return Ok(None);
    };
    let g = Gemm::linear(rows, inp, out);
    let outs = run(g, Epilogue::GeluAuxBias, [w, x2], b, &[(rows, out); 2])?;
    // the epilogue writes D = gelu(f) and the aux f
    Ok(outs.map(|o| {
        let [g, f]: [Tensor; 2] = o.try_into().expect("two outputs");
        (f, g)
    }))
}

/// df [rows, inp] = (dy2 [rows, out] w [out, inp]) * gelu'(f), f [rows, inp] the
/// pre-activation `linear_gelu` kept.
pub(crate) fn input_grad_through_gelu(
    dy2: &Tensor,
    w: &Tensor,
    f: &Tensor,
) -> Result<Option<Tensor>> {
    let ((rows, out), inp) = (dy2.dims2()?, w.dim(1)?);
    if w.dims2()? != (out, inp) || f.dims2()? != (rows, inp) {
        return Ok(None); // candle's ops report the mismatch
    }
    let g = Gemm::input_grad(rows, inp, out);
    let outs = run(g, Epilogue::DGelu, [w, dy2], f, &[(rows, inp)])?;
    Ok(outs.map(|mut o| o.remove(0)))
}

/// (rows, inp, out) of x2 [rows, inp] w [out, inp]^T + b [out]; None where the operands do
/// not fit together (candle's ops then report the mismatch): the descriptors would make
/// cuBLASLt read past them.
fn linear_shape(x2: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<(usize, usize, usize)>> {
    let ((rows, inp), (out, w_inp)) = (x2.dims2()?, w.dims2()?);
    let fits = w_inp == inp && b.dims() == [out];
    Ok(fits.then_some((rows, inp, out)))
}

/// D = op(A) op(B) with `epilogue`, whose vector (the bias) or input matrix (the aux of
/// DGelu) is `side`; the outputs (D, then the aux GeluAuxBias writes) are row-major `shapes`.
fn run(
    g: Gemm,
    epilogue: Epilogue,
    [a, b]: [&Tensor; 2],
    side: &Tensor,
    shapes: &[(usize, usize)],
) -> Result<Option<Vec<Tensor>>> {
    let Some(dtype) = eligible(&[a, b, side]) else {
        return Ok(None);
    };
    let Device::Cuda(dev) = a.device() else {
        return Ok(None);
    };
    if !g.takes(epilogue) {
        return Ok(None);
    }
    match algorithm(dev, dtype, &g, epilogue, MIN_ALIGN) {
        Ok(Some(_)) => launch(dev, dtype, g, epilogue, [a, b, side], shapes),
        Ok(None) => Ok(None),
        Err(e) => refused(e),
    }
}

/// A call cuBLASLt refused (`e`): the epilogues off for the process, with one warning, and
/// None for the caller, whose candle ops carry on.
fn refused<T>(e: candle_core::Error) -> Result<Option<T>> {
    if !OFF.swap(true, Ordering::Relaxed) {
        eprintln!(
            "warning: cuBLASLt's epilogues are off for this run ({e}); candle's matmul, bias \
             and GELU kernels carry on"
        );
    }
    Ok(None)
}

/// `run`'s product on new outputs of `shapes`. Only cuBLASLt's refusal turns the epilogues
/// off; another failure (an allocation, an earlier kernel's error) is the caller's.
fn launch(
    dev: &CudaDevice,
    dtype: DType,
    g: Gemm,
    epilogue: Epilogue,
    inputs: [&Tensor; 3],
    shapes: &[(usize, usize)],
) -> Result<Option<Vec<Tensor>>> {
    let outputs: Vec<(DType, Shape)> = shapes.iter().map(|&s| (dtype, Shape::from(s))).collect();
    let mut refusal = None;
    let outs = cuda::on_tensors(&inputs, &outputs, |_, ins, outs| {
        let (bias, aux) = match epilogue {
            Epilogue::Bias => (ins[2], 0),
            Epilogue::GeluAuxBias => (ins[2], outs[1]),
            Epilogue::DGelu => (0, ins[2]),
        };
        let at = Addresses {
            a: ins[0],
            b: ins[1],
            d: outs[0],
            bias,
            aux,
        };
        // the outputs of a refused call are dropped unread below
        refusal = matmul(dev, dtype, &g, epilogue, &at).err();
        Ok(())
    })?;
    match refusal {
        Some(e) => refused(e),
        None => Ok(outs),
    }
}

/// Set when cuBLASLt refused a call: the epilogues stay off for the process.
static OFF: AtomicBool = AtomicBool::new(false);

/// The dtype of `ts` when the epilogues may take them: all bf16 or all f16 on a GPU, none
/// tracked by autograd, contiguous ones starting on a 16-byte boundary (a strided one is
/// copied to a fresh allocation), DS_RS_MATMUL is not `candle` and no call failed.
fn eligible(ts: &[&Tensor]) -> Option<DType> {
    let dtype = ts[0].dtype();
    let aligned = |t: &Tensor| {
        let bytes = t.layout().start_offset() * dtype.size_in_bytes();
        !t.is_contiguous() || bytes.is_multiple_of(MIN_ALIGN as usize)
    };
    let ok = matches!(dtype, DType::BF16 | DType::F16)
        && ts
            .iter()
            .all(|t| t.dtype() == dtype && t.device().is_cuda() && !t.track_op() && aligned(t))
        && !OFF.load(Ordering::Relaxed)
        && std::env::var(MATMUL_ENV).map_or(true, |v| v != "candle");
    ok.then_some(dtype)
}

/// Where a call's operands are (0: the epilogue has none).
struct Addresses {
    a: u64,
    b: u64,
    d: u64,
    bias: u64,
    aux: u64,
}

impl Addresses {
    /// The largest power of two (at most 256) dividing every address: the alignment the
    /// algorithm may assume.
    fn alignment(&self) -> u32 {
        let all = [self.a, self.b, self.d, self.bias, self.aux];
        let low = all
            .iter()
            .filter(|&&p| p != 0)
            .fold(256u64, |m, &p| m.min(1 << p.trailing_zeros()));
        low as u32
    }
}

/// Runs the product on `dev`'s stream.
fn matmul(dev: &CudaDevice, dtype: DType, g: &Gemm, e: Epilogue, at: &Addresses) -> Result<()> {
    let align = at.alignment();
    let Some(algo) = algorithm(dev, dtype, g, e, align)? else {
        candle_core::bail!("cuBLASLt has no algorithm for {g:?} {e:?} at {align}-byte alignment");
    };
    let h = handle(dev)?;
    let op = Operation::new(g, e, dtype, at.bias, at.aux)?;
    let (alpha, beta) = (1f32, 0f32);
    let stream = dev.cuda_stream();
    let (workspace, _recorded) = h.workspace.device_ptr(&stream);
    // SAFETY: the layouts describe the operands' sizes (gemm.rs), every address is a live
    // allocation of candle's holding them (cuda::on_tensors keeps them until the launch is
    // queued), and the workspace is this stream's.
    unsafe {
        lt::matmul(
            h.raw,
            op.desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            at.a as *const c_void,
            op.a.0,
            at.b as *const c_void,
            op.b.0,
            at.d as *const c_void,
            op.d.0,
            at.d as *mut c_void,
            op.d.0,
            &algo,
            workspace as *mut c_void,
            WORKSPACE,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| lt_error("matmul", e))
}

/// Where a call's work goes: the device's stream (`device::gpu::stream_key`) and the calling
/// thread, since candle's stream, `CU_STREAM_PER_THREAD`, is a different stream in every
/// thread. A workspace shared by two of them would be written by unordered kernels, or by
/// another device's.
type WorkKey = (StreamKey, std::thread::ThreadId);

/// A cuBLASLt handle and its workspace, one per [`WorkKey`].
struct Handle {
    raw: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

// SAFETY: a cuBLASLt handle may be used from any thread; the calls on one stream are ordered.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

fn handle(dev: &CudaDevice) -> Result<Arc<Handle>> {
    static HANDLES: Mutex<Vec<(WorkKey, Arc<Handle>)>> = Mutex::new(Vec::new());
    let key = (stream_key(dev), std::thread::current().id());
    let mut handles = HANDLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, h)) = handles.iter().find(|(k, _)| *k == key) {
        return Ok(h.clone());
    }
    // SAFETY: the workspace is scratch cuBLASLt writes before it reads.
    let workspace = unsafe { dev.alloc::<u8>(WORKSPACE) }?;
    let raw = lt::create_handle().map_err(|e| lt_error("create a handle", e))?;
    let h = Arc::new(Handle { raw, workspace });
    handles.push((key, h.clone()));
    Ok(h)
}

/// What an algorithm is chosen for (on which GPU: the heuristic answers for its model).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    ordinal: usize,
    dtype: DType,
    gemm: Gemm,
    epilogue: Epilogue,
    align: u32,
}

/// cuBLASLt's fastest algorithm by its heuristic for the product at `align`-byte alignment,
/// asked once per shape; None where it has none (the caller then runs candle's ops).
fn algorithm(
    dev: &CudaDevice,
    dtype: DType,
    g: &Gemm,
    e: Epilogue,
    align: u32,
) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
    static ALGOS: OnceLock<Mutex<HashMap<Key, Option<sys::cublasLtMatmulAlgo_t>>>> =
        OnceLock::new();
    let key = Key {
        ordinal: dev.cuda_stream().context().ordinal(),
        dtype,
        gemm: *g,
        epilogue: e,
        align,
    };
    let algos = ALGOS.get_or_init(Default::default);
    if let Some(found) = algos.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(*found);
    }
    let h = handle(dev)?;
    // the heuristic reads the bias and aux addresses only for their alignment
    let placeholder = u64::from(align);
    let op = Operation::new(g, e, dtype, placeholder, placeholder)?;
    let pref = Preference::new(align)?;
    // SAFETY: every descriptor is live until the call returns.
    let found = unsafe {
        lt::get_matmul_algo_heuristic(h.raw, op.desc.0, op.a.0, op.b.0, op.d.0, op.d.0, pref.0)
    };
    let found = match found {
        Ok(r) => Some(r.algo),
        Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => None,
        Err(err) => return Err(lt_error("choose an algorithm", err)),
    };
    algos
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, found);
    Ok(found)
}

/// A matmul's description and its operands' layouts.
struct Operation {
    desc: Desc,
    a: Layout,
    b: Layout,
    d: Layout,
}

impl Operation {
    /// `g` with epilogue `e` in `dtype` (f32 accumulation and scale), its bias and aux at
    /// these addresses where `e` has them.
    fn new(g: &Gemm, e: Epilogue, dtype: DType, bias: u64, aux: u64) -> Result<Operation> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
            .map_err(|e| lt_error("describe a matmul", e))?;
        let desc = Desc(desc);
        desc.set(A::CUBLASLT_MATMUL_DESC_TRANSA, &(g.transa as i32))?;
        desc.set(A::CUBLASLT_MATMUL_DESC_TRANSB, &(g.transb as i32))?;
        desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue(e) as u32))?;
        if e.has_bias() {
            desc.set(A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
        }
        if e.has_aux() {
            desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
            desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(g.ldd as i64))?;
        }
        let ty = match dtype {
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            other => candle_core::bail!("cuBLASLt epilogues: unsupported dtype {other:?}"),
        };
        Ok(Operation {
            desc,
            a: Layout::new(ty, g.a_stored(), g.lda)?,
            b: Layout::new(ty, g.b_stored(), g.ldb)?,
            d: Layout::new(ty, (g.m, g.n), g.ldd)?,
        })
    }
}

fn epilogue(e: Epilogue) -> sys::cublasLtEpilogue_t {
    match e {
        Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
        Epilogue::GeluAuxBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
        Epilogue::DGelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
    }
}

struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn set<T>(&self, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> Result<()> {
        let (at, size) = (value as *const T as *const c_void, std::mem::size_of::<T>());
        // SAFETY: `value` is the attribute's type (cuBLASLt's table), read during the call.
        unsafe { lt::set_matmul_desc_attribute(self.0, attr, at, size) }
            .map_err(|e| lt_error(&format!("set {attr:?}"), e))
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: made by create_matmul_desc, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    /// A column-major matrix of (rows, columns) with leading dimension `ld`.
    fn new(ty: sys::cudaDataType, (rows, cols): (usize, usize), ld: usize) -> Result<Layout> {
        lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
            .map(Layout)
            .map_err(|e| lt_error("describe a matrix", e))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: made by create_matrix_layout, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    /// Algorithms that fit the workspace and need no more than `align`-byte alignment.
    fn new(align: u32) -> Result<Preference> {
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let p = Preference(lt::create_matmul_pref().map_err(|e| lt_error("preference", e))?);
        p.set(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(WORKSPACE as u64),
        )?;
        for a in [
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            p.set(a, &align)?;
        }
        Ok(p)
    }

    fn set<T>(&self, attr: sys::cublasLtMatmulPreferenceAttributes_t, value: &T) -> Result<()> {
        let (at, size) = (value as *const T as *const c_void, std::mem::size_of::<T>());
        // SAFETY: `value` is the attribute's type (cuBLASLt's table), read during the call.
        unsafe { lt::set_matmul_pref_attribute(self.0, attr, at, size) }
            .map_err(|e| lt_error(&format!("set {attr:?}"), e))
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: made by create_matmul_pref, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

fn lt_error(what: &str, e: lt::CublasError) -> candle_core::Error {
    candle_core::Error::Msg(format!("cuBLASLt: {what}: {e}"))
}
