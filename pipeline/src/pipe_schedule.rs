//! Pipeline schedules as data: for one stage, the steps of a batch, each a list of
//! instructions (DeepSpeed's `runtime/pipe/schedule.py`, instruction for instruction).
//!
//! Named "pipe schedules" so they are never mistaken for the learning-rate schedules of
//! ds-engine. A step is atomic: a barrier between two steps could not deadlock, because the
//! schedules pair every send of one stage with the matching receive of its neighbour in the
//! same step.

/// One instruction of a pipe schedule. `buffer` is the pipeline buffer (slot) that holds the
/// micro-batch's activations on this stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Instruction {
    /// Load a micro-batch's inputs (first stage) or labels (last stage) into `buffer`.
    LoadMicroBatch {
        buffer: usize,
    },
    ForwardPass {
        buffer: usize,
    },
    BackwardPass {
        buffer: usize,
    },
    SendActivation {
        buffer: usize,
    },
    RecvActivation {
        buffer: usize,
    },
    SendGrad {
        buffer: usize,
    },
    RecvGrad {
        buffer: usize,
    },
    /// All-reduce the gradients of parameters tied across stages.
    ReduceTiedGrads,
    /// Reduce the gradients over the data-parallel group.
    ReduceGrads,
    OptimizerStep,
}

impl Instruction {
    /// DeepSpeed's class name of the instruction.
    pub fn name(&self) -> &'static str {
        match self {
            Instruction::LoadMicroBatch { .. } => "LoadMicroBatch",
            Instruction::ForwardPass { .. } => "ForwardPass",
            Instruction::BackwardPass { .. } => "BackwardPass",
            Instruction::SendActivation { .. } => "SendActivation",
            Instruction::RecvActivation { .. } => "RecvActivation",
            Instruction::SendGrad { .. } => "SendGrad",
            Instruction::RecvGrad { .. } => "RecvGrad",
            Instruction::ReduceTiedGrads => "ReduceTiedGrads",
            Instruction::ReduceGrads => "ReduceGrads",
            Instruction::OptimizerStep => "OptimizerStep",
        }
    }

    /// The buffer a buffer instruction works on.
    pub fn buffer(&self) -> Option<usize> {
        match *self {
            Instruction::LoadMicroBatch { buffer }
            | Instruction::ForwardPass { buffer }
            | Instruction::BackwardPass { buffer }
            | Instruction::SendActivation { buffer }
            | Instruction::RecvActivation { buffer }
            | Instruction::SendGrad { buffer }
            | Instruction::RecvGrad { buffer } => Some(buffer),
            _ => None,
        }
    }
}

/// Which stage of how many runs a batch of how many micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagePlace {
    pub micro_batches: usize,
    pub stages: usize,
    pub stage: usize,
}

