//! A user-defined model trained through the engine API in a custom loop, as a DeepSpeed user
//! writes it: every rank builds the same model, joins the job, and trains on its own part of
//! each global batch. With `tensor_parallel` in the config (DeepSpeed's AutoTP spelling) the
//! model's hidden layer is split over the tensor-parallel ranks:
//!
//! ```json
//! "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [
//!     {"patterns": ["hidden\\.weight$"], "partition_type": "column"},
//!     {"patterns": ["out\\.weight$"], "partition_type": "row"}]}}
//! ```
//!
//! ```sh
//! # one rank, the built-in config below
//! cargo run --release -p ds-engine --example custom_loop
//! # one rank, your config
//! cargo run --release -p ds-engine --example custom_loop -- --config ds_config.json
//! # two ranks: the launcher passes the config to every rank as DS_RS_CONFIG
//! cargo build --release -p ds-engine --example custom_loop
//! ds-rs launch --nproc_per_node 2 --config ds_config.json target/release/examples/custom_loop
//! ```
//!
//! Options: `--config FILE` (else `DS_RS_CONFIG`, else the built-in config), `--steps N`
//! (optimizer steps, default 100) and `--micro-batch N` (the micro-batch per rank, over the
//! config's, as a training script's own batch-size flag does: what `ds-rs launch --autotuning`
//! sets through `autotuning.arg_mappings`). Rank 0 prints the loss every `steps_per_print` steps (the
//! ds_config key, default 10): the mean over the whole global batch, so for one
//! `train_batch_size` it is the same whatever the number of ranks.
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use candle_core::{Module, Tensor};
use candle_nn::{embedding, Linear, VarBuilder};
use ds_comm::ReduceOp;
use ds_data::{DataLoader, MarkovTokens, SampleOrder, Windows};
use ds_engine::model::{Context, Init, Layer, Model, ParamSpec};
use ds_engine::parallel::Tp;
use ds_engine::{Engine, EngineOptions};
use ds_models::loss::CrossEntropyLoss;

const V: usize = 64; // vocabulary
const W: usize = 32; // width
const T: usize = 16; // sequence length

/// The config used when neither `--config` nor `DS_RS_CONFIG` names one: a global batch of 8
/// samples per optimizer step (train_batch_size = micro-batch x accumulation x ranks, so the
/// accumulation steps follow the number of ranks: 4 on one rank, 2 on two, 1 on four).
const BUILT_IN_CONFIG: &str = r#"{
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 2}
}"#;

/// Token ids to next-token logits: embedding, a tanh hidden layer, output projection.
///
/// Ready for tensor parallelism: when the config's `partition_config` splits `hidden` by
/// output rows (column-parallel) and `out` by input columns (row-parallel), the engine hands
/// each rank its slices (read here with their local shapes), and the two region marks do
/// Megatron's communication: the hidden layer's input gradient is summed over the ranks in
/// backward, the output projection's partial products in forward, before its bias. Without
/// tensor parallelism both marks are the identity.
struct BigramMlp {
    tp: Tp,
}

impl Layer for BigramMlp {
    fn params(&self) -> Vec<ParamSpec> {
        let n = Init::normal(0.1);
        vec![
            ParamSpec::new("emb.weight", &[V, W], n),
            ParamSpec::new("hidden.weight", &[W, W], n),
            ParamSpec::new("hidden.bias", &[W], Init::Zeros),
            ParamSpec::new("out.weight", &[V, W], n),
            ParamSpec::new("out.bias", &[V], Init::Zeros),
        ]
    }
    fn forward(&self, vb: &VarBuilder, ids: &Tensor, _: &Context) -> candle_core::Result<Tensor> {
        let x = embedding(V, W, vb.pp("emb"))?.forward(ids)?;
        let x = self.tp.copy_to_region(&x)?;
        let hidden = Linear::new(
            vb.get_unchecked("hidden.weight")?,
            Some(vb.get_unchecked("hidden.bias")?),
        );
        let h = hidden.forward(&x)?.tanh()?;
        let out = Linear::new(vb.get_unchecked("out.weight")?, None);
        let y = self.tp.reduce_from_region(&out.forward(&h)?)?;
        y.broadcast_add(&vb.get_unchecked("out.bias")?)
    }
}

type Error = Box<dyn std::error::Error>;

struct Args {
    config: Option<PathBuf>,
    steps: u64,
    micro_batch: Option<i64>,
}

