//! The collective test matrix: every collective, on every dtype, with lengths 0, 1, primes and
//! large, checked element by element against a serial reference computed here in f64. It runs
//! on any set of ranks: threads of one process over the built-in transport (collectives.rs),
//! or the processes of an `mpirun` job over MPI (mpi_collectives.rs).

use super::{run_ranks, value};
use ds_comm::{Communicator, Element, ReduceOp, Transport};
use half::{bf16, f16};

/// The ranks a case runs on: `run` calls `f` once on every rank of `world`.
pub trait Ranks {
    fn world(&self) -> usize;
    fn run(&self, f: impl Fn(&Communicator) + Send + Sync + 'static);
}

/// `world` threads of this process, each its own rank over `transport`.
pub struct Threads {
    pub world: usize,
    pub transport: Transport,
}

impl Ranks for Threads {
    fn world(&self) -> usize {
        self.world
    }
    fn run(&self, f: impl Fn(&Communicator) + Send + Sync + 'static) {
        run_ranks(self.world, self.transport, move |comm| f(&comm));
    }
}

const LENGTHS: [usize; 6] = [0, 1, 7, 1009, 20_011, 300_007];
/// Longer than several of the all-reduce's ring slices (n parts of 256 KiB) for every world
/// size tested, with a short last slice.
const SLICED: usize = 2_300_017;

fn input<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| T::from_f32(value(rank, i))).collect()
}

/// The reduction of element i over `ranks`, in f64.
fn reference(ranks: &[usize], i: usize, op: ReduceOp) -> f64 {
    let vals = ranks.iter().map(|&r| value(r, i) as f64);
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<f64>() / ranks.len() as f64,
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
    }
}

/// Sums and maxima of these small integers are exact in every dtype; an average is the one
/// rounding of sum * (1/n) into the dtype, so it may be off by about one unit in the last place.
fn tolerance<T: Element>(op: ReduceOp, expect: f64) -> f64 {
    let ulp = match T::DTYPE {
        ds_comm::DType::F32 => 2f64.powi(-23),
        ds_comm::DType::BF16 => 2f64.powi(-7),
        ds_comm::DType::F16 => 2f64.powi(-10),
    };
    match op {
        ReduceOp::Avg => 2.0 * ulp * expect.abs().max(1e-30),
        _ => 0.0,
    }
}

fn check<T: Element>(
    what: &str,
    got: &[T],
    ranks: &[usize],
    op: ReduceOp,
    index: impl Fn(usize) -> usize,
) {
    for (k, v) in got.iter().enumerate() {
        let expect = reference(ranks, index(k), op);
        let err = (v.to_f32() as f64 - expect).abs();
        assert!(
            err <= tolerance::<T>(op, expect),
            "{what}: element {k}: got {}, expected {expect}",
            v.to_f32()
        );
    }
}

fn all_reduce_case<T: Element>(r: &impl Ranks) {
    let world = r.world();
    r.run(move |comm| {
        let g = comm.world();
        let ranks: Vec<usize> = (0..g.size()).collect();
        for len in LENGTHS.into_iter().chain([SLICED]) {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let mut buf = input::<T>(comm.rank(), len);
                g.all_reduce(&mut buf, op).unwrap();
                let what = format!(
                    "all_reduce {op:?} {:?} ws{world} len {len} rank {}",
                    T::DTYPE,
                    comm.rank()
                );
                check(&what, &buf, &ranks, op, |k| k);
            }
        }
    });
}

