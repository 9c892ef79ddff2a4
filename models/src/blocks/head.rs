//! The final norm and the LM head: [B, T, d] to logits [B, T, V/tp], the head split by
//! vocabulary rows under tensor parallelism, tied to the token embedding or not. With a tile
//! size (Note [tiles]) the head ends in the loss: the logits are computed a tile at a time and
//! never whole.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use ds_nn::model::{tensor_bytes, Context, Grads, Init, Layer, ParamSpec, Split, Tape, Taped};
use ds_nn::parallel::Tp;

use super::norm::{Norm, NormKept};
use super::rows;
use crate::loss::HeadKept;

/// The head of a family: its final norm, `lm_head` under the family's name and initialiser.
pub struct Head {
    pub norm: Norm,
    /// `lm_head`'s name ...
    pub name: String,
    /// ... its initialiser ...
    pub init: Init,
    /// ... and the embedding it is tied to (the same values, gradients summed), if any.
    pub tied_to: Option<String>,
    pub vocab: usize,
    pub hidden: usize,
    pub tp: Tp,
    /// Note [tiles]: positions per tile of the logits and the loss.
    pub tile: Option<usize>,
}

struct HeadTape {
    norm: Norm,
    name: String,
    rows: usize,
    hidden: usize,
    tp: Tp,
    x: Tensor,
    kept: NormKept,
    h: HeadKept,
}

impl Head {
    fn taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Taped> {
        let lm_head = vb.get((self.vocab / self.tp.size(), self.hidden), &self.name)?;
        let x = x.contiguous()?;
        let (h, kept) = self.norm.forward(vb, &x)?;
        let (output, h) = HeadKept::forward(&self.tp, h, &lm_head, cx, self.tile)?;
        let tape = HeadTape {
            norm: self.norm.clone(),
            name: self.name.clone(),
            rows: self.vocab / self.tp.size(),
            hidden: self.hidden,
            tp: self.tp.clone(),
            x,
            kept,
            h,
        };
        Ok(Taped {
            output,
            tape: Box::new(tape),
        })
    }
}

impl Layer for Head {
    fn params(&self) -> Vec<ParamSpec> {
        let head =
            ParamSpec::new(&self.name, &[self.vocab, self.hidden], self.init).split(Split::dim(0));
        let mut params = self.norm.params();
        params.push(match &self.tied_to {
            Some(embedding) => head.tied_to(embedding),
            None => head,
        });
        params
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Tensor> {
        Ok(self.taped(vb, x, cx)?.output)
    }

    fn forward_taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Option<Taped>> {
        self.taped(vb, x, cx).map(Some)
    }

    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        Some(2 * (rows(shape) * self.hidden * self.vocab / self.tp.size()) as u64)
    }
}

impl Tape for HeadTape {
    fn activation_bytes(&self) -> usize {
        tensor_bytes(&self.x) + self.kept.bytes() + self.h.bytes()
    }

    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> Result<Grads> {
        let lm_head = vb.get((self.rows, self.hidden), &self.name)?;
        let (dh, dw_head) = self.h.backward(&self.tp, &lm_head, dy)?;
        let (dx, norm) = self.norm.backward(vb, &self.x, &self.kept, &dh)?;
        // the norm's parameters are replicated: their gradients summed over the ranks
        let mut params = self.tp.sum_partial_grads(norm)?;
        params.push(dw_head);
        Ok(Grads {
            input: Some(dx),
            params,
        })
    }
}
