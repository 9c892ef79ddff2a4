//! The built-in GPT: exactly the model of the peer benchmark (../shared/bench/gpt.py), with
//! its parameter names, so ds-rs and PyTorch/DeepSpeed train the same function from the same
//! weights. Pre-LayerNorm blocks, fused q|k|v projection, causal attention, tanh-GELU MLP,
//! untied lm_head, mean cross-entropy.
//!
//! Why long: the block's attention and MLP with their written-out backward live here until
//! they join the shared blocks (blocks/) that the embedding, norms and head already use.

use std::path::Path;

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use serde::Deserialize;

use crate::blocks::{
    Activation, Embedding, Gelu, Head, Linear, MlpGrads, MlpKept, MlpWeights, Norm, Positions,
};
use crate::gpt_moe::GptMoe;
use crate::loss::{CrossEntropyLoss, VocabParallelCrossEntropy};
use crate::moe::{in_order, MoeLayer, MoeTape};

use ds_nn::kernels::fused_norm_loss::layer_norm_backward;
use ds_nn::kernels::grad::{bias_backward, linear, linear_backward};
use ds_nn::kernels::nn::layer_norm;
use ds_nn::kernels::ops::{causal_softmax, causal_softmax_backward};
use ds_nn::kernels::{cpu_attention, flash_attention};
use ds_nn::model::{
    tensor_bytes, Context, Grads, Init, Layer, Model, ParamSpec, Split, Tape, Taped,
};
use ds_nn::parallel::{row_parallel_linear, Parallel, Sp, Tp};

const LN_EPS: f64 = 1e-5;
const WEIGHT_INIT: Init = Init::Normal {
    mean: 0.0,
    std: 0.02,
};

/// The architecture's sizes. A model JSON names them as the peer benchmark's README does
/// (`{"V", "T", "d", "H", "L"}`); the long names are accepted too.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Vocabulary size (`V`).
    #[serde(rename = "V", alias = "vocab_size")]
    pub vocab_size: usize,
    /// Positions: the sequence length it trains at, the position table's rows (`T`).
    #[serde(rename = "T", alias = "seq_len")]
    pub seq_len: usize,
    /// Model width (`d`).
    #[serde(rename = "d", alias = "hidden")]
    pub hidden: usize,
    /// Attention heads (`H`).
    #[serde(rename = "H", alias = "heads")]
    pub heads: usize,
    /// Blocks (`L`).
    #[serde(rename = "L", alias = "layers")]
    pub layers: usize,
    /// The LM head reads the token embedding (`lm_head.weight` tied to `wte.weight`); the
    /// peer's model, and the default, is untied.
    #[serde(default)]
    pub tie_embeddings: bool,
    /// A mixture of experts in every `expert_interval`-th block (DeepSpeed-MoE's GPT).
    #[serde(default)]
    pub moe: Option<GptMoe>,
}

/// What differs between the peer's GPT and Hugging Face's GPT-2 (`GPT2LMHeadModel`) of the
/// same sizes: the MLP's width (GPT-2's `n_inner`), LayerNorm's epsilon, and the parameter
/// names (GPT-2's under `transformer.`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptVariant {
    pub mlp: usize,
    pub ln_eps: f64,
    pub hf_names: bool,
}

impl GptVariant {
    /// The peer benchmark's GPT: 4d, 1e-5, its own names.
    pub fn peer(c: &GptConfig) -> GptVariant {
        GptVariant {
            mlp: 4 * c.hidden,
            ln_eps: LN_EPS,
            hf_names: false,
        }
    }

    /// A name under GPT-2's `transformer.` module when the variant uses its names.
    fn module(&self, name: &str) -> String {
        match self.hf_names {
            true => format!("transformer.{name}"),
            false => name.to_string(),
        }
    }
}

