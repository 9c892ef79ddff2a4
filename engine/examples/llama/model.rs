//! A Llama-style decoder in plain candle-nn (Hugging Face's parameter names): RMSNorm,
//! rotary embeddings, grouped-query causal attention, a SwiGLU MLP. Nothing here implements a
//! ds-rs trait: the modules are built from a `VarBuilder` and are candle `Module`s. From
//! ds-rs come only differentiable versions of candle-nn's fused norm, softmax and rotary ops
//! (`ds_engine::nn`, which have a backward), and the two tensor-parallel marks, the identity
//! on one rank.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{embedding, VarBuilder};
use ds_engine::model::Model;
use ds_engine::nn::{rope, softmax_last_dim, Linear, RmsNorm};
use ds_engine::parallel::Tp;

#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// The longest sequence (the rotary tables' length).
    pub max_seq: usize,
    pub rope_theta: f64,
    pub eps: f64,
}

impl Config {
    /// A small model that trains in seconds on a CPU.
    pub fn tiny() -> Config {
        Config {
            vocab: 64,
            hidden: 64,
            intermediate: 172,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            max_seq: 64,
            rope_theta: 10_000.0,
            eps: 1e-5,
        }
    }

    /// The same model at width `hidden` (a multiple of 32): heads of 16, half as many
    /// key-value heads, SwiGLU's 8/3 inner ratio. For measuring memory at a size where the
    /// model's states outweigh the program.
    pub fn with_hidden(mut self, hidden: usize) -> Config {
        self.hidden = hidden;
        self.heads = hidden / 16;
        self.kv_heads = self.heads / 2;
        self.intermediate = (hidden * 8 / 3).div_ceil(4) * 4;
        self
    }

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// The rotary tables, cos and sin [max_seq, head_dim / 2], shared by every block.
#[derive(Clone)]
pub struct Rotary {
    cos: Tensor,
    sin: Tensor,
}

impl Rotary {
    pub fn new(c: &Config, dev: &Device) -> Result<Rotary> {
        let half = c.head_dim() / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| (1.0 / c.rope_theta.powf(2.0 * i as f64 / c.head_dim() as f64)) as f32)
            .collect();
        let inv = Tensor::from_vec(inv, (1, half), dev)?;
        let pos = Tensor::arange(0u32, c.max_seq as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((c.max_seq, 1))?;
        let angles = pos.broadcast_mul(&inv)?;
        Ok(Rotary {
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }

    /// `x` [b, heads, t, head_dim] rotated by position.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        let (cos, sin) = (self.cos.narrow(0, 0, t)?, self.sin.narrow(0, 0, t)?);
        let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
        rope(&x.contiguous()?, &cos, &sin)
    }
}

/// One decoder layer. Under tensor parallelism the engine hands q/k/v/gate/up their rows and
/// o/down their columns (the ds_config's `partition_config`), so this rank computes its heads
/// and its share of the MLP; the marks sum the partial outputs.
pub struct Block {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    rotary: Rotary,
    tp: Tp,
    head_dim: usize,
}

impl Block {
    pub fn new(c: &Config, rotary: Rotary, tp: Tp, vb: VarBuilder) -> Result<Block> {
        let (d, hd) = (c.hidden, c.head_dim());
        let (attn, mlp) = (vb.pp("self_attn"), vb.pp("mlp"));
        Ok(Block {
            input_layernorm: RmsNorm::new(d, c.eps, vb.pp("input_layernorm"))?,
            q_proj: Linear::no_bias(d, c.heads * hd, attn.pp("q_proj"))?,
            k_proj: Linear::no_bias(d, c.kv_heads * hd, attn.pp("k_proj"))?,
            v_proj: Linear::no_bias(d, c.kv_heads * hd, attn.pp("v_proj"))?,
            o_proj: Linear::no_bias(c.heads * hd, d, attn.pp("o_proj"))?,
            post_attention_layernorm: RmsNorm::new(d, c.eps, vb.pp("post_attention_layernorm"))?,
            gate_proj: Linear::no_bias(d, c.intermediate, mlp.pp("gate_proj"))?,
            up_proj: Linear::no_bias(d, c.intermediate, mlp.pp("up_proj"))?,
            down_proj: Linear::no_bias(c.intermediate, d, mlp.pp("down_proj"))?,
            rotary,
            tp,
            head_dim: hd,
        })
    }

