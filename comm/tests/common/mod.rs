//! Helpers for multi-rank tests: N ranks as threads of this process over loopback.
#![allow(dead_code)]

pub mod matrix;

use ds_comm::store::StoreServer;
use ds_comm::{init, Communicator, InitOptions, Transport};
use std::time::Duration;

pub const TOKEN: &str = "test-token";

pub fn options(
    rank: usize,
    world: usize,
    port: u16,
    transport: Transport,
    timeout: Duration,
) -> InitOptions {
    let mut o = InitOptions::new(rank, world, "127.0.0.1", port);
    o.host_store = false;
    o.token = Some(TOKEN.into());
    o.transport = transport;
    o.timeout = timeout;
    o
}

/// Runs `f` on `world` ranks, each in its own thread with its own communicator.
pub fn run_ranks<R: Send + 'static>(
    world: usize,
    transport: Transport,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_ranks_timeout(world, transport, Duration::from_secs(60), f)
}

pub fn run_ranks_timeout<R: Send + 'static>(
    world: usize,
    transport: Transport,
    timeout: Duration,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN)).unwrap();
    let port = server.addr().port();
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || {
                let comm = init(&options(rank, world, port, transport, timeout))
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                f(comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A deterministic small integer per (rank, index): sums over up to 64 ranks stay exact in
/// bf16 (8 significant bits) and f16, so any rounding of an intermediate sum would show.
pub fn value(rank: usize, i: usize) -> f32 {
    ((rank * 7919 + i * 31) % 17) as f32 - 8.0
}
