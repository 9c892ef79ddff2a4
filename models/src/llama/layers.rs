//! The Llama-family decoder as ds-rs layers under transformers' parameter names: the token
//! embedding, one layer per decoder layer, the final norm with the LM head, the loss. Each
//! layer is taped (Note [taped layers] in ds-engine's model API): its backward is written
//! out and tested against candle's autograd of its forward.
//!
//! The layer's attention and dense MLP are the shared blocks (blocks/) configured here;
//! the mixture of experts is sparse.rs.
//!
//! Under tensor parallelism (Megatron-LM's scheme): q, k, v, gate and up are column-parallel
//! (each rank owns whole query and key/value heads, so grouped-query attention stays local),
//! o and down row-parallel, the embedding and the LM head vocabulary-parallel; the norms
//! replicated.

use crate::blocks::{
    rms_norm, rms_norm_backward, Activation, Attention, AttentionKept, AttentionWeights, Embedding,
    Head, Linear, MlpGrads, MlpKept, MlpWeights, Norm, Projection,
};
use crate::loss::{CrossEntropyLoss, VocabParallelCrossEntropy};
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;
use ds_nn::kernels::grad::bias_backward;
use ds_nn::model::{
    tensor_bytes, Context, Grads, Init, Layer, Model, ParamSpec, Split, Tape, Taped,
};
use ds_nn::parallel::{Ep, Parallel, Sp, Tp};

use super::config::{LlamaConfig, SparseMlp};
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
    /// Qwen3's attention has RMSNorm weights over each query and key head [head_dim].
    attn: AttentionWeights,
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
            attn: AttentionWeights {
                qkv: Projection::Separate([q?, k?, v?]),
                qk_norm,
                o: o?,
            },
            post_norm: vb.get(d, "post_attention_layernorm.weight")?,
        })
    }

    /// The layer's attention: grouped heads split over the tensor-parallel group, rotary
    /// positions, the layer's window.
    fn attention(&self) -> Attention {
        let (c, tp) = (&self.c, self.tp.size());
        Attention {
            heads: c.num_attention_heads / tp,
            kv_heads: c.num_key_value_heads / tp,
            head_dim: c.head_dim,
            kv_copies: c.kv_copies(tp, self.sp.size()),
            rope: Some(c.rope),
            norm_eps: c.rms_norm_eps,
            window: self.window,
            tp: self.tp.clone(),
            sp: self.sp.clone(),
        }
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

    fn taped(&self, vb: &VarBuilder, x: &Tensor) -> Result<Taped> {
        let (c, tp) = (&self.c, &self.tp);
        let p = self.load(vb)?;
        let x = x.contiguous()?;
        let (h1, r1) = rms_norm(&x, &p.input_norm, c.rms_norm_eps)?;
        let (attn_out, attn) = self.attention().forward(&p.attn, &h1)?;
        let x2 = (&x + attn_out)?;
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

struct LayerTape {
    layer: DecoderLayer,
    x: Tensor,
    r1: Tensor,
    h1: Tensor,
    attn: AttentionKept,
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
        let mlp = match &self.mlp {
            MlpTape::Dense(kept) => kept.bytes(),
            MlpTape::Tiled(_) => 0,
            MlpTape::Sparse(t) => t.activation_bytes(),
        };
        [&self.x, &self.r1, &self.h1, &self.x2, &self.r2, &self.h2]
            .into_iter()
            .map(tensor_bytes)
            .sum::<usize>()
            + self.attn.bytes()
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
        let a = self
            .layer
            .attention()
            .backward(&p.attn, self.attn, &self.h1, &dx2)?;
        named.push(("self_attn.o_proj.weight".into(), a.o_weight));
        if let Some([dwq, dwk]) = a.qk_norm {
            named.push(("self_attn.q_norm.weight".into(), dwq));
            named.push(("self_attn.k_norm.weight".into(), dwk));
        }
        for (name, (dw, db)) in ["q", "k", "v"].into_iter().zip(a.qkv) {
            named.push((qkv_name(name, "weight").into(), dw));
            if let Some(db) = db {
                named.push((qkv_name(name, "bias").into(), db));
            }
        }
        let dh1 = a.dx;
        let (dx_n, dinput) = rms_norm_backward(&self.x, &self.r1, &p.input_norm, &dh1)?;
        // the replicated parameters' gradients, from this rank's positions under sequence
        // parallelism: summed over the group
        let mut replicated = vec![
            ("input_layernorm.weight", dinput),
            ("post_attention_layernorm.weight", dpost),
        ];
        if let Some(g) = a.o_bias {
            replicated.push(("self_attn.o_proj.bias", g));
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
