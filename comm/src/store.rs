//! The rendezvous key-value store (torch's TCPStore, in spirit): rank 0 hosts it, every rank
//! connects to it to exchange addresses, ids and barriers.
//!
//! Safety rails: a client must open with the job's token, every frame is capped at
//! [`MAX_FRAME`], and every wait has a deadline whose error names what is missing.

use crate::error::{CommError, Result};
use crate::frame::{read_frame, read_frame_by, write_frame, Decoder, Encoder, MAX_FRAME};
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: &[u8] = b"ds-rs store v1";
/// How long a new connection has to present the token before it is dropped.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

const SET: u8 = 1;
const GET: u8 = 2;
const ADD: u8 = 3;
const WAIT: u8 = 4;
const CHECK: u8 = 5;

const OK: u8 = 0;
const TIMEOUT: u8 = 1;
const ERROR: u8 = 2;

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Set when the server stops: every wait ends at once.
    closed: AtomicBool,
}

impl Table {
    /// Waits until every key is present; returns the keys still missing at the deadline (or
    /// when the server stops).
    fn wait(&self, keys: &[String], timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut map = self.map.lock().unwrap();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(*k))
                .cloned()
                .collect();
            let now = Instant::now();
            if missing.is_empty() || now >= deadline || self.closed.load(Ordering::SeqCst) {
                return missing;
            }
            map = self.changed.wait_timeout(map, deadline - now).unwrap().0;
        }
    }

    fn close(&self) {
        let _map = self.map.lock().unwrap();
        self.closed.store(true, Ordering::SeqCst);
        self.changed.notify_all();
    }

    fn set(&self, key: String, value: Vec<u8>) {
        self.map.lock().unwrap().insert(key, value);
        self.changed.notify_all();
    }

    fn add(&self, key: String, delta: i64) -> std::result::Result<i64, String> {
        let mut map = self.map.lock().unwrap();
        let old = match map.get(&key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| format!("add: the value of key {key:?} is not an integer"))?,
        };
        let new = old
            .checked_add(delta)
            .ok_or_else(|| format!("add: key {key:?} overflows"))?;
        map.insert(key, new.to_string().into_bytes());
        self.changed.notify_all();
        Ok(new)
    }
}

/// The store server. Dropping it closes every connection.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Conns,
    accept: Option<JoinHandle<()>>,
}

