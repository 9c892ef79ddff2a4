//! `ds-rs bench comm`: nccl-tests' table for the CPU collectives of ds-comm. Starts
//! `--nproc` local ranks itself, or runs as one rank inside `ds-rs launch`.

use anyhow::{bail, Context};
use ds_comm::{init, options_for, DType, Element, Group, ReduceOp, Transport};
use half::{bf16, f16};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct CommArgs {
    /// Ranks to start on this host (ignored inside `ds-rs launch`, which sets them).
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    #[arg(long, value_enum, default_value_t = Op::AllReduce)]
    op: Op,
    /// Smallest message, e.g. 1K, 4M (bytes of the whole buffer, as nccl-tests counts).
    #[arg(long, default_value = "1K", value_parser = parse_size)]
    min_bytes: u64,
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    max_bytes: u64,
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: DType,
    /// auto: shared memory between ranks of one host, TCP between hosts; tcp: TCP everywhere.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    transport: TransportArg,
    /// Timed iterations per size (default: more for small messages).
    #[arg(long)]
    iters: Option<usize>,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// One JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
    /// A ds_config whose `comms_logger` section applies (its summary is printed at the end).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    backend: crate::flags::BackendArg,
}

/// The op, by nccl-tests' spelling or DeepSpeed's (`all_to_all`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq)]
enum Op {
    #[value(alias = "all_reduce")]
    AllReduce,
    #[value(alias = "reduce_scatter")]
    ReduceScatter,
    #[value(alias = "all_gather")]
    AllGather,
    Broadcast,
    #[value(alias = "all_to_all")]
    AllToAll,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq)]
enum TransportArg {
    Auto,
    Tcp,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, ""),
    };
    let mult: u64 = match mult
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return Err(format!("unknown size unit in {s:?} (use K, M or G)")),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("not a size: {s:?}"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype {s:?} (f32, bf16 or f16)"))
}

pub fn run(args: &CommArgs) -> anyhow::Result<ExitCode> {
    if args.min_bytes > args.max_bytes || args.max_bytes == 0 {
        bail!(
            "--min-bytes {} exceeds --max-bytes {}",
            args.min_bytes,
            args.max_bytes
        );
    }
    if crate::cli::local_ranks::inside_job() {
        return run_rank(args);
    }
    let backend = args.backend.dist_backend;
    crate::cli::local_ranks::start_ranks(args.nproc, backend, transport_env(args.transport))
}

fn transport_env(t: TransportArg) -> &'static str {
    match t {
        TransportArg::Auto => "auto",
        TransportArg::Tcp => "tcp",
    }
}

fn run_rank(args: &CommArgs) -> anyhow::Result<ExitCode> {
    let mut opts =
        options_for(args.backend.dist_backend).context("reading the rank environment")?;
    if args.transport == TransportArg::Tcp {
        opts.transport = Transport::Tcp;
    }
    opts.comms_logger = comms_logger(args, opts.world_size)?;
    let comm = init(&opts).context("joining the job")?;
    let g = comm.world();
    let rank0 = comm.rank() == 0;
    if rank0 && !args.json {
        print_header(args, g.size());
    }
    let mut wrong_total = 0;
    let mut bytes = args.min_bytes.max(1);
    while bytes <= args.max_bytes {
        let row = match args.dtype {
            DType::F32 => measure::<f32>(&g, args, bytes)?,
            DType::BF16 => measure::<bf16>(&g, args, bytes)?,
            DType::F16 => measure::<f16>(&g, args, bytes)?,
        };
        wrong_total += row.wrong;
        if rank0 {
            print_row(args, g.size(), &row);
        }
        bytes *= 2;
    }
    if let (true, Some(summary)) = (rank0, comm.comms_summary()) {
        eprintln!("{summary}");
    }
    if wrong_total > 0 {
        bail!("rank {}: {wrong_total} wrong results", comm.rank());
    }
    Ok(ExitCode::SUCCESS)
}

fn comms_logger(
    args: &CommArgs,
    world: usize,
) -> anyhow::Result<Option<ds_config::monitor::CommsLoggerConfig>> {
    let Some(path) = &args.config else {
        return Ok(None);
    };
    let doc = ds_config::load(path)?;
    let config = ds_config::parallel_dims(&doc, world, None, None)
        .and_then(|dims| ds_config::resolve(&doc, &dims))
        .with_context(|| format!("{}", path.display()))?;
    Ok(config.comms_logger)
}

struct Row {
    bytes: u64,
    count: usize,
    time: Duration,
    wrong: usize,
}

/// Small integers per (rank, index): every reduction of them is exact in every dtype.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 131 + i * 7) % 5) as f32
}

fn measure<T: Element>(g: &Group, args: &CommArgs, bytes: u64) -> anyhow::Result<Row> {
    let n = g.size();
    let elem = std::mem::size_of::<T>();
    // nccl-tests' count: elements of the whole buffer, a multiple of the group size.
    let count = ((bytes as usize / elem) / n * n).max(n);
    let iters = args
        .iters
        .unwrap_or_else(|| (1usize << 30).div_ceil(bytes as usize).clamp(5, 100));
    let mut state = OpState::<T>::new(args.op, g, count);
    let mut times = Vec::with_capacity(iters);
    for i in 0..args.warmup + iters {
        state.reset(g);
        g.barrier()?;
        let start = Instant::now();
        state.run(g)?;
        if i >= args.warmup {
            times.push(start.elapsed());
        }
    }
    let wrong = state.wrong(g);
    times.sort();
    // The slowest rank's median is the op's time.
    let mut t = [times[times.len() / 2].as_secs_f32() * 1e6];
    g.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(Row {
        bytes: (count * elem) as u64,
        count,
        time: Duration::from_secs_f64(t[0] as f64 / 1e6),
        wrong,
    })
}

