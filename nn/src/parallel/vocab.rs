//! Vocabulary parallelism: each tensor-parallel rank owns rows [start, start + V/tp) of the
//! token embedding and of the LM head. The embedding looks up the ids it owns (others give
//! zero rows) and sums over the group; the cross-entropy finds each row's maximum and
//! normaliser with two all-reduces, so no rank ever holds the full logits (Megatron-LM's
//! `VocabParallelEmbedding` and `vocab_parallel_cross_entropy`).

use candle_core::{DType, Result, Tensor, D};

use super::Tp;
use crate::kernels::scatter_rows::sum_into_rows;

/// This rank's rows of a vocabulary of `vocab` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabRange {
    pub start: usize,
    pub len: usize,
}

impl VocabRange {
    pub fn new(tp: &Tp, vocab: usize) -> VocabRange {
        let len = vocab / tp.size();
        VocabRange {
            start: tp.rank() * len,
            len,
        }
    }

    /// The ids as local rows (clamped into range, u32 [N]) and a mask [N, 1] in `dtype`: 1
    /// where this rank owns the id.
    pub fn localise(&self, ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let ids = ids.flatten_all()?.to_vec1::<u32>()?;
        let (mut local, mut mask) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        for id in ids {
            let owned = (id as usize).wrapping_sub(self.start) < self.len;
            local.push(if owned { id - self.start as u32 } else { 0 });
            mask.push(if owned { 1f32 } else { 0f32 });
        }
        let n = local.len();
        let dev = &candle_core::Device::Cpu;
        Ok((
            Tensor::from_vec(local, n, dev)?,
            Tensor::from_vec(mask, (n, 1), dev)?.to_dtype(dtype)?,
        ))
    }
}

/// This rank's part of the embedding rows of `ids` [N] from its table `w` [V/tp, d]: the
/// rows of the ids it owns, zero for the others [N, d]. Adding the parts over the group
/// (`Tp::reduce`) gives the rows.
pub fn embed(tp: &Tp, w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if tp.size() == 1 {
        return w.index_select(&ids.flatten_all()?, 0);
    }
    let range = VocabRange::new(tp, w.dim(0)? * tp.size());
    let (local, mask) = range.localise(ids, w.dtype())?;
    let (local, mask) = (local.to_device(w.device())?, mask.to_device(w.device())?);
    w.index_select(&local, 0)?.broadcast_mul(&mask)
}

/// The gradient of this rank's table `w` [V/tp, d] given that of the looked-up rows `dy`
/// [N, d].
pub fn embed_backward(tp: &Tp, w: &Tensor, ids: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let rows = w.dim(0)?;
    if tp.size() == 1 {
        return sum_into_rows(&ids.flatten_all()?, dy, rows);
    }
    let range = VocabRange::new(tp, rows * tp.size());
    let (local, mask) = range.localise(ids, dy.dtype())?;
    let (local, mask) = (local.to_device(dy.device())?, mask.to_device(dy.device())?);
    sum_into_rows(&local, &dy.broadcast_mul(&mask)?, rows)
}

/// What the cross-entropy's backward needs: this rank's softmax columns and targets.
pub struct CrossEntropyTape {
    /// softmax(logits) over the whole vocabulary, this rank's columns [N, V/tp], f32.
    probs: Tensor,
    /// Local target column (clamped) [N, 1] and its mask [N, 1] (1 where this rank owns it).
    targets: Tensor,
    mask: Tensor,
}

impl CrossEntropyTape {
    pub fn bytes(&self) -> usize {
        [&self.probs, &self.targets, &self.mask]
            .into_iter()
            .map(crate::model::tensor_bytes)
            .sum()
    }
}

/// Mean cross-entropy of logits whose columns are split over the group: `logits` [N, V/tp]
/// are this rank's, `targets` [N] the global ids. Two all-reduces: the rows' maximum, then
/// their normaliser together with the target logit.
pub fn cross_entropy(
    tp: &Tp,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, CrossEntropyTape)> {
    let p = pieces(tp, logits, targets, |t| tp.sum(t))?;
    let tape = CrossEntropyTape {
        probs: p.exp.broadcast_div(&p.norm)?,
        targets: p.local,
        mask: p.mask,
    };
    Ok((p.loss, tape))
}

/// The same mean cross-entropy for a model differentiated by candle's autograd (a user's
/// candle-nn head whose output columns are split): made of candle's ops and
/// `Tp::reduce_from_region`, so the gradient reaches this rank's logits [N, V/tp] only, and
/// the identity at tp = 1. `targets` [N] are the global ids (u32).
pub fn vocab_parallel_cross_entropy(tp: &Tp, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(pieces(tp, logits, targets, |t| tp.reduce_from_region(t))?.loss)
}

/// The loss and what its backward reads.
struct Pieces {
    loss: Tensor,
    /// exp(logits - the rows' maximum), this rank's columns, and the rows' sums over all.
    exp: Tensor,
    norm: Tensor,
    /// The local target column (clamped) [N, 1] and 1 where this rank owns it [N, 1].
    local: Tensor,
    mask: Tensor,
}

/// The cross-entropy of this rank's columns `logits`, `sum` adding each row's partial
/// normaliser and target logit over the group.
fn pieces(
    tp: &Tp,
    logits: &Tensor,
    targets: &Tensor,
    sum: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Pieces> {
    let x = logits.to_dtype(DType::F32)?;
    let range = VocabRange::new(tp, x.dim(1)? * tp.size());
    let (local, mask) = range.localise(targets, DType::F32)?;
    let (local, mask) = (
        local.to_device(x.device())?.unsqueeze(1)?,
        mask.to_device(x.device())?,
    );
    // the rows' maximum only keeps exp() in range: it cancels from the loss and its gradient
    let max = tp.max(&x.detach().max_keepdim(D::Minus1)?)?;
    let exp = x.broadcast_sub(&max)?.exp()?;
    let picked = x.gather(&local, 1)?.broadcast_mul(&mask)?;
    let sums = sum(&Tensor::cat(&[&exp.sum_keepdim(D::Minus1)?, &picked], 1)?)?;
    let (norm, target) = (sums.narrow(1, 0, 1)?, sums.narrow(1, 1, 1)?);
    let loss = ((norm.log()? + &max)? - target)?.mean_all()?;
    Ok(Pieces {
        loss,
        exp,
        norm,
        local,
        mask,
    })
}

/// The gradient of this rank's logits: (softmax - one-hot) x `scale` (the loss seed over the
/// rows), f32 [N, V/tp].
pub fn cross_entropy_backward(tape: &CrossEntropyTape, scale: f64) -> Result<Tensor> {
    let onehot = tape.mask.neg()?;
    let d = tape.probs.scatter_add(&tape.targets, &onehot, 1)?;
    d.affine(scale, 0.0)
}