fn reduce_scatter_and_all_gather_case<T: Element>(r: &impl Ranks) {
    let world = r.world();
    r.run(move |comm| {
        let (g, me) = (comm.world(), comm.rank());
        let ranks: Vec<usize> = (0..world).collect();
        // 150_001: more than two of the out-of-place reduce-scatter's 256 KiB slices.
        for part in [0, 1, 13, 40_009, 150_001] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let mut out = vec![T::default(); part];
                let data = input::<T>(me, part * world);
                g.reduce_scatter(&data, &mut out, op).unwrap();
                let same = bytemuck::cast_slice::<T, u8>(&data)
                    == bytemuck::cast_slice::<T, u8>(&input::<T>(me, part * world));
                assert!(same, "reduce_scatter changed its input");
                check(
                    &format!("reduce_scatter {op:?} {:?} ws{world} part {part}", T::DTYPE),
                    &out,
                    &ranks,
                    op,
                    |k| me * part + k,
                );
            }

            let mine: Vec<T> = (0..part)
                .map(|k| T::from_f32(value(me, me * part + k)))
                .collect();
            let mut all = vec![T::default(); part * world];
            g.all_gather(&mine, &mut all).unwrap();
            for (k, v) in all.iter().enumerate() {
                let owner = k / part.max(1);
                assert_eq!(
                    v.to_f32(),
                    value(owner, k),
                    "all_gather {:?} ws{world} element {k}",
                    T::DTYPE
                );
            }
        }
        // Parts of different sizes, the length prime: the _v forms.
        // Also parts of zero length (only odd ranks own data): the shape of a flat range
        // that lies inside a few ZeRO shards.
        for (len, skewed) in [
            (5usize, false),
            (1009, false),
            (100_003, false),
            (1009, true),
        ] {
            let owners: Vec<usize> = match skewed && world > 1 {
                true => (0..world).filter(|r| r % 2 == 1).collect(),
                false => (0..world).collect(),
            };
            let n = owners.len();
            let counts: Vec<usize> = (0..world)
                .map(|r| match owners.iter().position(|&o| o == r) {
                    Some(i) => len / n + usize::from(i < len % n),
                    None => 0,
                })
                .collect();
            let start: usize = counts[..me].iter().sum();
            let mut buf = input::<T>(me, len);
            g.reduce_scatter_v(&mut buf, &counts, ReduceOp::Max)
                .unwrap();
            let mine = &buf[start..start + counts[me]];
            check(
                &format!("reduce_scatter_v ws{world} len {len}"),
                mine,
                &ranks,
                ReduceOp::Max,
                |k| start + k,
            );

            let mut buf: Vec<T> = (0..len)
                .map(|k| {
                    T::from_f32(if (start..start + counts[me]).contains(&k) {
                        value(me, k)
                    } else {
                        99.0
                    })
                })
                .collect();
            g.all_gather_v(&mut buf, &counts).unwrap();
            let owner = |k: usize| (0..world).find(|&r| k < counts[..=r].iter().sum()).unwrap();
            assert!(
                buf.iter()
                    .enumerate()
                    .all(|(k, v)| v.to_f32() == value(owner(k), k)),
                "all_gather_v ws{world} len {len}"
            );
        }
    });
}

fn broadcast_send_recv_barrier_case<T: Element>(r: &impl Ranks) {
    let world = r.world();
    r.run(move |comm| {
        let (g, me) = (comm.world(), comm.rank());
        for len in LENGTHS.into_iter().chain([3 << 20]) {
            let root = len % world;
            let mut buf = if me == root {
                input::<T>(root, len)
            } else {
                vec![T::default(); len]
            };
            g.broadcast(&mut buf, root).unwrap();
            assert!(
                buf.iter()
                    .enumerate()
                    .all(|(i, v)| v.to_f32() == value(root, i)),
                "broadcast ws{world} len {len} root {root}"
            );
        }
        if world > 1 {
            // A ring of sends: rank r sends to r+1 and receives from r-1; odd ranks receive first.
            let (to, from) = ((me + 1) % world, (me + world - 1) % world);
            let out = input::<T>(me, 1009);
            let mut got = vec![T::default(); 1009];
            if me % 2 == 0 {
                g.send(&out, to).unwrap();
                g.recv(&mut got, from).unwrap();
            } else {
                g.recv(&mut got, from).unwrap();
                g.send(&out, to).unwrap();
            }
            assert!(
                got.iter()
                    .enumerate()
                    .all(|(i, v)| v.to_f32() == value(from, i)),
                "send/recv ws{world}"
            );
        }
        if world > 1 {
            combined_send_recv_ring::<T>(&g, me, world);
        }
        g.barrier().unwrap();
    });
}

