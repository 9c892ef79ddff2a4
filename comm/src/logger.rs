//! DeepSpeed's communication logger (ds_config section `comms_logger`), with DeepSpeed 0.19.8's
//! figures and printed forms: `calc_bw_log`, `convert_size`, the verbose per-op line of
//! `CommsLogger.append` and the table of `log_summary` (deepspeed/utils/comms_logging.py), and
//! the op selection of `timed_op` (deepspeed/comm/comm.py).
//!
//! The caller times each op and hands it to [`CommsLogger::record`] with the byte count DeepSpeed
//! would record for it (see [`OpKind`]); the logger keeps per op name, per message size, every
//! latency and bandwidth, as DeepSpeed does, so that the summary can take trimmed means.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::Location;
use std::time::Duration;

use ds_config::monitor::CommsLoggerConfig;

/// A timed collective or point-to-point op. The doc of each variant says which bytes DeepSpeed
/// counts as its `msg_size` (the tensor argument `get_msg_size_from_args` picks), which is what
/// [`CommsLogger::record`] and [`bandwidths`] expect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `all_reduce` (DeepSpeed also files `inference_all_reduce` and `all_reduce_coalesced`
    /// under this name). Bytes: the tensor reduced.
    AllReduce,
    /// `reduce_scatter_tensor`. Bytes: the *input*, i.e. all the shards; the bandwidths then
    /// multiply it by the group size again, as DeepSpeed does.
    ReduceScatter,
    /// `all_gather_into_tensor`. Bytes: the input, i.e. this rank's shard.
    AllGather,
    /// `all_to_all_single`. Bytes: the input tensor.
    AllToAllSingle,
    /// `all_to_all`. Bytes: the sum of the input tensors.
    AllToAll,
    /// `broadcast`. Bytes: the tensor.
    Broadcast,
    /// `reduce`. Bytes: the tensor.
    Reduce,
    /// `gather`. Bytes: this rank's input tensor.
    Gather,
    /// `scatter`. Bytes: this rank's output tensor.
    Scatter,
    /// `send`. Bytes: the tensor.
    Send,
    /// `recv`. Bytes: the tensor.
    Recv,
    /// `isend`. Bytes: the tensor.
    Isend,
    /// `irecv`. Bytes: the tensor.
    Irecv,
    /// `barrier`. Bytes: 0.
    Barrier,
}

/// How `calc_bw_log` turns size and time into algbw and busbw.
enum BwRule {
    AllReduce,
    /// all_gather / reduce_scatter: the size is multiplied by n first.
    Gathered,
    AllToAll,
    /// Everything moved once: busbw = algbw.
    Direct,
}

impl OpKind {
    /// The name DeepSpeed records the op under, and the name `prof_ops` selects it by.
    pub fn ds_name(&self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter_tensor",
            OpKind::AllGather => "all_gather_into_tensor",
            OpKind::AllToAllSingle => "all_to_all_single",
            OpKind::AllToAll => "all_to_all",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Isend => "isend",
            OpKind::Irecv => "irecv",
            OpKind::Barrier => "barrier",
        }
    }

    fn bw_rule(self) -> BwRule {
        match self {
            OpKind::AllReduce => BwRule::AllReduce,
            OpKind::ReduceScatter | OpKind::AllGather => BwRule::Gathered,
            OpKind::AllToAllSingle | OpKind::AllToAll => BwRule::AllToAll,
            OpKind::Broadcast
            | OpKind::Reduce
            | OpKind::Gather
            | OpKind::Scatter
            | OpKind::Send
            | OpKind::Recv
            | OpKind::Isend
            | OpKind::Irecv
            | OpKind::Barrier => BwRule::Direct,
        }
    }
}