impl StagePlace {
    fn valid_micro_batch(&self, id: i64) -> bool {
        0 <= id && id < self.micro_batches as i64
    }
    fn has_prev(&self) -> bool {
        self.stage > 0
    }
    fn has_next(&self) -> bool {
        self.stage + 1 < self.stages
    }
    fn is_first(&self) -> bool {
        self.stage == 0
    }
    fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// DeepSpeed's `TrainSchedule`: synchronous 1F1B (PipeDream-Flush). Over
/// 2 (micro_batches + stages - 1) steps each stage alternates a forward and a backward
/// slot, so it holds at most `stages - stage` micro-batches' activations; the gradients are
/// reduced and the optimizer steps at the end of the batch.
pub fn train_schedule(p: StagePlace) -> Vec<Vec<Instruction>> {
    use Instruction::*;
    let buffers = train_buffers(p);
    let buffer = |mb: i64| mb as usize % buffers;
    let total = 2 * (p.micro_batches + p.stages - 1);
    let mut prev: i64 = -1;
    let mut steps = Vec::with_capacity(total);
    for step in 0..total {
        let (mb, forward) = step_to_micro_batch(p, step);
        let (prev_ok, curr_ok) = (p.valid_micro_batch(prev), p.valid_micro_batch(mb));
        let mut cmds = Vec::new();
        // exchange activations and gradients with the neighbours
        match forward {
            true => {
                if prev_ok && p.has_prev() {
                    cmds.push(SendGrad {
                        buffer: buffer(prev),
                    });
                }
                if curr_ok && p.has_prev() {
                    cmds.push(RecvActivation { buffer: buffer(mb) });
                }
            }
            false => {
                if curr_ok && p.has_next() {
                    cmds.push(RecvGrad { buffer: buffer(mb) });
                }
                if prev_ok && p.has_next() {
                    cmds.push(SendActivation {
                        buffer: buffer(prev),
                    });
                }
            }
        }
        if (p.is_first() || p.is_last()) && forward && curr_ok {
            cmds.push(LoadMicroBatch { buffer: buffer(mb) });
        }
        if curr_ok {
            cmds.push(match forward {
                true => ForwardPass { buffer: buffer(mb) },
                false => BackwardPass { buffer: buffer(mb) },
            });
        }
        if step + 1 == total {
            cmds.extend([ReduceTiedGrads, ReduceGrads, OptimizerStep]);
        }
        prev = mb;
        steps.push(cmds);
    }
    steps
}

/// The buffers `train_schedule` uses on a stage: the most micro-batches in flight there,
/// `stages - stage`, at least 2 (DeepSpeed's `num_pipe_buffers`).
pub fn train_buffers(p: StagePlace) -> usize {
    (p.stages - p.stage).min(p.micro_batches).max(2)
}

/// The micro-batch a step of `train_schedule` works on (possibly out of range: the stage
/// idles) and whether it is a forward slot. Even stages run forwards on even steps, odd
/// stages on odd ones; a stage's backward of a micro-batch comes `2 (stages - stage) - 1`
/// steps after its forward.
fn step_to_micro_batch(p: StagePlace, step: usize) -> (i64, bool) {
    let (step, stage, stages) = (step as i64, p.stage as i64, p.stages as i64);
    match (step % 2 == 0, stage % 2 == 0) {
        (true, true) => (step / 2 - stage / 2, true),
        (false, false) => ((step - 1) / 2 - stage / 2, true),
        (true, false) => (step / 2 - stages + (stage + 1) / 2, false),
        (false, true) => ((step - 1) / 2 - stages + 1 + stage / 2, false),
    }
}

/// DeepSpeed's `InferenceSchedule`: forward only, two buffers alternating between receiving
/// and sending, even and odd stages ordering their send and receive oppositely so that
/// neighbours pair up.
pub fn inference_schedule(p: StagePlace) -> Vec<Vec<Instruction>> {
    use Instruction::*;
    let total = p.micro_batches + p.stages - 1;
    let even_stage = p.stage.is_multiple_of(2);
    (0..total)
        .map(|step| {
            let mb = step as i64 - p.stage as i64;
            let (recv, send) = match even_stage {
                true => (step % 2, (step + 1) % 2),
                false => ((step + 1) % 2, step % 2),
            };
            let mut cmds = Vec::new();
            if (p.is_first() || p.is_last()) && p.valid_micro_batch(mb) {
                cmds.push(LoadMicroBatch { buffer: recv });
            }
            let send_cmd = (p.has_next() && p.valid_micro_batch(mb - 1))
                .then_some(SendActivation { buffer: send });
            let recv_cmd = (p.has_prev() && p.valid_micro_batch(mb))
                .then_some(RecvActivation { buffer: recv });
            match even_stage {
                true => cmds.extend(send_cmd.into_iter().chain(recv_cmd)),
                false => cmds.extend(recv_cmd.into_iter().chain(send_cmd)),
            }
            if p.valid_micro_batch(mb) {
                cmds.push(ForwardPass { buffer: recv });
            }
            cmds
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every micro-batch passes forward then backward once on every stage, in order, and a
    /// stage never holds more than `stages - stage` micro-batches (1F1B's memory bound).
    #[test]
    fn each_micro_batch_goes_forward_then_backward_within_the_bound() {
        for stages in 1..=5 {
            for micro_batches in 1..=9 {
                for stage in 0..stages {
                    let p = StagePlace {
                        micro_batches,
                        stages,
                        stage,
                    };
                    let (mut fwd, mut bwd, mut live, mut most) = (0, 0, 0usize, 0);
                    for cmd in train_schedule(p).into_iter().flatten() {
                        match cmd {
                            Instruction::ForwardPass { .. } => {
                                fwd += 1;
                                live += 1;
                            }
                            Instruction::BackwardPass { .. } => {
                                bwd += 1;
                                assert!(bwd <= fwd, "{p:?}: backward before forward");
                                live -= 1;
                            }
                            _ => {}
                        }
                        most = most.max(live);
                    }
                    assert_eq!((fwd, bwd), (micro_batches, micro_batches), "{p:?}");
                    assert!(most <= (stages - stage).min(micro_batches), "{p:?}: {most}");
                }
            }
        }
    }
}