/// Every rank sends to both neighbours and receives from both at once, with `send_recv`
/// (messages far larger than any socket or ring buffer, so one-sided blocking sends would
/// deadlock); then async sends from even ranks to the odd rank after them, received there.
fn combined_send_recv_ring<T: Element>(g: &ds_comm::Group, me: usize, world: usize) {
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let len = 3 << 20;
    let fwd = input::<T>(me, len);
    let bwd = input::<T>(me + world, 1009);
    let (mut from_prev, mut from_next) = (vec![T::default(); len], vec![T::default(); 1009]);
    let sends = [
        (next, bytemuck::cast_slice::<T, u8>(&fwd)),
        (prev, bytemuck::cast_slice::<T, u8>(&bwd)),
    ];
    let mut recvs = [
        (prev, bytemuck::cast_slice_mut::<T, u8>(&mut from_prev)),
        (next, bytemuck::cast_slice_mut::<T, u8>(&mut from_next)),
    ];
    g.send_recv(&sends, &mut recvs).unwrap();
    let same = |got: &[T], rank: usize| {
        got.iter()
            .enumerate()
            .all(|(i, v)| v.to_f32() == value(rank, i))
    };
    assert!(same(&from_prev, prev), "send_recv ws{world}: forward");
    assert!(
        same(&from_next, next + world),
        "send_recv ws{world}: backward"
    );

    if me.is_multiple_of(2) && !next.is_multiple_of(2) {
        g.send_async(fwd, next).wait().unwrap();
    } else if me % 2 == 1 {
        g.recv(&mut from_prev, prev).unwrap();
        assert!(same(&from_prev, prev), "send_async ws{world}");
    }
}

/// Sub-groups (the odd ranks in reverse order; the 3D layout's groups), and async collectives
/// in flight together, waited for in reverse order.
fn groups_and_async_case(r: &impl Ranks) {
    let world = r.world();
    r.run(move |comm| {
        let me = comm.rank();
        let odd: Vec<usize> = (0..world).rev().filter(|r| r % 2 == 1).collect();
        if odd.contains(&me) {
            let g = comm.group(&odd).unwrap();
            let mut buf = input::<f32>(me, 1009);
            g.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            check("all_reduce, odd ranks", &buf, &odd, ReduceOp::Sum, |k| k);
            let root = odd[odd.len() - 1];
            let mut b = match me == root {
                true => input::<bf16>(root, 77),
                false => vec![bf16::default(); 77],
            };
            g.broadcast(&mut b, root).unwrap();
            let same = b
                .iter()
                .enumerate()
                .all(|(i, v)| v.to_f32() == value(root, i));
            assert!(same, "broadcast from rank {root}, odd ranks");
        }
        if world >= 4 && world.is_multiple_of(2) {
            let dims = ds_config::ParallelDims::new(world, 2, 1).unwrap();
            let groups = ds_comm::Groups::new(comm, dims).unwrap();
            for (name, g) in [("dp", groups.dp()), ("tp", groups.tp())] {
                let mut buf = input::<f32>(me, 513);
                g.all_reduce(&mut buf, ReduceOp::Max).unwrap();
                let what = format!("all_reduce, {name} group {:?}", g.global_ranks());
                check(&what, &buf, g.global_ranks(), ReduceOp::Max, |k| k);
            }
        }

        let g = comm.world();
        let all: Vec<usize> = (0..world).collect();
        let a = g.all_reduce_async(input::<f32>(me, 20_011), ReduceOp::Avg);
        let len = 4099;
        let b = g.reduce_scatter_async(input::<f16>(me, len), ReduceOp::Max);
        let mine = g.my_part(len);
        let part: Vec<f32> = (0..len)
            .map(|k| match mine.contains(&k) {
                true => value(me, k),
                false => 99.0,
            })
            .collect();
        let c = g.all_gather_async(part);
        let gathered = c.wait().unwrap();
        let reduced = b.wait().unwrap();
        let averaged = a.wait().unwrap();
        check("all_reduce_async", &averaged, &all, ReduceOp::Avg, |k| k);
        let r = &reduced[mine.clone()];
        check("reduce_scatter_async", r, &all, ReduceOp::Max, |k| {
            mine.start + k
        });
        let bounds: Vec<usize> = (0..world).map(|q| comm_part_end(len, world, q)).collect();
        let owner = |k: usize| bounds.iter().position(|&end| k < end).unwrap();
        let ok = gathered
            .iter()
            .enumerate()
            .all(|(k, v)| *v == value(owner(k), k));
        assert!(ok, "all_gather_async ws{world}");
    });
}