struct OpState<T> {
    op: Op,
    buf: Vec<T>,
    out: Vec<T>,
}

impl<T: Element> OpState<T> {
    fn new(op: Op, g: &Group, count: usize) -> Self {
        let out_len = match op {
            Op::ReduceScatter => count / g.size(),
            Op::AllGather | Op::AllToAll => count,
            _ => 0,
        };
        let in_len = if op == Op::AllGather {
            count / g.size()
        } else {
            count
        };
        OpState {
            op,
            buf: vec![T::default(); in_len],
            out: vec![T::default(); out_len],
        }
    }

    fn reset(&mut self, g: &Group) {
        let me = g.rank();
        let offset = if self.op == Op::AllGather {
            me * self.buf.len()
        } else {
            0
        };
        let root_fill = self.op != Op::Broadcast || me == 0;
        for (i, v) in self.buf.iter_mut().enumerate() {
            *v = T::from_f32(if root_fill {
                value(me, offset + i)
            } else {
                -1.0
            });
        }
    }

    fn run(&mut self, g: &Group) -> ds_comm::Result<()> {
        match self.op {
            Op::AllReduce => g.all_reduce(&mut self.buf, ReduceOp::Sum),
            Op::ReduceScatter => g.reduce_scatter(&self.buf, &mut self.out, ReduceOp::Sum),
            Op::AllGather => g.all_gather(&self.buf, &mut self.out),
            Op::Broadcast => g.broadcast(&mut self.buf, g.global_ranks()[0]),
            Op::AllToAll => g.all_to_all(&self.buf, &mut self.out),
        }
    }

    /// Elements that differ from what the op must produce, computed from every rank's inputs.
    fn wrong(&self, g: &Group) -> usize {
        let (n, me) = (g.size(), g.rank());
        let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<f32>();
        let check = |got: &[T], expect: &dyn Fn(usize) -> f32| {
            got.iter()
                .enumerate()
                .filter(|(i, v)| v.to_f32() != expect(*i))
                .count()
        };
        match self.op {
            Op::AllReduce => check(&self.buf, &sum),
            Op::ReduceScatter => check(&self.out, &|i| sum(me * self.out.len() + i)),
            Op::AllGather => check(&self.out, &|i| value(i / self.buf.len(), i)),
            Op::Broadcast => check(&self.buf, &|i| value(0, i)),
            // part i of the output is rank i's part for this rank
            Op::AllToAll => {
                let part = (self.out.len() / n).max(1);
                check(&self.out, &|i| value(i / part, me * part + i % part))
            }
        }
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllReduce => "all_reduce",
        Op::ReduceScatter => "reduce_scatter",
        Op::AllGather => "all_gather",
        Op::Broadcast => "broadcast",
        Op::AllToAll => "all_to_all",
    }
}

/// nccl-tests' bus factor: what each rank must move relative to the message.
fn bus_factor(op: Op, n: usize) -> f64 {
    let n = n as f64;
    match op {
        Op::AllReduce => 2.0 * (n - 1.0) / n,
        Op::ReduceScatter | Op::AllGather | Op::AllToAll => (n - 1.0) / n,
        Op::Broadcast => 1.0,
    }
}

fn print_header(args: &CommArgs, n: usize) {
    let over = match args.backend.dist_backend {
        ds_comm::Backend::Mpi => "MPI".to_string(),
        _ => format!("transport {}", transport_env(args.transport)),
    };
    println!(
        "# ds-rs bench comm: {} over {n} ranks, {over}",
        op_name(args.op)
    );
    println!(
        "#{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
    );
    println!(
        "#{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
}

fn print_row(args: &CommArgs, n: usize, row: &Row) {
    let secs = row.time.as_secs_f64().max(1e-9);
    let algbw = row.bytes as f64 / secs / 1e9;
    let busbw = algbw * bus_factor(args.op, n);
    let time_us = secs * 1e6;
    if args.json {
        let obj = serde_json::json!({
            "op": op_name(args.op), "bytes": row.bytes, "dtype": args.dtype.nccl_name(), "nproc": n,
            "time_us": time_us, "algbw_gbs": algbw, "busbw_gbs": busbw,
        });
        println!("{obj}");
        return;
    }
    let (redop, root) = match args.op {
        Op::Broadcast => ("none", "0"),
        Op::AllGather | Op::AllToAll => ("none", "-1"),
        _ => ("sum", "-1"),
    };
    println!(
        " {:>12} {:>12} {:>9} {:>6} {:>5} {:>10.1} {:>8.2} {:>8.2} {:>7}",
        row.bytes,
        row.count,
        args.dtype.nccl_name(),
        redop,
        root,
        time_us,
        algbw,
        busbw,
        row.wrong
    );
}
