//! The token embedding, split by vocabulary rows under tensor parallelism, with a learned
//! position table added (GPT, GPT-2) or none (the Llama family's rotary positions are in its
//! attention). Token ids [B, T] to activations [B, T, d]; under sequence parallelism the ids
//! are this rank's positions.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use ds_nn::model::{tensor_bytes, Context, Grads, Init, Layer, ParamSpec, Split, Tape, Taped};
use ds_nn::parallel::{vocab, Sp, Tp};

use super::rows;

/// A learned position table: one row per position the model can see.
#[derive(Debug, Clone)]
pub struct Positions {
    pub name: String,
    pub rows: usize,
    pub init: Init,
}

/// A family's embedding: the token table under its name and initialiser, and its positions.
#[derive(Clone)]
pub struct Embedding {
    pub name: String,
    pub init: Init,
    pub vocab: usize,
    pub hidden: usize,
    pub positions: Option<Positions>,
    pub tp: Tp,
    pub sp: Sp,
}

impl Embedding {
    /// The rows of the position table of this rank's positions among `t` (each of sp ranks
    /// holds t).
    fn position_rows(&self, t: usize) -> std::ops::Range<usize> {
        let (pos, offset) = (self.tp.positions(t), self.sp.offset(t));
        pos.start + offset..pos.end + offset
    }

    fn taped(&self, vb: &VarBuilder, ids: &Tensor) -> Result<Taped> {
        let (b, t) = ids.dims2()?;
        let (tp, sp) = (&self.tp, &self.sp);
        if let Some(p) = self.positions.as_ref().filter(|p| t * sp.size() > p.rows) {
            candle_core::bail!(
                "sequence of {} tokens is longer than the model's T = {}",
                t * sp.size(),
                p.rows
            );
        }
        let w = vb.get((self.vocab / tp.size(), self.hidden), &self.name)?;
        let tokens = tp.reduce(&vocab::embed(tp, &w, ids)?.reshape((b, t, self.hidden))?)?;
        let output = match &self.positions {
            None => tokens,
            Some(p) => {
                let rows = self.position_rows(t);
                let table =
                    vb.get((p.rows, self.hidden), &p.name)?
                        .narrow(0, rows.start, rows.len())?;
                tokens.broadcast_add(&table)?
            }
        };
        let tape = EmbeddingTape {
            embedding: self.clone(),
            ids: ids.flatten_all()?,
        };
        Ok(Taped {
            output,
            tape: Box::new(tape),
        })
    }
}

impl Layer for Embedding {
    fn params(&self) -> Vec<ParamSpec> {
        let mut params = vec![
            ParamSpec::new(&self.name, &[self.vocab, self.hidden], self.init).split(Split::dim(0)),
        ];
        if let Some(p) = &self.positions {
            params.push(ParamSpec::new(&p.name, &[p.rows, self.hidden], p.init));
        }
        params
    }

    fn forward(&self, vb: &VarBuilder, ids: &Tensor, _: &Context) -> Result<Tensor> {
        Ok(self.taped(vb, ids)?.output)
    }

    fn forward_taped(&self, vb: &VarBuilder, ids: &Tensor, _: &Context) -> Result<Option<Taped>> {
        self.taped(vb, ids).map(Some)
    }

    /// The lookup is free; adding the positions costs one operation per element.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        match self.positions {
            Some(_) => Some((rows(shape) * self.hidden) as u64),
            None => Some(0),
        }
    }
}

struct EmbeddingTape {
    embedding: Embedding,
    /// The token ids, flattened.
    ids: Tensor,
}

impl Tape for EmbeddingTape {
    fn activation_bytes(&self) -> usize {
        tensor_bytes(&self.ids)
    }

    /// Each token's row of the table gets the gradients at its positions; each position's
    /// row the sum over the batch (under sequence parallelism each rank has its positions').
    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> Result<Grads> {
        let e = &self.embedding;
        let tp = &e.tp;
        let whole = tp.gather(dy)?;
        let (b, t, d) = whole.dims3()?;
        let rows = whole.reshape((b * t, d))?;
        let w = vb.get((e.vocab / tp.size(), d), &e.name)?;
        let mut params = vec![vocab::embed_backward(tp, &w, &self.ids, &rows)?];
        if let Some(p) = &e.positions {
            let pos = e.position_rows(t);
            let dtable = dy.sum(0)?.pad_with_zeros(0, pos.start, p.rows - pos.end)?;
            params.push(tp.sum_partial_grads(vec![dtable])?.remove(0));
        }
        Ok(Grads {
            input: None,
            params,
        })
    }
}
