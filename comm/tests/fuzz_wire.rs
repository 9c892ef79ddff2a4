//! Hostile bytes on the rendezvous store's port, over real loopback connections: from a
//! stranger (no hello, a wrong token, a broken hello) and from a client that presented the
//! right token and then sends garbage. The store must end that connection (or answer it
//! with an error), keep serving everyone else, and never allocate more than its frame cap,
//! whatever the lengths on the wire claim.
//!
//! A counting allocator records the largest single allocation of this test binary, so a
//! length prefix that reached `Vec::with_capacity` uncapped fails the test. The case count is
//! small for CI; `PROPTEST_CASES` raises it (scripts/fuzz.sh).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use ds_comm::store::{StoreClient, StoreServer};
use ds_comm::testkit::LargestAlloc;
use proptest::prelude::*;

/// The store's frame cap (`frame::MAX_FRAME`) and the bound on any one allocation here.
const MAX_FRAME: usize = 1 << 20;
const ALLOC_BOUND: usize = 2 * MAX_FRAME + 4096;

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc;

const TOKEN: &str = "s3cret";
const MAGIC: &[u8] = b"ds-rs store v1";
/// Longer than any answer the store should take; a case that reaches it is a hang.
const PATIENCE: Duration = Duration::from_secs(20);

fn config(default_cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cases);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    field(&mut out, payload);
    out
}

fn hello(token: &str) -> Vec<u8> {
    let mut p = Vec::new();
    field(&mut p, MAGIC);
    field(&mut p, token.as_bytes());
    p
}

/// Reads until the server closes, the patience runs out, or a frame arrives; returns what
/// came and whether the server closed.
fn read_until_closed(s: &mut TcpStream) -> (Vec<u8>, bool) {
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let start = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while start.elapsed() < PATIENCE {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is the server closing with our bytes unread.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => break,
        }
    }
    (got, false)
}

/// The store still serves a client with the token, promptly.
fn still_serves(addr: &str, n: u64) {
    let start = Instant::now();
    let c = StoreClient::connect(addr, Some(TOKEN), Duration::from_secs(5))
        .expect("a good client is still accepted");
    let key = format!("alive/{n}");
    c.set(&key, b"yes").expect("set");
    assert_eq!(c.get(&key).expect("get"), b"yes");
    assert!(
        start.elapsed() < PATIENCE,
        "the store took {:?}",
        start.elapsed()
    );
}

fn check_allocations() {
    let largest = LargestAlloc::largest();
    assert!(largest <= ALLOC_BOUND, "an allocation of {largest} bytes");
}

/// One change to a well-formed hello.
#[derive(Debug, Clone)]
enum HelloEdit {
    WrongToken(String),
    NoToken,
    WrongMagic(Vec<u8>),
    /// The frame's length prefix says this many bytes.
    FrameLength(u32),
    /// The magic's or the token's length field says this many bytes.
    FieldLength(bool, u32),
    Truncate(usize),
    Append(Vec<u8>),
}

fn hello_edit() -> impl Strategy<Value = HelloEdit> {
    let len = prop_oneof![Just(u32::MAX), Just(1u32 << 31), Just(4097u32), 0u32..64];
    prop_oneof![
        "[a-z0-9]{0,12}"
            .prop_filter("not the token", |t| t != TOKEN)
            .prop_map(HelloEdit::WrongToken),
        Just(HelloEdit::NoToken),
        prop::collection::vec(any::<u8>(), 0..20).prop_map(HelloEdit::WrongMagic),
        len.clone().prop_map(HelloEdit::FrameLength),
        (any::<bool>(), len).prop_map(|(m, n)| HelloEdit::FieldLength(m, n)),
        (0usize..40).prop_map(HelloEdit::Truncate),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(HelloEdit::Append),
    ]
}

