//! The activations one micro-batch holds on a rank of a model (the built-in GPT, its MoE
//! form and GPT-2, the Llama family), by the rules of
//! ds-engine's trainer (Note [checkpoint segments], Note [ZeRO-3 reuse]): what each layer's
//! forward keeps (its tape, its input only, or nothing), and the most held at once, at the end
//! of forward or while backward differentiates a layer with the layers below it still saved.

use ds_engine::kernels::cpu_flash_attention;
use ds_models::gpt::{GptConfig, GptVariant};
use ds_models::gpt_moe::GptMoe;
use ds_models::llama::SparseMlp;
use ds_models::{Arch, LlamaConfig, ModelSpec};

/// Per layer of a stage: the bytes of its input and of its tape (what its backward needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerActivations {
    pub input: u64,
    pub tape: u64,
}

/// The shape of a micro-batch on one rank.
#[derive(Debug, Clone, Copy)]
pub struct MicroBatch {
    pub rows: u64,
    /// Tensor-parallel degree (heads, MLP width and vocabulary split; no Megatron sequence
    /// parallelism).
    pub tp: u64,
    /// Ulysses' sequence-parallel size: a rank holds 1/sp of each sequence's positions, and
    /// attention whole sequences of 1/sp of its heads.
    pub sp: u64,
    /// Positions per tile of the MLPs and the logits and loss (Note [tiles]), if tiled.
    pub tile: Option<u64>,
    /// Bytes of the compute dtype.
    pub dtype: u64,
}

impl MicroBatch {
    /// A rank's positions: rows x seq / sp.
    fn tokens(&self, seq: usize) -> u64 {
        self.rows * seq as u64 / self.sp
    }

    /// Attention's output at this rank's positions and, under sequence parallelism, again as
    /// whole sequences of its heads: `width` is the heads' output width on a tensor rank.
    fn attention_out(&self, seq: usize, width: u64) -> u64 {
        let once = self.tokens(seq) * width * self.dtype;
        match self.sp {
            1 => once,
            _ => 2 * once,
        }
    }

    /// The last layers: ln_f/norm + lm_head keeping `head` bytes, and the loss; or, tiled,
    /// the head computing the loss with `head` plus the normed positions and their targets.
    fn head_and_loss(&self, seq: usize, d: u64, v: u64, head: u64) -> Vec<LayerActivations> {
        let tokens = self.tokens(seq);
        let hidden = tokens * d * self.dtype;
        match self.tile {
            Some(_) => vec![LayerActivations {
                input: hidden,
                tape: head + hidden + tokens * 4,
            }],
            None => vec![
                LayerActivations {
                    input: hidden,
                    tape: head + hidden,
                },
                LayerActivations {
                    input: tokens * v / self.tp * self.dtype,
                    tape: loss_tape(tokens, v, *self),
                },
            ],
        }
    }
}

/// The model's layers in model order, at its sequence length.
pub fn layers(spec: &ModelSpec, m: MicroBatch) -> Vec<LayerActivations> {
    match &spec.arch {
        Arch::Gpt(c) => gpt_layers(c, &GptVariant::peer(c), spec.seq_len, m),
        Arch::Gpt2(c) => gpt_layers(&c.gpt, &c.variant, spec.seq_len, m),
        Arch::Llama(c) => llama_layers(c, spec.seq_len, m),
    }
}

/// What attention keeps of its softmax for `heads` (batch x heads) rows of `seq` positions
/// in a dtype of `e` bytes: the probabilities, or from cpu_flash_attention::MIN_SEQ positions
/// in f32 (the CPU's blockwise path) each row's log-sum-exp.
fn softmax_bytes(heads: u64, seq: usize, e: u64) -> u64 {
    let t = seq as u64;
    match e == 4 && seq >= cpu_flash_attention::MIN_SEQ {
        true => heads * t * 4,
        false => heads * t * t * e,
    }
}

/// The loss layer's tape: softmax rows in f32 and the targets (u32); under tensor
/// parallelism this rank's softmax columns, its local targets and their mask.
fn loss_tape(tokens: u64, v: u64, m: MicroBatch) -> u64 {
    match m.tp {
        1 => tokens * v * 4 + tokens * 4,
        tp => tokens * v / tp * 4 + tokens * 4 + tokens * m.dtype,
    }
}