    /// Causal grouped-query attention of `h` [b, t, d].
    fn attention(&self, h: &Tensor) -> Result<Tensor> {
        let (b, t, _) = h.dims3()?;
        let heads = |x: Tensor| x.reshape((b, t, (), self.head_dim))?.transpose(1, 2);
        let q = self.rotary.apply(&heads(self.q_proj.forward(h)?)?)?;
        let k = self.rotary.apply(&heads(self.k_proj.forward(h)?)?)?;
        let v = heads(self.v_proj.forward(h)?)?.contiguous()?;
        let group = q.dim(1)? / k.dim(1)?;
        let (k, v) = (repeat_kv(&k, group)?, repeat_kv(&v, group)?);
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        let probs = softmax_last_dim(&scores.broadcast_add(&causal_mask(t, h)?)?)?;
        probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, ()))
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.tp.copy_to_region(&self.input_layernorm.forward(x)?)?;
        let a = self.o_proj.forward(&self.attention(&h)?)?;
        let x = (x + self.tp.reduce_from_region(&a)?)?;
        let h = self
            .tp
            .copy_to_region(&self.post_attention_layernorm.forward(&x)?)?;
        let gate = self.gate_proj.forward(&h)?.silu()?;
        let m = self
            .down_proj
            .forward(&(gate * self.up_proj.forward(&h)?)?)?;
        x + self.tp.reduce_from_region(&m)?
    }
}

/// Each of the `n_kv` heads of `x` [b, n_kv, t, hd] repeated `group` times in place.
fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (b, n_kv, t, hd) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, n_kv, group, t, hd))?
        .reshape((b, n_kv * group, t, hd))
}

/// 0 on and below the diagonal, -inf above: [t, t] in `like`'s dtype.
fn causal_mask(t: usize, like: &Tensor) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t * t)
        .map(|i| match i % t > i / t {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    Tensor::from_vec(mask, (t, t), like.device())?.to_dtype(like.dtype())
}

/// The final norm and the output projection: hidden states to logits. Under tensor
/// parallelism with `lm_head` split by rows, each rank computes its columns of the logits
/// (the loss is then `vocab_parallel_cross_entropy`).
pub struct Head {
    norm: RmsNorm,
    lm_head: Linear,
    tp: Tp,
}

impl Head {
    pub fn new(c: &Config, tp: Tp, vb: VarBuilder) -> Result<Head> {
        Ok(Head {
            norm: RmsNorm::new(c.hidden, c.eps, vb.pp("model.norm"))?,
            lm_head: Linear::no_bias(c.hidden, c.vocab, vb.pp("lm_head"))?,
            tp,
        })
    }
}

impl Module for Head {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.tp.copy_to_region(&self.norm.forward(x)?)?;
        self.lm_head.forward(&h)
    }
}

/// The token embedding, as candle-nn builds it.
pub fn embed(c: &Config, vb: VarBuilder) -> Result<candle_nn::Embedding> {
    embedding(c.vocab, c.hidden, vb)
}

/// The model as ds-rs trains it: one gather unit per module (ZeRO-3 gathers, frees and
/// recomputes module by module), each built by plain candle-nn code.
pub fn build(c: Config, tp: Tp) -> ds_engine::Result<Model> {
    let rotary = Rotary::new(&c, &Device::Cpu)?;
    let mut m = Model::new().module("model.embed_tokens", move |vb| embed(&c, vb))?;
    for i in 0..c.layers {
        let (rotary, tp) = (rotary.clone(), tp.clone());
        m = m.module(&format!("model.layers.{i}"), move |vb| {
            Block::new(&c, rotary.clone(), tp.clone(), vb)
        })?;
    }
    Ok(m.module("", move |vb| Head::new(&c, tp.clone(), vb))?)
}

/// This rank's memory report in one line, MiB: the model states (trainable parameters, their
/// gradients, optimizer states; frozen parameters) and the step's peaks (activations, the
/// layers' materialised parameters and gradients, communication buffers).
pub fn memory_line(m: &ds_engine::MemoryReport) -> String {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    format!(
        "memory (MiB): parameters {:.1}, gradients {:.1}, optimizer states {:.1}, frozen {:.1}; peaks: activations {:.1}, layer parameters {:.1}, layer gradients {:.1}, buffers {:.1}",
        mib(m.params),
        mib(m.grads),
        mib(m.optimizer_states),
        mib(m.frozen_params),
        mib(m.activations),
        mib(m.layer_params),
        mib(m.layer_grads),
        mib(m.comm_buffers)
    )
}
