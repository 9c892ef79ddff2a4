//! Adam's step as one kernel (kernels/adam.cu) when the master shard, its moments and the
//! gradients all lie in one GPU's buffers (ds-partition's `gpu::one_gpu`): the host loop's
//! arithmetic element for element, with the same per-step scalars.

use ds_partition::gpu::{arg, device_ptr, one_gpu, suffix, Span};

use super::adam::Consts;
use super::{OptimError, TypedGrads};

/// kernels/adam.cu as PTX (build.rs runs nvcc).
const ADAM_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adam.ptx"));

/// The step over the whole shard `p` with moments `m`, `v` and gradients `g` (times `k`):
/// Ok(false) when they are not all in one GPU's memory.
pub(super) fn adam(
    p: &mut [f32],
    g: TypedGrads<'_>,
    m: &mut [f32],
    v: &mut [f32],
    k: f32,
    consts: Consts,
) -> Result<bool, OptimError> {
    let spans = [Span::of(p), Span::of(g.bytes), Span::of(m), Span::of(v)];
    let Some(gpu) = one_gpu(&spans) else {
        return Ok(false);
    };
    assert!(
        g.len() == p.len() && m.len() == p.len() && v.len() == p.len(),
        "Adam on the GPU: the shard, its moments and gradients differ in length"
    );
    let device = |e: ds_partition::PartitionError| OptimError::Device(e.to_string());
    let kernels = gpu.kernels("adam", ADAM_PTX).map_err(device)?;
    let name = format!("adam_{}", suffix(g.dtype));
    let (mut pp, mut gp, mut mp, mut vp) = (
        device_ptr(p),
        device_ptr(g.bytes),
        device_ptr(m),
        device_ptr(v),
    );
    let (mut k, mut consts, mut n) = (k, consts, p.len() as u64);
    let mut args = [
        arg(&mut pp),
        arg(&mut gp),
        arg(&mut mp),
        arg(&mut vp),
        arg(&mut k),
        arg(&mut consts),
        arg(&mut n),
    ];
    // SAFETY: the arguments are adam_*'s parameters in order; the four buffers are `n`
    // elements of GPU memory (`one_gpu`, the lengths asserted above).
    unsafe { kernels.launch(&gpu, &name, p.len(), &mut args) }.map_err(device)?;
    Ok(true)
}