/// The Llama decoder's layers: the embedding, the decoder layers (their tapes: the input,
/// two norms' outputs and f32 reciprocal roots, rotated q and k, v, the probabilities, the
/// heads' outputs, the residual, Qwen3's q and k before their norms with f32 roots; then
/// gate, up and their product, or a mixture of experts' tape), the norm + head, the loss.
fn llama_layers(c: &LlamaConfig, seq: usize, m: MicroBatch) -> Vec<LayerActivations> {
    let (b, d, v) = (m.rows, c.hidden_size as u64, c.vocab_size as u64);
    let (tp, e) = (m.tp, m.dtype);
    let tokens = m.tokens(seq);
    let hidden = tokens * d * e;
    let (q, kv) = (c.q_width() as u64 / tp, c.kv_width() as u64 / tp);
    // key/value heads fewer than sp are copied so that each rank gets one
    let kv_held = kv * c.kv_copies(tp as usize, m.sp as usize) as u64;
    let f = c.intermediate_size as u64 / tp;
    let probs = softmax_bytes(b * (c.num_attention_heads as u64 / tp / m.sp), seq, e);
    let heads = (c.num_attention_heads + c.num_key_value_heads) as u64 / tp;
    let qk_norm = match c.qk_norm {
        true => tokens * (q + kv) * e + tokens * heads * 4,
        false => 0,
    };
    let attention = 4 * hidden // x, h1, x2, h2
        + 2 * tokens * 4 // the reciprocal roots
        + tokens * (q + 2 * kv_held) * e // q, k, v
        + m.attention_out(seq, q)
        + probs
        + qk_norm;
    let dense = match m.tile {
        Some(_) => attention,
        None => attention + 3 * tokens * f * e, // gate, up, their product
    };
    let mut layers = vec![LayerActivations {
        input: tokens * 4,
        tape: tokens * 4,
    }];
    layers.extend((0..c.num_hidden_layers).map(|i| LayerActivations {
        input: hidden,
        tape: match c.sparse_layer(i) {
            Some(s) => attention + experts_tape(s, tokens, d, m),
            None => dense,
        },
    }));
    layers.extend(m.head_and_loss(seq, d, v, hidden + tokens * 4));
    layers
}

/// A mixture of experts' tape (llama/sparse.rs): the input, the router's probabilities (f32),
/// the kept ones (f32) and the route weights, the rows the rank's experts ran on and their
/// outputs back, and each expert's gate, up and product. The rows an expert-parallel rank
/// receives depend on the routing: counted here as balanced, `top_k` per token (exact at ep
/// 1).
fn experts_tape(s: &SparseMlp, tokens: u64, d: u64, m: MicroBatch) -> u64 {
    let (k, experts, f) = (
        s.top_k as u64,
        s.num_experts as u64,
        s.expert_size as u64 / m.tp,
    );
    let routes = tokens * k;
    tokens * d * m.dtype
        + tokens * experts * 4
        + routes * 4
        + routes * m.dtype
        + 2 * routes * d * m.dtype
        + 3 * routes * f * m.dtype
}

/// DeepSpeed-MoE's layer's tape (moe/layer.rs): its whole input, the router's
/// probabilities (f32), each kept route's gate (f32), its renormaliser for k >= 2 (f32) and
/// weight, the rows the rank's experts ran on and their outputs back, and each expert's
/// pre-activation and GELU. The routes: every token's k without dropping, at most the
/// capacity's with it (exact where no expert fills up); an expert-parallel rank's received
/// rows counted as balanced.
fn moe_tape(moe: &GptMoe, tokens: u64, d: u64, mlp: u64, m: MicroBatch) -> u64 {
    let experts = moe.num_experts as u64;
    let routes = moe.gate().max_routes(tokens as usize, moe.num_experts) as u64;
    let renormaliser = if moe.k >= 2 { routes * 4 } else { 0 };
    tokens * d * m.dtype
        + tokens * experts * 4
        + routes * 4
        + renormaliser
        + routes * m.dtype
        + 2 * routes * d * m.dtype
        + 2 * routes * mlp / m.tp * m.dtype
}

