//! The Llama-family decoder as ds-rs layers under transformers' parameter names: the token
//! embedding, one layer per decoder layer, the final norm with the LM head, the loss. Each
//! layer is taped (Note [taped layers] in ds-engine's model API): its backward is written
//! out and tested against candle's autograd of its forward.
//!
//! Why long: the decoder layer's attention (grouped heads, rotary positions, windows, Ulysses)
//! and MLP with their written-out backward live here until they join the shared blocks
//! (blocks/) that the embedding, norms and head already use.
//!
//! Under tensor parallelism (Megatron-LM's scheme): q, k, v, gate and up are column-parallel
//! (each rank owns whole query and key/value heads, so grouped-query attention stays local),
//! o and down row-parallel, the embedding and the LM head vocabulary-parallel; the norms
//! replicated.

use crate::blocks::{Activation, Embedding, Head, Linear, MlpGrads, MlpKept, MlpWeights, Norm};
use crate::loss::{CrossEntropyLoss, VocabParallelCrossEntropy};
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use ds_nn::kernels::flash_attention;
use ds_nn::kernels::grad::{bias_backward, linear_backward};
use ds_nn::kernels::ops::{causal_softmax, causal_softmax_backward};
use ds_nn::model::{
    tensor_bytes, Context, Grads, Init, Layer, Model, ParamSpec, Split, Tape, Taped,
};
use ds_nn::parallel::{Ep, Parallel, Sp, Tp};

use super::config::{LlamaConfig, SparseMlp};
use super::ops::{repeat_heads, rms_norm, rms_norm_backward, sum_repeated_heads, window_softmax};
use super::rope;
use super::sparse::{self, Experts, RouterLoss, SparseTape};

/// The embedding's name, which a tied LM head reads.
pub const EMBED: &str = "model.embed_tokens.weight";

/// The model as layers in layout `p`: split over its tensor-parallel group, the experts over
/// its expert-parallel group, the sequences over its sequence-parallel group.
pub fn build(c: &LlamaConfig, p: &Parallel) -> std::result::Result<Model, String> {
    let (tp, ep) = (&p.tp, &p.ep);
    c.check_tp(tp.size())?;
    c.check_ep(ep.size())?;
    c.check_sp(p.sp.size(), tp.size())?;
    crate::check_tile(p.tile, tp.size())?;
    let embedding = Embedding {
        name: "embed_tokens.weight".into(),
        init: weight_init(c),
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        positions: None,
        tp: tp.clone(),
        sp: p.sp.clone(),
    };
    let mut m = Model::new().layer("model", embedding);
    let mut elsewhere = Vec::new();
    let sparse_layers = (0..c.num_hidden_layers).filter(|i| c.sparse_layer(*i).is_some());
    let router_loss = c.moe.as_ref().and_then(|moe| {
        let coef = moe.router_aux_loss_coef?;
        Some(RouterLoss::new(
            coef,
            moe.num_experts,
            sparse_layers.count(),
        ))
    });
    let mut ordinal = 0;
    for i in 0..c.num_hidden_layers {
        let prefix = format!("model.layers.{i}");
        let mut layer_loss = None;
        if let Some(s) = c.sparse_layer(i) {
            elsewhere.extend(sparse::held_elsewhere(s, c, ep, &prefix));
            layer_loss = router_loss.clone().map(|l| (l, ordinal));
            ordinal += 1;
        }
        let layer = DecoderLayer {
            c: c.clone(),
            tp: tp.clone(),
            sp: p.sp.clone(),
            tile: p.tile,
            window: c.windows[i],
            sparse: c.sparse_layer(i).cloned(),
            ep: ep.clone(),
            router_loss: layer_loss,
        };
        m = m.layer(&prefix, layer);
    }
    let m = m.held_elsewhere(elsewhere);
    let head = Head {
        norm: Norm::Rms {
            weight: "model.norm.weight".into(),
            hidden: c.hidden_size,
            eps: c.rms_norm_eps,
        },
        name: "lm_head.weight".into(),
        init: weight_init(c),
        tied_to: c.tie_word_embeddings.then(|| EMBED.to_string()),
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        tp: tp.clone(),
        tile: p.tile,
    };
    if p.tile.is_some() {
        // a tiled head computes the loss itself
        return Ok(match router_loss {
            None => m.layer("", head),
            Some(loss) => m.layer("", WithRouterLoss(head, loss)),
        });
    }
    let m = m.layer("", head);
    Ok(match (tp.size(), router_loss) {
        (1, None) => m.layer("", CrossEntropyLoss),
        (_, None) => m.layer("", VocabParallelCrossEntropy(tp.clone())),
        (1, Some(loss)) => m.layer("", WithRouterLoss(CrossEntropyLoss, loss)),
        (_, Some(loss)) => m.layer(
            "",
            WithRouterLoss(VocabParallelCrossEntropy(tp.clone()), loss),
        ),
    })
}