/// The presets of ../shared/bench/gpt.py, and the tiny one with DeepSpeed-MoE's experts (8,
/// top-1, every other block).
pub const PRESETS: [(&str, GptConfig); 4] = [
    (
        "tiny",
        GptConfig {
            vocab_size: 4096,
            seq_len: 128,
            hidden: 256,
            heads: 4,
            layers: 4,
            tie_embeddings: false,
            moe: None,
        },
    ),
    (
        "small",
        GptConfig {
            vocab_size: 8192,
            seq_len: 256,
            hidden: 512,
            heads: 8,
            layers: 6,
            tie_embeddings: false,
            moe: None,
        },
    ),
    (
        "gpt2",
        GptConfig {
            vocab_size: 50304,
            seq_len: 1024,
            hidden: 768,
            heads: 12,
            layers: 12,
            tie_embeddings: false,
            moe: None,
        },
    ),
    (
        "gpt-moe-tiny",
        GptConfig {
            vocab_size: 4096,
            seq_len: 128,
            hidden: 256,
            heads: 4,
            layers: 4,
            tie_embeddings: false,
            moe: Some(GptMoe::top1(8)),
        },
    ),
];

impl GptConfig {
    pub fn preset(name: &str) -> Option<GptConfig> {
        PRESETS.iter().find(|(n, _)| *n == name).map(|(_, c)| *c)
    }

