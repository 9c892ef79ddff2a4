//! The GPT's transformer block: pre-LayerNorm, the shared attention (fused q|k|v) and MLP
//! (tanh GELU) or a mixture of experts, under the peer benchmark's parameter names.

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

use super::{GptConfig, GptVariant, WEIGHT_INIT};
use crate::blocks::{
    Activation, Attention, AttentionKept, AttentionWeights, Gelu, Linear, MlpGrads, MlpKept,
    MlpWeights, Projection,
};
use crate::moe::{in_order, MoeLayer, MoeTape};
use ds_nn::kernels::fused_norm_loss::layer_norm_backward;
use ds_nn::kernels::grad::bias_backward;
use ds_nn::kernels::nn::layer_norm;
use ds_nn::model::{tensor_bytes, Context, Grads, Init, Layer, ParamSpec, Split, Tape, Taped};
use ds_nn::parallel::{Sp, Tp};

/// One pre-LayerNorm transformer block. Under tensor parallelism (Megatron-LM's block):
/// q|k|v and the MLP's first linear are column-parallel (each rank owns whole heads and
/// 4d/tp of the MLP width), the two output projections row-parallel; LayerNorms and the
/// projections' biases are replicated. In an MoE GPT's expert blocks a mixture of experts
/// (`moe`, DeepSpeed-MoE's layer) takes the MLP's place, on ln_2's whole tokens.
pub(super) struct Block {
    pub(super) c: GptConfig,
    pub(super) tp: Tp,
    pub(super) sp: Sp,
    /// Note [tiles]: the MLP `tile` positions at a time.
    pub(super) tile: Option<usize>,
    pub(super) v: GptVariant,
    pub(super) moe: Option<MoeLayer>,
}

/// The attention half's parameters, in declaration order.
struct BlockParams {
    ln_1: (Tensor, Tensor),
    attn: AttentionWeights,
    ln_2: (Tensor, Tensor),
}

impl BlockParams {
    /// This rank's slices: the local shapes of `Block::params` at degree `tp`.
    fn new(vb: &VarBuilder, d: usize, tp: usize) -> Result<BlockParams> {
        let ln = |n: &str| -> Result<(Tensor, Tensor)> {
            Ok((
                vb.get(d, &format!("{n}.weight"))?,
                vb.get(d, &format!("{n}.bias"))?,
            ))
        };
        let linear = |n: &str, out: usize, inp: usize| -> Result<Linear> {
            let (w, b) = linear_params(vb, n, out, inp)?;
            Ok(Linear { w, b: Some(b) })
        };
        Ok(BlockParams {
            ln_1: ln("ln_1")?,
            attn: AttentionWeights {
                qkv: Projection::Fused(linear("attn.c_attn", 3 * d / tp, d)?),
                qk_norm: None,
                o: linear("attn.c_proj", d, d / tp)?,
            },
            ln_2: ln("ln_2")?,
        })
    }
}

/// A linear's (weight [out, inp], bias [out]).
fn linear_params(vb: &VarBuilder, n: &str, out: usize, inp: usize) -> Result<(Tensor, Tensor)> {
    Ok((
        vb.get((out, inp), &format!("{n}.weight"))?,
        vb.get(out, &format!("{n}.bias"))?,
    ))
}

/// The dense MLP's c_fc and c_proj, this rank's slices.
fn mlp_params(vb: &VarBuilder, d: usize, mlp: usize) -> Result<MlpWeights> {
    let linear = |n: &str, out: usize, inp: usize| -> Result<Linear> {
        let (w, b) = linear_params(vb, n, out, inp)?;
        Ok(Linear { w, b: Some(b) })
    };
    Ok(MlpWeights {
        gate: None,
        up: linear("mlp.c_fc", mlp, d)?,
        down: linear("mlp.c_proj", d, mlp)?,
    })
}

/// The MLP's activation: PyTorch's tanh GELU, as the peer benchmark's model.
const ACTIVATION: Activation = Activation::Gelu(Gelu::Tanh);

