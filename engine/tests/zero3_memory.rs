//! ZeRO-3 keeps its memory promise (issue 15): on 2 and 4 ranks, no rank's heap holds more
//! than its shard's model states plus the largest layer gathered plus buffers, during
//! start-up (`Engine::initialize`) and during step 1 (one `train_batch`: forward, backward,
//! step).
//!
//! What is measured: **heap allocation bytes**, through a `#[global_allocator]` that wraps
//! `System` and counts the live bytes and their high-water mark (realloc included), not RSS.
//! Why: it is deterministic (the same program makes the same requests whatever the kernel
//! does), it does not depend on the kernel's page accounting (RSS lags calloc'd pages that
//! were never touched and keeps pages glibc has not returned, so it can both hide and invent
//! a peak), and it sees only this process, not other tests running beside it. It counts a
//! calloc'd buffer in full even if its pages are never touched, which can only make the
//! measure larger (stricter). What it does not see: memory-mapped files and shared-memory
//! segments (ds-comm's shm links, a memmap'd `--init` file; none holds model state here),
//! thread stacks, and memory that a library takes from the kernel without the global
//! allocator (candle's CPU tensors are Rust `Vec`s, so on CPU there is none).
//!
//! The allocator is process-wide and the ranks are threads of this process
//! (`ds_comm::testkit::run_ranks`), so the check is on the sum: the process's high-water
//! mark above the phase's baseline must stay below the sum over ranks of the per-rank bound
//! (if every rank keeps within its bound, the sum does). Barriers keep the ranks in the same
//! phase; the mark is reset to the live bytes at the start of each phase (the "baseline":
//! the communicators, the config, the batch, and before step 1 everything start-up built).
//! For that reason this file holds one `#[test]`: tests of one binary run in parallel
//! threads and would count each other's allocations.
//!
//! Why a high-water mark alone cannot see a whole model at start-up here: with fp32 and
//! AdamW a rank's model states are 20 bytes x Psi/N, 10 Psi bytes at N=2, 5 Psi at N=4,
//! while a whole fp32 model is 4 Psi bytes. A start-up that builds the whole model first
//! and then keeps only its shard (the pre-zero.Init code, or its regressions) frees it
//! before the shard's gradients, master copy and Adam moments exist, so its peak stays
//! below the steady state that the bound must allow anyway. Start-up is therefore also
//! checked for its **temporary** memory: the allocations of 64 KiB and more made and freed
//! within `Engine::initialize` are logged (address, size, in order) and the most of them
//! alive at once must stay within one layer-sized staging buffer per rank plus slack.
//! zero.Init writes values straight into the shard; a whole-model buffer, however short
//! lived, shows up there as 4 Psi bytes per rank.
//!
//! Process fixed costs are kept out of the phases: rayon's global pool is fixed at 2
//! workers, and a warm-up (the same shapes with one block: start-up and one step, then
//! dropped) allocates gemm's per-thread packing slabs, rayon's workers and candle's lazy
//! statics before the first baseline; the warm-up prints what it leaves (the fixed cost).
//!
//! How it fails (each tried by hand on 2 and 4 ranks, then reverted):
//! - start-up building the whole fp32 model and keeping its shard (`Zero::new` generating
//!   `0..padded` then copying the owned range out): the start-up temporary check, 36.1 MiB
//!   per rank against 6.0 (the high-water checks still pass, as explained above);
//! - a gradient bucket as large as the whole gradient (`ShardGrads::open` without the
//!   `reduce_bucket_size` cap): the step-1 check, 124.5 MiB per rank against 105.7 (N=2);
//! - every gathered layer kept from forward to backward (DeepSpeed's defaults 1e9 for
//!   `stage3_max_live_parameters` and `stage3_max_reuse_distance`): the step-1 check,
//!   119.8 MiB per rank against 105.7 (N=2);
//! - any whole-model buffer kept after start-up (parameters replicated at stage 3): the
//!   start-up high-water check (4 Psi = 32 MiB per rank above a 6 MiB margin).
//!
//! A rank that exceeds its bound by less than the other ranks' unused margin passes: the
//! check is on the sum because the allocator cannot tell the ranks' threads apart (the
//! communicator's worker and rayon's threads allocate and free for every rank).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use ds_comm::testkit::run_ranks;
use ds_config::{hjson, resolve, ParallelDims};
use ds_engine::Batch;
use ds_engine::{Engine, EngineOptions};
use ds_models::gpt::GptConfig;

// ---------------------------------------------------------------------------------------
// The counting allocator.

