//! ds-rs's model families, behind one interface (`ModelSpec`) that every command taking
//! `--model` uses: the built-in GPT (the peer benchmark's), and Hugging Face's Llama-family
//! decoders from a preset or a model directory (config.json, and safetensors weights when
//! present). The engine stays model-agnostic: it sees `ds_nn::model::Model`s.

pub mod blocks;
mod fields;
pub mod gpt;
pub mod gpt2;
pub mod gpt_moe;
pub mod hf_export;
pub mod llama;
pub mod loss;
pub mod moe;
#[cfg(test)]
mod seq_len_tests;
#[cfg(test)]
mod taped_check;

use std::path::{Path, PathBuf};

use crate::gpt::GptConfig;
use ds_nn::model::weights;
use ds_nn::model::Model;
use ds_nn::parallel::{Parallel, Tp};

pub use fields::ConfigProblem;
pub use gpt2::Gpt2Config;
pub use llama::LlamaConfig;

/// A model description that cannot be used, naming the file and field.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ModelError(String);

fn err(msg: impl Into<String>) -> ModelError {
    ModelError(msg.into())
}

impl ModelError {
    /// An error of another layer (a checkpoint's reader), by its message.
    pub fn from_message(message: String) -> ModelError {
        ModelError(message)
    }
}

impl From<ds_nn::NnError> for ModelError {
    fn from(e: ds_nn::NnError) -> ModelError {
        ModelError(e.to_string())
    }
}

/// The architecture and its sizes.
#[derive(Debug, Clone, PartialEq)]
pub enum Arch {
    Gpt(GptConfig),
    /// Hugging Face's GPT-2: the GPT's layers under its names.
    Gpt2(Gpt2Config),
    Llama(LlamaConfig),
}

impl Arch {
    /// A Hugging Face config.json's model, by its `model_type`.
    pub fn from_hf_json(v: &serde_json::Value) -> Result<Arch, ConfigProblem> {
        match v.get("model_type").and_then(|t| t.as_str()) {
            Some("gpt2") => Gpt2Config::from_hf_json(v).map(Arch::Gpt2),
            Some(t) if !llama::Family::SUPPORTED.contains(&t) => Err(ConfigProblem(format!(
                "`model_type` \"{t}\" is not supported; supported: gpt2, {}",
                llama::Family::SUPPORTED.join(", ")
            ))),
            _ => LlamaConfig::from_hf_json(v).map(Arch::Llama),
        }
    }
}

/// The longest sequence a run takes by default from a Hugging Face config.json, whose
/// max_position_embeddings can be 131,072 (Llama 3), more than a machine here holds for one
/// sample's activations; `--seq-len` asks for more.
pub const DEFAULT_MAX_SEQ: usize = 2048;

/// What `--model` names: an architecture, the sequence length it trains at, and the weights
/// it starts from (a Hugging Face directory's), if any.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// What `--model` said (for messages).
    pub name: String,
    pub arch: Arch,
    pub seq_len: usize,
    /// A model directory holding weights (`model.safetensors` or a sharded index).
    pub weights: Option<PathBuf>,
    /// The directory's config.json as read, kept for exports (its RoPE spelling and any
    /// field ds-rs does not use go out as they came in).
    pub source_config: Option<serde_json::Value>,
    /// Positions per tile of the MLPs and the logits and loss (`--tile`, Note [tiles]).
    pub tile: Option<usize>,
}

impl ModelSpec {
    /// `spec` is a preset name, a GPT model JSON (`{"V", "T", "d", "H", "L"}`) or a Hugging
    /// Face model directory; `seq_len` (`--seq-len`) overrides the default length: a Hugging
    /// Face config's `max_position_embeddings` up to `DEFAULT_MAX_SEQ`, a preset's own, the
    /// GPT's T.
    pub fn resolve(spec: &str, seq_len: Option<usize>) -> Result<ModelSpec, ModelError> {
        let mut source_config = None;
        let (arch, default_len, weights) = if let Some(c) = GptConfig::preset(spec) {
            (Arch::Gpt(c), c.seq_len, None)
        } else if let Some(p) = llama::presets().into_iter().find(|p| p.name == spec) {
            (Arch::Llama(p.config), p.seq_len, None)
        } else if let Some((_, c)) = gpt2::presets().into_iter().find(|(n, _)| *n == spec) {
            (Arch::Gpt2(c), c.gpt.seq_len, None)
        } else if Path::new(spec).is_dir() {
            let dir = Path::new(spec);
            let (arch, json) = read_hf_config(dir)?;
            source_config = Some(json);
            let len = match &arch {
                Arch::Llama(c) => c.max_position_embeddings,
                Arch::Gpt2(c) => c.gpt.seq_len,
                Arch::Gpt(c) => c.seq_len,
            };
            let w = weights::has_weights(dir).then(|| dir.to_path_buf());
            (arch, len.min(DEFAULT_MAX_SEQ), w)
        } else if spec.ends_with(".json") {
            let c = GptConfig::from_json_file(Path::new(spec)).map_err(|e| err(e.to_string()))?;
            (Arch::Gpt(c), c.seq_len, None)
        } else {
            return Err(err(format!(
                "--model {spec}: expected a preset ({}), a model JSON file or a Hugging Face model directory",
                preset_names().join(", ")
            )));
        };
        let seq_len = seq_len.unwrap_or(default_len);
        let spec_ok = ModelSpec {
            name: spec.to_string(),
            arch,
            seq_len,
            weights,
            source_config,
            tile: None,
        };
        spec_ok
            .check_seq_len()
            .map_err(|e| err(format!("--model {spec}: {e}")))?;
        Ok(spec_ok)
    }