/// The GPT's layers in model order: embeddings, the blocks, ln_f + lm_head, the loss.
fn gpt_layers(c: &GptConfig, var: &GptVariant, seq: usize, m: MicroBatch) -> Vec<LayerActivations> {
    let (b, d, v) = (m.rows, c.hidden as u64, c.vocab_size as u64);
    let (tp, e) = (m.tp, m.dtype);
    let tokens = m.tokens(seq);
    let hidden = tokens * d * e;
    let probs = softmax_bytes(b * (c.heads as u64 / tp / m.sp), seq, e);
    let attention = 4 * hidden // x, ln_1(x), x2, ln_2(x2)
        + tokens * 3 * d / tp * e // q|k|v
        + probs
        + m.attention_out(seq, d / tp); // the heads' outputs
    let mlp = match m.tile {
        Some(_) => 0,
        None => 2 * tokens * var.mlp as u64 / tp * e, // the MLP's pre-activation and GELU
    };
    let mut layers = vec![LayerActivations {
        input: tokens * 4,
        tape: tokens * 4,
    }];
    layers.extend((0..c.layers).map(|i| LayerActivations {
        input: hidden,
        tape: match c.moe.filter(|moe| moe.holds_experts(i)) {
            Some(moe) => attention + moe_tape(&moe, tokens, d, var.mlp as u64, m),
            None => attention + mlp,
        },
    }));
    layers.extend(m.head_and_loss(seq, d, v, hidden));
    layers
}

/// What forward keeps of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    Tape,
    Input,
    Nothing,
}

/// The most activation bytes held at once over a micro-batch's forward and backward through
/// `layers` (a stage's or chunk's), each kept as `kept` says.
pub fn peak(layers: &[LayerActivations], kept: &[Kept]) -> u64 {
    let saved = |j: usize| match kept[j] {
        Kept::Tape => layers[j].tape,
        Kept::Input => layers[j].input,
        Kept::Nothing => 0,
    };
    let end_of_forward: u64 = (0..layers.len()).map(saved).sum();
    // backward at layer i: the layers below its segment still saved, its segment recomputed
    // (every layer from the segment's checkpoint up to i holds its tape)
    let during_backward = (0..layers.len()).map(|i| {
        let start = match kept[i] {
            Kept::Nothing => (0..=i).rev().find(|&j| kept[j] == Kept::Input).unwrap_or(0),
            _ => i,
        };
        let below: u64 = (0..start).map(saved).sum();
        below + layers[start..=i].iter().map(|l| l.tape).sum::<u64>()
    });
    during_backward.fold(end_of_forward, u64::max)
}

/// The trainer's choice per layer: with recomputation, the input of every `interval`-th layer
/// (counted from the first) and nothing else; without, the tape of the layers `keep_graph`
/// keeps and the input of the others.
pub fn kept(n: usize, recompute: Option<usize>, keep_graph: &[bool]) -> Vec<Kept> {
    (0..n)
        .map(|i| match (recompute, keep_graph[i]) {
            (Some(k), _) if i % k.max(1) == 0 => Kept::Input,
            (Some(_), _) => Kept::Nothing,
            (None, true) => Kept::Tape,
            (None, false) => Kept::Input,
        })
        .collect()
}

/// ZeRO-3's Note [ZeRO-3 reuse]: walking back from the last layer, a layer keeps its graph
/// while the parameters used after it stay within `max_reuse_distance` and the live ones
/// within `max_live`; at stages 0-2 every layer keeps it. `numel`: each layer's elements.
pub fn keep_graph(numel: &[usize], zero3: Option<(usize, usize)>) -> Vec<bool> {
    let Some((max_reuse_distance, max_live)) = zero3 else {
        return vec![true; numel.len()];
    };
    let (mut keep, mut after, mut live) = (vec![false; numel.len()], 0, 0);
    for i in (0..numel.len()).rev() {
        live += numel[i];
        if after > max_reuse_distance || live > max_live {
            break;
        }
        keep[i] = true;
        after += numel[i];
    }
    keep
}
