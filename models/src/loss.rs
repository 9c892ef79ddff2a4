//! The language-modelling losses every family ends with: the mean cross-entropy of the logits
//! against the next tokens, whole or split by vocabulary over the tensor-parallel group.
//!
//! Targets that do not count (`ds_nn::IGNORE`, Hugging Face's -100: instruction data's
//! prompts) are left out: the loss is the mean over the counted targets times the
//! micro-batch's weight (`Targets::weight`, which the data sets so that the step averages
//! over the counted targets of the whole global batch), and their rows get no gradient.
//! With every target counted and a weight of 1, the loss is the plain mean, bit for bit.

use candle_core::{DType, Result, Tensor, D};
use candle_nn::VarBuilder;

use ds_nn::kernels::fused_norm_loss::{
    cross_entropy_and_lse, cross_entropy_backward, cross_entropy_grad, cross_entropy_grad_from_lse,
    cross_entropy_with_probs,
};
use ds_nn::kernels::grad::{linear, linear_backward};
use ds_nn::kernels::nn::cross_entropy;
use ds_nn::kernels::scatter_rows::sum_into_rows;
use ds_nn::model::{tensor_bytes, Context, Grads, Layer, ParamSpec, Tape, Taped};
use ds_nn::parallel::{vocab, Tp};
use ds_nn::Targets;

/// The rows of the loss: the targets [k] of the counted positions among n, and what the mean
/// over them is multiplied by.
struct Rows {
    targets: Tensor,
    /// The counted positions among the n, when not all count.
    at: Option<Tensor>,
    n: usize,
    weight: f64,
}

impl Rows {
    /// The counted rows of `logits` [.., v] as [k, v] (or of any per-position tensor), and
    /// the rows; None when nothing in the micro-batch counts.
    fn of(logits: &Tensor, t: &Targets) -> Result<Option<(Tensor, Rows)>> {
        let v = logits.dim(D::Minus1)?;
        let (logits, targets) = (logits.reshape(((), v))?, t.ids.flatten_all()?);
        let (n, weight) = (targets.elem_count(), f64::from(t.weight));
        Ok(match &t.counted {
            None => Some((
                logits,
                Rows {
                    targets,
                    at: None,
                    n,
                    weight,
                },
            )),
            Some(at) if at.elem_count() == 0 => None,
            Some(at) => Some((
                logits.index_select(at, 0)?,
                Rows {
                    targets: targets.index_select(at, 0)?,
                    at: Some(at.clone()),
                    n,
                    weight,
                },
            )),
        })
    }

    /// The loss times the weight (untouched at weight 1).
    fn weighted(&self, loss: Tensor) -> Result<Tensor> {
        match self.weight == 1.0 {
            true => Ok(loss),
            false => loss.affine(self.weight, 0.0),
        }
    }

    /// The gradient of the selected rows put back among all n (zeros elsewhere).
    fn scatter(&self, d: Tensor) -> Result<Tensor> {
        match &self.at {
            None => Ok(d),
            Some(at) => sum_into_rows(at, &d, self.n),
        }
    }

    /// The backward's scale: the loss seed over the counted rows, times the weight.
    fn scale(&self, seed: f64) -> f64 {
        let k = self.targets.elem_count().max(1) as f64;
        match self.weight == 1.0 {
            true => seed / k,
            false => seed * self.weight / k,
        }
    }
}

/// A loss of 0 with zero gradients: a micro-batch where no target counts.
fn nothing_counts(logits: &Tensor) -> Result<Taped> {
    Ok(Taped {
        output: Tensor::zeros((), DType::F32, logits.device())?,
        tape: Box::new(ZeroTape(logits.zeros_like()?)),
    })
}

struct ZeroTape(Tensor);

impl Tape for ZeroTape {
    fn activation_bytes(&self) -> usize {
        0
    }
    fn backward(self: Box<Self>, _: &Tensor, _: &VarBuilder) -> Result<Grads> {
        Ok(Grads {
            input: Some(self.0),
            params: Vec::new(),
        })
    }
}