struct Counting;

/// Heap bytes allocated and not yet freed, process-wide.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most `LIVE` has been since the last `reset_peak`.
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// While on, allocations and frees of at least `LOG_MIN` bytes are appended to `LOG`, in the
/// order of their `LOG_LEN` ticket (an allocation's ticket precedes its free's: the free
/// happens after the allocation returned).
static LOGGING: AtomicBool = AtomicBool::new(false);
static LOG_LEN: AtomicUsize = AtomicUsize::new(0);
const LOG_MIN: usize = 64 << 10;
const LOG_CAP: usize = 1 << 14;

struct Event {
    ptr: AtomicUsize,
    /// Bytes, positive for an allocation, negative for a free; 0 for a slot not written.
    size: AtomicIsize,
}

static LOG: [Event; LOG_CAP] = [const {
    Event {
        ptr: AtomicUsize::new(0),
        size: AtomicIsize::new(0),
    }
}; LOG_CAP];

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, SeqCst) + n;
    PEAK.fetch_max(now, SeqCst);
}

fn shrank(n: usize) {
    LIVE.fetch_sub(n, SeqCst);
}

fn log(ptr: *mut u8, size: isize) {
    if size.unsigned_abs() < LOG_MIN || !LOGGING.load(SeqCst) {
        return;
    }
    let i = LOG_LEN.fetch_add(1, SeqCst);
    if let Some(e) = LOG.get(i) {
        e.ptr.store(ptr as usize, SeqCst);
        e.size.store(size, SeqCst);
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
            log(p, l.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
            log(p, l.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        shrank(l.size());
        log(p, -(l.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new_size) };
        if q.is_null() {
            return q;
        }
        let old = l.size();
        if q == p {
            // resized in place: only the difference was ever held
            if new_size >= old {
                grew(new_size - old);
            } else {
                shrank(old - new_size);
            }
            log(p, -(old as isize));
            log(q, new_size as isize);
        } else {
            // moved: both blocks existed while the contents were copied
            grew(new_size);
            log(q, new_size as isize);
            shrank(old);
            log(p, -(old as isize));
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Sets the high-water mark to the live bytes now and returns them (the phase's baseline).
fn reset_peak() -> usize {
    let live = LIVE.load(SeqCst);
    PEAK.store(live, SeqCst);
    // allocations racing with the store can only have raised LIVE: keep the mark above it
    PEAK.fetch_max(LIVE.load(SeqCst), SeqCst);
    live
}

/// The most bytes held at once in allocations that were both made and freed while logging
/// was on (temporaries), from the event log.
fn temporary_peak(events: &[(usize, isize)]) -> usize {
    let mut open: HashMap<usize, (usize, usize)> = HashMap::new();
    let mut delta = vec![0isize; events.len() + 1];
    for (i, &(ptr, size)) in events.iter().enumerate() {
        match size {
            0 => {} // a ticket taken as logging stopped, never written
            s if s > 0 => {
                open.insert(ptr, (i, s as usize));
            }
            _ => {
                if let Some((a, n)) = open.remove(&ptr) {
                    delta[a] += n as isize;
                    delta[i] -= n as isize;
                }
            }
        }
    }
    let (mut now, mut most) = (0isize, 0isize);
    for d in delta {
        now += d;
        most = most.max(now);
    }
    most as usize
}

// ---------------------------------------------------------------------------------------
// Phases.

/// One phase's figures, process-wide, in bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Measure {
    baseline: usize,
    peak: usize,
    end: usize,
    /// Start-up only: the most held at once in temporaries of at least `LOG_MIN` bytes.
    temporary: Option<usize>,
}

impl Measure {
    fn above(&self) -> usize {
        self.peak.saturating_sub(self.baseline)
    }
}

/// Shared by the rank threads: the barrier that keeps them in one phase, and the figures.
struct Phases {
    barrier: Barrier,
    open: Mutex<Measure>,
    done: Mutex<Vec<Measure>>,
}

impl Phases {
    /// Every rank arrives; one resets the mark (and starts the log); then all go on.
    fn begin(&self, log_temporaries: bool) {
        if self.barrier.wait().is_leader() {
            let mut m = self.open.lock().unwrap();
            if log_temporaries {
                LOG_LEN.store(0, SeqCst);
                LOGGING.store(true, SeqCst);
            }
            *m = Measure {
                baseline: reset_peak(),
                ..Measure::default()
            };
        }
        self.barrier.wait();
    }

    /// Every rank has finished the phase; one reads the mark (and the log).
    fn end(&self) {
        if self.barrier.wait().is_leader() {
            let peak = PEAK.load(SeqCst);
            let end = LIVE.load(SeqCst);
            let logging = LOGGING.swap(false, SeqCst);
            let mut m = *self.open.lock().unwrap();
            m.peak = peak;
            m.end = end;
            if logging {
                let n = LOG_LEN.load(SeqCst);
                assert!(
                    n <= LOG_CAP,
                    "{n} allocations of {LOG_MIN} bytes or more at start-up: raise LOG_CAP"
                );
                let events: Vec<(usize, isize)> = LOG[..n]
                    .iter()
                    .map(|e| (e.ptr.load(SeqCst), e.size.load(SeqCst)))
                    .collect();
                m.temporary = Some(temporary_peak(&events));
            }
            self.done.lock().unwrap().push(m);
        }
        self.barrier.wait();
    }
}

// ---------------------------------------------------------------------------------------
// The run.

/// A GPT whose whole fp32 copy (4 Psi = 33.7 MB) is large next to one layer (4.2 MB), so a
/// whole-model buffer cannot hide in the per-layer terms or the slack.
const GPT: GptConfig = GptConfig {
    vocab_size: 4096,
    seq_len: 16,
    hidden: 256,
    heads: 4,
    layers: 8,
    tie_embeddings: false,
    moe: None,
};
const MICRO: usize = 2;
/// `stage3_max_live_parameters`: about one block (789,760 parameters here).
const MAX_LIVE: usize = 800_000;
/// `reduce_bucket_size`: about one block; at stage 3 the engine halves the live limit for
/// its two buckets, so this also shows that the smaller of the two is what is used.
const REDUCE_BUCKET: usize = 800_000;
/// `stage3_prefetch_bucket_size`: smaller than any layer, so no layer is gathered ahead.
const PREFETCH: usize = 10_000;

fn config(world: usize) -> ds_config::Config {
    // overlap_comm is left at its stage-3 default (true): two buckets can be alive at once.
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": {MICRO}, "gradient_accumulation_steps": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": 3, "reduce_bucket_size": {REDUCE_BUCKET},
            "stage3_max_live_parameters": {MAX_LIVE}, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": {PREFETCH}, "stage3_param_persistence_threshold": 0}}}}"#
    );
    let doc = hjson::parse_bytes(text.as_bytes()).unwrap();
    resolve(&doc, &ParallelDims::new(world, 1, 1).unwrap()).unwrap()
}

/// A learnable micro-batch (the same on every rank: memory does not depend on the tokens).
fn batch() -> Batch {
    let (b, t) = (MICRO, GPT.seq_len);
    let w: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 7 % 97) as u32).collect();
    let (mut inputs, mut targets) = (Vec::new(), Vec::new());
    for s in w.chunks(t + 1) {
        inputs.extend(&s[..t]);
        targets.extend(&s[1..]);
    }
    Batch {
        inputs,
        targets,
        batch: b,
        seq: t,
        loss_weight: 1.0,
    }
}

/// Warm-up, start-up and step 1 on `world` ranks, in that order.
fn measure(world: usize) -> Vec<Measure> {
    let phases = Arc::new(Phases {
        barrier: Barrier::new(world),
        open: Mutex::new(Measure::default()),
        done: Mutex::new(Vec::new()),
    });
    let shared = phases.clone();
    run_ranks(world, Duration::from_secs(120), move |comm| {
        let cfg = config(world);
        let data = batch();
        let opts = EngineOptions::default();
        // (0) warm-up: the same layer shapes with one block, trained one step and dropped,
        // so that the process's fixed cost (rayon's workers, gemm's per-thread packing
        // slabs, candle's lazy statics, the communicator's first buffers) is in the baseline
        shared.begin(false);
        let one_block = GptConfig { layers: 1, ..GPT };
        let mut warm = Engine::initialize(
            one_block.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &opts,
        )?;
        warm.train_batch(|_| Ok(data.clone()))?;
        drop(warm);
        shared.end();
        // (1) start-up: the model's description and the engine with its shard
        shared.begin(true);
        let mut engine = Engine::initialize(
            GPT.build(),
            &cfg,
            &ds_comm::Groups::data_parallel(&comm)?,
            &opts,
        )?;
        shared.end();
        // (2) step 1: forward, backward (gather, recompute, reduce-scatter), AdamW step
        shared.begin(false);
        let (loss, _) = engine.train_batch(|_| Ok(data.clone()))?;
        shared.end();
        assert!(loss.is_finite(), "loss {loss}");
        Ok::<_, ds_engine::EngineError>(())
    })
    .unwrap();
    let done = phases.done.lock().unwrap().clone();
    assert_eq!(done.len(), 3);
    done
}

// ---------------------------------------------------------------------------------------
// The bound, from the model's shapes and the ZeRO formula (not from the engine's report).

/// One rank's allowance, in bytes, by term.
#[derive(Debug)]
struct Bound {
    /// Model states of the shard.
    states: usize,
    /// One layer's parameters gathered (the largest layer).
    layer: usize,
    /// The two gradient buckets.
    buckets: usize,
    /// Activations of the micro-batch.
    activations: usize,
    slack: usize,
}

const F32: usize = 4;
const MIB: f64 = (1 << 20) as f64;

/// Parameters per layer of the GPT, in model order, written out from its definition
/// (models/src/gpt, as ../shared/bench/gpt.py): embeddings wte [V, d] + wpe [T, d]; each
/// block 2 LayerNorms (2d each), q|k|v (3d^2 + 3d), attention projection (d^2 + d), MLP
/// (4d^2 + 4d and 4d^2 + d): 12d^2 + 13d; head ln_f (2d) + lm_head [V, d]; the loss none.
fn layer_sizes(c: GptConfig) -> Vec<usize> {
    let (v, t, d, l) = (c.vocab_size, c.seq_len, c.hidden, c.layers);
    let mut sizes = vec![v * d + t * d];
    sizes.extend(std::iter::repeat_n(12 * d * d + 13 * d, l));
    sizes.push(2 * d + v * d);
    sizes.push(0);
    sizes
}

fn per_rank_bound(c: GptConfig, world: usize) -> Bound {
    let sizes = layer_sizes(c);
    let psi: usize = sizes.iter().sum();
    let largest = *sizes.iter().max().unwrap();
    // Model states (ZeRO paper, 16 Psi/N at mixed precision; here fp32 + AdamW): per owned
    // element 4 bytes of parameter shard, 4 of gradient shard, 4 of fp32 master copy and
    // 8 of Adam moments (exp_avg, exp_avg_sq); each rank owns ceil(Psi/N) elements (the
    // flat buffer is padded to N equal shards).
    let states = 20 * psi.div_ceil(world);
    // The live layer, counted three times: its gathered buffer (which becomes the layer's
    // parameter tensors), a second buffer of its size (autograd's own variables for a layer
    // without a tape, or the embeddings' zero-filled gradient that index_add copies), and
    // its parameter gradients. stage3_max_reuse_distance 0 and a live limit below the
    // largest layer keep no other layer gathered (the loss layer, kept, has no parameters),
    // and no layer fits the prefetch bucket, so no second layer is ever in flight.
    let layer = 3 * F32 * largest;
    // Two gradient buckets (Note [bounded buckets]: one filling, one being reduce-scattered
    // under overlap_comm). Each holds min(reduce_bucket_size, stage3_max_live_parameters / 2)
    // elements, or one layer's whole gradient when that alone is larger (a layer's gradient
    // is never split across buckets).
    let bucket = REDUCE_BUCKET.min(MAX_LIVE / 2).max(largest);
    let buckets = 2 * F32 * bucket;
    // Activations of one micro-batch (B sequences of T tokens), fp32, generously:
    //   (L + 2) B T d      every layer's saved input (the released layers keep only it)
    // + 2 (16 B T d + B H T^2)  the live block's tape (x, h1, q|k|v 3, attention out, x2,
    //                    h2, MLP pre-activation 4 and GELU 4 = 16 B T d, probabilities
    //                    B H T^2) and as much again for its backward's temporaries
    // + 4 B T V          logits, the loss's kept probabilities, their gradient, one more
    let (v, t, d, h, l) = (c.vocab_size, c.seq_len, c.hidden, c.heads, c.layers);
    let btd = MICRO * t * d;
    let activations =
        F32 * ((l + 2) * btd + 2 * (16 * btd + MICRO * h * t * t) + 4 * MICRO * t * v);
    // Allocator-visible bookkeeping: the communicator's per-collective send/receive lists
    // and worker hand-offs, candle's tensor headers, the layer list and flat index, rayon's
    // and gemm's per-thread buffers: 2 MiB per rank.
    let slack = 2 << 20;
    Bound {
        states,
        layer,
        buckets,
        activations,
        slack,
    }
}

impl Bound {
    /// Step 1 (and any moment of training): everything.
    fn step(&self) -> usize {
        self.states + self.layer + self.buckets + self.activations + self.slack
    }
    /// Start-up: the states it builds, at most one layer-sized staging buffer (zero.Init
    /// generates the shard in pieces), no activations, no buckets.
    fn startup(&self) -> usize {
        self.states + self.layer / 3 + self.slack
    }
    /// Start-up temporaries: the one staging buffer, and slack.
    fn startup_temporary(&self) -> usize {
        self.layer / 3 + self.slack
    }
}

fn mib(b: usize) -> String {
    format!("{:.1} MiB", b as f64 / MIB)
}

#[test]
fn zero3_heap_stays_within_shard_plus_one_layer_plus_buffers() {
    let t0 = Instant::now();
    // gemm keeps a packing slab (an L2 cache's size) per thread that runs a product, and
    // rayon starts one worker per core: a fixed pool makes that fixed cost the same on any
    // machine, and the warm-up allocates it before the phases are measured.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build_global();
    // the written-out sizes are the model's own
    let sizes = layer_sizes(GPT);
    let model = GPT.build();
    let from_model: Vec<usize> = model
        .layers()
        .iter()
        .map(|l| l.params().iter().map(|p| p.numel()).sum())
        .collect();
    assert_eq!(sizes, from_model, "layer sizes");
    let psi: usize = sizes.iter().sum();
    assert_eq!(psi, GPT.n_params());
    drop(model);
    eprintln!(
        "GPT {GPT:?}: Psi = {psi} ({} fp32), largest layer {} ({} fp32)",
        mib(F32 * psi),
        sizes.iter().max().unwrap(),
        mib(F32 * sizes.iter().max().unwrap())
    );

    let mut failures = Vec::new();
    for world in [2, 4] {
        let b = per_rank_bound(GPT, world);
        eprintln!(
            "N={world}: per-rank bound: states {} + layer x3 {} + buckets {} + activations {} \
             + slack {} = {} (step), {} (start-up)",
            mib(b.states),
            mib(b.layer),
            mib(b.buckets),
            mib(b.activations),
            mib(b.slack),
            mib(b.step()),
            mib(b.startup())
        );
        let [warm, startup, step] = measure(world)[..] else {
            unreachable!()
        };
        eprintln!(
            "N={world} warm-up (one-block GPT, start-up + step, dropped): baseline {}, \
             peak {}, left {} (the process's fixed cost)",
            mib(warm.baseline),
            mib(warm.peak),
            mib(warm.end.saturating_sub(warm.baseline))
        );
        let checks = [
            ("start-up", startup.above(), world * b.startup(), startup),
            // Step 1 is measured from the same origin as start-up (the heap before the
            // engine existed), so the bound is the whole per-rank bound, states included.
            (
                "step 1",
                step.peak.saturating_sub(startup.baseline),
                world * b.step(),
                step,
            ),
        ];
        for (phase, held, bound, m) in checks {
            eprintln!(
                "N={world} {phase}: baseline {}, peak {}, end {}, peak above the pre-engine \
                 heap {} (per rank {}), bound {} (N x {})",
                mib(m.baseline),
                mib(m.peak),
                mib(m.end),
                mib(held),
                mib(held / world),
                mib(bound),
                mib(bound / world)
            );
            if held > bound {
                failures.push(format!(
                    "N={world} {phase}: the heap rose {} above the heap before the engine, \
                     more than {world} ranks x {} (shard states + largest layer + buffers)",
                    mib(held),
                    mib(bound / world)
                ));
            }
        }
        eprintln!(
            "N={world} step 1: rose {} above its own baseline (per rank {}); per-rank working \
             bound without states {}",
            mib(step.above()),
            mib(step.above() / world),
            mib(b.step() - b.states)
        );
        let temp = startup.temporary.expect("start-up logs its temporaries");
        let temp_bound = world * b.startup_temporary();
        eprintln!(
            "N={world} start-up temporaries: at most {} alive at once (per rank {}), bound {} \
             (N x {})",
            mib(temp),
            mib(temp / world),
            mib(temp_bound),
            mib(b.startup_temporary())
        );
        if temp > temp_bound {
            failures.push(format!(
                "N={world} start-up: {} of temporary buffers alive at once, more than {world} \
                 ranks x {} (one layer-sized staging buffer + slack): a rank built more than its \
                 shard (a whole-model buffer is {} per rank)",
                mib(temp),
                mib(b.startup_temporary()),
                mib(F32 * psi)
            ));
        }
    }
    eprintln!("zero3_memory: {:.1} s", t0.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