/// The loss with the router's load-balancing loss added (Note [router load-balancing
/// loss] in sparse.rs).
struct WithRouterLoss<L>(L, RouterLoss);

impl<L: Layer> Layer for WithRouterLoss<L> {
    fn params(&self) -> Vec<ParamSpec> {
        self.0.params()
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.0.forward(vb, x, cx)?.affine(1.0, self.1.value()?)
    }

    fn forward_taped(&self, vb: &VarBuilder, x: &Tensor, cx: &Context) -> Result<Option<Taped>> {
        let Some(t) = self.0.forward_taped(vb, x, cx)? else {
            return Ok(None);
        };
        Ok(Some(Taped {
            output: t.output.affine(1.0, self.1.value()?)?,
            tape: Box::new(RouterLossTape(t.tape, self.1.clone())),
        }))
    }

    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        self.0.forward_flops(shape)
    }
}

/// The loss's tape, recording the seed its backward receives for the sparse layers'.
struct RouterLossTape(Box<dyn Tape>, RouterLoss);

impl Tape for RouterLossTape {
    fn seed_added_loss(&mut self, seed: f64) {
        self.0.seed_added_loss(seed);
    }

    fn activation_bytes(&self) -> usize {
        self.0.activation_bytes()
    }

    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> Result<Grads> {
        let seed = dy
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .get(0)?;
        self.1.set_seed(seed.to_scalar::<f32>()?);
        self.0.backward(dy, vb)
    }
}

pub(super) fn weight_init(c: &LlamaConfig) -> Init {
    Init::normal(c.initializer_range)
}

/// Token positions in an input of `shape` ([B, T] ids or [B, T, d] activations).
fn rows(shape: &[usize]) -> usize {
    shape.iter().take(2).product()
}

/// One decoder layer: `x + attn(norm(x))`, then `+ mlp(norm(.))`, the MLP dense or a
/// mixture of experts.
struct DecoderLayer {
    c: LlamaConfig,
    tp: Tp,
    sp: Sp,
    /// Note [tiles]: the dense MLP `tile` positions at a time.
    tile: Option<usize>,
    window: Option<usize>,
    sparse: Option<SparseMlp>,
    /// Where the experts are (a sparse layer's).
    ep: Ep,
    /// The router's load-balancing loss and this layer's place among the sparse ones.
    router_loss: Option<(RouterLoss, usize)>,
}

/// A decoder layer's parameters but the MLP's, this rank's slices.
struct LayerParams {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3's RMSNorm weights over each query and key head [head_dim].
    qk_norm: Option<(Tensor, Tensor)>,
    post_norm: Tensor,
}

impl DecoderLayer {
    /// (name, whole shape, split, has bias) of attention's linears, in declaration order.
    fn attention_linears(&self) -> [LinearSpec; 4] {
        let c = &self.c;
        let d = c.hidden_size;
        let (q, kv) = (c.q_width(), c.kv_width());
        let column = Split::dim(0);
        let row = Split::dim(1);
        [
            ("self_attn.q_proj", [q, d], column, c.qkv_bias),
            ("self_attn.k_proj", [kv, d], column, c.qkv_bias),
            ("self_attn.v_proj", [kv, d], column, c.qkv_bias),
            ("self_attn.o_proj", [d, q], row, c.o_bias),
        ]
    }