/// Note [tiles]: the logits [n, V] and their softmax are the largest activations of a small
/// model at long sequences (V/d times the hidden states). Computed a tile of positions at a
/// time from the normed hidden states and lm_head's weight (DeepSpeed's
/// `TiledFusedLogitsLoss`), the loss keeps only the hidden states; backward computes each
/// tile's logits again, its softmax and its gradients, adding up lm_head's. The MLPs tile the
/// same way (`TiledMLP`): each tile's hidden activations live only while it is computed.
pub struct TiledLoss {
    /// The normed hidden states of the counted positions [k, d], and the rows; None when
    /// nothing counts.
    counted: Option<(Tensor, Rows)>,
    shape: Vec<usize>,
    tile: usize,
}

/// The weighted mean cross-entropy of the logits `h W^T` [.., V] against the targets, computed
/// `tile` positions at a time (Note [tiles]); `h` [.., d] are the normed hidden states, `w`
/// [V, d] lm_head's weight. Returns the loss and what backward reads.
pub fn tiled_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    t: &Targets,
    tile: usize,
) -> Result<(Tensor, TiledLoss)> {
    let shape = h.dims().to_vec();
    let Some((h, rows)) = Rows::of(h, t)? else {
        let loss = Tensor::zeros((), DType::F32, h.device())?;
        let counted = None;
        return Ok((
            loss,
            TiledLoss {
                counted,
                shape,
                tile,
            },
        ));
    };
    // The tiles' sum stays on the device: no host round trip per tile.
    let mut sum = Tensor::zeros((), DType::F32, h.device())?;
    for r in tiles(h.dim(0)?, tile) {
        let logits = linear(&h.narrow(0, r.start, r.len())?, w, None)?;
        let mean = cross_entropy(&logits, &rows.targets.narrow(0, r.start, r.len())?)?;
        sum = (sum + (mean * r.len() as f64)?)?;
    }
    let loss = rows.weighted((sum / h.dim(0)? as f64)?)?;
    let counted = Some((h, rows));
    Ok((
        loss,
        TiledLoss {
            counted,
            shape,
            tile,
        },
    ))
}

impl TiledLoss {
    pub fn bytes(&self) -> usize {
        self.counted
            .as_ref()
            .map_or(0, |(h, r)| tensor_bytes(h) + tensor_bytes(&r.targets))
    }

    /// The gradients of the hidden states [.., d] (zero at positions that do not count) and
    /// of lm_head's weight [V, d], at loss seed `seed`.
    pub fn backward(&self, w: &Tensor, seed: f64) -> Result<(Tensor, Tensor)> {
        let Some((all, r)) = &self.counted else {
            let dh = Tensor::zeros(self.shape.clone(), w.dtype(), w.device())?;
            return Ok((dh, w.zeros_like()?));
        };
        let scale = r.scale(seed);
        let (mut dh, mut dw) = (Vec::new(), w.zeros_like()?);
        for p in tiles(all.dim(0)?, self.tile) {
            let h = all.narrow(0, p.start, p.len())?;
            let targets = r.targets.narrow(0, p.start, p.len())?;
            // the gradient in the logits' dtype, computed in f32 and rounded once
            let logits = linear(&h, w, None)?;
            let dlogits = cross_entropy_grad(&logits, &targets, scale)?;
            let g = linear_backward(&h, w, &dlogits)?;
            dw = (dw + g.dw)?;
            dh.push(g.dx);
        }
        let dh = Tensor::cat(&dh, 0)?;
        Ok((r.scatter(dh)?.reshape(self.shape.clone())?, dw))
    }
}

/// What a model's head keeps of lm_head: its input, the normed positions; or, when the head
/// computes the loss itself in tiles (Note [tiles]), the tiled loss's tape.
pub(crate) enum HeadKept {
    Normed(Tensor),
    Loss(TiledLoss),
}