/// What a block's backward reads: the activations of its forward.
struct BlockTape {
    c: GptConfig,
    v: GptVariant,
    tp: Tp,
    sp: Sp,
    moe: Option<MoeLayer>,
    x: Tensor,
    h1: Tensor,
    attn: AttentionKept,
    x2: Tensor,
    h2: Tensor,
    mlp: MlpTape,
}

/// The MLP's pre-activation and its GELU, or nothing of a tiled MLP (Note [tiles]: computed
/// again in backward), or the mixture's tape.
enum MlpTape {
    Dense(MlpKept),
    Tiled(usize),
    Moe(MoeTape),
}

impl Block {
    fn taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Taped> {
        let (c, tp, v) = (self.c, &self.tp, self.v);
        let p = BlockParams::new(vb, c.hidden, tp.size())?;
        let x = x.contiguous()?;
        // Note [gather and reduce]: x, h1, x2, h2 and the output are this rank's positions
        // under sequence parallelism, whole otherwise
        let h1 = layer_norm(&x, &p.ln_1.0, &p.ln_1.1, v.ln_eps)?;
        let (attn_out, attn) = attention(&c, tp, &self.sp).forward(&p.attn, &h1)?;
        let x2 = (&x + attn_out)?;
        let h2 = layer_norm(&x2, &p.ln_2.0, &p.ln_2.1, v.ln_eps)?;
        let whole = tp.gather(&h2)?;
        let (branch, mlp) = match &self.moe {
            Some(moe) => {
                let xs = whole.reshape(((), c.hidden))?;
                let (out, aux, tape) = moe.run(&vb.pp("mlp"), &xs, cx.evaluating())?;
                cx.add_loss(aux)?;
                (tp.reduce(&out.reshape(whole.shape())?)?, MlpTape::Moe(tape))
            }
            None => {
                let w = mlp_params(vb, c.hidden, v.mlp / tp.size())?;
                match self.tile {
                    Some(tile) => {
                        let out = ACTIVATION.tiled_forward(tp, &w, &whole, tile)?;
                        (out, MlpTape::Tiled(tile))
                    }
                    None => {
                        let (out, kept) = ACTIVATION.forward_rows(tp, &w, &whole)?;
                        (out, MlpTape::Dense(kept))
                    }
                }
            }
        };
        let output = (&x2 + branch)?;
        let tape = BlockTape {
            c,
            v,
            tp: tp.clone(),
            sp: self.sp.clone(),
            moe: self.moe.clone(),
            x,
            h1,
            attn,
            x2,
            h2,
            mlp,
        };
        Ok(Taped {
            output,
            tape: Box::new(tape),
        })
    }

    /// The attention half's and the MLP's specs; `mlp.`'s mixture in an expert block.
    fn mlp_specs(&self, matrix: impl Fn(String, &[usize]) -> ParamSpec) -> Vec<ParamSpec> {
        let (d, m) = (self.c.hidden, self.v.mlp);
        match &self.moe {
            Some(moe) => moe
                .specs()
                .into_iter()
                .map(|mut p| {
                    p.name = format!("mlp.{}", p.name);
                    p
                })
                .collect(),
            None => [
                column(&matrix, "mlp.c_fc", m, d, 1),
                row(&matrix, "mlp.c_proj", d, m),
            ]
            .concat(),
        }
    }
}

/// A column-parallel linear's specs: weight and bias split by output rows (in `blocks`
/// blocks: q, k and v each by heads).
fn column(
    matrix: &impl Fn(String, &[usize]) -> ParamSpec,
    n: &str,
    out: usize,
    d: usize,
    blocks: usize,
) -> [ParamSpec; 2] {
    let split = Split::Dim { dim: 0, blocks };
    [
        matrix(format!("{n}.weight"), &[out, d]).split(split),
        ParamSpec::new(&format!("{n}.bias"), &[out], Init::Zeros).split(split),
    ]
}

/// A row-parallel linear's specs: weight split by input columns, bias replicated.
fn row(
    matrix: &impl Fn(String, &[usize]) -> ParamSpec,
    n: &str,
    d: usize,
    inp: usize,
) -> [ParamSpec; 2] {
    [
        matrix(format!("{n}.weight"), &[d, inp]).split(Split::dim(1)),
        ParamSpec::new(&format!("{n}.bias"), &[d], Init::Zeros),
    ]
}