/// `calc_bw_log`: (algbw, busbw) in Gbps (10^9 bits per second) for `bytes` counted as DeepSpeed
/// counts them for `op` (see [`OpKind`]). Bus factors as in nccl-tests: all_reduce 2(n-1)/n,
/// all_gather, reduce_scatter and all_to_all (n-1)/n, the rest 1. DeepSpeed's own twists are
/// kept: all_reduce's algbw is 2 × size / time, and all_gather / reduce_scatter scale the size
/// by n before dividing.
///
/// DeepSpeed takes n from `dist.get_world_size()`, the whole world, whatever the op's group; pass
/// the world size to reproduce its figures for sub-group ops, the group's size for true ones.
/// The arithmetic follows calc_bw_log step by step so that the figures agree to the last bit.
/// A zero latency gives infinities (NaN for 0 bytes) where DeepSpeed raises ZeroDivisionError.
pub fn bandwidths(op: OpKind, bytes: u64, latency: Duration, group_size: usize) -> (f64, f64) {
    assert!(group_size > 0, "an op's group has at least one rank");
    let n = group_size as f64;
    let ms = millis(latency);
    let (algbw, busbw) = match op.bw_rule() {
        BwRule::AllReduce => {
            let size = bytes as f64;
            (size * 2.0 / ms, size / ms * (2.0 * (n - 1.0) / n))
        }
        BwRule::Gathered => {
            // Python multiplies exact integers; u128 cannot overflow and rounds once, like it.
            let rate = (u128::from(bytes) * group_size as u128) as f64 / ms;
            (rate, rate * ((n - 1.0) / n))
        }
        BwRule::AllToAll => {
            let rate = bytes as f64 / ms;
            (rate, rate * ((n - 1.0) / n))
        }
        BwRule::Direct => {
            let rate = bytes as f64 / ms;
            (rate, rate)
        }
    };
    (gbps(algbw), gbps(busbw))
}

/// DeepSpeed's timers report milliseconds; every figure it logs is in them.
fn millis(latency: Duration) -> f64 {
    latency.as_nanos() as f64 / 1e6
}

/// Bytes per millisecond to Gbps, in calc_bw_log's order (× 8, then / 1e6).
fn gbps(bytes_per_ms: f64) -> f64 {
    bytes_per_ms * 8.0 / 1e6
}

/// `convert_size`: "0B", "512.0 B", "1.5 KB", "28.61 MB", ... — binary (1024) steps, the value
/// rounded to 2 decimals and written as Python writes a float (shortest form, at least ".0").
pub fn convert_size(bytes: u64) -> String {
    const UNITS: [&str; 9] = ["B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"];
    if bytes == 0 {
        return "0B".to_string();
    }
    let size = bytes as f64;
    // math.log(size, 1024) is log(size) / log(1024); kept as such because its rounding decides
    // the unit at exact powers of 1024.
    let unit = (size.ln() / 1024f64.ln()).floor() as i32;
    let value = round2(size / 1024f64.powi(unit));
    format!("{} {}", python_float(value), UNITS[unit as usize])
}

/// Python's `round(x, 2)`: the correctly rounded 2-decimal string (ties to even on the exact
/// binary value, as Rust's formatting also does), read back.
fn round2(x: f64) -> f64 {
    format!("{x:.2}").parse().expect("a formatted float parses")
}

/// Python's `str(float)` for the magnitudes convert_size produces (no exponent form needed).
fn python_float(x: f64) -> String {
    let s = x.to_string();
    if s.contains('.') {
        s
    } else {
        s + ".0"
    }
}

/// DeepSpeed's `trim_mean(data, 0.1)`: sort, drop round(n / 10) values (Python's round: ties to
/// even) from each end, average the rest. Never called on an empty list.
fn trimmed_mean(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let k = (sorted.len() as f64 * 0.1).round_ties_even() as usize;
    let kept = &sorted[k..sorted.len() - k];
    kept.iter().sum::<f64>() / kept.len() as f64
}

/// Where verbose lines go: stderr unless a test or caller injects another.
type Sink = Box<dyn FnMut(&str) + Send>;

/// One (op name, message size) bucket: every sample, as DeepSpeed keeps them.
#[derive(Default)]
struct Samples {
    latency_ms: Vec<f64>,
    algbw: Vec<f64>,
    busbw: Vec<f64>,
}

/// All buckets of one record name, message sizes in order (the summary lists them sorted).
struct OpRecord {
    name: String,
    by_size: BTreeMap<u64, Samples>,
}

/// DeepSpeed's `CommsLogger`, configured from the `comms_logger` section.
pub struct CommsLogger {
    cfg: CommsLoggerConfig,
    rank: usize,
    sink: Sink,
    /// In first-recorded order, which is the order the summary prints them in.
    records: Vec<OpRecord>,
}

impl CommsLogger {
    /// A logger for rank 0 whose verbose lines go to stderr.
    pub fn new(cfg: &CommsLoggerConfig) -> CommsLogger {
        CommsLogger {
            cfg: cfg.clone(),
            rank: 0,
            sink: Box::new(|line| eprintln!("{line}")),
            records: Vec::new(),
        }
    }

    /// This process's rank: DeepSpeed prints verbose lines on rank 0 only.
    pub fn with_rank(mut self, rank: usize) -> CommsLogger {
        self.rank = rank;
        self
    }

    /// Sends verbose lines to `sink` instead of stderr.
    pub fn with_sink(mut self, sink: impl FnMut(&str) + Send + 'static) -> CommsLogger {
        self.sink = Box::new(sink);
        self
    }