    /// A model JSON: `{"V": .., "T": .., "d": .., "H": .., "L": ..}`.
    pub fn from_json_file(path: &Path) -> ds_nn::Result<GptConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| ds_nn::NnError::file(path, e))?;
        let cfg: GptConfig =
            serde_json::from_str(&text).map_err(|e| ds_nn::NnError::file(path, e))?;
        cfg.validate().map_err(|e| ds_nn::NnError::file(path, e))?;
        Ok(cfg)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        let sizes = [
            self.vocab_size,
            self.seq_len,
            self.hidden,
            self.heads,
            self.layers,
        ];
        if sizes.contains(&0) {
            return Err(format!("every size must be positive, got {self:?}"));
        }
        let (d, h) = (self.hidden, self.heads);
        if d % h != 0 {
            return Err(format!("d ({d}) must be a multiple of H ({h})"));
        }
        match &self.moe {
            Some(moe) => moe.validate(),
            None => Ok(()),
        }
    }

    /// Parameter count: embeddings, L blocks of 12d^2 + 13d, final LayerNorm, lm_head
    /// (once: a tied head is the embedding).
    pub fn n_params(&self) -> usize {
        self.n_params_of(&GptVariant::peer(self))
    }

    /// The parameter count with `v`'s MLP width m: blocks of 4d^2 + 2dm + 9d + m, and the
    /// mixtures' experts and routers.
    pub fn n_params_of(&self, v: &GptVariant) -> usize {
        let experts = self.moe.map_or(0, |moe| {
            moe.moe_blocks(self.layers) * moe.extra_params(self.hidden, v.mlp)
        });
        self.dense_params(v) + experts
    }

    fn dense_params(&self, v: &GptVariant) -> usize {
        let (vocab, positions, d, m) = (self.vocab_size, self.seq_len, self.hidden, v.mlp);
        let head = if self.tie_embeddings { 0 } else { vocab * d };
        let block = 4 * d * d + 2 * d * m + 9 * d + m;
        vocab * d + positions * d + self.layers * block + 2 * d + head
    }

    /// The parameters one token meets: a mixture's router and its k experts, not all.
    pub fn active_params_of(&self, v: &GptVariant) -> usize {
        let experts = self.moe.map_or(0, |moe| {
            moe.moe_blocks(self.layers) * moe.extra_active_params(self.hidden, v.mlp)
        });
        self.dense_params(v) + experts
    }

    /// Model FLOPs per trained token (forward + backward): 6 per active parameter for the
    /// matrix products plus 12 L T d for attention's scores and weighted sums (the PaLM
    /// paper's count).
    pub fn flops_per_token(&self) -> f64 {
        self.flops_per_token_of(&GptVariant::peer(self))
    }

    pub fn flops_per_token_of(&self, v: &GptVariant) -> f64 {
        6.0 * self.active_params_of(v) as f64
            + 12.0 * (self.layers * self.seq_len * self.hidden) as f64
    }

    /// The model as layers: embeddings, the blocks, ln_f + lm_head, the loss.
    pub fn build(&self) -> Model {
        self.build_parallel(&Tp::none())
            .expect("invariant: tp = 1 divides every size")
    }

    /// Whether tensor parallelism of degree `tp` can split this model (Megatron's scheme:
    /// whole heads per rank, the MLP width and the vocabulary in equal parts); the error
    /// names the numbers.
    pub fn check_tp(&self, tp: usize) -> std::result::Result<(), String> {
        self.check_tp_of(tp, &GptVariant::peer(self))
    }

    pub fn check_tp_of(&self, tp: usize, v: &GptVariant) -> std::result::Result<(), String> {
        crate::check_tp_divides(
            tp,
            &[
                ("heads H", self.heads),
                ("MLP width", v.mlp),
                ("vocabulary V", self.vocab_size),
            ],
        )
    }

    /// Whether expert parallelism of size `ep` splits the mixtures' experts evenly.
    pub fn check_ep(&self, ep: usize) -> std::result::Result<(), String> {
        match (&self.moe, ep) {
            (_, 1) => Ok(()),
            (None, _) => Err(format!("expert-parallel size {ep}: the GPT has no experts")),
            (Some(moe), _) => crate::moe::check_ep_divides(moe.num_experts, ep),
        }
    }

    /// The model with its layers split over the tensor-parallel group `tp`: column-parallel
    /// q|k|v and MLP input, row-parallel projections, vocabulary-parallel embedding, LM head
    /// and cross-entropy. Names, shapes and initial values stay those of the logical model.
    pub fn build_parallel(&self, tp: &Tp) -> std::result::Result<Model, String> {
        self.build_variant(tp, &GptVariant::peer(self))
    }

    /// The model of variant `v` (Hugging Face's GPT-2 with its names, MLP width and epsilon).
    pub fn build_variant(&self, tp: &Tp, v: &GptVariant) -> std::result::Result<Model, String> {
        self.build_with(&Parallel::tensor(tp.clone()), v)
    }

    /// Whether sequence parallelism of size `sp` (Ulysses) can split this model at tensor
    /// parallelism `tp`: each rank's heads split again over sp, and no mixture (its capacity
    /// and load-balancing loss count the tokens of one rank).
    pub fn check_sp(&self, sp: usize, tp: usize) -> std::result::Result<(), String> {
        if sp == 1 {
            return Ok(());
        }
        if self.moe.is_some() {
            return Err(format!(
                "sequence-parallel size {sp}: the MoE GPT's experts do not combine with sequence parallelism"
            ));
        }
        crate::check_sp_divides(sp, tp, &[("heads H", self.heads)])
    }

    /// The final LayerNorm and lm_head (tied to wte with `tie_embeddings`).
    fn head(&self, v: &GptVariant, tp: &Tp, tile: Option<usize>) -> Head {
        Head {
            norm: Norm::Layer {
                weight: v.module("ln_f.weight"),
                bias: v.module("ln_f.bias"),
                hidden: self.hidden,
                eps: v.ln_eps,
            },
            name: "lm_head.weight".into(),
            init: WEIGHT_INIT,
            tied_to: self.tie_embeddings.then(|| v.module("wte.weight")),
            vocab: self.vocab_size,
            hidden: self.hidden,
            tp: tp.clone(),
            tile,
        }
    }

    /// The model of variant `v` in layout `p`: its layers split over `p.tp`, its mixtures'
    /// experts over `p.ep`, its sequences over `p.sp`.
    pub fn build_with(&self, p: &Parallel, v: &GptVariant) -> std::result::Result<Model, String> {
        let (tp, ep) = (&p.tp, &p.ep);
        self.check_tp_of(tp.size(), v)?;
        self.check_ep(ep.size())?;
        self.check_sp(p.sp.size(), tp.size())?;
        crate::check_tile(p.tile, tp.size())?;
        let top = if v.hf_names { "transformer" } else { "" };
        let embeddings = Embedding {
            name: "wte.weight".into(),
            init: WEIGHT_INIT,
            vocab: self.vocab_size,
            hidden: self.hidden,
            positions: Some(Positions {
                name: "wpe.weight".into(),
                rows: self.seq_len,
                init: WEIGHT_INIT,
            }),
            tp: tp.clone(),
            sp: p.sp.clone(),
        };
        let mut m = Model::new().layer(top, embeddings);
        let mut elsewhere = Vec::new();
        for i in 0..self.layers {
            let moe = match self.moe.filter(|moe| moe.holds_experts(i)) {
                Some(moe) => Some(moe.layer(self.hidden, v.mlp, tp, ep)?),
                None => None,
            };
            let prefix = v.module(&format!("h.{i}"));
            if let Some(moe) = &moe {
                elsewhere.extend(moe.held_elsewhere(&format!("{prefix}.mlp")));
            }
            let block = Block {
                c: *self,
                tp: tp.clone(),
                sp: p.sp.clone(),
                tile: p.tile,
                v: *v,
                moe,
            };
            m = m.layer(&prefix, block);
        }
        let m = m
            .layer("", self.head(v, tp, p.tile))
            .held_elsewhere(elsewhere);
        // a tiled head computes the loss itself
        Ok(match (tp.size(), p.tile) {
            (_, Some(_)) => m,
            (1, None) => m.layer("", CrossEntropyLoss),
            _ => m.layer("", VocabParallelCrossEntropy(tp.clone())),
        })
    }
}

