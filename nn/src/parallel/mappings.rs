//! The tensor-parallel group as layers see it, and Megatron's region mappings on tensors.
//! At tp = 1 every mapping is the identity and communicates nothing.
//!
//! Note [gather and reduce]: Megatron-LM's pair of conjugate mappings. `reduce` ends a
//! row-parallel product (its partial sums are added over the group) and is the backward of a
//! column-parallel input; `gather` starts a column-parallel product and is the backward of
//! `reduce`. Without sequence parallelism activations between the products are whole on every
//! rank: `reduce` is an all-reduce and `gather` the identity. With it they are split along the
//! sequence: `reduce` is a reduce-scatter to this rank's positions and `gather` an all-gather,
//! the same bytes as one all-reduce, with the LayerNorms and residuals between them computed
//! on 1/tp of the positions.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};
use ds_comm::{Element, Group, ReduceOp};

use super::TpRank;

/// A layer's tensor-parallel group: given to the layers when the model is built.
#[derive(Clone, Default)]
pub struct Tp {
    group: Option<Group>,
    /// Activations between the parallel products are split along the sequence.
    sequence_parallel: bool,
}

impl Tp {
    /// No tensor parallelism.
    pub fn none() -> Tp {
        Tp::default()
    }

    /// Tensor parallelism over `group` (a group of one is the same as `none`).
    pub fn new(group: Group) -> Tp {
        Tp {
            group: (group.size() > 1).then_some(group),
            sequence_parallel: false,
        }
    }

    /// The same group with activations split along the sequence between the parallel
    /// products (Megatron-LM's sequence parallelism; nothing changes at tp = 1).
    pub fn with_sequence_parallel(mut self, on: bool) -> Tp {
        self.sequence_parallel = on && self.group.is_some();
        self
    }

    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, Group::size)
    }
    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, Group::rank)
    }
    pub fn slice(&self) -> TpRank {
        TpRank {
            rank: self.rank(),
            size: self.size(),
        }
    }

    /// Megatron's `copy_to_tensor_model_parallel_region` for layers differentiated by
    /// candle's autograd: the identity in forward, the sum over the group of the gradient in
    /// backward (the input of column-parallel products).
    pub fn copy_to_region(&self, t: &Tensor) -> Result<Tensor> {
        match self.group {
            None => Ok(t.clone()),
            Some(_) => on_host(t, |h| h.contiguous()?.apply_op1(CopyToRegion(self.clone()))),
        }
    }

    /// Megatron's `reduce_from_tensor_model_parallel_region` for layers differentiated by
    /// candle's autograd: the sum over the group in forward (the output of row-parallel
    /// products), the identity in backward.
    pub fn reduce_from_region(&self, t: &Tensor) -> Result<Tensor> {
        match self.group {
            None => Ok(t.clone()),
            Some(_) => on_host(t, |h| {
                h.contiguous()?.apply_op1(ReduceFromRegion(self.clone()))
            }),
        }
    }

    /// The sum of `t` over the group, whole on every rank.
    pub fn sum(&self, t: &Tensor) -> Result<Tensor> {
        self.all_reduce(t, ReduceOp::Sum)
    }

    /// Partial sums of activations [B, T, ..] added over the group (Note [gather and
    /// reduce]): whole, or under sequence parallelism this rank's positions [B, T/tp, ..].
    pub fn reduce(&self, t: &Tensor) -> Result<Tensor> {
        match (&self.group, self.sequence_parallel) {
            (Some(g), true) => reduce_scatter_sequence(g, t),
            _ => self.sum(t),
        }
    }

    /// Activations [B, T/tp, ..] made whole along the sequence under sequence parallelism;
    /// the identity otherwise (Note [gather and reduce]).
    pub fn gather(&self, t: &Tensor) -> Result<Tensor> {
        match (&self.group, self.sequence_parallel) {
            (Some(g), true) => all_gather_sequence(g, t),
            _ => Ok(t.clone()),
        }
    }

    /// The positions this rank holds of a sequence of `len` under sequence parallelism (all
    /// of them otherwise).
    pub fn positions(&self, len: usize) -> std::ops::Range<usize> {
        match self.sequence_parallel {
            true => {
                let chunk = len / self.size();
                self.rank() * chunk..(self.rank() + 1) * chunk
            }
            false => 0..len,
        }
    }

    /// Gradients of replicated parameters that each rank computed from its own positions
    /// only (sequence parallelism), summed over the group in one all-reduce; unchanged
    /// otherwise.
    pub fn sum_partial_grads(&self, grads: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if !self.sequence_parallel || grads.is_empty() {
            return Ok(grads);
        }
        let flat = grads
            .iter()
            .map(|g| g.flatten_all())
            .collect::<Result<Vec<_>>>()?;
        let summed = self.sum(&Tensor::cat(&flat, 0)?)?;
        let mut at = 0;
        grads
            .iter()
            .map(|g| {
                let n = g.elem_count();
                let part = summed.narrow(0, at, n)?.reshape(g.shape())?;
                at += n;
                Ok(part)
            })
            .collect()
    }

    /// The element-wise maximum of `t` over the group.
    pub fn max(&self, t: &Tensor) -> Result<Tensor> {
        self.all_reduce(t, ReduceOp::Max)
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let Some(group) = &self.group else {
            return Ok(t.clone());
        };
        match t.dtype() {
            DType::F32 => all_reduce_as::<f32>(group, t, op),
            DType::BF16 => all_reduce_as::<half::bf16>(group, t, op),
            DType::F16 => all_reduce_as::<half::f16>(group, t, op),
            d => candle_core::bail!("tensor-parallel all-reduce of {d:?} tensors"),
        }
    }
}

