//! Megatron-LM's interleaved 1F1B schedule (virtual pipeline stages), a ds-rs extension of
//! DeepSpeed's `pipeline` section (`pipeline.virtual_stages`).
//!
//! Each of the `stages` ranks holds `chunks` model chunks: with `V = stages * chunks` virtual
//! stages of the layers, rank `r` runs virtual stages `r, r + stages, r + 2 stages, ...`. A
//! micro-batch therefore passes every rank `chunks` times, and the pipeline fills and drains
//! in chunk-sized pieces: the idle fraction falls from `(p - 1) / (m + p - 1)` to
//! `(p - 1) / (v m + p - 1)`.
//!
//! Each rank's order of computations is Megatron's (`forward_backward_pipelining_with_
//! interleaving`): warm-up forwards, then one forward and one backward alternately, then the
//! remaining backwards. Note [interleaved ticks]: when each transfer happens is decided here,
//! by simulating the schedule in ticks: at a tick, every rank runs its next computation if its
//! input arrived at an earlier tick, and every output is exchanged with the neighbour at the
//! end of the tick it was computed in. A rank's exchange at tick `t` pairs only with its
//! neighbours' exchanges at tick `t` (both ends derive it from the same simulation), so
//! exchanges at each tick complete before anything of a later tick is needed: executing the
//! ticks in order, with one combined send+receive per tick, cannot deadlock, even though the
//! transfers from the last rank back to the first make the pipeline a ring.

use std::collections::HashMap;

/// Which computation: the forward or the backward of micro-batch `micro` over this rank's
/// model chunk `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Work {
    pub chunk: usize,
    pub micro: usize,
    pub forward: bool,
}

/// A tensor crossing between ranks: an activation (forward) or the gradient of one
/// (backward), for micro-batch `micro` and this rank's chunk `chunk` (the chunk that produced
/// it when sending, the chunk that will use it when receiving).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub peer: usize,
    pub chunk: usize,
    pub micro: usize,
    pub activation: bool,
}

/// One tick of one rank: at most one computation, then one exchange (sends and receives
/// together; both lists in the same canonical order on both ends: activations first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tick {
    /// The tick's number in the simulation (the same for all ranks).
    pub at: usize,
    pub work: Option<Work>,
    pub sends: Vec<Transfer>,
    pub recvs: Vec<Transfer>,
}

impl Tick {
    fn is_empty(&self) -> bool {
        self.work.is_none() && self.sends.is_empty() && self.recvs.is_empty()
    }
}

/// Why an interleaved schedule cannot be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleError(pub String);

impl std::fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ScheduleError {}

/// The shape of an interleaved pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interleaving {
    pub stages: usize,
    pub chunks: usize,
    pub micro_batches: usize,
}

impl Interleaving {
    /// Megatron's conditions: at least two stages and two chunks, and a number of
    /// micro-batches that is a multiple of the stages (each round of `stages` micro-batches
    /// passes a chunk together).
    pub fn check(&self) -> Result<(), ScheduleError> {
        let Interleaving {
            stages,
            chunks,
            micro_batches,
        } = *self;
        if stages < 2 || chunks < 2 {
            return Err(ScheduleError(format!(
                "the interleaved schedule needs at least 2 stages and 2 virtual stages per rank (got {stages} stages x {chunks})"
            )));
        }
        if micro_batches == 0 || !micro_batches.is_multiple_of(stages) {
            return Err(ScheduleError(format!(
                "the interleaved schedule needs a number of micro-batches (gradient_accumulation_steps = {micro_batches}) that is a multiple of the pipeline stages ({stages}), as Megatron-LM's"
            )));
        }
        Ok(())
    }

    fn virtual_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// The rank and chunk of virtual stage `v`.
    fn place(&self, v: usize) -> (usize, usize) {
        (v % self.stages, v / self.stages)
    }

