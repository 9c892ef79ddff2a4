//! The MoE GPT of DeepSpeed-MoE's examples (Megatron-DeepSpeed's `--num-experts` with
//! `--expert-interval 2`): the built-in GPT whose every `expert_interval`-th block's MLP is a
//! DeepSpeed-MoE layer of `num_experts` copies of it, with DeepSpeed's top-k gating,
//! capacity and load-balancing loss (moe::MoeLayer). Its parameters take DeepSpeed's module
//! names under the block's `mlp.`: `mlp.deepspeed_moe.gate.wg.weight`,
//! `mlp.deepspeed_moe.experts.deepspeed_experts.{e}.c_fc.weight`, ...

use serde::{Deserialize, Serialize};

use crate::moe::gating::{DropPolicy, GateConfig};
use crate::moe::{MoeLayer, MoeStyle};
use ds_nn::parallel::{Ep, Tp};

/// The mixture's settings, named as `deepspeed.moe.layer.MoE`'s arguments (a model JSON's
/// `"moe"` object).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GptMoe {
    pub num_experts: usize,
    /// Experts per token (`k`).
    #[serde(default = "one")]
    pub k: usize,
    /// Slots per expert relative to an even share of a micro-batch's tokens in training, and
    /// in evaluation.
    #[serde(default = "one_f64")]
    pub capacity_factor: f64,
    #[serde(default = "one_f64")]
    pub eval_capacity_factor: f64,
    #[serde(default = "four")]
    pub min_capacity: usize,
    /// Drop the tokens beyond an expert's capacity.
    #[serde(default = "yes")]
    pub drop_tokens: bool,
    /// The weight of each MoE layer's `l_aux` in the loss (Megatron-DeepSpeed's
    /// `--moe-loss-coeff`).
    #[serde(default = "aux_coef")]
    pub aux_loss_coef: f64,
    /// Every `expert_interval`-th block (the 2nd, 4th, ... for 2) holds experts.
    #[serde(default = "two")]
    pub expert_interval: usize,
    /// DeepSpeed's random token selection (an over-full expert keeps random tokens): read to
    /// be refused, since its draws are torch's generator's; ds-rs keeps the most probable.
    #[serde(default)]
    pub use_rts: bool,
    /// DeepSpeed's noise on the router's logits: read to be refused for the same reason.
    #[serde(default)]
    pub noisy_gate_policy: NoisyGate,
}

/// `noisy_gate_policy`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum NoisyGate {
    #[default]
    None,
    Jitter,
    RSample,
}

fn one() -> usize {
    1
}
fn one_f64() -> f64 {
    1.0
}
fn four() -> usize {
    4
}
fn yes() -> bool {
    true
}
fn aux_coef() -> f64 {
    0.01
}
fn two() -> usize {
    2
}

impl GptMoe {
    /// DeepSpeed-MoE's defaults (top-1, capacity factor 1, at least 4 slots, dropping) with
    /// `num_experts` experts every other block and 0.01 x l_aux.
    pub const fn top1(num_experts: usize) -> GptMoe {
        GptMoe {
            num_experts,
            k: 1,
            capacity_factor: 1.0,
            eval_capacity_factor: 1.0,
            min_capacity: 4,
            drop_tokens: true,
            aux_loss_coef: 0.01,
            expert_interval: 2,
            use_rts: false,
            noisy_gate_policy: NoisyGate::None,
        }
    }

    /// Whether block `i` (from 0) holds experts.
    pub fn holds_experts(&self, i: usize) -> bool {
        (i + 1).is_multiple_of(self.expert_interval)
    }

    /// How many of `blocks` blocks hold experts.
    pub fn moe_blocks(&self, blocks: usize) -> usize {
        (0..blocks).filter(|i| self.holds_experts(*i)).count()
    }

    pub fn gate(&self) -> GateConfig {
        GateConfig {
            k: self.k,
            capacity_factor: self.capacity_factor,
            min_capacity: self.min_capacity,
            drop_tokens: self.drop_tokens,
            drop_policy: DropPolicy::Probs,
        }
    }

    /// The MoE layer of a block of width `d` whose dense MLP is `mlp` wide.
    pub fn layer(&self, d: usize, mlp: usize, tp: &Tp, ep: &Ep) -> Result<MoeLayer, String> {
        MoeLayer::new(d, mlp, self.num_experts, self.gate(), self.aux_loss_coef)?
            .with_style(MoeStyle::GPT)
            .with_eval_capacity_factor(self.eval_capacity_factor)
            .map_err(|e| format!("moe.{}", e.trim_start_matches("moe: ")))?
            .parallel(tp, ep)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.use_rts {
            return Err("moe.use_rts true: random token selection draws from torch's generator, which ds-rs does not reproduce; an over-full expert keeps its most probable tokens with use_rts false".into());
        }
        if self.noisy_gate_policy != NoisyGate::None {
            return Err(format!(
                "moe.noisy_gate_policy {:?}: the router's noise draws from torch's generator, which ds-rs does not reproduce; use \"None\"",
                self.noisy_gate_policy
            ));
        }
        if self.expert_interval == 0 {
            return Err("moe.expert_interval must be at least 1".into());
        }
        if !(self.aux_loss_coef.is_finite() && self.aux_loss_coef >= 0.0) {
            return Err(format!(
                "moe.aux_loss_coef {} must be a number >= 0",
                self.aux_loss_coef
            ));
        }
        // the layer's own checks: experts, k, capacity factor
        self.layer(1, 1, &Tp::none(), &Ep::none()).map(|_| ())
    }

    /// Parameters of one MoE block's mixture beyond a dense MLP of width `m` (d + 2dm + m
    /// parameters): the router's E d and E - 1 more MLPs.
    pub fn extra_params(&self, d: usize, m: usize) -> usize {
        let mlp = 2 * d * m + m + d;
        self.num_experts * d + (self.num_experts - 1) * mlp
    }

    /// Parameters one token meets in an MoE block beyond a dense MLP: the router and k - 1
    /// more MLPs (the active parameters of FLOPs and MFU).
    pub fn extra_active_params(&self, d: usize, m: usize) -> usize {
        let mlp = 2 * d * m + m + d;
        self.num_experts * d + (self.k - 1) * mlp
    }
}