/// `f(t)` computed on the host: a tensor on a GPU goes there and back (two moves candle's
/// autograd differentiates), so the region ops, whose collectives run on host buffers, serve
/// every device.
fn on_host(t: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    match t.device() {
        candle_core::Device::Cpu => f(t),
        dev => f(&t.to_device(&candle_core::Device::Cpu)?)?.to_device(dev),
    }
}

/// `Tp::copy_to_region` as an autograd op.
struct CopyToRegion(Tp);

/// `Tp::reduce_from_region` as an autograd op.
struct ReduceFromRegion(Tp);

impl candle_core::CustomOp1 for CopyToRegion {
    fn name(&self) -> &'static str {
        "tp-copy-to-region"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((contiguous_copy(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        self.0.sum(grad).map(Some)
    }
}

impl candle_core::CustomOp1 for ReduceFromRegion {
    fn name(&self) -> &'static str {
        "tp-reduce-from-region"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let group = self
            .0
            .group
            .as_ref()
            .expect("invariant: made only with a group");
        let sum = |e: ds_comm::CommError| comm_error("all-reduce", e);
        let summed = match contiguous_copy(s, l)? {
            CpuStorage::F32(mut v) => group
                .all_reduce(&mut v, ReduceOp::Sum)
                .map(|_| CpuStorage::F32(v)),
            CpuStorage::BF16(mut v) => group
                .all_reduce(&mut v, ReduceOp::Sum)
                .map(|_| CpuStorage::BF16(v)),
            CpuStorage::F16(mut v) => group
                .all_reduce(&mut v, ReduceOp::Sum)
                .map(|_| CpuStorage::F16(v)),
            _ => unreachable!("contiguous_copy keeps only float storage"),
        };
        Ok((summed.map_err(sum)?, l.shape().clone()))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// The elements of a contiguous layout of `s`, copied.
fn contiguous_copy(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("tensor-parallel region: a contiguous tensor expected");
    };
    Ok(match s {
        CpuStorage::F32(v) => CpuStorage::F32(v[a..b].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[a..b].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[a..b].to_vec()),
        _ => candle_core::bail!("tensor-parallel region: float tensors only"),
    })
}

/// [B, T, ..] partial sums to this rank's summed positions [B, T/tp, ..].
fn reduce_scatter_sequence(group: &Group, t: &Tensor) -> Result<Tensor> {
    let n = group.size();
    let dims = t.dims().to_vec();
    if dims.len() < 2 || !dims[1].is_multiple_of(n) {
        candle_core::bail!(
            "sequence parallelism: a sequence of {:?} positions does not split over {n} ranks",
            dims.get(1)
        );
    }
    let mut split = vec![dims[0], n, dims[1] / n];
    split.extend(&dims[2..]);
    // [B, n, T/n, ..] -> [n, B, T/n, ..]: rank r's positions become the r-th part
    let parts = t.reshape(split)?.transpose(0, 1)?.contiguous()?;
    let mut out_dims = dims.clone();
    out_dims[1] /= n;
    let flat = parts.flatten_all()?;
    let out = match t.dtype() {
        DType::F32 => reduce_scatter_as::<f32>(group, &flat)?,
        DType::BF16 => reduce_scatter_as::<half::bf16>(group, &flat)?,
        DType::F16 => reduce_scatter_as::<half::f16>(group, &flat)?,
        d => candle_core::bail!("tensor-parallel reduce-scatter of {d:?} tensors"),
    };
    out.reshape(out_dims)
}

/// [B, T/tp, ..] from every rank to [B, T, ..].
fn all_gather_sequence(group: &Group, t: &Tensor) -> Result<Tensor> {
    let n = group.size();
    let dims = t.dims().to_vec();
    let flat = t.flatten_all()?;
    let all = match t.dtype() {
        DType::F32 => all_gather_as::<f32>(group, &flat)?,
        DType::BF16 => all_gather_as::<half::bf16>(group, &flat)?,
        DType::F16 => all_gather_as::<half::f16>(group, &flat)?,
        d => candle_core::bail!("tensor-parallel all-gather of {d:?} tensors"),
    };
    let mut stacked = vec![n];
    stacked.extend(&dims);
    let mut whole = dims.clone();
    whole[1] *= n;
    // [n, B, T/n, ..] -> [B, n, T/n, ..] -> [B, T, ..]
    all.reshape(stacked)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape(whole)
}

fn comm_error(what: &str, e: ds_comm::CommError) -> candle_core::Error {
    candle_core::Error::Msg(format!("tensor-parallel {what}: {e}"))
}

fn reduce_scatter_as<T: Element + candle_core::WithDType>(
    group: &Group,
    flat: &Tensor,
) -> Result<Tensor> {
    let input = flat.to_vec1::<T>()?;
    let mut out = vec![T::default(); input.len() / group.size()];
    group
        .reduce_scatter(&input, &mut out, ReduceOp::Sum)
        .map_err(|e| comm_error("reduce-scatter", e))?;
    let n = out.len();
    Tensor::from_vec(out, n, flat.device())
}

fn all_gather_as<T: Element + candle_core::WithDType>(
    group: &Group,
    flat: &Tensor,
) -> Result<Tensor> {
    let input = flat.to_vec1::<T>()?;
    let mut out = vec![T::default(); input.len() * group.size()];
    group
        .all_gather(&input, &mut out)
        .map_err(|e| comm_error("all-gather", e))?;
    let n = out.len();
    Tensor::from_vec(out, n, flat.device())
}

fn all_reduce_as<T: Element + candle_core::WithDType>(
    group: &Group,
    t: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    let mut v = t.flatten_all()?.to_vec1::<T>()?;
    group
        .all_reduce(&mut v, op)
        .map_err(|e| comm_error("all-reduce", e))?;
    Tensor::from_vec(v, t.shape(), t.device())
}
