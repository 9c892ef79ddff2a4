//! The built-in GPT: exactly the model of the peer benchmark (../shared/bench/gpt.py), with
//! its parameter names, so ds-rs and PyTorch/DeepSpeed train the same function from the same
//! weights. Pre-LayerNorm blocks, fused q|k|v projection, causal attention, tanh-GELU MLP,
//! untied lm_head, mean cross-entropy.
//!
//! The config and the model's assembly live here, the block in block.rs.

mod block;

use block::Block;

use std::path::Path;

use serde::Deserialize;

use crate::blocks::{Embedding, Head, Norm, Positions};
use crate::gpt_moe::GptMoe;
use crate::loss::{CrossEntropyLoss, VocabParallelCrossEntropy};

use ds_nn::model::{Init, Model};
use ds_nn::parallel::{Parallel, Tp};

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
