//! Rendezvous: every rank announces its address in the store, then the ranks connect to
//! each other once (persistent connections) and pick, per pair, shared memory when both
//! are on one host and TCP otherwise.
//!
//! Peer connections open with the job's token and a per-job nonce; anything else that
//! connects (a stranger, a port scanner, garbage) is dropped and the rendezvous goes on.

use crate::error::{CommError, Result};
use crate::frame::{read_frame, read_frame_by, write_frame, Decoder, Encoder};
use crate::link::shm::ShmLink;
use crate::link::tcp::TcpLink;
use crate::link::{Link, Links};
use crate::store::StoreClient;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PEER_MAGIC: &[u8] = b"ds-rs peer v1";
/// How long an accepted connection has to say who it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// How ranks on one host talk to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory within a host, TCP between hosts.
    Auto,
    /// TCP everywhere (tests, benchmarks, or a host without /dev/shm).
    Tcp,
}

pub(crate) struct MeshSpec<'a> {
    pub rank: usize,
    pub world: usize,
    pub token: &'a str,
    pub transport: Transport,
    pub timeout: Duration,
}

/// What a rank publishes about itself.
struct PeerInfo {
    addr: SocketAddr,
    host: String,
}

pub(crate) fn connect_mesh(store: &StoreClient, spec: &MeshSpec, master: &str) -> Result<Links> {
    let deadline = Instant::now() + spec.timeout;
    let listener = bind_listener(master)?;
    let me = PeerInfo {
        addr: listener
            .local_addr()
            .map_err(|e| CommError::io("peer listener", e))?,
        host: host_id(),
    };
    if spec.rank == 0 {
        // Before rank 0's address, so whoever has seen every address can read it.
        new_job_nonce(store)?;
    }
    store.set(
        &format!("peer/{}", spec.rank),
        format!("{}\n{}", me.addr, me.host).as_bytes(),
    )?;
    let all: Vec<usize> = (0..spec.world).collect();
    store.wait_ranks("rendezvous: waiting for every rank to join", &all, |r| {
        format!("peer/{r}")
    })?;
    let nonce = String::from_utf8(store.get("job/nonce")?)
        .map_err(|_| CommError::Invalid("store: job nonce is not UTF-8".into()))?;
    let infos: Vec<PeerInfo> = all
        .iter()
        .map(|&r| peer_info(store, r))
        .collect::<Result<_>>()?;

    let hello = Hello {
        token: spec.token.to_string(),
        nonce: nonce.clone(),
        rank: spec.rank,
    };
    let accepted = accept_peers(listener, &hello, spec, deadline);
    let mut streams: HashMap<usize, TcpStream> = HashMap::new();
    for (lower, info) in infos.iter().enumerate().take(spec.rank) {
        streams.insert(lower, dial(&info.addr, &hello, lower, deadline)?);
    }
    for (peer, stream) in accepted.recv().unwrap_or_else(|_| Ok(Vec::new()))? {
        streams.insert(peer, stream);
    }
    let shm_peers: Vec<usize> = match (spec.transport, shm_dir()) {
        (Transport::Auto, Some(_)) => (0..spec.world)
            .filter(|&p| p != spec.rank && infos[p].host == me.host)
            .collect(),
        _ => Vec::new(),
    };
    build_links(spec, streams, &shm_peers, &nonce)
}

fn new_job_nonce(store: &StoreClient) -> Result<()> {
    let mut bytes = [0u8; 12];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .map_err(|e| CommError::io("reading /dev/urandom", e))?;
    let nonce: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    store.set("job/nonce", nonce.as_bytes())
}

/// Listens on the address this host uses to reach the master (port chosen by the kernel).
fn bind_listener(master: &str) -> Result<TcpListener> {
    let ip = local_ip_towards(master).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    TcpListener::bind((ip, 0)).map_err(|e| CommError::io(format!("binding a peer port on {ip}"), e))
}

/// The local address of a route to `master` (a UDP connect sends nothing).
fn local_ip_towards(master: &str) -> Option<IpAddr> {
    let target = master.to_socket_addrs().ok()?.next()?;
    let unspecified: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse().ok()?
    } else {
        "[::]:0".parse().ok()?
    };
    let s = UdpSocket::bind(unspecified).ok()?;
    s.connect(target).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// Same boot, same network namespace, same host name: then /dev/shm is shared.
fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!(
        "{}|{}|{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id"),
        netns
    )
}

fn peer_info(store: &StoreClient, rank: usize) -> Result<PeerInfo> {
    let raw = store.get(&format!("peer/{rank}"))?;
    let bad = || CommError::Invalid(format!("store: rank {rank} published a malformed address"));
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let (addr, host) = text.split_once('\n').ok_or_else(bad)?;
    Ok(PeerInfo {
        addr: addr.parse().map_err(|_| bad())?,
        host: host.to_string(),
    })
}

#[derive(Clone)]
struct Hello {
    token: String,
    nonce: String,
    rank: usize,
}

impl Hello {
    fn encode(&self, to: usize) -> Vec<u8> {
        let e = Encoder::default()
            .bytes(PEER_MAGIC)
            .str(&self.token)
            .str(&self.nonce);
        e.u64(self.rank as u64).u64(to as u64).0
    }
}

/// Connects to a lower rank and introduces itself.
fn dial(addr: &SocketAddr, hello: &Hello, peer: usize, deadline: Instant) -> Result<TcpStream> {
    let fail = |cause: String| CommError::PeerLost {
        what: "rendezvous: connecting".into(),
        peer,
        cause,
    };
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let mut s = TcpStream::connect_timeout(addr, left).map_err(|e| fail(format!("{addr}: {e}")))?;
    s.set_read_timeout(Some(left))
        .map_err(|e| fail(e.to_string()))?;
    write_frame(&mut s, &hello.encode(peer)).map_err(|e| fail(e.to_string()))?;
    match read_frame(&mut s, 64) {
        Ok(ack) if ack == [1] => Ok(s),
        Ok(_) | Err(_) => Err(fail(
            "refused the connection (a different job or token?)".into(),
        )),
    }
}

type Accepted = Result<Vec<(usize, TcpStream)>>;

/// Accepts the higher ranks in the background; strangers are dropped without harm.
fn accept_peers(
    listener: TcpListener,
    hello: &Hello,
    spec: &MeshSpec,
    deadline: Instant,
) -> mpsc::Receiver<Accepted> {
    let (tx, rx) = mpsc::channel();
    let expected: Vec<usize> = (spec.rank + 1..spec.world).collect();
    let (hello, timeout) = (hello.clone(), spec.timeout);
    std::thread::spawn(move || {
        let _ = tx.send(accept_loop(listener, &hello, expected, deadline, timeout));
    });
    rx
}