    /// Megatron's order of computations on `rank`: the k-th forward works on chunk
    /// `(k / p) % v` of micro-batch `(k / (p v)) p + k % p`; backwards run the chunks in the
    /// reverse order.
    pub fn order(&self, rank: usize) -> Vec<Work> {
        let (p, v) = (self.stages, self.chunks);
        let total = self.micro_batches * v;
        let micro = |k: usize| (k / (p * v)) * p + k % p;
        let fwd = |k: usize| Work {
            chunk: (k / p) % v,
            micro: micro(k),
            forward: true,
        };
        let bwd = |k: usize| Work {
            chunk: v - 1 - (k / p) % v,
            micro: micro(k),
            forward: false,
        };
        let warmup = match self.micro_batches == p {
            true => total,
            false => ((p - rank - 1) * 2 + (v - 1) * p).min(total),
        };
        let mut order: Vec<Work> = (0..warmup).map(fwd).collect();
        for i in 0..total - warmup {
            order.push(fwd(warmup + i));
            order.push(bwd(i));
        }
        order.extend((total - warmup..total).map(bwd));
        order
    }
}

/// The ticks of every rank (Note [interleaved ticks]), empty ticks left out.
pub fn interleaved_schedule(shape: Interleaving) -> Result<Vec<Vec<Tick>>, ScheduleError> {
    shape.check()?;
    let p = shape.stages;
    let last = p * shape.chunks - 1;
    let orders: Vec<Vec<Work>> = (0..p).map(|r| shape.order(r)).collect();
    let mut next = vec![0usize; p];
    // (virtual stage, micro-batch, activation?) -> the tick its input arrived at
    let mut arrived: HashMap<(usize, usize, bool), usize> = HashMap::new();
    let mut done_forward: HashMap<(usize, usize), usize> = HashMap::new();
    let mut ticks: Vec<Vec<Tick>> = vec![Vec::new(); p];
    let mut tick = 0;
    while (0..p).any(|r| next[r] < orders[r].len()) {
        let mut row: Vec<Tick> = vec![
            Tick {
                at: tick,
                ..Tick::default()
            };
            p
        ];
        let mut progress = false;
        for r in 0..p {
            let Some(&w) = orders[r].get(next[r]) else {
                continue;
            };
            let v = shape.virtual_stage(r, w.chunk);
            let ready_before = |t: Option<&usize>| t.is_some_and(|&t| t < tick);
            let ready = match w.forward {
                true => v == 0 || ready_before(arrived.get(&(v, w.micro, true))),
                false => {
                    ready_before(done_forward.get(&(v, w.micro)))
                        && (v == last || ready_before(arrived.get(&(v, w.micro, false))))
                }
            };
            if !ready {
                continue;
            }
            progress = true;
            next[r] += 1;
            row[r].work = Some(w);
            if w.forward {
                done_forward.insert((v, w.micro), tick);
            }
            // the output goes to the neighbouring virtual stage, if any
            let to = match w.forward {
                true => (v < last).then(|| v + 1),
                false => v.checked_sub(1),
            };
            if let Some(to) = to {
                let (peer, chunk) = shape.place(to);
                arrived.insert((to, w.micro, w.forward), tick);
                row[r].sends.push(Transfer {
                    peer,
                    chunk: w.chunk,
                    micro: w.micro,
                    activation: w.forward,
                });
                row[peer].recvs.push(Transfer {
                    peer: r,
                    chunk,
                    micro: w.micro,
                    activation: w.forward,
                });
            }
        }
        if !progress {
            return Err(ScheduleError(format!(
                "interleaved schedule for {shape:?} is stuck at tick {tick} (a bug: Megatron's order always progresses)"
            )));
        }
        for (r, mut t) in row.into_iter().enumerate() {
            // canonical order on both ends: activations first
            t.sends.sort_by_key(|x| !x.activation);
            t.recvs.sort_by_key(|x| !x.activation);
            if !t.is_empty() {
                ticks[r].push(t);
            }
        }
        tick += 1;
    }
    Ok(ticks)
}

