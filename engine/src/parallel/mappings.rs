//! The tensor-parallel group as layers see it, and Megatron's region mappings on tensors.
//! At tp = 1 every mapping is the identity and communicates nothing.

use candle_core::{DType, Result, Tensor};
use ds_comm::{Element, Group, ReduceOp};

use super::TpRank;

/// A layer's tensor-parallel group: given to the layers when the model is built.
#[derive(Clone, Default)]
pub struct Tp {
    group: Option<Group>,
}

impl Tp {
    /// No tensor parallelism.
    pub fn none() -> Tp {
        Tp { group: None }
    }

    /// Tensor parallelism over `group` (a group of one is the same as `none`).
    pub fn new(group: Group) -> Tp {
        Tp {
            group: (group.size() > 1).then_some(group),
        }
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

    /// Megatron's reduce region: the sum of `t` over the group (a row-parallel output in
    /// forward, a column-parallel input gradient in backward).
    pub fn reduce(&self, t: &Tensor) -> Result<Tensor> {
        self.all_reduce(t, ReduceOp::Sum)
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

fn all_reduce_as<T: Element + candle_core::WithDType>(
    group: &Group,
    t: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    let mut v = t.flatten_all()?.to_vec1::<T>()?;
    group
        .all_reduce(&mut v, op)
        .map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-reduce: {e}")))?;
    Tensor::from_vec(v, t.shape(), t.device())
}
