//! The time model: a step's seconds predicted from its work (the FLOPs each rank computes, the
//! bytes each collective moves, the bytes the optimizer streams) at rates measured on the
//! cluster before the search, so that candidates are ranked before any of them runs. The
//! model-based tuner then fits two factors to the trials it has run (`Fit`), which corrects
//! what the rates miss (the elementwise work, the overlap of communication with compute).

use ds_config::{Config, ZeroStage};
use ds_engine::{Precision, Settings};
use ds_models::ModelSpec;
use serde::Serialize;

/// What the cluster was measured to do.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Rates {
    /// One rank's matrix-product speed while the other ranks of its host compute too.
    pub flops_per_s: f64,
    /// Bus bandwidth of an all-reduce among a trial's ranks (nccl-tests' busbw), bytes/s.
    pub bus_bytes_per_s: f64,
    /// The fixed cost of one collective call.
    pub collective_s: f64,
    /// How fast one rank streams memory (the optimizer step reads and writes its states).
    pub memory_bytes_per_s: f64,
}

/// A step's predicted work, in seconds at the measured rates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepCost {
    /// The matrix products of every micro-batch, with the pipeline's bubble.
    pub compute_s: f64,
    /// Data-parallel reductions and gathers, tensor-parallel all-reduces, pipeline transfers.
    pub comm_s: f64,
    /// The optimizer over the rank's owned elements.
    pub optimizer_s: f64,
    /// The job's samples and model FLOPs per step (for the throughput and flops metrics).
    pub samples: f64,
    pub flops: f64,
}

impl StepCost {
    pub fn total_s(&self) -> f64 {
        self.compute_s + self.comm_s + self.optimizer_s
    }
}

/// What a model asks of a step, per sample: what the time model needs to know of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Work {
    /// Trained parameters (the whole model).
    pub params: f64,
    /// Model FLOPs of one sample's forward and backward.
    pub flops_per_sample: f64,
    /// Bytes of one sample's activation at a layer boundary in the compute dtype's elements
    /// (what tensor parallelism all-reduces and a pipeline stage sends).
    pub boundary_elements_per_sample: f64,
    /// Transformer blocks (two tensor-parallel all-reduces each way per block).
    pub layers: usize,
}

impl Work {
    /// A model ds-rs builds (`--model`), at its sequence length.
    pub fn of_model(m: &ModelSpec) -> Work {
        Work {
            params: m.n_params() as f64,
            flops_per_sample: m.seq_len as f64 * m.flops_per_token(),
            boundary_elements_per_sample: (m.seq_len * m.hidden_size()) as f64,
            layers: m.blocks(),
        }
    }

    /// A model known only by its parameter count (DeepSpeed's `model_info.num_params`): 6
    /// FLOPs per parameter and sample, as if a sample were one token; the model-based
    /// tuner's fit scales it to what the trials measure.
    pub fn of_params(params: u64) -> Work {
        Work {
            params: params as f64,
            flops_per_sample: 6.0 * params as f64,
            boundary_elements_per_sample: 0.0,
            layers: 0,
        }
    }
}

/// The predicted cost of one step of `config` at `micro_batch` on a rank of its largest
/// stage.
pub fn step_cost(
    config: &Config,
    work: &Work,
    micro_batch: usize,
    rates: &Rates,
) -> anyhow::Result<StepCost> {
    let s = Settings::from_config(config, false)?;
    let dims = config.dims;
    let (dp, tp, pp, sp) = (dims.dp(), dims.tp, dims.pp, dims.sp);
    let micro = micro_batch as f64;
    let gas = s.grad_accum as f64;
    // recomputation runs each checkpointed forward twice: 8 instead of 6 FLOPs per parameter
    let recompute = if s.recompute { 4.0 / 3.0 } else { 1.0 };
    let flops = micro * gas * work.flops_per_sample;
    // 1F1B: (m + p - 1) micro-batch slots for m micro-batches
    let bubble = (gas + pp as f64 - 1.0) / gas;
    let compute_s = flops * recompute / (tp * pp * sp) as f64 / rates.flops_per_s * bubble;
    let width = match s.precision {
        Precision::F32 => 4.0,
        Precision::BF16 | Precision::F16 => 2.0,
    };
    let elements = work.params / (tp * pp) as f64;
    let activation = micro * work.boundary_elements_per_sample * width / sp as f64;
    let comm_s = data_parallel_s(&s, dp, elements, width, gas, rates)
        + tensor_parallel_s(tp, work.layers, activation, gas, rates)
        + pipeline_s(pp, activation, gas, rates)
        + sequence_parallel_s(sp, tp, work.layers, activation, gas, rates);
    let owned = match s.zero.stage {
        ZeroStage::Disabled => elements,
        _ => elements / dp as f64,
    };
    // Adam reads and writes the fp32 master, both moments and the gradient
    let optimizer_s = owned * 4.0 * 4.0 * 2.0 / rates.memory_bytes_per_s;
    Ok(StepCost {
        compute_s,
        comm_s,
        optimizer_s,
        samples: micro * gas * dims.replicas() as f64,
        flops: flops * dims.replicas() as f64,
    })
}