    /// The dense MLP's linears, as `attention_linears`.
    fn mlp_linears(&self) -> [LinearSpec; 3] {
        let c = &self.c;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        [
            ("mlp.gate_proj", [f, d], Split::dim(0), c.mlp_bias),
            ("mlp.up_proj", [f, d], Split::dim(0), c.mlp_bias),
            ("mlp.down_proj", [d, f], Split::dim(1), c.mlp_bias),
        ]
    }

    /// This rank's slice of a linear.
    fn load_linear(
        &self,
        vb: &VarBuilder,
        (name, [out, inp], split, bias): LinearSpec,
    ) -> Result<Linear> {
        let tp = self.tp.size();
        let (out, inp) = match split {
            Split::Dim { dim: 0, .. } => (out / tp, inp),
            _ => (out, inp / tp),
        };
        Ok(Linear {
            w: vb.get((out, inp), &format!("{name}.weight"))?,
            b: match bias {
                true => Some(vb.get(out, &format!("{name}.bias"))?),
                false => None,
            },
        })
    }

    fn load(&self, vb: &VarBuilder) -> Result<LayerParams> {
        let c = &self.c;
        let d = c.hidden_size;
        let [q, k, v, o] = self.attention_linears().map(|l| self.load_linear(vb, l));
        let qk_norm = match c.qk_norm {
            true => Some((
                vb.get(c.head_dim, "self_attn.q_norm.weight")?,
                vb.get(c.head_dim, "self_attn.k_norm.weight")?,
            )),
            false => None,
        };
        Ok(LayerParams {
            input_norm: vb.get(d, "input_layernorm.weight")?,
            q: q?,
            k: k?,
            v: v?,
            o: o?,
            qk_norm,
            post_norm: vb.get(d, "post_attention_layernorm.weight")?,
        })
    }

    fn load_mlp(&self, vb: &VarBuilder) -> Result<MlpWeights> {
        let [gate, up, down] = self.mlp_linears().map(|l| self.load_linear(vb, l));
        Ok(MlpWeights {
            gate: Some(gate?),
            up: up?,
            down: down?,
        })
    }

    /// The dense MLP's weights' (and column biases') gradients into `named`, under their
    /// names; its input's gradient reduced over the group.
    fn dense_mlp_grads(&self, g: MlpGrads, named: &mut Vec<(String, Tensor)>) -> Result<Tensor> {
        let names = self
            .mlp_linears()
            .into_iter()
            .flat_map(|(name, _, _, bias)| {
                let b = bias.then(|| format!("{name}.bias"));
                std::iter::once(format!("{name}.weight")).chain(b)
            });
        // down's bias, last, is replicated: the caller's
        let dx = self.tp.reduce(&g.dx)?;
        named.extend(names.zip(g.declared()));
        Ok(dx)
    }

    /// The dense MLP's replicated down bias, where it has one.
    fn dense_down_bias(&self, vb: &VarBuilder) -> Result<Option<Tensor>> {
        match self.sparse.is_none() && self.c.mlp_bias {
            true => vb.get(self.c.hidden_size, "mlp.down_proj.bias").map(Some),
            false => Ok(None),
        }
    }

    /// This layer's mixture of experts, for a sparse layer.
    fn experts<'a>(&'a self, m: &'a SparseMlp) -> Experts<'a> {
        Experts {
            m,
            family: self.c.family,
            tp: &self.tp,
            ep: &self.ep,
            hidden: self.c.hidden_size,
            router_loss: self.router_loss.as_ref().map(|(l, i)| (l, *i)),
        }
    }

    fn scale(&self) -> f64 {
        1.0 / (self.c.head_dim as f64).sqrt()
    }

