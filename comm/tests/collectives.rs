//! The collective matrix (common/matrix.rs) for world sizes 1-8 (threads over loopback, shared
//! memory and TCP), and the f32 sum's accuracy.

mod common;

use common::matrix::{every_op, Threads};
use common::run_ranks;
use ds_comm::{ReduceOp, Transport};

#[test]
fn world_1() {
    every_op(&Threads {
        world: 1,
        transport: Transport::Auto,
    });
}

#[test]
fn world_2_shared_memory() {
    every_op(&Threads {
        world: 2,
        transport: Transport::Auto,
    });
}

#[test]
fn world_2_tcp() {
    every_op(&Threads {
        world: 2,
        transport: Transport::Tcp,
    });
}

#[test]
fn world_3_shared_memory() {
    every_op(&Threads {
        world: 3,
        transport: Transport::Auto,
    });
}

#[test]
fn world_3_tcp() {
    every_op(&Threads {
        world: 3,
        transport: Transport::Tcp,
    });
}

#[test]
fn world_4_shared_memory() {
    every_op(&Threads {
        world: 4,
        transport: Transport::Auto,
    });
}

#[test]
fn world_4_tcp() {
    every_op(&Threads {
        world: 4,
        transport: Transport::Tcp,
    });
}

#[test]
fn world_8_shared_memory() {
    every_op(&Threads {
        world: 8,
        transport: Transport::Auto,
    });
}

#[test]
fn world_8_tcp() {
    every_op(&Threads {
        world: 8,
        transport: Transport::Tcp,
    });
}

/// Random floats: the ring's per-hop f32 sums differ from a serial sum only by rounding, and
/// every rank must get the bit-identical result (ZeRO relies on replicas staying equal).
#[test]
fn random_f32_all_reduce_is_accurate_and_identical_on_every_rank() {
    let world = 4;
    let len = 250_007;
    let data = move |r: usize| -> Vec<f32> {
        let mut s = 0x9E3779B97F4A7C15u64 ^ (r as u64 * 0x2545F4914F6CDD1D);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    };
    let results = run_ranks(world, Transport::Auto, move |comm| {
        let mut buf = data(comm.rank());
        comm.world().all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        buf
    });
    let inputs: Vec<Vec<f32>> = (0..world).map(data).collect();
    for i in 0..len {
        let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
        let magnitude: f64 = inputs.iter().map(|v| v[i].abs() as f64).sum();
        // world-1 additions, each rounding by at most half an ulp of a partial sum <= magnitude.
        let bound = (world - 1) as f64 * 2f64.powi(-24) * magnitude;
        assert!((results[0][i] as f64 - exact).abs() <= bound, "element {i}");
    }
    assert!(results.iter().all(|r| r == &results[0]), "ranks disagree");
}

#[test]
fn integers_up_to_2_pow_48_gather_exactly() {
    run_ranks(3, Transport::Auto, move |comm| {
        let g = comm.world();
        let r = comm.rank() as u64;
        // Values that f32 alone would round: odd numbers above 2^24, and the largest allowed.
        let mine = [(1 << 24) + 2 * r + 1, (1 << 48) - 1 - r, r];
        let all = g.all_gather_u64(&mine).unwrap();
        let want: Vec<u64> = (0..3u64)
            .flat_map(|q| [(1 << 24) + 2 * q + 1, (1 << 48) - 1 - q, q])
            .collect();
        assert_eq!(all, want);
        assert!(g.all_gather_u64(&[1 << 48]).is_err());
    });
}