/// One all-reduce-sized pass over `bytes` among `n` ranks in calls of `call` bytes: the ring's
/// 2 (n - 1) / n of the bytes at the bus bandwidth (reduce-scatter and all-gather are half of
/// it each), plus each call's fixed cost.
fn ring_s(bytes: f64, n: usize, call: f64, half: bool, rates: &Rates) -> f64 {
    if n <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let share = if half { 0.5 } else { 1.0 };
    let calls = (bytes / call.max(1.0)).ceil();
    share * bytes * 2.0 * (n - 1) as f64 / n as f64 / rates.bus_bytes_per_s
        + calls * rates.collective_s
}

/// ZeRO's collectives per step over the rank's `bytes` of gradients: stages 0-1 all-reduce once
/// at the boundary (stage 1 as reduce-scatter then all-gather: the same volume); stage 2
/// reduce-scatters every micro-step and gathers the parameters once; stage 3 gathers the
/// parameters for forward and backward and reduce-scatters every micro-step.
fn data_parallel_s(
    s: &Settings,
    dp: usize,
    elements: f64,
    width: f64,
    gas: f64,
    rates: &Rates,
) -> f64 {
    let bytes = elements * width;
    let call = |elements: usize| elements as f64 * width;
    let (reduce, gather) = (
        call(s.zero.reduce.bucket_size),
        call(s.zero.allgather_bucket_size),
    );
    match s.zero.stage {
        ZeroStage::Disabled | ZeroStage::OptimizerStates => ring_s(bytes, dp, reduce, false, rates),
        ZeroStage::Gradients => {
            gas * ring_s(bytes, dp, reduce, true, rates) + ring_s(bytes, dp, gather, true, rates)
        }
        ZeroStage::Weights => {
            let prefetch = call(s.zero.stage3.prefetch_bucket_size);
            gas * (2.0 * ring_s(bytes, dp, prefetch, true, rates)
                + ring_s(bytes, dp, reduce, true, rates))
        }
    }
}

/// Megatron's tensor parallelism: two all-reduces of the activations per block forward and
/// two backward, and one each for the embedding and the loss, every micro-batch.
fn tensor_parallel_s(tp: usize, layers: usize, activation: f64, gas: f64, rates: &Rates) -> f64 {
    let calls = (4 * layers + 2) as f64;
    gas * calls * ring_s(activation, tp, activation, false, rates)
}

/// Ulysses: per block, q|k|v (three of the rank's `activation` bytes over its tp share) and
/// the output (one) go from positions to heads and back by all-to-all in forward, their
/// gradients in backward; each rank keeps 1/sp of what it sends.
fn sequence_parallel_s(
    sp: usize,
    tp: usize,
    layers: usize,
    activation: f64,
    gas: f64,
    rates: &Rates,
) -> f64 {
    if sp <= 1 {
        return 0.0;
    }
    let bytes = 2.0 * 4.0 * activation / tp as f64 * (sp - 1) as f64 / sp as f64;
    gas * layers as f64 * (bytes / rates.bus_bytes_per_s + 4.0 * rates.collective_s)
}

/// A stage sends its output forward and receives the gradient back, every micro-batch.
fn pipeline_s(pp: usize, activation: f64, gas: f64, rates: &Rates) -> f64 {
    if pp <= 1 {
        return 0.0;
    }
    gas * 2.0 * (activation / rates.bus_bytes_per_s + rates.collective_s)
}