/// The open connections by number, so that stopping the server can close them; each
/// connection's thread removes (and closes) its own when it ends.
type Conns = Arc<Mutex<HashMap<u64, TcpStream>>>;

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free port; see [`StoreServer::addr`]).
    pub fn bind(addr: impl ToSocketAddrs, token: Option<&str>) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| CommError::io("store: bind", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("store: local address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io("store: listener", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Conns::default();
        let token = token.unwrap_or("").as_bytes().to_vec();
        let (s, c) = (stop.clone(), conns.clone());
        let accept = std::thread::Builder::new()
            .name("ds-store".into())
            .spawn(move || accept_loop(listener, token, s, c))
            .map_err(|e| CommError::io("store: thread", e))?;
        Ok(StoreServer {
            addr,
            stop,
            conns,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for (_, c) in self.conns.lock().unwrap().drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, token: Vec<u8>, stop: Arc<AtomicBool>, conns: Conns) {
    let table = Arc::new(Table::default());
    let token = Arc::new(token);
    let mut next = 0u64;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let id = next;
                next += 1;
                if let Ok(clone) = stream.try_clone() {
                    conns.lock().unwrap().insert(id, clone);
                }
                let (t, k, c) = (table.clone(), token.clone(), conns.clone());
                let _ = std::thread::Builder::new()
                    .name("ds-store-conn".into())
                    .spawn(move || {
                        serve(&stream, &k, &t);
                        // Closes the connection now, whoever else holds a clone of it.
                        let _ = stream.shutdown(Shutdown::Both);
                        c.lock().unwrap().remove(&id);
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    table.close();
}

/// One client: the hello with the token, then requests until it hangs up. A stranger, a wrong
/// token or a malformed frame ends this connection only.
fn serve(mut stream: &TcpStream, token: &[u8], table: &Table) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let Ok(hello) = read_frame_by(stream, 4096, Instant::now() + HELLO_TIMEOUT) else {
        return;
    };
    let mut d = Decoder(&hello);
    let valid = d.bytes().is_ok_and(|m| m == MAGIC) && d.bytes().is_ok_and(|t| t == token);
    if !valid {
        let _ = write_frame(
            &mut stream,
            &Encoder::default().u8(ERROR).str("wrong job token").0,
        );
        return;
    }
    if write_frame(&mut stream, &[OK]).is_err() {
        return;
    }
    let _ = stream.set_read_timeout(None);
    while let Ok(req) = read_frame(&mut stream, MAX_FRAME) {
        let reply = match handle(&req, table) {
            Ok(reply) => reply,
            Err(e) => Encoder::default()
                .u8(ERROR)
                .str(&format!("malformed request: {e}")),
        };
        if write_frame(&mut stream, &reply.0).is_err() {
            return;
        }
    }
}

fn handle(req: &[u8], table: &Table) -> io::Result<Encoder> {
    let mut d = Decoder(req);
    let ok = Encoder::default().u8(OK);
    Ok(match d.u8()? {
        SET => {
            table.set(d.str()?, d.bytes()?);
            ok
        }
        GET => {
            let key = d.str()?;
            let timeout = Duration::from_millis(d.u64()?);
            let missing = table.wait(std::slice::from_ref(&key), timeout);
            match missing.is_empty() {
                true => ok.bytes(&table.map.lock().unwrap()[&key]),
                false => Encoder::default().u8(TIMEOUT).strs(&missing),
            }
        }
        ADD => match table.add(d.str()?, d.i64()?) {
            Ok(v) => ok.i64(v),
            Err(msg) => Encoder::default().u8(ERROR).str(&msg),
        },
        WAIT => {
            let keys = d.strs()?;
            let missing = table.wait(&keys, Duration::from_millis(d.u64()?));
            match missing.is_empty() {
                true => ok,
                false => Encoder::default().u8(TIMEOUT).strs(&missing),
            }
        }
        CHECK => {
            let keys = d.strs()?;
            let map = table.map.lock().unwrap();
            ok.u8(keys.iter().all(|k| map.contains_key(k)) as u8)
        }
        other => Encoder::default()
            .u8(ERROR)
            .str(&format!("unknown request {other}")),
    })
}

/// A connection to the store.
pub struct StoreClient {
    addr: String,
    stream: Mutex<TcpStream>,
    timeout: Duration,
}

/// What a wait found missing at its deadline.
#[derive(Debug, PartialEq, Eq)]
pub struct Missing(pub Vec<String>);

impl StoreClient {
    /// Connects to `addr` ("host:port"), retrying until `timeout` (rank 0 may start last), and
    /// presents the token. `timeout` is also the default for every later wait.
    pub fn connect(addr: &str, token: Option<&str>, timeout: Duration) -> Result<StoreClient> {
        let deadline = Instant::now() + timeout;
        let err = |cause: String| CommError::Store {
            addr: addr.to_string(),
            cause,
        };
        let mut stream = loop {
            match connect_once(addr, deadline) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(err(format!(
                        "not reachable within {}s (is rank 0 running?): {e}",
                        timeout.as_secs_f64()
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let _ = stream.set_nodelay(true);
        let hello = Encoder::default().bytes(MAGIC).str(token.unwrap_or(""));
        stream
            .set_read_timeout(Some(HELLO_TIMEOUT))
            .map_err(|e| err(e.to_string()))?;
        write_frame(&mut stream, &hello.0).map_err(|e| err(e.to_string()))?;
        let reply = read_frame(&mut stream, MAX_FRAME)
            .map_err(|e| err(format!("no answer to hello: {e}")))?;
        if reply.first() != Some(&OK) {
            let why = Decoder(reply.get(1..).unwrap_or(&[]))
                .str()
                .unwrap_or_default();
            return Err(err(format!(
                "refused this process: {why} (DS_RS_JOB_TOKEN differs from rank 0's?)"
            )));
        }
        Ok(StoreClient {
            addr: addr.to_string(),
            stream: Mutex::new(stream),
            timeout,
        })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.call(
            Encoder::default().u8(SET).str(key).bytes(value),
            Duration::ZERO,
        )? {
            Ok(_) => Ok(()),
            Err(_) => Err(self.error("set timed out".into())),
        }
    }

    /// The value of `key`, waiting for it up to the client's timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let req = Encoder::default()
            .u8(GET)
            .str(key)
            .u64(self.timeout.as_millis() as u64);
        match self.call(req, self.timeout)? {
            Ok(reply) => Decoder(&reply)
                .bytes()
                .map_err(|e| self.error(e.to_string())),
            Err(_) => Err(self.error(format!(
                "key {key:?} did not appear within {}s",
                self.timeout.as_secs_f64()
            ))),
        }
    }

    /// The value of `key` if it appears within `timeout`.
    pub fn get_within(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let req = Encoder::default()
            .u8(GET)
            .str(key)
            .u64(timeout.as_millis() as u64);
        match self.call(req, timeout)? {
            Ok(reply) => Ok(Some(
                Decoder(&reply)
                    .bytes()
                    .map_err(|e| self.error(e.to_string()))?,
            )),
            Err(_) => Ok(None),
        }
    }

    /// Adds `delta` to the integer at `key` (0 when absent) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let reply = self.call(
            Encoder::default().u8(ADD).str(key).i64(delta),
            Duration::ZERO,
        )?;
        let reply = reply.map_err(|_| self.error("add timed out".into()))?;
        Decoder(&reply).i64().map_err(|e| self.error(e.to_string()))
    }

    /// Waits until every key exists; `Ok(Err(Missing))` lists those absent at the deadline.
    pub fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<std::result::Result<(), Missing>> {
        let req = Encoder::default()
            .u8(WAIT)
            .strs(keys)
            .u64(timeout.as_millis() as u64);
        Ok(self.call(req, timeout)?.map(|_| ()))
    }

    pub fn check(&self, keys: &[String]) -> Result<bool> {
        let reply = self.call(Encoder::default().u8(CHECK).strs(keys), Duration::ZERO)?;
        let reply = reply.map_err(|_| self.error("check timed out".into()))?;
        Ok(Decoder(&reply)
            .u8()
            .map_err(|e| self.error(e.to_string()))?
            == 1)
    }

    /// Waits for `key(r)` of every rank in `ranks`; the error names the ranks that never set theirs.
    pub fn wait_ranks(
        &self,
        what: &str,
        ranks: &[usize],
        key: impl Fn(usize) -> String,
    ) -> Result<()> {
        let keys: Vec<String> = ranks.iter().map(|&r| key(r)).collect();
        match self.wait(&keys, self.timeout)? {
            Ok(()) => Ok(()),
            Err(Missing(missing)) => Err(CommError::Timeout {
                what: what.to_string(),
                missing: ranks
                    .iter()
                    .zip(&keys)
                    .filter(|(_, k)| missing.contains(k))
                    .map(|(r, _)| *r)
                    .collect(),
                after: self.timeout,
            }),
        }
    }

    /// One request and its reply: `Ok(payload)` or `Err(Missing)` for a timed-out wait.
    fn call(&self, req: Encoder, wait: Duration) -> Result<std::result::Result<Vec<u8>, Missing>> {
        let mut stream = self.stream.lock().unwrap();
        let read_timeout = wait + self.timeout.max(Duration::from_secs(10));
        stream
            .set_read_timeout(Some(read_timeout))
            .map_err(|e| self.error(e.to_string()))?;
        write_frame(&mut *stream, &req.0)
            .map_err(|e| self.error(format!("lost the connection: {e}")))?;
        let reply = read_frame(&mut *stream, MAX_FRAME)
            .map_err(|e| self.error(format!("lost the connection: {e}")))?;
        let mut d = Decoder(&reply);
        match d.u8().map_err(|e| self.error(e.to_string()))? {
            OK => Ok(Ok(d.0.to_vec())),
            TIMEOUT => Ok(Err(Missing(
                d.strs().map_err(|e| self.error(e.to_string()))?,
            ))),
            _ => Err(self.error(d.str().unwrap_or_else(|_| "error".into()))),
        }
    }

    fn error(&self, cause: String) -> CommError {
        CommError::Store {
            addr: self.addr.clone(),
            cause,
        }
    }
}

fn connect_once(addr: &str, deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "address resolves to nothing");
    for a in addr.to_socket_addrs()? {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(5))) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn server(token: Option<&str>) -> (StoreServer, String) {
        let s = StoreServer::bind("127.0.0.1:0", token).unwrap();
        let addr = s.addr().to_string();
        (s, addr)
    }

    #[test]
    fn set_get_add_wait_across_clients() {
        let (_s, addr) = server(Some("t0k"));
        let t = Duration::from_secs(5);
        let a = StoreClient::connect(&addr, Some("t0k"), t).unwrap();
        let b = StoreClient::connect(&addr, Some("t0k"), t).unwrap();
        let waiter = std::thread::spawn(move || b.get("late").unwrap());
        std::thread::sleep(Duration::from_millis(50));
        a.set("late", b"value").unwrap();
        assert_eq!(waiter.join().unwrap(), b"value");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(a.add("n", -5).unwrap(), -3);
        assert!(a.check(&["n".into(), "late".into()]).unwrap());
        assert!(!a.check(&["nope".into()]).unwrap());
        let err = a.add("late", 1).unwrap_err().to_string();
        assert!(err.contains("not an integer"), "{err}");
    }

    #[test]
    fn waits_time_out_naming_the_missing_ranks() {
        let (_s, addr) = server(None);
        let c = StoreClient::connect(&addr, None, Duration::from_millis(300)).unwrap();
        c.set("addr/0", b"x").unwrap();
        c.set("addr/2", b"x").unwrap();
        let start = Instant::now();
        let err = c
            .wait_ranks("rendezvous", &[0, 1, 2, 3], |r| format!("addr/{r}"))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        match err {
            CommError::Timeout { missing, .. } => assert_eq!(missing, vec![1, 3]),
            other => panic!("{other}"),
        }
        assert!(c
            .get("never")
            .unwrap_err()
            .to_string()
            .contains("did not appear"));
    }

    #[test]
    fn strangers_and_wrong_tokens_are_refused_and_the_store_goes_on() {
        let (_s, addr) = server(Some("secret"));
        let t = Duration::from_secs(2);
        let err = StoreClient::connect(&addr, Some("guess"), t)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("refused"), "{err}");
        // Garbage: a huge length prefix, then random bytes.
        let mut g = TcpStream::connect(&addr).unwrap();
        let _ = g.write_all(&[0xff, 0xff, 0xff, 0x7f, 1, 2, 3]);
        let mut g2 = TcpStream::connect(&addr).unwrap();
        let _ = g2.write_all(b"GET / HTTP/1.1\r\n\r\n");
        let ok = StoreClient::connect(&addr, Some("secret"), t).unwrap();
        ok.set("k", b"v").unwrap();
        assert_eq!(ok.get("k").unwrap(), b"v");
    }

    /// A loopback port bound by a socket that does not listen, held until it drops:
    /// connecting is refused, and no other socket can take the port meanwhile (a listener
    /// bound and closed left it free, and another test's store took it once, answering).
    struct RefusingPort(libc::c_int, u16);

    impl RefusingPort {
        fn new() -> RefusingPort {
            // SAFETY: plain socket calls on a fresh descriptor and a local sockaddr_in.
            unsafe {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                assert!(fd >= 0, "socket");
                let mut a: libc::sockaddr_in = std::mem::zeroed();
                a.sin_family = libc::AF_INET as libc::sa_family_t;
                a.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
                let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
                let sa = &mut a as *mut libc::sockaddr_in as *mut libc::sockaddr;
                assert_eq!(libc::bind(fd, sa, len), 0, "bind");
                let mut got = len;
                assert_eq!(libc::getsockname(fd, sa, &mut got), 0, "getsockname");
                RefusingPort(fd, u16::from_be(a.sin_port))
            }
        }
    }

    impl Drop for RefusingPort {
        fn drop(&mut self) {
            // SAFETY: the descriptor is ours and closed once.
            unsafe { libc::close(self.0) };
        }
    }

    #[test]
    fn an_absent_store_is_an_error_within_the_timeout() {
        let port = RefusingPort::new();
        let addr = format!("127.0.0.1:{}", port.1);
        let start = Instant::now();
        let err = StoreClient::connect(&addr, None, Duration::from_millis(300))
            .err()
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(err.to_string().contains("is rank 0 running"), "{err}");
    }
}