    /// The most positions the architecture takes: its position table, or a config's
    /// max_position_embeddings.
    pub fn max_positions(&self) -> usize {
        match &self.arch {
            Arch::Gpt(c) => c.seq_len,
            Arch::Gpt2(c) => c.gpt.seq_len,
            Arch::Llama(c) => c.max_position_embeddings,
        }
    }

    fn check_seq_len(&self) -> Result<(), String> {
        if self.seq_len == 0 {
            return Err("the sequence length must be positive".into());
        }
        let positions = match &self.arch {
            Arch::Gpt(c) => Some(c.seq_len),
            Arch::Gpt2(c) => Some(c.gpt.seq_len),
            Arch::Llama(_) => None,
        };
        match positions {
            Some(t) if self.seq_len > t => Err(format!(
                "sequence length {} is longer than the model's {t} positions (its position table)",
                self.seq_len
            )),
            _ => Ok(()),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match &self.arch {
            Arch::Gpt(c) => c.vocab_size,
            Arch::Gpt2(c) => c.gpt.vocab_size,
            Arch::Llama(c) => c.vocab_size,
        }
    }

    /// The model width (HF's `hidden_size`, which "auto" values of a ds_config read).
    pub fn hidden_size(&self) -> usize {
        match &self.arch {
            Arch::Gpt(c) => c.hidden,
            Arch::Gpt2(c) => c.gpt.hidden,
            Arch::Llama(c) => c.hidden_size,
        }
    }

    pub fn n_params(&self) -> usize {
        match &self.arch {
            Arch::Gpt(c) => c.n_params(),
            Arch::Gpt2(c) => c.gpt.n_params_of(&c.variant),
            Arch::Llama(c) => c.n_params(),
        }
    }

    /// Transformer blocks (decoder layers).
    pub fn blocks(&self) -> usize {
        match &self.arch {
            Arch::Gpt(c) => c.layers,
            Arch::Gpt2(c) => c.gpt.layers,
            Arch::Llama(c) => c.num_hidden_layers,
        }
    }

    /// Model FLOPs per trained token, forward and backward.
    pub fn flops_per_token(&self) -> f64 {
        match &self.arch {
            Arch::Gpt(c) => c.flops_per_token(),
            Arch::Gpt2(c) => c.gpt.flops_per_token_of(&c.variant),
            Arch::Llama(c) => c.flops_per_token(self.seq_len),
        }
    }

    /// Whether tensor parallelism of degree `tp` can split the model.
    pub fn check_tp(&self, tp: usize) -> Result<(), String> {
        match &self.arch {
            Arch::Gpt(c) => c.check_tp(tp),
            Arch::Gpt2(c) => c.gpt.check_tp_of(tp, &c.variant),
            Arch::Llama(c) => c.check_tp(tp),
        }
    }

    /// Whether expert parallelism of size `ep` splits the model's experts evenly.
    pub fn check_ep(&self, ep: usize) -> Result<(), String> {
        match &self.arch {
            Arch::Llama(c) => c.check_ep(ep),
            Arch::Gpt(c) => c.check_ep(ep),
            _ if ep > 1 => Err(format!(
                "expert-parallel size {ep}: {} has no experts",
                self.architecture()
            )),
            _ => Ok(()),
        }
    }

    /// Whether the ds_config's AutoEP section (`expert_parallel`) describes this model: its
    /// `preset_model` is the model's family, its `top_k` the model's.
    pub fn check_expert_parallel(
        &self,
        preset_model: Option<&str>,
        top_k: Option<usize>,
    ) -> Result<(), String> {
        let moe = match &self.arch {
            Arch::Llama(c) => c.moe.as_ref().map(|m| (c.family.model_type(), m.top_k)),
            Arch::Gpt(c) => c
                .moe
                .map(|m| ("the built-in MoE GPT (DeepSpeed-MoE's)", m.k)),
            _ => None,
        };
        match (preset_model, moe) {
            (Some(preset), Some((family, _))) if preset != family => {
                return Err(format!(
                    "expert_parallel.preset_model \"{preset}\" is not this model's family, \"{family}\""
                ))
            }
            (Some(preset), None) => {
                return Err(format!(
                    "expert_parallel.preset_model \"{preset}\": {} has no experts",
                    self.architecture()
                ))
            }
            _ => {}
        }
        match (top_k, moe) {
            (Some(k), Some((_, own))) if k != own => Err(format!(
                "expert_parallel.top_k {k}: the model routes each token to {own} experts (num_experts_per_tok)"
            )),
            _ => Ok(()),
        }
    }

    /// Whether pipeline parallelism of `pp` stages can cut the model: the router's
    /// load-balancing loss of a mixture of experts (`output_router_logits`) needs every sparse
    /// layer in the process that computes the loss.
    pub fn check_pp(&self, pp: usize) -> Result<(), String> {
        let aux = match &self.arch {
            Arch::Llama(c) => c
                .moe
                .as_ref()
                .is_some_and(|m| m.router_aux_loss_coef.is_some()),
            _ => false,
        };
        match aux && pp > 1 {
            true => Err(format!(
                "output_router_logits (the router's load-balancing loss over all layers) with {pp} pipeline stages is not built yet"
            )),
            false => Ok(()),
        }
    }

    /// Whether sequence parallelism of size `sp` (Ulysses) can split the model's sequences
    /// of `seq_len` positions and its attention heads at tensor-parallel degree `tp`.
    pub fn check_sp(&self, sp: usize, tp: usize) -> Result<(), String> {
        if sp == 0 || !self.seq_len.is_multiple_of(sp) {
            return Err(format!(
                "sequence-parallel size {sp} does not divide the sequence length {} (--seq-len)",
                self.seq_len
            ));
        }
        match &self.arch {
            Arch::Gpt(c) => c.check_sp(sp, tp),
            Arch::Gpt2(c) => c.gpt.check_sp(sp, tp),
            Arch::Llama(c) => c.check_sp(sp, tp),
        }
    }

    /// The same model computing its MLPs and its loss `tile` positions at a time.
    pub fn with_tile(mut self, tile: Option<usize>) -> ModelSpec {
        self.tile = tile;
        self
    }

    /// Whether the model's tiles (`with_tile`) work at tensor-parallel degree `tp`.
    pub fn check_tile(&self, tp: usize) -> Result<(), String> {
        check_tile(self.tile, tp)
    }

    /// The model's layers, split over `tp`.
    pub fn build(&self, tp: &Tp) -> Result<Model, String> {
        self.build_with(&Parallel::tensor(tp.clone()))
    }

    /// The model's layers in layout `p`: split over its tensor-parallel group, a mixture of
    /// experts' experts over its expert-parallel group, the sequences over its
    /// sequence-parallel group.
    pub fn build_with(&self, p: &Parallel) -> Result<Model, String> {
        self.check_ep(p.ep.size())?;
        let p = &p.clone().with_tile(p.tile.or(self.tile));
        match &self.arch {
            Arch::Gpt(c) => c.build_with(p, &gpt::GptVariant::peer(c)),
            Arch::Gpt2(c) => c.gpt.build_with(p, &c.variant),
            Arch::Llama(c) => llama::build(c, p),
        }
    }

    /// The architecture's name for reports: "GPT" or transformers' class.
    pub fn architecture(&self) -> &'static str {
        match &self.arch {
            Arch::Gpt(c) if c.moe.is_some() => "GPT-MoE",
            Arch::Gpt(_) => "GPT",
            Arch::Gpt2(_) => "GPT2LMHeadModel",
            Arch::Llama(c) => c.family.architecture(),
        }
    }