/// One pre-LayerNorm transformer block. Under tensor parallelism (Megatron-LM's block):
/// q|k|v and the MLP's first linear are column-parallel (each rank owns whole heads and
/// 4d/tp of the MLP width), the two output projections row-parallel; LayerNorms and the
/// projections' biases are replicated. In an MoE GPT's expert blocks a mixture of experts
/// (`moe`, DeepSpeed-MoE's layer) takes the MLP's place, on ln_2's whole tokens.
struct Block {
    c: GptConfig,
    tp: Tp,
    sp: Sp,
    /// Note [tiles]: the MLP `tile` positions at a time.
    tile: Option<usize>,
    v: GptVariant,
    moe: Option<MoeLayer>,
}

/// The attention half's parameters, each a (weight, bias) pair, in declaration order.
struct BlockParams {
    ln_1: (Tensor, Tensor),
    c_attn: (Tensor, Tensor),
    attn_proj: (Tensor, Tensor),
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
        Ok(BlockParams {
            ln_1: ln("ln_1")?,
            c_attn: linear_params(vb, "attn.c_attn", 3 * d / tp, d)?,
            attn_proj: linear_params(vb, "attn.c_proj", d, d / tp)?,
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
    attn: Attention,
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
        let attn = Attention::forward(c.heads / tp.size(), &tp.gather(&h1)?, &p.c_attn, &self.sp)?;
        let x2 = (&x + row_parallel_linear(tp, &attn.out, &p.attn_proj.0, &p.attn_proj.1)?)?;
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
        let a = &self.attn;
        let mlp = match &self.mlp {
            MlpTape::Dense(kept) => kept.bytes(),
            MlpTape::Tiled(_) => 0,
            MlpTape::Moe(t) => t.activation_bytes(),
        };
        [&self.x, &self.h1, &a.qkv, &a.out, &self.x2, &self.h2]
            .into_iter()
            .map(tensor_bytes)
            .sum::<usize>()
            + a.heads_out.as_ref().map_or(0, tensor_bytes)
            + a.softmax_bytes()
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
        let aproj = linear_backward(&attn.out, &p.attn_proj.0, &tp.gather(&dx2)?)?;
        let dqkv = attn.backward(c.heads / tp.size(), &aproj.dx, &sp)?;
        let qkv = linear_backward(&tp.gather(&h1)?, &p.c_attn.0, &dqkv)?;
        let dh1 = tp.reduce(&qkv.dx)?;
        let (dx_ln, dln_1w, dln_1b) =
            layer_norm_backward(&x, &p.ln_1.0, &p.ln_1.1, &dh1, v.ln_eps)?;
        // the replicated parameters' gradients, from this rank's positions under sequence
        // parallelism: summed over the group
        let mut partial = vec![
            dln_1w,
            dln_1b,
            bias_backward(&dx2, &p.attn_proj.1)?,
            dln_2w,
            dln_2b,
        ];
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
            qkv.dw,
            bias_backward(&dqkv, &p.c_attn.1)?,
            aproj.dw,
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

/// Causal self-attention with the fused q|k|v projection, and what its backward reads.
/// Under sequence parallelism (Note [ulysses]) the projections hold this rank's positions
/// of all its heads, attention itself whole sequences of a part of them.
struct Attention {
    /// The fused projection's output [B, T, 3d], q, k and v side by side: attention's input
    /// (whole sequences, this rank's part of the heads under sequence parallelism).
    qkv: Tensor,
    softmax: Softmax,
    /// The heads' outputs side by side [B, T, d], before the output projection (this
    /// rank's positions).
    out: Tensor,
    /// Under sequence parallelism, attention's own output: whole sequences, the rank's part
    /// of the heads.
    heads_out: Option<Tensor>,
}

/// What attention's backward reads of its softmax: the probabilities [B, H, T, T], or for
/// sequences of `cpu_flash_attention::MIN_SEQ` and more on the CPU, and always on a GPU in bf16
/// or f16 (`flash_attention::wanted`), each row's log-sum-exp [B, H, T] (the probabilities
/// recomputed in blocks: memory linear in T).
enum Softmax {
    Probs(Tensor),
    LogSumExp(Tensor),
}

impl Attention {
    /// `h` heads (this rank's, under tensor parallelism) of `x`'s q|k|v projection, their
    /// sequences split over `sp`.
    fn forward(h: usize, x: &Tensor, c_attn: &(Tensor, Tensor), sp: &Sp) -> Result<Attention> {
        let qkv = linear(x, &c_attn.0, Some(&c_attn.1))?;
        if sp.size() == 1 {
            return Attention::whole(h, qkv);
        }
        let (b, t, d3) = qkv.dims3()?;
        let hd = d3 / 3 / h;
        let n = h / sp.size();
        let qkv = sp.to_heads(&qkv.reshape((b, t, 3, h, hd))?)?;
        let whole_t = qkv.dim(1)?;
        let mut a = Attention::whole(n, qkv.reshape((b, whole_t, 3 * n * hd))?)?;
        let heads_out = a.out.reshape((b, whole_t, 1, n, hd))?;
        a.out = sp.to_sequence(&heads_out)?.reshape((b, t, h * hd))?;
        a.heads_out = Some(heads_out.reshape((b, whole_t, n * hd))?);
        Ok(a)
    }

    /// `h` heads of whole sequences' q|k|v [B, T, 3 h hd].
    fn whole(h: usize, qkv: Tensor) -> Result<Attention> {
        let (b, t, d3) = qkv.dims3()?;
        let d = d3 / 3;
        let hd = d / h;
        let s = scale(hd) as f32;
        if flash_attention::wanted(t, qkv.device(), qkv.dtype()) {
            if let Some((out, lse)) = flash_attention::forward(&qkv, h, s)? {
                let softmax = Softmax::LogSumExp(lse);
                return Ok(Attention::of(qkv, softmax, out));
            }
        }
        if let Some((probs, out)) = cpu_attention::forward(&qkv, h, s)? {
            let softmax = Softmax::Probs(probs);
            return Ok(Attention::of(qkv, softmax, out));
        }
        let (q, k, v) = heads(h, &qkv)?;
        let probs = causal_softmax(&q.matmul(&k.t()?)?, scale(hd))?;
        let out = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        let softmax = Softmax::Probs(probs);
        Ok(Attention::of(qkv, softmax, out))
    }

    fn of(qkv: Tensor, softmax: Softmax, out: Tensor) -> Attention {
        Attention {
            qkv,
            softmax,
            out,
            heads_out: None,
        }
    }

    /// Bytes of what backward reads besides the projection and the output.
    fn softmax_bytes(&self) -> usize {
        match &self.softmax {
            Softmax::Probs(p) | Softmax::LogSumExp(p) => tensor_bytes(p),
        }
    }

    /// The gradient of the q|k|v projection's output [B, T, 3d] from that of `out`, through
    /// the exchanges of the forward under sequence parallelism.
    fn backward(&self, h: usize, dout: &Tensor, sp: &Sp) -> Result<Tensor> {
        let Some(heads_out) = &self.heads_out else {
            return self.core_backward(h, &self.out, dout);
        };
        let (b, t, d) = dout.dims3()?;
        let (hd, n) = (d / h, h / sp.size());
        let dheads = sp.to_heads(&dout.reshape((b, t, 1, h, hd))?)?;
        let whole_t = dheads.dim(1)?;
        let dheads = dheads.reshape((b, whole_t, n * hd))?;
        let dqkv = self.core_backward(n, heads_out, &dheads)?;
        let dqkv = sp.to_sequence(&dqkv.reshape((b, whole_t, 3, n, hd))?)?;
        dqkv.reshape((b, t, 3 * d))
    }

    /// The gradient of attention's input [B, T, 3d] from that of its output `out`.
    fn core_backward(&self, h: usize, out: &Tensor, dout: &Tensor) -> Result<Tensor> {
        let (b, t, d) = dout.dims3()?;
        let hd = d / h;
        let s = scale(hd) as f32;
        let probs = match &self.softmax {
            Softmax::LogSumExp(lse) => {
                return flash_attention::backward(&self.qkv, out, lse, dout, h, s)?.ok_or_else(
                    || {
                        candle_core::Error::Msg(
                            "attention: the blockwise backward declined the forward it ran".into(),
                        )
                    },
                )
            }
            Softmax::Probs(p) => p,
        };
        if let Some(dqkv) = cpu_attention::backward(&self.qkv, probs, dout, h, s)? {
            return Ok(dqkv);
        }
        let (q, k, v) = heads(h, &self.qkv)?;
        let dheads = dout.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous()?;
        let dprobs = dheads.matmul(&v.t()?)?;
        let dv = probs.t()?.matmul(&dheads)?;
        let dscores = causal_softmax_backward(probs, &dprobs, scale(hd))?;
        let dq = dscores.matmul(&k)?;
        let dk = dscores.t()?.matmul(&q)?;
        // [3, b, H, t, hd] back to [b, t, 3, H, hd]
        Tensor::stack(&[dq, dk, dv], 0)?
            .permute((1, 3, 0, 2, 4))?
            .contiguous()?
            .reshape((b, t, 3 * d))
    }
}

/// q, k and v [B, H, T, hd] of the fused projection's output [B, T, 3d]: one copy into
/// [3, B, H, T, hd], of which they are views.
fn heads(h: usize, qkv: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, d3) = qkv.dims3()?;
    let hd = d3 / 3 / h;
    let heads = qkv
        .reshape((b, t, 3, h, hd))?
        .permute((2, 0, 3, 1, 4))?
        .contiguous()?;
    Ok((heads.get(0)?, heads.get(1)?, heads.get(2)?))
}

/// The scores' scale, 1/sqrt(head size).
fn scale(hd: usize) -> f64 {
    1.0 / (hd as f64).sqrt()
}

/// Token positions in an input of `shape` ([B, T] ids or [B, T, d] activations).
fn rows(shape: &[usize]) -> usize {
    shape.iter().take(2).product()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_peer_benchmark() {
        // figures printed by `python ../shared/bench/gpt.py` (README's preset table)
        assert_eq!(GptConfig::preset("tiny").unwrap().n_params(), 5_289_472);
        assert_eq!(GptConfig::preset("small").unwrap().n_params(), 27_435_008);
        for (_, c) in PRESETS {
            let declared: usize = c.build().params().iter().map(|p| p.numel()).sum();
            assert_eq!(declared, c.n_params());
        }
    }

    /// A model JSON names the sizes as the peer benchmark does, or by their long names.
    #[test]
    fn a_model_json_reads_either_spelling() {
        let short: GptConfig =
            serde_json::from_str(r#"{"V": 64, "T": 16, "d": 32, "H": 4, "L": 2}"#).unwrap();
        let long: GptConfig = serde_json::from_str(
            r#"{"vocab_size": 64, "seq_len": 16, "hidden": 32, "heads": 4, "layers": 2}"#,
        )
        .unwrap();
        assert_eq!(short, long);
        assert_eq!((short.vocab_size, short.seq_len), (64, 16));
        assert_eq!((short.hidden, short.heads, short.layers), (32, 4, 2));
    }

    #[test]
    fn names_follow_the_pytorch_state_dict() {
        let names: Vec<String> = GptConfig::preset("tiny")
            .unwrap()
            .build()
            .params()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names[0], "wte.weight");
        assert_eq!(names[2], "h.0.ln_1.weight");
        assert!(names.contains(&"h.3.mlp.c_proj.bias".to_string()));
        assert_eq!(names.last().unwrap(), "lm_head.weight");
        assert_eq!(names.len(), 2 + 4 * 12 + 3);
    }

    /// From `cpu_flash_attention::MIN_SEQ` positions the blocks' attention keeps no
    /// probabilities and differentiates blockwise: its backward against candle's autograd of
    /// the attention that holds them, at and beyond a whole number of blocks.
    #[test]
    fn long_sequences_take_the_blockwise_attention() {
        let t = ds_nn::kernels::cpu_flash_attention::MIN_SEQ;
        let c = GptConfig {
            vocab_size: 24,
            seq_len: t + 40,
            hidden: 16,
            heads: 2,
            layers: 1,
            tie_embeddings: false,
            moe: None,
        };
        for len in [t, t + 40] {
            crate::taped_check::check_layers(
                &c.build(),
                (1, len),
                c.hidden,
                c.vocab_size,
                "long GPT",
            );
        }
    }

    /// A top-1 expert block's FLOPs are a dense block's and the router's (2 d E a token),
    /// whatever the shape the profile passes ([B, T] ids or [B, T, d] activations).
    #[test]
    fn a_top1_expert_block_counts_a_dense_block_and_its_router() {
        let moe = GptConfig::preset("gpt-moe-tiny").unwrap();
        let dense = GptConfig { moe: None, ..moe };
        let (moe, dense) = (moe.build(), dense.build());
        let (b, t, d, experts) = (4u64, 128u64, 256u64, 8u64);
        for shape in [[4, 128].as_slice(), &[4, 128, 256]] {
            let flops = |m: &Model, i: usize| m.layers()[i].layer.forward_flops(shape).unwrap();
            // layer 0 is the embeddings: h.0 is dense, h.1 holds experts
            assert_eq!(flops(&moe, 1), flops(&dense, 1), "h.0 is dense");
            assert_eq!(flops(&moe, 2), flops(&dense, 2) + 2 * b * t * d * experts);
        }
    }

    /// Each layer's hand-written backward against candle's autograd of its `forward`: the
    /// output, the input gradient and every parameter gradient.
    #[test]
    fn taped_backward_matches_autograd() {
        let c = GptConfig {
            vocab_size: 24,
            seq_len: 8,
            hidden: 16,
            heads: 2,
            layers: 1,
            tie_embeddings: false,
            moe: None,
        };
        // t = 7 < T exercises the unused positions of wpe
        crate::taped_check::check_layers(&c.build(), (3, 7), c.hidden, c.vocab_size, "GPT");
        let gpt2 = GptVariant {
            mlp: 24,
            ln_eps: 1e-6,
            hf_names: true,
        };
        let model = c.build_variant(&Tp::none(), &gpt2).unwrap();
        crate::taped_check::check_layers(&model, (3, 7), c.hidden, c.vocab_size, "GPT-2");
        // an expert block: top-1 and top-2, some tokens dropped (capacity 2 of 21 tokens over
        // 4 experts), others not
        for (k, capacity_factor, drop_tokens) in [(1, 0.3, true), (2, 0.3, true), (2, 1.0, false)] {
            let moe = GptMoe {
                num_experts: 4,
                k,
                capacity_factor,
                eval_capacity_factor: capacity_factor,
                min_capacity: 2,
                drop_tokens,
                aux_loss_coef: 0.5,
                expert_interval: 1,
                ..GptMoe::top1(4)
            };
            let c = GptConfig {
                moe: Some(moe),
                ..c
            };
            let what = format!("MoE GPT k {k} capacity {capacity_factor} drop {drop_tokens}");
            crate::taped_check::check_layers(&c.build(), (3, 7), c.hidden, c.vocab_size, &what);
        }
    }
}