/// How many elements rank `from` sends rank `to` in the uneven all-to-all: some pairs none,
/// the rest of different sizes around `base`.
fn a2a_count(from: usize, to: usize, base: usize) -> usize {
    match (from + 2 * to) % 4 {
        0 if base > 0 => 0,
        k => base + k * (base / 3 + 1),
    }
}

fn all_to_all_case<T: Element>(r: &impl Ranks) {
    let world = r.world();
    r.run(move |comm| {
        let (g, me) = (comm.world(), comm.rank());
        // what rank `from` holds at flat index x of its input
        let sent = |from: usize, x: usize| T::from_f32(value(from, x)).to_f32();
        for part in [0, 1, 13, 40_009, 150_001] {
            let data = input::<T>(me, part * world);
            let mut out = vec![T::default(); part * world];
            g.all_to_all(&data, &mut out).unwrap();
            for (k, v) in out.iter().enumerate() {
                let (from, at) = (k / part.max(1), k % part.max(1));
                assert_eq!(
                    v.to_f32(),
                    sent(from, me * part + at),
                    "all_to_all {:?} ws{world} part {part} element {k}",
                    T::DTYPE
                );
            }
            let out = g.all_to_all_async(data).wait().unwrap();
            let again: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
            let want: Vec<f32> = (0..part * world)
                .map(|k| sent(k / part.max(1), me * part + k % part.max(1)))
                .collect();
            assert_eq!(again, want, "all_to_all_async ws{world} part {part}");
        }
        for base in [0, 5, 1009, 60_013] {
            let send: Vec<usize> = (0..world).map(|j| a2a_count(me, j, base)).collect();
            let recv: Vec<usize> = (0..world).map(|i| a2a_count(i, me, base)).collect();
            let data = input::<T>(me, send.iter().sum());
            let out = g
                .all_to_all_v_async(data, send.clone(), recv.clone())
                .wait()
                .unwrap();
            let mut k = 0;
            for (from, &n) in recv.iter().enumerate() {
                // where rank `from`'s part for this rank starts in its input
                let start: usize = (0..me).map(|j| a2a_count(from, j, base)).sum();
                for at in 0..n {
                    assert_eq!(
                        out[k].to_f32(),
                        sent(from, start + at),
                        "all_to_all_v {:?} ws{world} base {base} from {from} element {at}",
                        T::DTYPE
                    );
                    k += 1;
                }
            }
        }
    });
}

/// Where rank q's part of an even split of `len` over `n` ends (the first parts one longer).
fn comm_part_end(len: usize, n: usize, q: usize) -> usize {
    (0..=q).map(|i| len / n + usize::from(i < len % n)).sum()
}

/// The whole matrix on the ranks of `r`.
pub fn every_op(r: &impl Ranks) {
    groups_and_async_case(r);
    all_reduce_case::<f32>(r);
    all_reduce_case::<bf16>(r);
    all_reduce_case::<f16>(r);
    reduce_scatter_and_all_gather_case::<f32>(r);
    reduce_scatter_and_all_gather_case::<bf16>(r);
    reduce_scatter_and_all_gather_case::<f16>(r);
    broadcast_send_recv_barrier_case::<f32>(r);
    broadcast_send_recv_barrier_case::<bf16>(r);
    all_to_all_case::<f32>(r);
    all_to_all_case::<bf16>(r);
    all_to_all_case::<f16>(r);
}
