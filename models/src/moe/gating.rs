//! DeepSpeed-MoE's routing (deepspeed/moe/sharded_moe.py: `top1gating`, `top2gating`,
//! `topkgating`): which experts each token goes to, where in each expert's buffer of
//! `capacity` slots, with which combine weight, the tokens dropped when an expert is full,
//! and the auxiliary load-balancing loss. The decisions are discrete, so they are computed
//! here on the host in f32, step for step as DeepSpeed computes them; the MoE layer makes
//! the differentiable parts (the kept gates, `l_aux`) from the router's logits with them.
//!
//! Not here: DeepSpeed's noise (`noisy_gate_policy`, the Gumbel sampling of top-2's second
//! expert) and random token selection (`use_rts`), which draw from torch's generator: the
//! layer refuses them for now.

/// How tokens are routed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateConfig {
    /// Experts per token.
    pub k: usize,
    /// Slots per expert relative to an even share of the tokens (`capacity_factor`, or
    /// `eval_capacity_factor` in evaluation).
    pub capacity_factor: f64,
    pub min_capacity: usize,
    /// Drop the tokens beyond an expert's capacity; else the capacity grows to the busiest
    /// expert's load.
    pub drop_tokens: bool,
    /// top-k (k > 2) only: which tokens an over-full expert keeps.
    pub drop_policy: DropPolicy,
}

/// `topkgating`'s `drop_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropPolicy {
    /// The tokens with the largest gate values.
    Probs,
    /// The first tokens in token order.
    Position,
}

/// One kept route of a token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Route {
    pub expert: usize,
    /// Its slot in the expert's buffer, below the capacity.
    pub slot: usize,
    /// The weight of the expert's output in the token's output.
    pub weight: f32,
}

/// The routing of `tokens` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub capacity: usize,
    /// The auxiliary load-balancing loss: `aux_scale` x the sum over experts of the mean gate
    /// times `choice_fraction`.
    pub l_aux: f32,
    /// Per expert: the share of the tokens that chose it (top-2: as first choice), the
    /// constant factor of `l_aux`.
    pub choice_fraction: Vec<f32>,
    pub aux_scale: f32,
    /// Per expert: the routes asked of it, dropped ones included.
    pub exp_counts: Vec<usize>,
    /// Per token: its kept routes.
    pub routes: Vec<Vec<Route>>,
}

impl Routing {
    /// DeepSpeed's dense `combine_weights` [tokens, experts, capacity], row-major (its
    /// dispatch mask is where they are not zero).
    pub fn combine_weights(&self, experts: usize) -> Vec<f32> {
        let c = self.capacity;
        let mut w = vec![0f32; self.routes.len() * experts * c];
        for (s, routes) in self.routes.iter().enumerate() {
            for r in routes {
                w[(s * experts + r.expert) * c + r.slot] += r.weight;
            }
        }
        w
    }
}

impl GateConfig {
    /// The most routes the gate keeps of `tokens` tokens over `experts`: all of them without
    /// dropping, else at most each expert's capacity (`capacity_factor * k` of an even share).
    pub fn max_routes(&self, tokens: usize, experts: usize) -> usize {
        let all = tokens * self.k;
        match self.drop_tokens {
            true => {
                let factor = self.capacity_factor * self.k as f64;
                let c = capacity(tokens, experts, factor, self.min_capacity).min(tokens);
                all.min(experts * c)
            }
            false => all,
        }
    }
}

/// Routes the tokens whose router logits are `logits` [tokens, experts] (row-major, f32).
/// `cfg.k` lies between 1 and `experts` (`MoeLayer::new` checks it).
pub fn route(logits: &[f32], experts: usize, cfg: &GateConfig) -> Routing {
    assert!(
        (1..=experts).contains(&cfg.k),
        "invariant: top-k {} within 1..={experts}",
        cfg.k
    );
    let tokens = logits.len() / experts;
    let gates: Vec<Vec<f32>> = logits.chunks(experts).map(softmax).collect();
    match cfg.k {
        1 => top1(&gates, experts, cfg),
        2 => top2(&gates, experts, cfg),
        _ => topk(&gates, experts, tokens, cfg),
    }
}

/// `_capacity`: ceil(tokens / experts x factor) in f32, at least `min_capacity`.
fn capacity(tokens: usize, experts: usize, factor: f64, min_capacity: usize) -> usize {
    let even = (tokens as f64 / experts as f64) as f32;
    ((even * factor as f32).ceil() as usize).max(min_capacity)
}

fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

/// The first index of the largest value (torch's argmax).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Per expert, the share of tokens `chosen` (a 0/1 mask) routes to it.
fn fractions(chosen: &[Vec<bool>], experts: usize) -> Vec<f32> {
    let n = chosen.len() as f32;
    counts(chosen, experts)
        .iter()
        .map(|&c| c as f32 / n)
        .collect()
}

/// The sum over experts of the mean gate times `ce`: the core of every `l_aux`.
fn balance(gates: &[Vec<f32>], ce: &[f32]) -> f32 {
    let n = gates.len() as f32;
    ce.iter()
        .enumerate()
        .map(|(e, ce)| gates.iter().map(|g| g[e]).sum::<f32>() / n * ce)
        .sum()
}

fn counts(chosen: &[Vec<bool>], experts: usize) -> Vec<usize> {
    (0..experts)
        .map(|e| chosen.iter().filter(|c| c[e]).count())
        .collect()
}

/// The busiest expert's load: the capacity when no token is dropped.
fn busiest(counts: &[usize]) -> usize {
    counts.iter().copied().max().unwrap_or(0)
}

/// `top1gating` with `use_rts=False`: each token to its most likely expert; an over-full
/// expert keeps its first tokens; the weight is the gate itself (not renormalised).
fn top1(gates: &[Vec<f32>], experts: usize, cfg: &GateConfig) -> Routing {
    let tokens = gates.len();
    let first: Vec<usize> = gates.iter().map(|g| argmax(g)).collect();
    let chosen: Vec<Vec<bool>> = first.iter().map(|&e| one_hot(e, experts)).collect();
    let exp_counts = counts(&chosen, experts);
    let capacity = match cfg.drop_tokens {
        true => capacity(tokens, experts, cfg.capacity_factor, cfg.min_capacity),
        false => busiest(&exp_counts).min(tokens),
    };
    let choice_fraction = fractions(&chosen, experts);
    let aux_scale = experts as f32;
    let l_aux = balance(gates, &choice_fraction) * aux_scale;
    let mut used = vec![0usize; experts];
    let routes = first
        .iter()
        .zip(gates)
        .map(|(&e, g)| match used[e] < capacity.min(tokens) {
            true => {
                used[e] += 1;
                vec![Route {
                    expert: e,
                    slot: used[e] - 1,
                    weight: g[e],
                }]
            }
            false => Vec::new(),
        })
        .collect();
    Routing {
        capacity,
        l_aux,
        choice_fraction,
        aux_scale,
        exp_counts,
        routes,
    }
}

/// `top2gating` without the Gumbel sampling: the two most likely experts; second choices
/// queue behind every first choice of their expert; kept gates renormalised over the two.
fn top2(gates: &[Vec<f32>], experts: usize, cfg: &GateConfig) -> Routing {
    let tokens = gates.len();
    let first: Vec<usize> = gates.iter().map(|g| argmax(g)).collect();
    let second: Vec<usize> = gates
        .iter()
        .zip(&first)
        .map(|(g, &f)| {
            let masked: Vec<f32> = (0..experts)
                .map(|e| if e == f { f32::NEG_INFINITY } else { g[e] })
                .collect();
            argmax(&masked)
        })
        .collect();
    let chosen1: Vec<Vec<bool>> = first.iter().map(|&e| one_hot(e, experts)).collect();
    let chosen2: Vec<Vec<bool>> = second.iter().map(|&e| one_hot(e, experts)).collect();
    // DeepSpeed: mean over experts of me x ce, times experts squared
    let choice_fraction = fractions(&chosen1, experts);
    let aux_scale = experts as f32;
    let l_aux = balance(gates, &choice_fraction) / experts as f32 * (experts * experts) as f32;
    let c1 = counts(&chosen1, experts);
    let exp_counts: Vec<usize> = c1
        .iter()
        .zip(counts(&chosen2, experts))
        .map(|(a, b)| a + b)
        .collect();
    let capacity = match cfg.drop_tokens {
        true => capacity(tokens, experts, cfg.capacity_factor * 2.0, cfg.min_capacity),
        false => busiest(&exp_counts),
    };
    // slots: first choices in token order, then second choices after all first ones
    let (mut used1, mut used2) = (vec![0usize; experts], c1.clone());
    let routes = (0..tokens)
        .map(|s| {
            let (e1, e2) = (first[s], second[s]);
            let (slot1, slot2) = (used1[e1], used2[e2]);
            used1[e1] += 1;
            used2[e2] += 1;
            let keep1 = slot1 < capacity;
            let keep2 = slot2 < capacity;
            let g1 = if keep1 { gates[s][e1] } else { 0.0 };
            let g2 = if keep2 { gates[s][e2] } else { 0.0 };
            let denom = (g1 + g2).max(f32::EPSILON);
            let mut r = Vec::new();
            if keep1 {
                r.push(Route {
                    expert: e1,
                    slot: slot1,
                    weight: g1 / denom,
                });
            }
            if keep2 {
                r.push(Route {
                    expert: e2,
                    slot: slot2,
                    weight: g2 / denom,
                });
            }
            r
        })
        .collect();
    Routing {
        capacity,
        l_aux,
        choice_fraction,
        aux_scale,
        exp_counts,
        routes,
    }
}