const USAGE: &str = "usage: custom_loop [--config FILE] [--steps N] [--micro-batch N]";

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        config: std::env::var_os("DS_RS_CONFIG").map(PathBuf::from),
        steps: 100,
        micro_batch: None,
    };
    let mut it = std::env::args_os().skip(1);
    while let Some(arg) = it.next() {
        let arg = arg
            .into_string()
            .map_err(|a| format!("argument {a:?} is not UTF-8"))?;
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || match inline.clone() {
            Some(v) => Ok(v),
            None => it
                .next()
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}")),
        };
        match name.as_str() {
            "--config" => args.config = Some(PathBuf::from(value()?)),
            "--steps" => {
                let v = value()?;
                args.steps = v
                    .parse()
                    .map_err(|_| format!("--steps {v}: expected a whole number of steps"))?;
            }
            "--micro-batch" => {
                let v = value()?;
                let m = v.parse().ok().filter(|&m: &i64| m > 0);
                args.micro_batch = Some(
                    m.ok_or_else(|| format!("--micro-batch {v}: expected a positive number"))?,
                );
            }
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("custom_loop: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // one write: a launcher stopping this rank midway leaves no half line
            let line = format!("custom_loop: error: {e}\n");
            eprint!("{line}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Error> {
    // Join the job: alone this is rank 0 of 1; under `ds-rs launch` (or torchrun, mpirun,
    // srun) each rank finds its place from the environment.
    let mut opts = ds_comm::options_from_env()?;
    let (mut doc, source) = match &args.config {
        Some(path) => (ds_config::load(path)?, path.display().to_string()),
        None => (
            ds_config::hjson::parse_bytes(BUILT_IN_CONFIG.as_bytes())?,
            "the built-in config".to_string(),
        ),
    };
    // The flag wins over the file; the global batch then follows from it.
    if let (Some(m), ds_config::Value::Dict(d)) = (args.micro_batch, &mut doc) {
        d.insert("train_micro_batch_size_per_gpu", ds_config::Value::Int(m));
        d.remove("train_batch_size");
    }
    // The layout, decided once: the config's tensor-parallel degree, data parallelism over
    // the rest; the groups every collective of the engine runs on.
    let dims = ds_config::parallel_dims(&doc, opts.world_size, None, None)
        .map_err(|e| format!("{source}: {e}"))?;
    let config = ds_config::resolve(&doc, &dims)
        .and_then(ds_config::Config::with_expert_parallel)
        .map_err(|e| format!("{source}: {e}"))?;
    // DeepSpeed's comms logger, when the config enables it, times every collective (its table
    // is printed at the end, as deepspeed.comm.log_summary())
    opts.comms_logger = config.comms_logger.clone().filter(|c| c.enabled);
    let comm = ds_comm::init(&opts)?;
    let groups = ds_comm::Groups::new(&comm, config.dims)?;
    let steps_per_print = ds_engine::steps_per_print(&config);

    let model = Model::new()
        .layer(
            "",
            BigramMlp {
                tp: Tp::new(groups.tp().clone()),
            },
        )
        .layer("", CrossEntropyLoss);
    let mut engine = Engine::initialize(model, &config, &groups, &EngineOptions::default())?;

    // The data: a learnable Markov stream (its entropy rate is the lowest reachable loss), cut
    // into windows of T + 1 tokens. The sample order is DeepSpeed's DistributedSampler: step s
    // trains on the global batch of samples s*GB .. (s+1)*GB (shuffled per epoch, the same
    // permutation on every rank), and this rank reads only its own micro-batch x accumulation
    // of them, so the ranks together cover the global batch once.
    let s = engine.settings();
    let (micro, accum, dp, dp_rank) = (s.micro_batch, s.grad_accum, dims.dp(), engine.dp_rank());
    let tokens = MarkovTokens::new(V, 4, 1 << 16, 7)?;
    let floor = tokens.entropy_rate_nats();
    let order = SampleOrder::new(T, micro, accum, dp_rank, dp)?;
    let samples = Windows::new(Arc::new(tokens), T)?.shuffled(1);
    let loader = DataLoader::new(Arc::new(samples), order, V)?;
    if comm.rank() == 0 {
        println!(
            "{} rank(s): micro-batch {micro} x {accum} accumulation x {dp} data-parallel = global \
             batch {}; config {source}; loss floor {floor:.4}",
            comm.world_size(),
            order.global_batch()
        );
    }

    let world = comm.world();
    for step in 0..args.steps {
        let mut loss_sum = 0.0f32;
        // an autotuning trial (`ds-rs launch --autotuning`) ends after its profiled steps
        let mut trial_complete = false;
        for k in 0..accum {
            let batch = loader.micro_batch(step, k)?.to_inputs(&engine.device())?;
            let loss = engine.forward(&batch)?;
            engine.backward(&loss)?;
            // Steps the optimizer at the end of the accumulation window only (DeepSpeed's
            // engine.step()); the gradients are averaged over all ranks first.
            trial_complete |= engine.step()?.is_some_and(|o| o.trial_complete);
            loss_sum += loss.to_scalar::<f32>()?;
        }
        // This rank's loss is the mean over its own samples; the mean over the ranks is the
        // loss of the global batch (every rank holds as many samples).
        let mut loss = [loss_sum / accum as f32];
        world.all_reduce(&mut loss, ReduceOp::Avg)?;
        let done = engine.global_steps();
        if comm.rank() == 0 && (done % steps_per_print == 0 || step + 1 == args.steps) {
            println!(
                "step {done:>4}  loss {:.6}  lr {:.3e}",
                loss[0],
                engine.get_lr()
            );
        }
        if trial_complete {
            break;
        }
    }
    if let Some(table) = comm.comms_summary().filter(|_| comm.rank() == 0) {
        println!("{table}");
    }
    Ok(())
}