impl HeadKept {
    /// lm_head over the normed positions `h`: the logits (this rank's vocabulary columns
    /// under tensor parallelism), or with a `tile` the loss against the context's targets.
    pub(crate) fn forward(
        tp: &Tp,
        h: Tensor,
        lm_head: &Tensor,
        cx: &Context,
        tile: Option<usize>,
    ) -> Result<(Tensor, HeadKept)> {
        Ok(match tile {
            Some(tile) => {
                let (loss, tape) = tiled_cross_entropy(&h, lm_head, cx.targets()?, tile)?;
                (loss, HeadKept::Loss(tape))
            }
            None => (linear(&tp.gather(&h)?, lm_head, None)?, HeadKept::Normed(h)),
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        match self {
            HeadKept::Normed(h) => tensor_bytes(h),
            HeadKept::Loss(loss) => loss.bytes(),
        }
    }

    /// The gradients of the normed positions (summed over the tensor-parallel group: lm_head
    /// is column-parallel over the vocabulary) and of lm_head's weight, from `dy`, the
    /// logits' gradient or the loss seed.
    pub(crate) fn backward(
        &self,
        tp: &Tp,
        lm_head: &Tensor,
        dy: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        match self {
            HeadKept::Loss(loss) => {
                let seed = dy.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                loss.backward(lm_head, f64::from(seed))
            }
            HeadKept::Normed(h) => {
                let dy = dy.to_dtype(h.dtype())?;
                let head = linear_backward(&tp.gather(h)?, lm_head, &dy)?;
                Ok((tp.reduce(&head.dx)?, head.dw))
            }
        }
    }
}

/// The ranges of `tile` consecutive rows (the last shorter) that cover `n` rows.
pub fn tiles(n: usize, tile: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let tile = tile.max(1);
    (0..n).step_by(tile).map(move |s| s..(s + tile).min(n))
}

/// Mean cross-entropy of the logits against the next tokens, over the counted positions.
pub struct CrossEntropyLoss;

impl Layer for CrossEntropyLoss {
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    fn forward(&self, _: &VarBuilder, logits: &Tensor, cx: &Context) -> Result<Tensor> {
        match Rows::of(logits, cx.targets()?)? {
            Some((x, r)) => r.weighted(cross_entropy(&x, &r.targets)?),
            None => (logits.sum_all()? * 0.0)?.to_dtype(DType::F32),
        }
    }

    /// Keeps what backward reads (`Kept`): on a GPU the logits and their log-sum-exp, else
    /// the softmax.
    fn forward_taped(
        &self,
        _: &VarBuilder,
        logits: &Tensor,
        cx: &Context,
    ) -> Result<Option<Taped>> {
        let Some((x, rows)) = Rows::of(logits, cx.targets()?)? else {
            return nothing_counts(logits).map(Some);
        };
        let (loss, kept) = match cross_entropy_and_lse(&x, &rows.targets)? {
            Some((loss, lse)) => (loss, Kept::LogitsAndLse(x, lse)),
            None => {
                let (loss, p) = cross_entropy_with_probs(&x.to_dtype(DType::F32)?, &rows.targets)?;
                (loss, Kept::Probs(p))
            }
        };
        let tape = LossTape {
            kept,
            rows,
            shape: logits.dims().to_vec(),
            dtype: logits.dtype(),
        };
        Ok(Some(Taped {
            output: tape.rows.weighted(loss)?,
            tape: Box::new(tape),
        }))
    }
}

struct LossTape {
    kept: Kept,
    rows: Rows,
    shape: Vec<usize>,
    dtype: DType,
}

/// What the loss's backward reads of its forward, by where it runs.
enum Kept {
    /// The softmax of each counted row of logits [k, V] in f32 (the CPU: backward is one pass
    /// and computes no exponential, the CPU's cost).
    Probs(Tensor),
    /// The counted rows of logits [k, V] in their dtype and their log-sum-exp [k] (a GPU,
    /// whose backward is memory-bound: it recomputes the softmax in its one pass, and nothing
    /// [k, V] in f32 is made: 3.3 GB at GPT-2's micro-batch of 16).
    LogitsAndLse(Tensor, Tensor),
}

impl Tape for LossTape {
    fn activation_bytes(&self) -> usize {
        let kept = match &self.kept {
            Kept::Probs(p) => tensor_bytes(p),
            Kept::LogitsAndLse(x, lse) => tensor_bytes(x) + tensor_bytes(lse),
        };
        kept + tensor_bytes(&self.rows.targets)
    }

    /// `dy` is the loss seed (loss scale over accumulation steps); the mean spreads it over
    /// the counted rows.
    fn backward(self: Box<Self>, dy: &Tensor, _: &VarBuilder) -> Result<Grads> {
        let seed = dy.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        let r = &self.rows;
        let d = match &self.kept {
            Kept::Probs(p) => cross_entropy_backward(p, &r.targets, r.scale(seed))?,
            Kept::LogitsAndLse(x, lse) => {
                cross_entropy_grad_from_lse(x, lse, &r.targets, r.scale(seed))?.ok_or_else(
                    || candle_core::Error::Msg("the loss's logits left the GPU".into()),
                )?
            }
        };
        let dlogits = r.scatter(d)?.reshape(self.shape)?.to_dtype(self.dtype)?;
        Ok(Grads {
            input: Some(dlogits),
            params: Vec::new(),
        })
    }
}

/// Mean cross-entropy of logits split by vocabulary over the tensor-parallel group
/// (`vocab::cross_entropy`): every rank gets the whole loss, no rank the whole logits.
pub struct VocabParallelCrossEntropy(pub Tp);

impl VocabParallelCrossEntropy {
    fn taped(&self, logits: &Tensor, cx: &Context) -> Result<Taped> {
        // every tensor-parallel rank has the same targets, so the same rows
        let Some((x, rows)) = Rows::of(logits, cx.targets()?)? else {
            return nothing_counts(logits);
        };
        let (loss, tape) = vocab::cross_entropy(&self.0, &x, &rows.targets)?;
        let tape = VocabLossTape {
            tape,
            rows,
            shape: logits.dims().to_vec(),
            dtype: logits.dtype(),
        };
        Ok(Taped {
            output: tape.rows.weighted(loss)?,
            tape: Box::new(tape),
        })
    }
}

impl Layer for VocabParallelCrossEntropy {
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }

    fn forward(&self, _: &VarBuilder, logits: &Tensor, cx: &Context) -> Result<Tensor> {
        Ok(self.taped(logits, cx)?.output)
    }

    fn forward_taped(
        &self,
        _: &VarBuilder,
        logits: &Tensor,
        cx: &Context,
    ) -> Result<Option<Taped>> {
        self.taped(logits, cx).map(Some)
    }
}

struct VocabLossTape {
    tape: vocab::CrossEntropyTape,
    rows: Rows,
    shape: Vec<usize>,
    dtype: DType,
}

impl Tape for VocabLossTape {
    fn activation_bytes(&self) -> usize {
        self.tape.bytes()
    }