/// `topkgating`: the k most likely experts; an over-full expert keeps the tokens with the
/// largest gates (`Probs`) or its first tokens (`Position`); kept gates renormalised.
fn topk(gates: &[Vec<f32>], experts: usize, tokens: usize, cfg: &GateConfig) -> Routing {
    let k = cfg.k;
    let mut chosen: Vec<Vec<bool>> = gates
        .iter()
        .map(|g| {
            let mut order: Vec<usize> = (0..experts).collect();
            // descending; ties to the lower index, as torch.topk on distinct values
            order.sort_by(|&a, &b| g[b].total_cmp(&g[a]).then(a.cmp(&b)));
            let mut c = vec![false; experts];
            for &e in &order[..k.min(experts)] {
                c[e] = true;
            }
            c
        })
        .collect();
    let exp_counts = counts(&chosen, experts);
    let choice_fraction = fractions(&chosen, experts);
    let aux_scale = experts as f32 / k as f32;
    let l_aux =
        balance(gates, &choice_fraction) / experts as f32 * (experts * experts) as f32 / k as f32;
    let capacity = match cfg.drop_tokens {
        true => capacity(
            tokens,
            experts,
            cfg.capacity_factor * k as f64,
            cfg.min_capacity,
        ),
        false => busiest(&exp_counts),
    };
    if cfg.drop_tokens {
        match cfg.drop_policy {
            DropPolicy::Probs => keep_largest(gates, &mut chosen, capacity.min(tokens)),
            DropPolicy::Position => keep_first(&mut chosen, capacity),
        }
    }
    // a slot counts the kept tokens before it in its expert (DeepSpeed counts the routed
    // ones under the position policy, which are the same: it keeps an expert's first tokens)
    let mut used = vec![0usize; experts];
    let routes = (0..tokens)
        .map(|s| {
            let kept: Vec<usize> = (0..experts).filter(|&e| chosen[s][e]).collect();
            let denom = kept
                .iter()
                .map(|&e| gates[s][e])
                .sum::<f32>()
                .max(f32::EPSILON);
            kept.into_iter()
                .map(|e| {
                    used[e] += 1;
                    Route {
                        expert: e,
                        slot: used[e] - 1,
                        weight: gates[s][e] / denom,
                    }
                })
                .collect()
        })
        .collect();
    Routing {
        capacity,
        l_aux,
        choice_fraction,
        aux_scale,
        exp_counts,
        routes,
    }
}

/// `Probs`: each expert keeps the `capacity` routed tokens with the largest gates.
fn keep_largest(gates: &[Vec<f32>], chosen: &mut [Vec<bool>], capacity: usize) {
    let experts = chosen.first().map_or(0, Vec::len);
    for e in 0..experts {
        let mut routed: Vec<usize> = (0..chosen.len()).filter(|&s| chosen[s][e]).collect();
        routed.sort_by(|&a, &b| gates[b][e].total_cmp(&gates[a][e]).then(a.cmp(&b)));
        for &s in routed.iter().skip(capacity) {
            chosen[s][e] = false;
        }
    }
}

/// `Position`: each expert keeps its first `capacity` routed tokens.
fn keep_first(chosen: &mut [Vec<bool>], capacity: usize) {
    let experts = chosen.first().map_or(0, Vec::len);
    for e in 0..experts {
        let mut seen = 0;
        for c in chosen.iter_mut() {
            if c[e] {
                c[e] = seen < capacity;
                seen += 1;
            }
        }
    }
}

fn one_hot(e: usize, experts: usize) -> Vec<bool> {
    (0..experts).map(|i| i == e).collect()
}
