//! Why a launcher should stop its ranks early: SIGINT or SIGTERM to the launcher, or (for a
//! node launcher started by a head launcher) its stdin closing because the head went away.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context;

/// Set to the number of the signal that asked the launcher to stop (0: keep going).
#[derive(Clone, Default)]
pub struct StopFlag(Arc<AtomicUsize>);

/// The value that a closed stdin (head launcher gone) sets: SIGHUP, what a hang-up means.
const HANGUP: usize = libc::SIGHUP as usize;

impl StopFlag {
    /// A flag that SIGINT and SIGTERM set.
    pub fn on_signals() -> anyhow::Result<StopFlag> {
        let flag = StopFlag::default();
        for sig in [libc::SIGINT, libc::SIGTERM] {
            signal_hook::flag::register_usize(sig, flag.0.clone(), sig as usize)
                .context("installing the launcher's signal handlers")?;
        }
        Ok(flag)
    }

    /// Also set the flag when stdin reaches end of file.
    pub fn watch_stdin(&self) {
        let flag = self.0.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin().lock();
            while matches!(std::io::Read::read(&mut stdin, &mut sink), Ok(n) if n > 0) {}
            flag.store(HANGUP, Ordering::SeqCst);
        });
    }

    pub fn get(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s as i32),
        }
    }
}

/// A signal's conventional name.
pub fn name(sig: i32) -> String {
    let known = [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGTERM, "SIGTERM"),
    ];
    known
        .iter()
        .find(|(s, _)| *s == sig)
        .map_or_else(|| format!("signal {sig}"), |(_, n)| n.to_string())
}