    /// Whether `op` is to be timed at all: enabled, and prof_all or its name in prof_ops.
    pub fn wants(&self, op: OpKind) -> bool {
        self.cfg.enabled
            && (self.cfg.prof_all || self.cfg.prof_ops.iter().any(|p| p == op.ds_name()))
    }

    /// Records one completed op (ignored unless [`wants`](Self::wants) it): `bytes` as DeepSpeed
    /// counts them for `op`, `latency` its wall time, `group_size` the `n` of [`bandwidths`].
    /// Verbose: writes DeepSpeed's per-op line to the sink, on rank 0.
    ///
    /// With `debug`, DeepSpeed files each op under "name | [Caller Func: f]", f the function that
    /// called the op. Rust has no function names at run time, so the caller's file:line stands
    /// in; wrappers between the user's call and this one should be `#[track_caller]` too.
    #[track_caller]
    pub fn record(&mut self, op: OpKind, bytes: u64, latency: Duration, group_size: usize) {
        if !self.wants(op) {
            return;
        }
        let name = self.record_name(op, Location::caller());
        let (algbw, busbw) = bandwidths(op, bytes, latency, group_size);
        let ms = millis(latency);
        if self.cfg.verbose && self.rank == 0 {
            let line = format!(
                "[Rank 0] comm op: {name} | time (ms): {ms:.2} | msg size: {} \
                 | algbw (Gbps): {algbw:.2} | busbw (Gbps): {busbw:.2}",
                convert_size(bytes)
            );
            (self.sink)(&line);
        }
        let samples = self.bucket(name, bytes);
        samples.latency_ms.push(ms);
        samples.algbw.push(algbw);
        samples.busbw.push(busbw);
    }

    fn record_name(&self, op: OpKind, caller: &Location) -> String {
        if self.cfg.debug {
            format!(
                "{} | [Caller Func: {}:{}]",
                op.ds_name(),
                caller.file(),
                caller.line()
            )
        } else {
            op.ds_name().to_string()
        }
    }

    fn bucket(&mut self, name: String, bytes: u64) -> &mut Samples {
        let at = match self.records.iter().position(|r| r.name == name) {
            Some(at) => at,
            None => {
                self.records.push(OpRecord {
                    name,
                    by_size: BTreeMap::new(),
                });
                self.records.len() - 1
            }
        };
        self.records[at].by_size.entry(bytes).or_default()
    }