/// The idle fraction of the interleaved schedule in theory (equal chunk times, a backward
/// costing as much as a forward): `(p - 1) / (v m + p - 1)`.
pub fn interleaved_bubble(shape: Interleaving) -> f64 {
    let p = shape.stages as f64;
    (p - 1.0) / (shape.chunks as f64 * shape.micro_batches as f64 + p - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes() -> impl Iterator<Item = Interleaving> {
        (2..=4).flat_map(|stages| {
            (2..=3).flat_map(move |chunks| {
                (1..=4).map(move |k| Interleaving {
                    stages,
                    chunks,
                    micro_batches: k * stages,
                })
            })
        })
    }

    /// Every micro-batch passes every virtual stage forward in order, then backward in
    /// reverse, each computation after its input arrived.
    #[test]
    fn every_micro_batch_crosses_every_virtual_stage_in_order() {
        for s in shapes() {
            let ticks = interleaved_schedule(s).unwrap();
            for (r, rank) in ticks.iter().enumerate() {
                let works: Vec<Work> = rank.iter().filter_map(|t| t.work).collect();
                assert_eq!(
                    works.len(),
                    2 * s.chunks * s.micro_batches,
                    "{s:?} rank {r}"
                );
                for w in &works {
                    let f = works
                        .iter()
                        .position(|x| x.forward && x.chunk == w.chunk && x.micro == w.micro);
                    let b = works
                        .iter()
                        .position(|x| !x.forward && x.chunk == w.chunk && x.micro == w.micro);
                    assert!(f < b, "{s:?} rank {r}: {w:?}");
                }
            }
        }
    }

    /// A send of rank r to rank q at its k-th exchange with q meets q's k-th receive from r,
    /// for the same micro-batch and kind, into the next virtual stage.
    #[test]
    fn sends_and_receives_pair_up_per_link() {
        for s in shapes() {
            let ticks = interleaved_schedule(s).unwrap();
            for r in 0..s.stages {
                for q in 0..s.stages {
                    let sent: Vec<Transfer> = ticks[r]
                        .iter()
                        .flat_map(|t| t.sends.iter().filter(|x| x.peer == q).copied())
                        .collect();
                    let got: Vec<Transfer> = ticks[q]
                        .iter()
                        .flat_map(|t| t.recvs.iter().filter(|x| x.peer == r).copied())
                        .collect();
                    assert_eq!(sent.len(), got.len(), "{s:?} {r}->{q}");
                    for (a, b) in sent.iter().zip(&got) {
                        assert_eq!((a.micro, a.activation), (b.micro, b.activation));
                        let from = s.virtual_stage(r, a.chunk);
                        let to = s.virtual_stage(q, b.chunk);
                        match a.activation {
                            true => assert_eq!(to, from + 1, "{s:?}"),
                            false => assert_eq!(to + 1, from, "{s:?}"),
                        }
                    }
                }
            }
        }
    }

    /// Interleaving shrinks the pipeline to Megatron's figure: in chunk-sized ticks, the
    /// 2 v m computations of a rank plus a fill and a drain of p - 1 ticks each, against
    /// plain 1F1B's 2 (m + p - 1) ticks of `chunks` chunks each over the same layers.
    #[test]
    fn interleaving_takes_megatrons_length() {
        for s in shapes() {
            let ticks = interleaved_schedule(s).unwrap();
            let length = 1 + ticks.iter().flatten().map(|t| t.at).max().unwrap();
            let plain = 2 * (s.micro_batches + s.stages - 1) * s.chunks;
            let megatron = 2 * s.micro_batches * s.chunks + 2 * (s.stages - 1);
            assert_eq!(length, megatron, "{s:?}");
            assert!(length < plain, "{s:?}: {length} vs {plain}");
        }
    }

    #[test]
    fn refuses_what_megatron_refuses() {
        let bad = |stages, chunks, micro_batches| {
            interleaved_schedule(Interleaving {
                stages,
                chunks,
                micro_batches,
            })
            .unwrap_err()
            .0
        };
        assert!(bad(2, 2, 3).contains("multiple of the pipeline stages (2)"));
        assert!(bad(1, 2, 4).contains("at least 2 stages"));
        assert!(bad(2, 1, 4).contains("2 virtual stages"));
    }
}