impl Layer for Block {
    fn params(&self) -> Vec<ParamSpec> {
        let d = self.c.hidden;
        // GPT-2's Conv1D keeps its weights as [in, out] in Hugging Face's files
        let hf = self.v.hf_names;
        let matrix = move |name: String, shape: &[usize]| {
            let p = ParamSpec::new(&name, shape, WEIGHT_INIT);
            match hf {
                true => p.stored_transposed(),
                false => p,
            }
        };
        let ln = |n: &str| {
            [
                ParamSpec::new(&format!("{n}.weight"), &[d], Init::Ones).norm(),
                ParamSpec::new(&format!("{n}.bias"), &[d], Init::Zeros).norm(),
            ]
        };
        let attention = [
            ln("ln_1"),
            column(&matrix, "attn.c_attn", 3 * d, d, 3),
            row(&matrix, "attn.c_proj", d, d),
            ln("ln_2"),
        ]
        .concat();
        [attention, self.mlp_specs(matrix)].concat()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Tensor> {
        Ok(self.taped(vb, x, cx)?.output)
    }

    fn forward_taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Option<Taped>> {
        self.taped(vb, x, cx).map(Some)
    }

    /// The matrix products, as DeepSpeed's profiler counts them: q|k|v, attention projection
    /// and MLP (12 d^2 multiply-adds per token), plus scores and their weighted sum over the
    /// sequence (2 T d per token); a mixture's router and routes instead of the MLP.
    /// Normalisation and activations are left out.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        let (d, seq) = (
            self.c.hidden as u64,
            (*shape.get(1)? * self.sp.size()) as u64,
        );
        let (tp, m) = (self.tp.size() as u64, self.v.mlp as u64);
        let attention = 2 * rows(shape) as u64 * (4 * d * d + 2 * seq * d) / tp;
        let mlp = match &self.moe {
            Some(moe) => moe.flops(rows(shape)),
            None => 2 * rows(shape) as u64 * 2 * d * m / tp,
        };
        Some(attention + mlp)
    }
}

impl Tape for BlockTape {
    fn activation_bytes(&self) -> usize {
        let mlp = match &self.mlp {
            MlpTape::Dense(kept) => kept.bytes(),
            MlpTape::Tiled(_) => 0,
            MlpTape::Moe(t) => t.activation_bytes(),
        };
        [&self.x, &self.h1, &self.x2, &self.h2]
            .into_iter()
            .map(tensor_bytes)
            .sum::<usize>()
            + self.attn.bytes()
            + mlp
    }

