//! ds-comm across separate processes: the real `ds-rs` binary as 2-4 ranks, each result
//! checked by the ranks themselves (bench comm counts wrong elements against the inputs of
//! every rank), a rank killed mid-collective, and the --json contract.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn ds_rs() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ds-rs"))
}

fn bench(nproc: usize, op: &str, dtype: &str, transport: &str) -> Vec<serde_json::Value> {
    let out = ds_rs()
        .args([
            "bench",
            "comm",
            "--nproc",
            &nproc.to_string(),
            "--op",
            op,
            "--dtype",
            dtype,
        ])
        .args([
            "--transport",
            transport,
            "--min-bytes",
            "8",
            "--max-bytes",
            "2M",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{op} {dtype} x{nproc}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn every_op_and_dtype_is_correct_across_processes() {
    for nproc in [2, 3, 4] {
        for op in ["all-reduce", "reduce-scatter", "all-gather", "broadcast"] {
            for dtype in ["f32", "bf16", "f16"] {
                let transport = if nproc == 3 { "tcp" } else { "auto" };
                let rows = bench(nproc, op, dtype, transport);
                assert_eq!(rows.len(), 19, "sizes 8 B .. 2 MiB, doubling");
                for r in &rows {
                    let keys: Vec<&str> =
                        r.as_object().unwrap().keys().map(|k| k.as_str()).collect();
                    assert_eq!(
                        keys,
                        [
                            "op",
                            "bytes",
                            "dtype",
                            "nproc",
                            "time_us",
                            "algbw_gbs",
                            "busbw_gbs"
                        ]
                    );
                    assert_eq!(r["nproc"], nproc);
                    assert_eq!(r["op"], op.replace('-', "_"));
                    assert!(r["time_us"].as_f64().unwrap() > 0.0);
                }
            }
        }
    }
}

/// Ranks started directly (as a scheduler would), one of them killed mid-run: the others exit
/// with an error naming it, well within their timeout.
#[test]
fn a_killed_rank_fails_the_others_naming_it() {
    for transport in ["auto", "tcp"] {
        let port = free_port();
        let mut ranks: Vec<Child> = (0..3)
            .map(|rank| {
                ds_rs()
                    .args([
                        "bench",
                        "comm",
                        "--op",
                        "all-reduce",
                        "--min-bytes",
                        "8M",
                        "--max-bytes",
                        "8M",
                        "--iters",
                        "100000",
                    ])
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", "3")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("DS_RS_TRANSPORT", transport)
                    .env("DS_RS_COMM_TIMEOUT", "30")
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(1500));
        ranks[1].kill().unwrap();
        let _ = ranks[1].wait();
        let killed_at = Instant::now();
        for rank in [0, 2] {
            let status = wait_at_most(&mut ranks[rank], Duration::from_secs(20));
            let took = killed_at.elapsed();
            let mut err = String::new();
            ranks[rank]
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(
                !status
                    .unwrap_or_else(|| panic!("{transport}: rank {rank} hung"))
                    .success(),
                "{transport}: rank {rank} succeeded"
            );
            assert!(
                err.contains("rank 1"),
                "{transport}: rank {rank} said: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
            assert!(
                took < Duration::from_secs(15),
                "{transport}: rank {rank} took {took:?}"
            );
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_at_most(c: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Some(s) = c.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
    None
}