    /// The sizes for summary.json: the GPT's V, T, d, H, L, or config.json's names.
    pub fn summary(&self) -> serde_json::Value {
        let mut v = match &self.arch {
            Arch::Gpt(c) => {
                let mut v = serde_json::json!({"V": c.vocab_size, "T": c.seq_len, "d": c.hidden, "H": c.heads, "L": c.layers});
                if let Some(m) = &c.moe {
                    v["moe"] = serde_json::to_value(m).unwrap_or_default();
                }
                v
            }
            Arch::Gpt2(c) => c.to_hf_json(),
            Arch::Llama(c) => serde_json::json!({
                "model_type": c.family.model_type(),
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_hidden_layers,
                "num_attention_heads": c.num_attention_heads,
                "num_key_value_heads": c.num_key_value_heads,
                "tie_word_embeddings": c.tie_word_embeddings,
            }),
        };
        v["architecture"] = self.architecture().into();
        v["seq_len"] = self.seq_len.into();
        v["parameters"] = self.n_params().into();
        v["from_weights"] = self
            .weights
            .as_ref()
            .map(|p| p.display().to_string())
            .into();
        v
    }

    /// config.json of the model in transformers' form: the source directory's as read, or one
    /// made from a preset; None for the built-in GPT, which has no Hugging Face form.
    pub fn hf_config(&self) -> Option<serde_json::Value> {
        match (&self.arch, &self.source_config) {
            (Arch::Gpt(_), _) => None,
            (_, Some(json)) => Some(json.clone()),
            (Arch::Gpt2(c), None) => Some(c.to_hf_json()),
            (Arch::Llama(c), None) => Some(c.to_hf_json()),
        }
    }
}