    fn seed_added_loss(&mut self, seed: f64) {
        if let MlpTape::Moe(t) = &mut self.mlp {
            t.seed(seed);
        }
    }

    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> Result<Grads> {
        let p = BlockParams::new(vb, self.c.hidden, self.tp.size())?;
        let BlockTape {
            c,
            v,
            tp,
            sp,
            moe,
            x,
            h1,
            attn,
            x2,
            h2,
            mlp,
        } = *self;
        // the MLP branch: y = x2 + mlp(ln_2(x2))
        let (dh2, mlp_grads, proj_bias) = match (mlp, &moe) {
            (MlpTape::Dense(kept), _) => {
                let run = |w: &MlpWeights, h: &Tensor, dout: &Tensor| {
                    ACTIVATION.backward(w, h, Some(kept), dout)
                };
                dense_mlp_backward(vb, &c, &v, &tp, &h2, dy, run)?
            }
            (MlpTape::Tiled(tile), _) => {
                let run = |w: &MlpWeights, h: &Tensor, dout: &Tensor| {
                    ACTIVATION.tiled_backward(w, h, dout, tile)
                };
                dense_mlp_backward(vb, &c, &v, &tp, &h2, dy, run)?
            }
            (MlpTape::Moe(t), Some(moe)) => {
                let whole = tp.gather(dy)?;
                let g = moe.backward_parts(&vb.pp("mlp"), t, &whole.reshape(((), c.hidden))?)?;
                // the experts' input gradients are partial sums, the router's whole
                let pos = tp.positions(whole.dim(1)?);
                let router = g.dx_router.reshape(whole.shape())?;
                let dh2 = (tp.reduce(&g.dx_experts.reshape(whole.shape())?)?
                    + router.narrow(1, pos.start, pos.len())?)?;
                let names: Vec<String> = moe.specs().into_iter().map(|p| p.name).collect();
                (dh2, in_order(g.params, &names)?, None)
            }
            (MlpTape::Moe(_), None) => {
                unreachable!("invariant: an MoE tape comes from an MoE block")
            }
        };
        let (dx2_ln, dln_2w, dln_2b) =
            layer_norm_backward(&x2, &p.ln_2.0, &p.ln_2.1, &dh2, v.ln_eps)?;
        let dx2 = (dy + dx2_ln)?;
        // the attention branch: x2 = x + c_proj(attention(ln_1(x)))
        let a = attention(&c, &tp, &sp).backward(&p.attn, attn, &h1, &dx2)?;
        let (dx_ln, dln_1w, dln_1b) =
            layer_norm_backward(&x, &p.ln_1.0, &p.ln_1.1, &a.dx, v.ln_eps)?;
        let Some(dproj_bias) = a.o_bias else {
            unreachable!("invariant: c_proj has a bias")
        };
        let (dqkv_w, dqkv_b) = a.qkv.into_iter().next().expect("invariant: c_attn's");
        let dqkv_b = dqkv_b.expect("invariant: c_attn has a bias");
        // the replicated parameters' gradients, from this rank's positions under sequence
        // parallelism: summed over the group
        let mut partial = vec![dln_1w, dln_1b, dproj_bias, dln_2w, dln_2b];
        partial.extend(proj_bias);
        let mut partial = tp.sum_partial_grads(partial)?.into_iter();
        let mut next = || {
            partial
                .next()
                .expect("invariant: as many gradients out as in")
        };
        let mut params = vec![
            next(),
            next(),
            dqkv_w,
            dqkv_b,
            a.o_weight,
            next(),
            next(),
            next(),
        ];
        params.extend(mlp_grads);
        if moe.is_none() {
            params.push(next());
        }
        Ok(Grads {
            input: Some((&dx2 + dx_ln)?),
            params,
        })
    }
}

/// The dense MLP's backward (`run`, from its weights, gathered input and output gradient)
/// from its input `h2` and output gradient `dy` (this rank's positions): the gradient of its
/// input, of its weights and biases in declaration order, and c_proj's bias.
fn dense_mlp_backward(
    vb: &VarBuilder,
    c: &GptConfig,
    v: &GptVariant,
    tp: &Tp,
    h2: &Tensor,
    dy: &Tensor,
    run: impl FnOnce(&MlpWeights, &Tensor, &Tensor) -> Result<MlpGrads>,
) -> Result<(Tensor, Vec<Tensor>, Option<Tensor>)> {
    let w = mlp_params(vb, c.hidden, v.mlp / tp.size())?;
    let g = run(&w, &tp.gather(h2)?, &tp.gather(dy)?)?;
    let proj_bias = match &w.down.b {
        Some(b) => bias_backward(dy, b)?,
        None => unreachable!("invariant: c_proj has a bias"),
    };
    // a column-parallel input's gradient: the sum of every rank's part
    Ok((tp.reduce(&g.dx)?, g.declared(), Some(proj_bias)))
}

/// The block's attention: GPT's fused q|k|v projection, `c.heads` heads split over `tp`.
fn attention(c: &GptConfig, tp: &Tp, sp: &Sp) -> Attention {
    let heads = c.heads / tp.size();
    Attention {
        heads,
        kv_heads: heads,
        head_dim: c.hidden / c.heads,
        kv_copies: 1,
        rope: None,
        norm_eps: 0.0,
        window: None,
        tp: tp.clone(),
        sp: sp.clone(),
    }
}

/// Token positions in an input of `shape` ([B, T] ids or [B, T, d] activations).
fn rows(shape: &[usize]) -> usize {
    shape.iter().take(2).product()
}