fn accept_loop(
    listener: TcpListener,
    hello: &Hello,
    expected: Vec<usize>,
    deadline: Instant,
    timeout: Duration,
) -> Accepted {
    let _ = listener.set_nonblocking(true);
    let (tx, rx) = mpsc::channel::<(usize, TcpStream)>();
    let mut got: HashMap<usize, TcpStream> = HashMap::new();
    while got.len() < expected.len() {
        if Instant::now() >= deadline {
            let missing = expected
                .iter()
                .filter(|r| !got.contains_key(r))
                .copied()
                .collect();
            return Err(CommError::Timeout {
                what: "rendezvous: waiting for peers to connect".into(),
                missing,
                after: timeout,
            });
        }
        if let Ok((stream, _)) = listener.accept() {
            let (tx, hello) = (tx.clone(), hello.clone());
            std::thread::spawn(move || {
                if let Some(peer) = vet(stream.try_clone().ok(), &hello) {
                    let _ = tx.send((peer, stream));
                }
            });
        }
        while let Ok((peer, stream)) = rx.try_recv() {
            if expected.contains(&peer) && !got.contains_key(&peer) {
                got.insert(peer, stream);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(got.into_iter().collect())
}

/// Reads an accepted connection's hello; the peer's rank if it belongs to this job.
fn vet(stream: Option<TcpStream>, hello: &Hello) -> Option<usize> {
    let mut s = stream?;
    s.set_nonblocking(false).ok()?;
    let frame = read_frame_by(&s, 4096, Instant::now() + HELLO_TIMEOUT).ok()?;
    let mut d = Decoder(&frame);
    let ok = d.bytes().ok()? == PEER_MAGIC
        && d.str().ok()? == hello.token
        && d.str().ok()? == hello.nonce;
    let (from, to) = (d.u64().ok()? as usize, d.u64().ok()? as usize);
    if !ok || to != hello.rank || from <= hello.rank {
        return None;
    }
    write_frame(&mut s, &[1]).ok()?;
    Some(from)
}

fn shm_dir() -> Option<PathBuf> {
    let dir = PathBuf::from("/dev/shm");
    dir.is_dir().then_some(dir)
}

/// Turns the connections into links. For shm peers the lower rank creates the pair's file,
/// tells the higher one over the connection, and unlinks the file once both have mapped it
/// (so nothing is left in /dev/shm whatever happens later).
fn build_links(
    spec: &MeshSpec,
    mut streams: HashMap<usize, TcpStream>,
    shm_peers: &[usize],
    nonce: &str,
) -> Result<Links> {
    let me = spec.rank;
    let path = |lo: usize, hi: usize| shm_dir().unwrap().join(format!("ds-rs-{nonce}-{lo}-{hi}"));
    let fail = |peer: usize, e: std::io::Error| CommError::PeerLost {
        what: "rendezvous: shared memory".into(),
        peer,
        cause: e.to_string(),
    };
    let mut links: Vec<Option<Box<dyn Link>>> = (0..spec.world).map(|_| None).collect();
    let mut created = Vec::new();
    for &p in shm_peers.iter().filter(|&&p| p > me) {
        let s = streams.remove(&p).unwrap();
        s.set_read_timeout(Some(spec.timeout))
            .map_err(|e| fail(p, e))?;
        let link = ShmLink::create(&path(me, p), s.try_clone().map_err(|e| fail(p, e))?)
            .map_err(|e| fail(p, e))?;
        write_frame(&mut &s, b"shm ready").map_err(|e| fail(p, e))?;
        created.push((p, s, link));
    }
    for &p in shm_peers.iter().filter(|&&p| p < me) {
        let s = streams.remove(&p).unwrap();
        s.set_read_timeout(Some(spec.timeout))
            .map_err(|e| fail(p, e))?;
        read_frame(&mut &s, 64).map_err(|e| fail(p, e))?;
        let link = ShmLink::open(&path(p, me), s.try_clone().map_err(|e| fail(p, e))?)
            .map_err(|e| fail(p, e))?;
        write_frame(&mut &s, b"shm mapped").map_err(|e| fail(p, e))?;
        s.set_nonblocking(true).map_err(|e| fail(p, e))?;
        links[p] = Some(Box::new(link));
    }
    for (p, s, link) in created {
        let acked = read_frame(&mut &s, 64);
        let _ = std::fs::remove_file(path(me, p));
        acked.map_err(|e| fail(p, e))?;
        s.set_nonblocking(true).map_err(|e| fail(p, e))?;
        links[p] = Some(Box::new(link));
    }
    for (p, s) in streams {
        links[p] = Some(Box::new(TcpLink::new(s).map_err(|e| fail(p, e))?));
    }
    Ok(Links { links })
}

#[cfg(test)]
mod tests {
    //! Hostile bytes on a rank's peer port: a stranger's, and a hello that carries the token
    //! and nonce but is otherwise wrong. Each such connection is closed, and the rank still
    //! accepts its real peer before the deadline. `PROPTEST_CASES` raises the case count
    //! (scripts/fuzz.sh).

    use super::*;
    use proptest::prelude::*;
    use std::io::{Read, Write};
    use std::net::Shutdown;

    const PATIENCE: Duration = Duration::from_secs(20);

    fn config() -> ProptestConfig {
        let cases = std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(64);
        ProptestConfig {
            cases,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    fn hello(rank: usize) -> Hello {
        Hello {
            token: "tok".into(),
            nonce: "n0nce".into(),
            rank,
        }
    }

    /// A hostile connection: raw bytes, or rank 1's hello to rank 0 changed.
    #[derive(Debug, Clone)]
    enum Visit {
        Bytes(Vec<u8>),
        Ranks(u64, u64),
        Nonce(String),
        Cut(usize),
        Length(u32),
    }

    fn visit() -> impl Strategy<Value = Visit> {
        prop_oneof![
            1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(Visit::Bytes),
            3 => (
                prop::sample::select(&[0u64, 2, 3, u64::MAX][..]),
                prop::sample::select(&[0u64, 1, u64::MAX][..]),
            )
                .prop_map(|(f, t)| Visit::Ranks(f, t)),
            1 => "[a-z0-9]{0,8}".prop_map(Visit::Nonce),
            1 => (0usize..64).prop_map(Visit::Cut),
            1 => prop_oneof![Just(u32::MAX), Just(4097u32), 0u32..40].prop_map(Visit::Length),
        ]
    }

    fn wire(v: &Visit) -> Vec<u8> {
        let framed = |payload: Vec<u8>| {
            let mut out = (payload.len() as u32).to_le_bytes().to_vec();
            out.extend_from_slice(&payload);
            out
        };
        let good = hello(1).encode(0);
        match v {
            Visit::Bytes(b) => b.clone(),
            Visit::Ranks(from, to) => {
                let mut p = good[..good.len() - 16].to_vec();
                p.extend_from_slice(&from.to_le_bytes());
                p.extend_from_slice(&to.to_le_bytes());
                framed(p)
            }
            Visit::Nonce(n) => framed(
                Hello {
                    nonce: n.clone(),
                    ..hello(1)
                }
                .encode(0),
            ),
            Visit::Cut(n) => {
                let mut w = framed(good);
                w.truncate(n % w.len());
                w
            }
            Visit::Length(n) => {
                let mut w = framed(good);
                w[..4].copy_from_slice(&n.to_le_bytes());
                w
            }
        }
    }

    /// Whether the rank let this connection in (acked it).
    fn admitted(addr: &SocketAddr, bytes: &[u8]) -> bool {
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(bytes);
        let _ = s.shutdown(Shutdown::Write);
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut got = Vec::new();
        let closed = match s.read_to_end(&mut got) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "the rank kept a hostile connection open");
        got == [1, 0, 0, 0, 1]
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn hostile_peers_are_dropped_and_the_real_one_accepted(
            visits in prop::collection::vec(visit(), 1..5),
        ) {
            let spec = MeshSpec {
                rank: 0,
                world: 2,
                token: "tok",
                transport: Transport::Tcp,
                timeout: PATIENCE,
            };
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let deadline = Instant::now() + PATIENCE;
            let accepted = accept_peers(listener, &hello(0), &spec, deadline);
            for v in &visits {
                let bytes = wire(v);
                // Only a well-formed hello from a higher rank to rank 0 is answered.
                let fine = matches!(v, Visit::Ranks(f, 0) if *f > 0)
                    || bytes.starts_with(&[&(hello(1).encode(0).len() as u32).to_le_bytes()[..], &hello(1).encode(0)].concat());
                let let_in = admitted(&addr, &bytes);
                prop_assert!(!let_in || fine, "{v:?} was let in");
            }
            let start = Instant::now();
            let s = dial(&addr, &hello(1), 0, deadline).expect("the real peer is accepted");
            let got = accepted.recv_timeout(PATIENCE).expect("the accept loop ends");
            let got = got.expect("rank 1 connected");
            prop_assert_eq!(got.iter().map(|(r, _)| *r).collect::<Vec<_>>(), vec![1]);
            prop_assert!(start.elapsed() < PATIENCE);
            drop(s);
        }
    }

    #[test]
    fn decoder_never_panics_on_any_bytes() {
        let mut runner = proptest::test_runner::TestRunner::new(config());
        let ops = prop::collection::vec(0u8..6, 0..12);
        runner
            .run(
                &(prop::collection::vec(any::<u8>(), 0..128), ops),
                |(bytes, ops)| {
                    let mut d = Decoder(&bytes);
                    for op in ops {
                        let _ = match op {
                            0 => d.u8().map(drop),
                            1 => d.u64().map(drop),
                            2 => d.i64().map(drop),
                            3 => d.bytes().map(drop),
                            4 => d.str().map(drop),
                            _ => d.strs().map(drop),
                        };
                    }
                    let mut r = bytes.as_slice();
                    if let Ok(f) = read_frame(&mut r, 64) {
                        prop_assert!(f.len() <= 64);
                    }
                    Ok(())
                },
            )
            .unwrap();
    }
}
