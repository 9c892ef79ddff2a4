//! SGD with momentum, as torch.optim.SGD computes it (DeepSpeed takes `"type": "SGD"` from
//! torch.optim): `d = g + wd * p`; with momentum, `buf = d` on the first step and
//! `buf = momentum * buf + (1 - dampening) * d` after; `d = d + momentum * buf` (Nesterov) or
//! `d = buf`; `p -= lr * d`.

use rayon::prelude::*;

use super::{
    check_len, Group, GroupHyper, OptimError, Optimizer, OptimizerState, SgdParams, BLOCK, LANES,
};

/// SGD over one shard. As in torch, the momentum buffer is set to the first gradient (not
/// decayed from zero) on the first step taken with momentum != 0; `live` says that happened.
#[derive(Debug, Clone)]
pub struct Sgd {
    hp: SgdParams,
    shard_len: usize,
    step: u64,
    /// Allocated at construction when momentum != 0 (so the memory report is right before the
    /// first step), else on the first step with momentum != 0 (OneCycle may raise it from 0).
    buf: Vec<f32>,
    live: bool,
    /// The parameter groups' settings (`Optimizer::set_groups`; one group: SGD's own).
    groups: Vec<GroupHyper>,
    /// The constants of the step begun (one set per group), and whether it is the first
    /// with a live buffer.
    begun: Option<(Vec<Consts>, bool)>,
}

/// The per-step scalars in f32, computed once.
#[derive(Debug, Clone, Copy)]
struct Consts {
    weight_decay: f32,
    momentum: f32,
    one_minus_dampening: f32,
    neg_lr: f32,
}

impl Sgd {
    pub fn new(hp: SgdParams, shard_len: usize) -> Sgd {
        let len = if hp.momentum != 0.0 { shard_len } else { 0 };
        Sgd {
            hp,
            shard_len,
            step: 0,
            buf: vec![0.0; len],
            live: false,
            groups: vec![GroupHyper::DEFAULT],
            begun: None,
        }
    }

    fn consts(&self, lr: f64, weight_decay: f64) -> Consts {
        Consts {
            weight_decay: weight_decay as f32,
            momentum: self.hp.momentum as f32,
            one_minus_dampening: (1.0 - self.hp.dampening) as f32,
            neg_lr: -lr as f32,
        }
    }
}

impl Optimizer for Sgd {
    fn set_groups(&mut self, groups: Vec<GroupHyper>) {
        self.groups = groups;
    }

    fn begin(&mut self, lr: f64) {
        self.step += 1;
        let first = !self.live;
        if self.hp.momentum != 0.0 {
            self.buf.resize(self.shard_len, 0.0);
            self.live = true;
        }
        let consts = self.groups.iter().map(|g| {
            let wd = g.weight_decay.unwrap_or(self.hp.weight_decay);
            self.consts(lr * g.lr_scale, wd)
        });
        self.begun = Some((consts.collect(), first));
    }

    fn update(&mut self, at: usize, params: &mut [f32], grads: &[f32], group: Group) {
        let n = params.len();
        assert_eq!(grads.len(), n, "Sgd::update: grads length != params length");
        assert!(
            at + n <= self.shard_len,
            "Sgd::update: part beyond the shard"
        );
        let (k, first) = self.begun.as_ref().expect("Sgd::update: begin() first");
        let (k, first) = (k[group.0], *first);
        if self.hp.momentum == 0.0 {
            return for_blocks(params, grads, &mut [], |p, g, _| plain(&k, p, g));
        }
        let nesterov = self.hp.nesterov;
        let kernel: Kernel = match (first, nesterov) {
            (true, true) => momentum::<true, true>,
            (true, false) => momentum::<true, false>,
            (false, true) => momentum::<false, true>,
            (false, false) => momentum::<false, false>,
        };
        let buf = &mut self.buf[at..at + n];
        for_blocks(params, grads, buf, |p, g, b| kernel(&k, p, g, b));
    }

    fn shard_len(&self) -> usize {
        self.shard_len
    }

    fn state_bytes(&self) -> usize {
        self.buf.len() * std::mem::size_of::<f32>()
    }