fn edited_hello(edit: &HelloEdit) -> Vec<u8> {
    match edit {
        HelloEdit::WrongToken(t) => frame(&hello(t)),
        HelloEdit::NoToken => {
            let mut p = Vec::new();
            field(&mut p, MAGIC);
            frame(&p)
        }
        HelloEdit::WrongMagic(m) => {
            let mut p = Vec::new();
            field(&mut p, m);
            field(&mut p, TOKEN.as_bytes());
            frame(&p)
        }
        HelloEdit::FrameLength(n) => {
            let mut f = frame(&hello(TOKEN));
            f[..4].copy_from_slice(&n.to_le_bytes());
            f
        }
        HelloEdit::FieldLength(magic, n) => {
            let mut f = frame(&hello(TOKEN));
            let at = if *magic { 4 } else { 4 + 4 + MAGIC.len() };
            f[at..at + 4].copy_from_slice(&n.to_le_bytes());
            f
        }
        HelloEdit::Truncate(n) => {
            let mut f = frame(&hello(TOKEN));
            f.truncate(*n % f.len());
            f
        }
        HelloEdit::Append(extra) => {
            let mut f = frame(&hello(TOKEN));
            f.extend_from_slice(extra);
            f
        }
    }
}

/// A request as a client with the token might send it, field lengths and counts included,
/// and whether the server may rightly wait on it (a misread key or timeout).
fn request() -> impl Strategy<Value = (Vec<u8>, bool)> {
    let key = prop_oneof![
        Just(b"k".to_vec()),
        prop::collection::vec(any::<u8>(), 0..16)
    ];
    let len = prop_oneof![Just(u32::MAX), Just(MAX_FRAME as u32 + 1), 0u32..32];
    let count = prop_oneof![
        Just(u64::MAX),
        Just(1u64 << 40),
        Just(MAX_FRAME as u64),
        0u64..4
    ];
    // A huge timeout on a present key must not overflow the server's deadline arithmetic.
    let timeout = prop_oneof![Just(u64::MAX), Just(u64::MAX / 2), 0u64..50];
    let op = prop_oneof![1u8..=5, any::<u8>()];
    (
        op,
        key,
        len,
        count,
        timeout,
        any::<i64>(),
        any::<bool>(),
        any::<u8>(),
    )
        .prop_map(|(op, key, len, count, timeout, delta, honest, cut)| {
            let mut p = vec![op];
            let key = if honest { b"k".to_vec() } else { key };
            if op == 4 || op == 5 {
                p.extend_from_slice(&(if honest { 1 } else { count }).to_le_bytes());
            }
            field(&mut p, &key);
            match op {
                1 => field(&mut p, b"value"),
                3 => p.extend_from_slice(&delta.to_le_bytes()),
                _ => p.extend_from_slice(&timeout.to_le_bytes()),
            }
            if !honest {
                // Claim a field length that is not the one that follows, and cut the end.
                p[1..5].copy_from_slice(&len.to_le_bytes());
                p.truncate(p.len() - (cut as usize % p.len()));
            }
            (p, !honest && (op == 2 || op == 4))
        })
}

/// Sends a request frame; the server answers with one frame or closes.
fn exchange(s: &mut TcpStream, payload: &[u8]) -> Option<Vec<u8>> {
    s.write_all(&frame(payload)).ok()?;
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let len = u32::from_le_bytes(len) as usize;
    assert!(len <= MAX_FRAME, "a reply of {len} bytes");
    let mut reply = vec![0u8; len];
    s.read_exact(&mut reply).ok()?;
    Some(reply)
}

fn open_with_token(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    assert_eq!(
        exchange(&mut s, &hello(TOKEN)),
        Some(vec![0]),
        "hello accepted"
    );
    s
}