    fn backward(self: Box<Self>, dy: &Tensor, _: &VarBuilder) -> Result<Grads> {
        let seed = dy.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        let d = vocab::cross_entropy_backward(&self.tape, self.rows.scale(seed))?;
        let dlogits = self
            .rows
            .scatter(d)?
            .reshape(self.shape)?
            .to_dtype(self.dtype)?;
        Ok(Grads {
            input: Some(dlogits),
            params: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// [n, v] logits, n = 6, v = 5, from a fixed formula.
    fn logits() -> Tensor {
        let v: Vec<f32> = (0..30)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0)
            .collect();
        Tensor::from_vec(v, (6, 5), &Device::Cpu).unwrap()
    }

    fn targets(ids: [u32; 6], counted: &[u32], weight: f32) -> Targets {
        let at = Tensor::from_vec(counted.to_vec(), counted.len(), &Device::Cpu).unwrap();
        Targets {
            ids: Tensor::from_vec(ids.to_vec(), (1, 6), &Device::Cpu).unwrap(),
            weight,
            counted: Some(at),
        }
    }

    /// The loss and d(loss)/d(logits) through the taped path, seed 1.
    fn loss_and_grad(t: &Targets) -> (f64, Vec<Vec<f32>>) {
        let vb = VarBuilder::zeros(DType::F32, &Device::Cpu);
        let x = logits().reshape((1, 6, 5)).unwrap();
        let taped = CrossEntropyLoss
            .forward_taped(&vb, &x, &Context::of_targets(t))
            .unwrap()
            .unwrap();
        let loss = taped.output.to_scalar::<f32>().unwrap() as f64;
        let one = Tensor::new(1f32, &Device::Cpu).unwrap();
        let g = taped.tape.backward(&one, &vb).unwrap().input.unwrap();
        (loss, g.reshape((6, 5)).unwrap().to_vec2().unwrap())
    }

    /// float64: weight x the mean over the counted rows of -log softmax at the target, and its
    /// gradient (softmax - onehot) x weight / counted on those rows, zero on the others.
    fn reference(ids: [u32; 6], counted: &[usize], weight: f64) -> (f64, Vec<Vec<f64>>) {
        let x: Vec<Vec<f32>> = logits().to_vec2().unwrap();
        let mut grad = vec![vec![0.0; 5]; 6];
        let mut sum = 0.0;
        for &r in counted {
            let row: Vec<f64> = x[r].iter().map(|&v| v as f64).collect();
            let z: f64 = row.iter().map(|v| v.exp()).sum();
            sum += z.ln() - row[ids[r] as usize];
            for (j, g) in grad[r].iter_mut().enumerate() {
                let onehot = if j == ids[r] as usize { 1.0 } else { 0.0 };
                *g = (row[j].exp() / z - onehot) * weight / counted.len() as f64;
            }
        }
        (weight * sum / counted.len() as f64, grad)
    }

    fn close(got: (f64, Vec<Vec<f32>>), want: (f64, Vec<Vec<f64>>)) -> bool {
        let grads = got.1.iter().flatten().zip(want.1.iter().flatten());
        (got.0 - want.0).abs() < 1e-6 && grads.map(|(g, w)| (*g as f64 - w).abs()).all(|d| d < 1e-6)
    }

    /// The tiled loss (tiles of 4 and 2 rows) of hidden states h = the logits and lm_head =
    /// the identity is the float64 reference's loss, its hidden states' gradient the
    /// reference's gradient of the logits, lm_head's that gradient transposed times h.
    #[test]
    fn the_tiled_loss_is_the_reference_in_tiles() {
        let ids = [1, 4, 0, 2, 3, 1];
        let counted = [0u32, 1, 2, 4, 5];
        let t = targets(ids, &counted, 0.5);
        let h = logits().reshape((1, 6, 5)).unwrap();
        let w = Tensor::eye(5, DType::F32, &Device::Cpu).unwrap();
        let (loss, tape) = tiled_cross_entropy(&h, &w, &t, 4).unwrap();
        let (dh, dw) = tape.backward(&w, 1.0).unwrap();
        let got = (
            loss.to_scalar::<f32>().unwrap() as f64,
            dh.reshape((6, 5)).unwrap().to_vec2().unwrap(),
        );
        let want = reference(ids, &[0, 1, 2, 4, 5], 0.5);
        let x: Vec<Vec<f32>> = logits().to_vec2().unwrap();
        let dw: Vec<Vec<f32>> = dw.to_vec2().unwrap();
        for (i, row) in dw.iter().enumerate() {
            for (j, g) in row.iter().enumerate() {
                let w: f64 = (0..6).map(|r| want.1[r][i] * x[r][j] as f64).sum();
                assert!((*g as f64 - w).abs() < 1e-6, "dw[{i}][{j}] {g} vs {w}");
            }
        }
        assert!(close(got, want));
    }

    #[test]
    fn only_counted_targets_move_the_loss() {
        let ids = [1, 4, 0, 2, 3, 1];
        let counted = [1u32, 2, 4];
        let base = loss_and_grad(&targets(ids, &counted, 1.5));
        assert!(close(base.clone(), reference(ids, &[1, 2, 4], 1.5)));
        // a target that does not count, changed: nothing moves
        let mut other = ids;
        other[3] = 0;
        assert_eq!(loss_and_grad(&targets(other, &counted, 1.5)), base);
        // a counted target, changed: the loss moves, as the reference says
        let mut moved = ids;
        moved[2] = 4;
        let got = loss_and_grad(&targets(moved, &counted, 1.5));
        assert_ne!(got.0, base.0);
        assert!(close(got, reference(moved, &[1, 2, 4], 1.5)));
        // nothing counts: zero loss, zero gradient
        let none = loss_and_grad(&targets(ids, &[], 1.0));
        assert_eq!(none.0, 0.0);
        assert!(none.1.iter().flatten().all(|&g| g == 0.0));
    }
}