/// This host's compute and memory rates per rank, measured here: a matrix product of a
/// GPT layer's MLP shape (`rows` tokens of width `d`) and a streamed update over 64 MiB, each
/// divided among the `ranks` that will share the host's cores.
pub fn measure_host(d: usize, rows: usize, ranks: usize) -> anyhow::Result<(f64, f64)> {
    use candle_core::{Device, Tensor};
    let cpu = Device::Cpu;
    let a = Tensor::ones((rows, d), candle_core::DType::F32, &cpu)?;
    let b = Tensor::ones((d, 4 * d), candle_core::DType::F32, &cpu)?;
    let flops = 2.0 * (rows * d * 4 * d) as f64;
    let matmul = repeat_for(0.3, || {
        a.matmul(&b)?;
        Ok(())
    })?;
    let mut x = vec![1.0f32; 16 << 20];
    let y = vec![0.5f32; 16 << 20];
    let stream = repeat_for(0.2, || {
        x.iter_mut().zip(&y).for_each(|(x, y)| *x = 0.9 * *x + y);
        Ok(())
    })?;
    // an update reads x and y and writes x
    let bytes = 3.0 * 4.0 * x.len() as f64;
    let ranks = ranks.max(1) as f64;
    Ok((flops / matmul / ranks, bytes / stream / ranks))
}

/// Seconds per call of `f`, called until `budget` seconds have passed (at least twice, the
/// first call untimed).
fn repeat_for(budget: f64, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    f()?;
    let start = std::time::Instant::now();
    let mut n = 0;
    while n == 0 || start.elapsed().as_secs_f64() < budget {
        f()?;
        n += 1;
    }
    Ok(start.elapsed().as_secs_f64() / n as f64)
}

/// The model-based tuner's correction: predicted = compute x a + (comm + optimizer) x b,
/// fitted by least squares to the trials that ran (one common factor until two trials
/// disagree in their mix).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub compute: f64,
    pub other: f64,
}

impl Default for Fit {
    fn default() -> Fit {
        Fit {
            compute: 1.0,
            other: 1.0,
        }
    }
}

impl Fit {
    pub fn predict(&self, c: &StepCost) -> f64 {
        c.compute_s * self.compute + (c.comm_s + c.optimizer_s) * self.other
    }

    /// Fits to (predicted cost, measured seconds) pairs.
    pub fn to(observed: &[(StepCost, f64)]) -> Fit {
        let common = || {
            let (num, den) = observed.iter().fold((0.0, 0.0), |(n, d), (c, t)| {
                (n + c.total_s() * t, d + c.total_s() * c.total_s())
            });
            match den > 0.0 {
                true => Fit {
                    compute: num / den,
                    other: num / den,
                },
                false => Fit::default(),
            }
        };
        // normal equations of t = a x + b y
        let (mut xx, mut xy, mut yy, mut xt, mut yt) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (c, t) in observed {
            let (x, y) = (c.compute_s, c.comm_s + c.optimizer_s);
            xx += x * x;
            xy += x * y;
            yy += y * y;
            xt += x * t;
            yt += y * t;
        }
        let det = xx * yy - xy * xy;
        // nearly collinear mixes cannot tell the two factors apart
        if observed.len() < 2 || det <= 1e-9 * xx * yy {
            return common();
        }
        let a = (xt * yy - yt * xy) / det;
        let b = (yt * xx - xt * xy) / det;
        match a > 0.0 && b >= 0.0 {
            true => Fit {
                compute: a,
                other: b,
            },
            false => common(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(compute_s: f64, other: f64) -> StepCost {
        StepCost {
            compute_s,
            comm_s: other,
            optimizer_s: 0.0,
            samples: 1.0,
            flops: 1.0,
        }
    }

    #[test]
    fn the_fit_recovers_two_factors_from_differing_mixes() {
        // measured = 2 x compute + 0.5 x other, computed independently here
        let truth = |c: &StepCost| 2.0 * c.compute_s + 0.5 * c.comm_s;
        let pts: Vec<(StepCost, f64)> = [cost(1.0, 1.0), cost(3.0, 0.5), cost(0.5, 4.0)]
            .into_iter()
            .map(|c| (c, truth(&c)))
            .collect();
        let f = Fit::to(&pts);
        assert!((f.compute - 2.0).abs() < 1e-9, "{f:?}");
        assert!((f.other - 0.5).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn one_trial_gives_one_common_factor() {
        let f = Fit::to(&[(cost(1.0, 1.0), 3.0)]);
        assert_eq!(
            f,
            Fit {
                compute: 1.5,
                other: 1.5
            }
        );
    }
}