    fn taped(&self, vb: &VarBuilder, x: &Tensor) -> Result<Taped> {
        let (c, tp) = (&self.c, &self.tp);
        let p = self.load(vb)?;
        let x = x.contiguous()?;
        let (h1, r1) = rms_norm(&x, &p.input_norm, c.rms_norm_eps)?;
        let attn = Attention::forward(self, &p, &tp.gather(&h1)?)?;
        let x2 = (&x + p.o.forward_rows(tp, &attn.out)?)?;
        let (h2, r2) = rms_norm(&x2, &p.post_norm, c.rms_norm_eps)?;
        let h2g = tp.gather(&h2)?;
        let (y, mlp) = match &self.sparse {
            None => {
                let w = self.load_mlp(vb)?;
                match self.tile {
                    Some(tile) => {
                        let y = Activation::SwiGlu.tiled_forward(tp, &w, &h2g, tile)?;
                        (y, MlpTape::Tiled(tile))
                    }
                    None => {
                        let (y, kept) = Activation::SwiGlu.forward_rows(tp, &w, &h2g)?;
                        (y, MlpTape::Dense(kept))
                    }
                }
            }
            Some(m) => {
                let (partial, tape) = self.experts(m).forward(vb, &h2g)?;
                (tp.reduce(&partial)?, MlpTape::Sparse(tape))
            }
        };
        let output = (&x2 + y)?;
        let tape = LayerTape {
            layer: DecoderLayer {
                c: c.clone(),
                tp: tp.clone(),
                sp: self.sp.clone(),
                tile: self.tile,
                window: self.window,
                sparse: self.sparse.clone(),
                ep: self.ep.clone(),
                router_loss: self.router_loss.clone(),
            },
            x,
            r1,
            h1,
            attn,
            x2,
            r2,
            h2,
            mlp,
        };
        Ok(Taped {
            output,
            tape: Box::new(tape),
        })
    }
}

impl Layer for DecoderLayer {
    fn params(&self) -> Vec<ParamSpec> {
        let c = &self.c;
        let d = c.hidden_size;
        let mut specs = vec![ParamSpec::new("input_layernorm.weight", &[d], Init::Ones).norm()];
        for l in self.attention_linears() {
            specs.extend(linear_specs(c, l));
        }
        if c.qk_norm {
            for name in ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] {
                specs.push(ParamSpec::new(name, &[c.head_dim], Init::Ones).norm());
            }
        }
        specs.push(ParamSpec::new("post_attention_layernorm.weight", &[d], Init::Ones).norm());
        match &self.sparse {
            Some(m) => specs.extend(sparse::params(m, c, &self.ep)),
            None => {
                for l in self.mlp_linears() {
                    specs.extend(linear_specs(c, l));
                }
            }
        }
        specs
    }

    fn forward(&self, vb: &VarBuilder, x: &Tensor, _: &Context) -> Result<Tensor> {
        Ok(self.taped(vb, x)?.output)
    }

    fn forward_taped(&self, vb: &VarBuilder, x: &Tensor, _: &Context) -> Result<Option<Taped>> {
        self.taped(vb, x).map(Some)
    }

    /// The products (q, k, v, o; gate, up, down of the dense MLP or of each token's experts
    /// and the router) and attention's scores and weighted sums.
    fn forward_flops(&self, shape: &[usize]) -> Option<u64> {
        let c = &self.c;
        let seq = (*shape.get(1)? * self.sp.size()) as u64;
        let d = c.hidden_size as u64;
        let (q, kv) = (c.q_width() as u64, c.kv_width() as u64);
        let mlp = match &self.sparse {
            Some(m) => (m.top_k * 3 * m.expert_size + m.num_experts) as u64 * d,
            None => 3 * d * c.intermediate_size as u64,
        };
        let per_token = 2 * d * q + 2 * d * kv + mlp + 2 * seq * q;
        Some(2 * rows(shape) as u64 * per_token / self.tp.size() as u64)
    }
}