    fn state(&self) -> OptimizerState<'_> {
        let buffers = match self.live {
            true => vec![("momentum_buffer", &self.buf[..])],
            false => Vec::new(),
        };
        OptimizerState {
            step: self.step,
            buffers,
        }
    }

    fn state_names(&self) -> Vec<&'static str> {
        match self.hp.momentum != 0.0 {
            true => vec!["momentum_buffer"],
            false => Vec::new(),
        }
    }

    fn state_mut(&mut self) -> Vec<&mut [f32]> {
        match self.hp.momentum != 0.0 {
            true => vec![&mut self.buf[..]],
            false => Vec::new(),
        }
    }

    /// A checkpoint without `momentum_buffer` is torch's state before any momentum step.
    fn load_state(&mut self, state: &OptimizerState<'_>) -> Result<(), OptimError> {
        let mut loaded = None;
        for &(name, buf) in &state.buffers {
            if name != "momentum_buffer" {
                let optimizer = "SGD";
                return Err(OptimError::UnknownState {
                    name: name.to_string(),
                    optimizer,
                });
            }
            check_len(name, buf, self.shard_len)?;
            loaded = Some(buf);
        }
        match loaded {
            Some(buf) => self.buf = buf.to_vec(),
            None => self.buf.iter_mut().for_each(|b| *b = 0.0),
        }
        self.live = loaded.is_some();
        self.step = state.step;
        Ok(())
    }

    fn set_momentum(&mut self, momentum: f64) {
        self.hp.momentum = momentum;
    }
}

/// Runs `f` over matching BLOCK-sized pieces of the shard, on rayon's threads when there is
/// more than one block. `buf` is empty when SGD has no momentum.
fn for_blocks<F>(p: &mut [f32], g: &[f32], buf: &mut [f32], f: F)
where
    F: Fn(&mut [f32], &[f32], &mut [f32]) + Sync,
{
    if p.len() <= BLOCK {
        return f(p, g, buf);
    }
    if buf.is_empty() {
        let blocks = p.par_chunks_mut(BLOCK).zip(g.par_chunks(BLOCK));
        return blocks.for_each(|(p, g)| f(p, g, &mut []));
    }
    let blocks = p.par_chunks_mut(BLOCK).zip(g.par_chunks(BLOCK));
    blocks
        .zip(buf.par_chunks_mut(BLOCK))
        .for_each(|((p, g), b)| f(p, g, b));
}

/// `p -= lr * (g + wd * p)`: no buffer to read or write.
fn plain(k: &Consts, p: &mut [f32], g: &[f32]) {
    let mut pc = p.chunks_exact_mut(LANES);
    let mut gc = g.chunks_exact(LANES);
    for (p, g) in (&mut pc).zip(&mut gc) {
        for i in 0..LANES {
            p[i] += k.neg_lr * (g[i] + k.weight_decay * p[i]);
        }
    }
    for (p, g) in pc.into_remainder().iter_mut().zip(gc.remainder()) {
        *p += k.neg_lr * (g + k.weight_decay * *p);
    }
}

type Kernel = fn(&Consts, &mut [f32], &[f32], &mut [f32]);

/// The momentum update of one block; FIRST and NESTEROV are constants so each of the four
/// loops is branch-free.
fn momentum<const FIRST: bool, const NESTEROV: bool>(
    k: &Consts,
    p: &mut [f32],
    g: &[f32],
    b: &mut [f32],
) {
    let mut pc = p.chunks_exact_mut(LANES);
    let mut gc = g.chunks_exact(LANES);
    let mut bc = b.chunks_exact_mut(LANES);
    for ((p, g), b) in (&mut pc).zip(&mut gc).zip(&mut bc) {
        for i in 0..LANES {
            update::<FIRST, NESTEROV>(k, &mut p[i], g[i], &mut b[i]);
        }
    }
    let tail = pc.into_remainder().iter_mut().zip(gc.remainder());
    for ((p, g), b) in tail.zip(bc.into_remainder()) {
        update::<FIRST, NESTEROV>(k, p, *g, b);
    }
}

/// One element, in torch's order of operations.
#[inline(always)]
fn update<const FIRST: bool, const NESTEROV: bool>(k: &Consts, p: &mut f32, g: f32, b: &mut f32) {
    let d = g + k.weight_decay * *p;
    let b_new = if FIRST {
        d
    } else {
        *b * k.momentum + k.one_minus_dampening * d
    };
    let d = if NESTEROV {
        d + k.momentum * b_new
    } else {
        b_new
    };
    *p += k.neg_lr * d;
    *b = b_new;
}
