//! Many ranks in one process, one thread each over loopback: the harness of multi-rank tests
//! in every crate above ds-comm.

use std::sync::Arc;
use std::time::Duration;

use crate::store::StoreServer;
use crate::{init, Communicator, InitOptions, Transport};

const TOKEN: &str = "testkit";

/// Runs `f` on `world` ranks, each a thread with its own communicator (`timeout` bounds every
/// wait). Returns the ranks' results in rank order, or the first failing rank's error, named.
pub fn run_ranks<R, E>(
    world: usize,
    timeout: Duration,
    f: impl Fn(Communicator) -> Result<R, E> + Send + Sync + 'static,
) -> Result<Vec<R>, String>
where
    R: Send + 'static,
    E: std::fmt::Display,
{
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN)).map_err(|e| e.to_string())?;
    let port = server.addr().port();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let f = f.clone();
            std::thread::spawn(move || -> Result<R, String> {
                let mut o = InitOptions::new(rank, world, "127.0.0.1", port);
                o.host_store = false;
                o.token = Some(TOKEN.into());
                o.transport = Transport::Auto;
                o.timeout = timeout;
                let comm = init(&o).map_err(|e| format!("rank {rank}: {e}"))?;
                f(comm).map_err(|e| format!("rank {rank}: {e}"))
            })
        })
        .collect();
    let results: Vec<Result<R, String>> = handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| {
            h.join()
                .unwrap_or_else(|_| Err(format!("rank {rank} panicked")))
        })
        .collect();
    results.into_iter().collect()
}

/// A global allocator that records the largest single allocation, for tests that feed hostile
/// bytes to a parser: a length read from the input that reached an allocation uncapped shows
/// up as a huge one. Install it with `#[global_allocator] static A: LargestAlloc = LargestAlloc;`.
pub struct LargestAlloc;

static LARGEST: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl LargestAlloc {
    /// The largest allocation (or reallocation) so far, in bytes.
    pub fn largest() -> usize {
        LARGEST.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn record(size: usize) {
        LARGEST.fetch_max(size, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator unchanged; only records sizes.
unsafe impl std::alloc::GlobalAlloc for LargestAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        Self::record(layout.size());
        std::alloc::System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        Self::record(layout.size());
        std::alloc::System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        Self::record(new_size);
        std::alloc::System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        std::alloc::System.dealloc(ptr, layout)
    }
}