/// A linear's name, whole shape [out, in], split and whether it has a bias.
type LinearSpec = (&'static str, [usize; 2], Split, bool);

/// A linear's weight and bias specs.
fn linear_specs(c: &LlamaConfig, (name, shape, split, bias): LinearSpec) -> Vec<ParamSpec> {
    let w = ParamSpec::new(&format!("{name}.weight"), &shape, weight_init(c)).split(split);
    if !bias {
        return vec![w];
    }
    // a column-parallel bias is split with its rows; a row-parallel one replicated
    let b = ParamSpec::new(&format!("{name}.bias"), &[shape[0]], Init::Zeros);
    vec![
        w,
        match split == Split::dim(0) {
            true => b.split(split),
            false => b,
        },
    ]
}

/// What attention's backward reads of its softmax: the probabilities [B, h, T, T], or for
/// what `flash_attention::wanted` sends through the blockwise path (long sequences on the CPU,
/// bf16 and f16 on a GPU) each row's log-sum-exp [B, h, T] (the probabilities recomputed in
/// blocks: memory linear in T).
enum Softmax {
    Probs(Tensor),
    LogSumExp(Tensor),
}

/// Grouped-query causal attention's forward values, kept for its backward.
struct Attention {
    /// Rotated queries [B, h, T, hd] and keys [B, g, T, hd], values [B, g, T, hd].
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax: Softmax,
    /// Under Qwen3's per-head norms: the queries and keys before them, and their reciprocal
    /// roots.
    normed: Option<[Tensor; 4]>,
    /// The heads side by side [B, T, h hd], o_proj's input (this rank's positions).
    out: Tensor,
    /// Under sequence parallelism, attention's own output: whole sequences, this rank's part
    /// of the heads (Note [ulysses]).
    heads_out: Option<Tensor>,
}

impl Attention {
    fn forward(layer: &DecoderLayer, p: &LayerParams, x: &Tensor) -> Result<Attention> {
        let c = &layer.c;
        let tp = layer.tp.size();
        let (h, g, hd) = (
            c.num_attention_heads / tp,
            c.num_key_value_heads / tp,
            c.head_dim,
        );
        let sp = &layer.sp;
        let r = c.kv_copies(tp, sp.size());
        let (q, k) = (
            split_heads(sp, &p.q.forward(x)?, h, hd, 1)?,
            split_heads(sp, &p.k.forward(x)?, g, hd, r)?,
        );
        // the heads attention runs here: all of them, or this rank's part of the sequences'
        let (b, h, t, _) = q.dims4()?;
        let g = k.dim(1)?;
        let (cos, sin) = c.rope.tables(hd, 0, t, x.dtype(), x.device())?;
        let (q, k, normed) = match &p.qk_norm {
            Some((wq, wk)) => {
                let (qn, rq) = rms_norm(&q, wq, c.rms_norm_eps)?;
                let (kn, rk) = rms_norm(&k, wk, c.rms_norm_eps)?;
                (qn, kn, Some([q, rq, k, rk]))
            }
            None => (q, k, None),
        };
        let q = rope::apply(&q, &cos, &sin)?;
        let k = rope::apply(&k, &cos, &sin)?;
        let v = split_heads(sp, &p.v.forward(x)?, c.num_key_value_heads / tp, hd, r)?;
        let window = layer.window.filter(|w| *w < t);
        if flash_attention::wanted(t, q.device(), q.dtype()) {
            let s = layer.scale() as f32;
            if let Some((out, lse)) = flash_attention::forward_grouped(&q, &k, &v, s, window)? {
                let softmax = Softmax::LogSumExp(lse);
                return Attention::joined(sp, [q, k, v], softmax, normed, out);
            }
        }
        let scores = q.matmul(&repeat_heads(&k, h / g)?.t()?)?;
        let probs = match window {
            Some(w) => window_softmax(&scores, layer.scale(), w)?,
            None => causal_softmax(&scores, layer.scale())?,
        };
        let out = probs
            .matmul(&repeat_heads(&v, h / g)?)?
            .transpose(1, 2)?
            .reshape((b, t, h * hd))?;
        let softmax = Softmax::Probs(probs);
        Attention::joined(sp, [q, k, v], softmax, normed, out)
    }

    /// The forward's values, attention's output `out` [B, T, h hd] back at this rank's
    /// positions under sequence parallelism.
    fn joined(
        sp: &Sp,
        [q, k, v]: [Tensor; 3],
        softmax: Softmax,
        normed: Option<[Tensor; 4]>,
        out: Tensor,
    ) -> Result<Attention> {
        let (h, hd) = (q.dim(1)?, q.dim(3)?);
        let (out, heads_out) = match sp.size() {
            1 => (out, None),
            n => (join_heads(sp, &out, h * n, hd, 1)?, Some(out)),
        };
        Ok(Attention {
            q,
            k,
            v,
            softmax,
            normed,
            out,
            heads_out,
        })
    }

    /// The gradients of the rotated queries, the rotated keys and the values from `dout`.
    fn core_backward(&self, layer: &DecoderLayer, dout: &Tensor) -> Result<[Tensor; 3]> {
        let (b, h, t, hd) = self.q.dims4()?;
        let n = h / self.k.dim(1)?;
        let probs = match &self.softmax {
            Softmax::LogSumExp(lse) => {
                let (s, window) = (layer.scale() as f32, layer.window.filter(|w| *w < t));
                let qkv = (&self.q, &self.k, &self.v);
                let out = self.heads_out.as_ref().unwrap_or(&self.out);
                return flash_attention::backward_grouped(qkv, out, lse, dout, s, window)?
                    .ok_or_else(|| {
                        candle_core::Error::Msg(
                            "attention: the blockwise backward declined the forward it ran".into(),
                        )
                    });
            }
            Softmax::Probs(p) => p,
        };
        let dheads = dout.reshape((b, t, h, hd))?.transpose(1, 2)?.contiguous()?;
        let (k, v) = (repeat_heads(&self.k, n)?, repeat_heads(&self.v, n)?);
        let dprobs = dheads.matmul(&v.t()?)?;
        let dv = sum_repeated_heads(&probs.t()?.matmul(&dheads)?, n)?;
        let dscores = causal_softmax_backward(probs, &dprobs, layer.scale())?;
        let dq = dscores.matmul(&k)?;
        let dk = sum_repeated_heads(&dscores.t()?.matmul(&self.q)?, n)?;
        Ok([dq, dk, dv])
    }

    fn softmax_bytes(&self) -> usize {
        match &self.softmax {
            Softmax::Probs(p) | Softmax::LogSumExp(p) => tensor_bytes(p),
        }
    }

    /// The gradients of the q, k and v projections' outputs [B, T, width] from `dout`, and
    /// those of the per-head norms' weights (this rank's heads' part) where there are.
    fn backward(
        &self,
        layer: &DecoderLayer,
        p: &LayerParams,
        dout: &Tensor,
    ) -> Result<([Tensor; 3], Option<[Tensor; 2]>)> {
        let (b, h, t, hd) = self.q.dims4()?;
        let sp = &layer.sp;
        let (cos, sin) = layer.c.rope.tables(hd, 0, t, dout.dtype(), dout.device())?;
        let dout = match sp.size() {
            1 => dout.clone(),
            n => {
                let (_, local, _) = dout.dims3()?;
                let whole = sp.to_heads(&dout.reshape((b, local, 1, h * n, hd))?)?;
                whole.reshape((b, t, h * hd))?
            }
        };
        let [dq, dk, dv] = self.core_backward(layer, &dout)?;
        let dq = rope::apply_backward(&dq, &cos, &sin)?;
        let dk = rope::apply_backward(&dk, &cos, &sin)?;
        let (dq, dk, dnorms) = match (&self.normed, &p.qk_norm) {
            (Some([q, rq, k, rk]), Some((wq, wk))) => {
                let (dq, dwq) = rms_norm_backward(q, rq, wq, &dq)?;
                let (dk, dwk) = rms_norm_backward(k, rk, wk, &dk)?;
                (dq, dk, Some([dwq, dwk]))
            }
            _ => (dq, dk, None),
        };
        let flat = |g: Tensor| -> Result<Tensor> {
            let heads = g.dim(1)?;
            g.transpose(1, 2)?.contiguous()?.reshape((b, t, heads * hd))
        };
        let (tp, c) = (layer.tp.size(), &layer.c);
        let (kv, r) = (c.num_key_value_heads / tp, c.kv_copies(tp, sp.size()));
        let dq = join_heads(sp, &flat(dq)?, h * sp.size(), hd, 1)?;
        let dk = join_heads(sp, &flat(dk)?, kv, hd, r)?;
        let dv = join_heads(sp, &flat(dv)?, kv, hd, r)?;
        Ok(([dq, dk, dv], dnorms))
    }
}

/// A projection's output [B, t, n hd] at this rank's positions as heads [B, m, T, hd] of
/// whole sequences (Note [ulysses]): each head first copied `replicas` times, then this
/// rank's n replicas / sp of them. Without sequence parallelism: its n heads.
fn split_heads(sp: &Sp, y: &Tensor, n: usize, hd: usize, replicas: usize) -> Result<Tensor> {
    let (b, t, _) = y.dims3()?;
    let y = y.reshape((b, t, n, 1, hd))?;
    let y = match replicas {
        1 => y,
        r => y.broadcast_as((b, t, n, r, hd))?.contiguous()?,
    };
    let y = sp.to_heads(&y.reshape((b, t, 1, n * replicas, hd))?)?;
    let (_, whole, _, m, _) = y.dims5()?;
    y.reshape((b, whole, m, hd))?.transpose(1, 2)?.contiguous()
}

/// The inverse of `split_heads` for [B, T, m hd] (heads side by side): back at this rank's
/// positions [B, t, n hd], the copies of each head summed (a gradient's).
fn join_heads(sp: &Sp, y: &Tensor, n: usize, hd: usize, replicas: usize) -> Result<Tensor> {
    if sp.size() == 1 {
        return Ok(y.clone());
    }
    let (b, whole, width) = y.dims3()?;
    let y = sp.to_sequence(&y.reshape((b, whole, 1, width / hd, hd))?)?;
    let t = y.dim(1)?;
    let y = y.reshape((b, t, n, replicas, hd))?;
    let y = match replicas {
        1 => y,
        _ => y.sum_keepdim(3)?,
    };
    y.reshape((b, t, n * hd))
}

struct LayerTape {
    layer: DecoderLayer,
    x: Tensor,
    r1: Tensor,
    h1: Tensor,
    attn: Attention,
    x2: Tensor,
    r2: Tensor,
    h2: Tensor,
    mlp: MlpTape,
}

/// What the MLP's backward needs: the dense one's products, or the experts' tape.
enum MlpTape {
    Dense(MlpKept),
    /// Nothing: computed again in backward (Note [tiles]).
    Tiled(usize),
    Sparse(SparseTape),
}

impl Tape for LayerTape {
    fn activation_bytes(&self) -> usize {
        let a = &self.attn;
        let normed = a.normed.iter().flatten().map(tensor_bytes).sum::<usize>();
        let mlp = match &self.mlp {
            MlpTape::Dense(kept) => kept.bytes(),
            MlpTape::Tiled(_) => 0,
            MlpTape::Sparse(t) => t.activation_bytes(),
        };
        [
            &self.x, &self.r1, &self.h1, &a.q, &a.k, &a.v, &a.out, &self.x2, &self.r2, &self.h2,
        ]
        .into_iter()
        .map(tensor_bytes)
        .sum::<usize>()
            + a.heads_out.as_ref().map_or(0, tensor_bytes)
            + a.softmax_bytes()
            + normed
            + mlp
    }

    fn backward(self: Box<Self>, dy: &Tensor, vb: &VarBuilder) -> Result<Grads> {
        let p = self.layer.load(vb)?;
        let tp = &self.layer.tp;
        let mut named: Vec<(String, Tensor)> = Vec::new();
        // the MLP branch: y = x2 + mlp(h2)
        let dyg = tp.gather(dy)?;
        let h2g = tp.gather(&self.h2)?;
        let dh2 = match self.mlp {
            MlpTape::Dense(kept) => {
                let w = self.layer.load_mlp(vb)?;
                let g = Activation::SwiGlu.backward(&w, &h2g, Some(kept), &dyg)?;
                self.layer.dense_mlp_grads(g, &mut named)?
            }
            MlpTape::Tiled(tile) => {
                let w = self.layer.load_mlp(vb)?;
                let g = Activation::SwiGlu.tiled_backward(&w, &h2g, &dyg, tile)?;
                self.layer.dense_mlp_grads(g, &mut named)?
            }
            MlpTape::Sparse(t) => {
                let m = self
                    .layer
                    .sparse
                    .as_ref()
                    .expect("invariant: a sparse layer's tape");
                let g = self.layer.experts(m).backward(vb, t, &dyg)?;
                named.extend(g.params);
                // the router's share is whole on every rank: this rank's positions of it
                let pos = tp.positions(g.dx_router.dim(1)?);
                (tp.reduce(&g.dx_experts)? + g.dx_router.narrow(1, pos.start, pos.len())?)?
            }
        };
        let (dx2_n, dpost) = rms_norm_backward(&self.x2, &self.r2, &p.post_norm, &dh2)?;
        let dx2 = (dy + dx2_n)?;
        // the attention branch: x2 = x + o(attention(h1))
        let dx2g = tp.gather(&dx2)?;
        let o = linear_backward(&self.attn.out, &p.o.w, &dx2g)?;
        named.push(("self_attn.o_proj.weight".into(), o.dw));
        let ([dq, dk, dv], dnorms) = self.attn.backward(&self.layer, &p, &o.dx)?;
        if let Some([dwq, dwk]) = dnorms {
            // replicated weights over this rank's heads: summed over the group
            named.push(("self_attn.q_norm.weight".into(), tp.sum(&dwq)?));
            named.push(("self_attn.k_norm.weight".into(), tp.sum(&dwk)?));
        }
        let h1g = tp.gather(&self.h1)?;
        let mut dh1: Option<Tensor> = None;
        for (name, lin, d) in [("q", &p.q, dq), ("k", &p.k, dk), ("v", &p.v, dv)] {
            let g = linear_backward(&h1g, &lin.w, &d)?;
            dh1 = Some(match dh1 {
                Some(acc) => (acc + g.dx)?,
                None => g.dx,
            });
            named.push((qkv_name(name, "weight").into(), g.dw));
            if let Some(b) = &lin.b {
                named.push((qkv_name(name, "bias").into(), bias_backward(&d, b)?));
            }
        }
        let dh1 = tp.reduce(&dh1.expect("invariant: three projections"))?;
        let (dx_n, dinput) = rms_norm_backward(&self.x, &self.r1, &p.input_norm, &dh1)?;
        // the replicated parameters' gradients, from this rank's positions under sequence
        // parallelism: summed over the group
        let mut replicated = vec![
            ("input_layernorm.weight", dinput),
            ("post_attention_layernorm.weight", dpost),
        ];
        if let Some(b) = &p.o.b {
            replicated.push(("self_attn.o_proj.bias", bias_backward(&dx2, b)?));
        }
        if let Some(b) = self.layer.dense_down_bias(vb)? {
            replicated.push(("mlp.down_proj.bias", bias_backward(dy, &b)?));
        }
        let (names, grads): (Vec<&str>, Vec<Tensor>) = replicated.into_iter().unzip();
        let summed = tp.sum_partial_grads(grads)?;
        named.extend(names.into_iter().map(String::from).zip(summed));
        let params = self
            .layer
            .params()
            .iter()
            .map(|s| {
                let at = named.iter().position(|(n, _)| *n == s.name);
                Ok(named
                    .swap_remove(at.expect("invariant: a gradient per parameter"))
                    .1)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Grads {
            input: Some((dx2 + dx_n)?),
            params,
        })
    }
}

fn qkv_name(which: &str, kind: &str) -> &'static str {
    match (which, kind) {
        ("q", "weight") => "self_attn.q_proj.weight",
        ("k", "weight") => "self_attn.k_proj.weight",
        ("v", "weight") => "self_attn.v_proj.weight",
        ("q", _) => "self_attn.q_proj.bias",
        ("k", _) => "self_attn.k_proj.bias",
        _ => "self_attn.v_proj.bias",
    }
}