fn server() -> (StoreServer, String) {
    let s = StoreServer::bind("127.0.0.1:0", Some(TOKEN)).unwrap();
    let addr = s.addr().to_string();
    // The key that "present" requests name, so their waits end at once.
    StoreClient::connect(&addr, Some(TOKEN), Duration::from_secs(5))
        .unwrap()
        .set("k", b"7")
        .unwrap();
    (s, addr)
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn strangers_sending_bytes_are_dropped(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let (_server, addr) = server();
        let mut s = TcpStream::connect(&addr).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(Shutdown::Write);
        let (reply, closed) = read_until_closed(&mut s);
        prop_assert!(closed, "the store kept a stranger's connection open");
        // Nothing but a refusal: an OK frame would mean the bytes passed as the token.
        prop_assert!(reply != [1, 0, 0, 0, 0], "a stranger was let in");
        still_serves(&addr, 0);
        check_allocations();
    }

    #[test]
    fn broken_hellos_are_refused(edit in hello_edit()) {
        let (_server, addr) = server();
        let mut s = TcpStream::connect(&addr).unwrap();
        let wire = edited_hello(&edit);
        let _ = s.write_all(&wire);
        let _ = s.shutdown(Shutdown::Write);
        let (reply, closed) = read_until_closed(&mut s);
        if wire.starts_with(&frame(&hello(TOKEN))) {
            // The hello itself is well formed (an edit that changed nothing, or bytes after
            // it, which are a request of their own).
            prop_assert!(reply.starts_with(&[1, 0, 0, 0, 0]), "{reply:?}");
        } else {
            prop_assert!(!reply.starts_with(&[1, 0, 0, 0, 0]), "let in: {reply:?}");
        }
        prop_assert!(closed, "the store kept the connection open");
        still_serves(&addr, 1);
        check_allocations();
    }

    #[test]
    fn a_client_with_the_token_sending_garbage_frames(
        payloads in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 1..6),
    ) {
        let (_server, addr) = server();
        let mut s = open_with_token(&addr);
        for p in &payloads {
            // Every frame within the cap gets one answer (OK, a timeout, or ERROR).
            prop_assert!(exchange(&mut s, p).is_some(), "no answer to {p:?}");
        }
        still_serves(&addr, 2);
        check_allocations();
    }

    #[test]
    fn a_client_with_the_token_sending_hostile_requests(reqs in prop::collection::vec(request(), 1..6)) {
        let (server, addr) = server();
        for (r, may_wait) in &reqs {
            // One connection each: a misread wait may rightly block its own connection.
            let mut s = open_with_token(&addr);
            if *may_wait {
                s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                let _ = s.write_all(&frame(r));
                let _ = s.read(&mut [0u8; 64]);
            } else {
                let reply = exchange(&mut s, r);
                prop_assert!(reply.is_some(), "no answer to {r:?}");
            }
        }
        still_serves(&addr, 3);
        // Dropping the store ends the connections still waiting.
        drop(server);
        check_allocations();
    }

    #[test]
    fn a_client_with_the_token_then_raw_bytes_is_dropped(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        claimed in prop_oneof![Just(u32::MAX), Just(MAX_FRAME as u32 + 1), any::<u32>()],
    ) {
        let (_server, addr) = server();
        let mut s = open_with_token(&addr);
        let mut wire = claimed.to_le_bytes().to_vec();
        wire.extend_from_slice(&bytes);
        let _ = s.write_all(&wire);
        let _ = s.shutdown(Shutdown::Write);
        let (_, closed) = read_until_closed(&mut s);
        prop_assert!(closed, "the store kept the connection open");
        still_serves(&addr, 4);
        check_allocations();
    }
}

/// Strangers that connect and say nothing do not stop the store serving others meanwhile.
#[test]
fn silent_strangers_do_not_block_the_store() {
    let (_server, addr) = server();
    let silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let mut half = TcpStream::connect(&addr).unwrap();
    half.write_all(&[0xff, 0xff, 0x0f, 0x00, 1, 2]).unwrap();
    still_serves(&addr, 5);
    drop(silent);
    check_allocations();
}

/// A stranger that trickles its hello a byte at a time, each within the per-read timeout, is
/// cut off when the hello's deadline (5 s) passes, not served for as long as it trickles.
#[test]
fn a_trickling_stranger_is_cut_off_at_the_hello_deadline() {
    let (_server, addr) = server();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    s.write_all(&1000u32.to_le_bytes()).unwrap(); // a frame of 1000 bytes, sent slowly
    let t0 = Instant::now();
    let closed_after = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "the store still reads a hello trickling for {:?}",
            t0.elapsed()
        );
        let _ = s.write_all(&[7]);
        match s.read(&mut [0u8; 64]) {
            Ok(0) => break t0.elapsed(),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Ok(_) | Err(_) => break t0.elapsed(),
        }
    };
    assert!(
        closed_after >= Duration::from_secs(4),
        "cut off after {closed_after:?}, before the deadline"
    );
    still_serves(&addr, 6);
}