    /// The table `log_summary` prints: a header, then per op name (first-recorded first) one
    /// row per message size (smallest first) with count, total and trimmed-mean latency (ms)
    /// and trimmed-mean algbw and busbw (Gbps). Every line ends in a newline.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let header = [
            "Comm. Op",
            "Message Size",
            "Count",
            "Total Latency(ms)",
            "Avg Latency(ms)",
            "tput_avg (Gbps)",
            "busbw_avg (Gbps)",
        ];
        for column in header {
            let _ = write!(out, "{column:<20}");
        }
        out.push('\n');
        for record in &self.records {
            out.push_str(&record.name);
            out.push('\n');
            for (&bytes, s) in &record.by_size {
                let _ = writeln!(
                    out,
                    "{:<20}{:<20}{:<20}{:<20.2}{:<20.2}{:<20.2}{:<20.2}",
                    "",
                    convert_size(bytes),
                    s.latency_ms.len(),
                    s.latency_ms.iter().sum::<f64>(),
                    trimmed_mean(&s.latency_ms),
                    trimmed_mean(&s.algbw),
                    trimmed_mean(&s.busbw),
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    const ALL_OPS: [OpKind; 14] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::AllToAllSingle,
        OpKind::AllToAll,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Isend,
        OpKind::Irecv,
        OpKind::Barrier,
    ];

    // Computed by DeepSpeed's own code: tests/fixtures/comms_logger/gen_fixtures.py says how.
    const BANDWIDTHS: &str = include_str!("../tests/fixtures/comms_logger/bandwidths.tsv");
    const CONVERT_SIZE: &str = include_str!("../tests/fixtures/comms_logger/convert_size.tsv");
    const REPLAY: &str = include_str!("../tests/fixtures/comms_logger/replay.tsv");
    const REPLAY_VERBOSE: &str = include_str!("../tests/fixtures/comms_logger/replay_verbose.txt");
    const REPLAY_SUMMARY: &str = include_str!("../tests/fixtures/comms_logger/replay_summary.txt");

    fn rows(tsv: &str) -> impl Iterator<Item = Vec<&str>> {
        tsv.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split('\t').collect())
    }

    fn op_named(name: &str) -> OpKind {
        *ALL_OPS
            .iter()
            .find(|op| op.ds_name() == name)
            .unwrap_or_else(|| panic!("no OpKind is named {name}"))
    }

    fn config(enabled: bool, prof_all: bool, prof_ops: &[&str]) -> CommsLoggerConfig {
        CommsLoggerConfig {
            enabled,
            prof_all,
            prof_ops: prof_ops.iter().map(|s| s.to_string()).collect(),
            verbose: false,
            debug: false,
        }
    }

    /// A logger of everything whose verbose lines (if `verbose`) land in the returned list.
    fn capturing(verbose: bool) -> (CommsLogger, Arc<Mutex<Vec<String>>>) {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let cfg = CommsLoggerConfig {
            verbose,
            ..config(true, true, &[])
        };
        let logger =
            CommsLogger::new(&cfg).with_sink(move |l| sink.lock().unwrap().push(l.to_string()));
        (logger, lines)
    }

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1e3)
    }

    fn close(a: f64, b: f64) -> bool {
        a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
    }

    #[test]
    fn bandwidths_match_deepspeed_calc_bw_log() {
        let mut seen = Vec::new();
        for r in rows(BANDWIDTHS) {
            let op = op_named(r[0]);
            let bytes = r[1].parse().unwrap();
            let latency = Duration::from_nanos(r[2].parse().unwrap());
            let n = r[3].parse().unwrap();
            let want: (f64, f64) = (r[4].parse().unwrap(), r[5].parse().unwrap());
            let got = bandwidths(op, bytes, latency, n);
            assert!(
                close(got.0, want.0) && close(got.1, want.1),
                "{r:?}: got {got:?}"
            );
            seen.push(op);
        }
        for op in ALL_OPS {
            assert!(seen.contains(&op), "{op:?} missing from the fixture");
        }
    }

    #[test]
    fn bus_factors_follow_nccl_tests() {
        // 1 GB in 1 s is 8 Gbps; n = 4.
        let bw = |op| bandwidths(op, 1_000_000_000, Duration::from_secs(1), 4);
        assert_eq!(bw(OpKind::AllReduce), (16.0, 12.0));
        assert_eq!(bw(OpKind::AllGather), (32.0, 24.0));
        assert_eq!(bw(OpKind::ReduceScatter), (32.0, 24.0));
        assert_eq!(bw(OpKind::AllToAll), (8.0, 6.0));
        assert_eq!(bw(OpKind::Broadcast), (8.0, 8.0));
        assert_eq!(bw(OpKind::Send), (8.0, 8.0));
    }

    #[test]
    fn convert_size_matches_deepspeed() {
        let mut count = 0;
        for r in rows(CONVERT_SIZE) {
            assert_eq!(convert_size(r[0].parse().unwrap()), r[1], "bytes {}", r[0]);
            count += 1;
        }
        assert!(count > 50);
    }

    #[test]
    fn wants_all_ops_under_prof_all() {
        let logger = CommsLogger::new(&config(true, true, &[]));
        assert!(ALL_OPS.iter().all(|&op| logger.wants(op)));
    }

    #[test]
    fn wants_only_named_ops_without_prof_all() {
        // "all_gather" is the list op's name: it does not select all_gather_into_tensor.
        let logger = CommsLogger::new(&config(
            true,
            false,
            &["all_reduce", "reduce_scatter_tensor", "all_gather"],
        ));
        let wanted: Vec<_> = ALL_OPS.into_iter().filter(|&op| logger.wants(op)).collect();
        assert_eq!(wanted, [OpKind::AllReduce, OpKind::ReduceScatter]);
    }

    #[test]
    fn wants_nothing_when_disabled() {
        let logger = CommsLogger::new(&config(false, true, &["all_reduce"]));
        assert!(ALL_OPS.iter().all(|&op| !logger.wants(op)));
    }

    #[test]
    fn record_ignores_ops_not_wanted() {
        let mut logger = CommsLogger::new(&config(true, false, &["all_reduce"]));
        logger.record(OpKind::Broadcast, 4096, ms(1.0), 2);
        logger.record(OpKind::AllReduce, 4096, ms(1.0), 2);
        let summary = logger.summary();
        assert!(summary.contains("\nall_reduce\n"));
        assert!(!summary.contains("broadcast"));
    }

    #[test]
    fn summary_rows_follow_recorded_inputs() {
        let (mut logger, _) = capturing(false);
        let n = 4;
        let all_reduce_ms = [2.0, 3.0, 7.0];
        for &t in &all_reduce_ms {
            logger.record(OpKind::AllReduce, 1 << 20, ms(t), n);
        }
        logger.record(OpKind::Barrier, 0, ms(0.5), n);
        logger.record(OpKind::AllReduce, 1536, ms(0.25), n);

        // all_reduce over 4 ranks: algbw = 2 × size / time, busbw = size / time × 2(n-1)/n, in
        // Gbps (bytes per ms × 8e-6). Under 5 samples per bucket the trimmed mean trims nothing.
        let bw = |bytes: f64, t: f64| (2.0 * bytes / t * 8e-6, bytes / t * 1.5 * 8e-6);
        let (alg, bus): (Vec<f64>, Vec<f64>) =
            all_reduce_ms.iter().map(|&t| bw(1048576.0, t)).unzip();
        let avg = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        let row = |size: &str, count, total: f64, lat: f64, (alg, bus): (f64, f64)| {
            format!(
                "{:20}{size:<20}{count:<20}{total:<20.2}{lat:<20.2}{alg:<20.2}{bus:<20.2}",
                ""
            )
        };
        let lines: Vec<String> = logger.summary().lines().map(str::to_string).collect();
        assert_eq!(lines.len(), 6);
        assert!(lines[0].starts_with("Comm. Op            Message Size        Count"));
        assert_eq!(lines[1], "all_reduce");
        // Message sizes ascend within an op, whatever the recording order.
        assert_eq!(lines[2], row("1.5 KB", 1, 0.25, 0.25, bw(1536.0, 0.25)));
        let big = row("1.0 MB", 3, 12.0, 4.0, (avg(&alg), avg(&bus)));
        assert_eq!(lines[3], big);
        assert_eq!(lines[4], "barrier");
        assert_eq!(lines[5], row("0B", 1, 0.5, 0.5, (0.0, 0.0)));
    }

    #[test]
    fn trimmed_mean_drops_a_tenth_from_each_end() {
        let values = |n: usize| (1..=n).map(|x| x as f64).rev().collect::<Vec<_>>();
        // n = 5: round(0.5) = 0, nothing dropped; 100 pulls the mean up.
        assert_eq!(trimmed_mean(&[1.0, 2.0, 3.0, 4.0, 100.0]), 22.0);
        // n = 15: round(1.5) = 2 dropped each end; n = 25: round(2.5) = 2.
        assert_eq!(trimmed_mean(&values(15)), 8.0);
        let mut skewed = values(25);
        skewed[0] = 1000.0;
        assert_eq!(trimmed_mean(&skewed), 13.0);
    }

    /// Feeds replay.tsv through a verbose logger, as the fixture script fed DeepSpeed's.
    fn replay() -> (CommsLogger, Vec<String>) {
        let (mut logger, lines) = capturing(true);
        for r in rows(REPLAY) {
            let latency = Duration::from_nanos(r[2].parse().unwrap());
            logger.record(
                op_named(r[0]),
                r[1].parse().unwrap(),
                latency,
                r[3].parse().unwrap(),
            );
        }
        let lines = lines.lock().unwrap().clone();
        (logger, lines)
    }

    #[test]
    fn verbose_lines_match_deepspeed() {
        let (_, lines) = replay();
        assert_eq!(lines, REPLAY_VERBOSE.lines().collect::<Vec<_>>());
    }

    #[test]
    fn summary_matches_deepspeed_log_all() {
        let (logger, _) = replay();
        assert_eq!(logger.summary(), REPLAY_SUMMARY);
    }

    #[test]
    fn verbose_lines_only_when_verbose_on_rank_0() {
        let (mut quiet, lines) = capturing(false);
        quiet.record(OpKind::Send, 8, ms(1.0), 2);
        assert!(lines.lock().unwrap().is_empty());

        let (logger, lines) = capturing(true);
        let mut rank1 = logger.with_rank(1);
        rank1.record(OpKind::Send, 8, ms(1.0), 2);
        assert!(lines.lock().unwrap().is_empty());
        assert!(rank1.summary().contains("\nsend\n"), "still recorded");
    }

    #[test]
    fn debug_files_ops_by_call_site() {
        let cfg = CommsLoggerConfig {
            debug: true,
            ..config(true, false, &["all_reduce"])
        };
        let mut logger = CommsLogger::new(&cfg);
        let line = line!() + 1;
        logger.record(OpKind::AllReduce, 8, ms(1.0), 2);
        let name = format!("all_reduce | [Caller Func: {}:{line}]", file!());
        assert!(logger.summary().contains(&format!("\n{name}\n")));
    }
}