/// What the job plan asks of a model (`ds_nn::JobPlan`).
impl ds_nn::Architecture for ModelSpec {
    fn describe(&self) -> String {
        format!("--model {}", self.name)
    }

    fn hidden_size(&self) -> usize {
        ModelSpec::hidden_size(self)
    }

    fn check_layout(&self, config: &ds_config::Config) -> Result<(), String> {
        let dims = config.dims;
        self.check_tp(dims.tp)?;
        self.check_ep(dims.ep)?;
        self.check_pp(dims.pp)?;
        self.check_sp(dims.sp, dims.tp)?;
        self.check_tile(dims.tp)?;
        // DeepSpeed reads the section only when it is enabled
        let ep = Some(&config.expert_parallel).filter(|e| e.enabled);
        let preset = ep.and_then(|e| e.preset_model.as_deref());
        self.check_expert_parallel(preset, ep.and_then(|e| e.top_k))
    }

    fn build(&self, parallel: &Parallel) -> Result<Model, String> {
        self.build_with(parallel)
    }

    fn weights(&self) -> Option<PathBuf> {
        self.weights.clone()
    }
}

/// Whether tensor parallelism of degree `tp` divides every named size of a model (heads, MLP
/// width, vocabulary); the error names the sizes it does not.
pub(crate) fn check_tp_divides(tp: usize, sizes: &[(&str, usize)]) -> Result<(), String> {
    let bad: Vec<String> = sizes
        .iter()
        .filter(|(_, n)| tp == 0 || !n.is_multiple_of(tp))
        .map(|(what, n)| format!("{what} = {n}"))
        .collect();
    match bad.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "tensor-parallel degree {tp} does not divide the model's {}",
            bad.join(", ")
        )),
    }
}

/// Whether sequence parallelism of `sp` splits the attention heads each of `tp` ranks holds;
/// the error names the sizes that do not divide.
pub(crate) fn check_sp_divides(
    sp: usize,
    tp: usize,
    sizes: &[(&str, usize)],
) -> Result<(), String> {
    let bad: Vec<String> = sizes
        .iter()
        .filter(|(_, n)| !n.is_multiple_of(sp * tp))
        .map(|(what, n)| format!("{what} = {n}"))
        .collect();
    match bad.is_empty() {
        true => Ok(()),
        false => Err(format!(
            "sequence-parallel size {sp} x tensor-parallel degree {tp} does not divide the model's {} (each rank attends with whole heads)",
            bad.join(", ")
        )),
    }
}

/// Whether the MLPs and the loss can be computed `tile` positions at a time (Note [tiles]) at
/// tensor-parallel degree `tp`.
pub(crate) fn check_tile(tile: Option<usize>, tp: usize) -> Result<(), String> {
    match tile {
        Some(0) => Err("a tile of 0 positions: give at least 1".into()),
        Some(_) if tp > 1 => Err(format!(
            "tiled logits and loss with tensor-parallel degree {tp} are not built (the vocabulary-parallel loss splits the logits over the ranks instead)"
        )),
        _ => Ok(()),
    }
}

/// Every preset name, GPT's first.
pub fn preset_names() -> Vec<&'static str> {
    let gpt = crate::gpt::PRESETS.iter().map(|(n, _)| *n);
    gpt.chain(llama::presets().into_iter().map(|p| p.name))
        .collect()
}

/// A model directory's config.json, as an architecture and as read.
pub fn read_hf_config(dir: &Path) -> Result<(Arch, serde_json::Value), ModelError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let arch = Arch::from_hf_json(&v).map_err(|e| err(format!("{}: {e}", path.display())))?;
    Ok((arch, v))
}
