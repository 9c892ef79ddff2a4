//! A set of child processes that live and die together: the ranks of one host, or the node
//! launchers of a multi-host job. The first member to fail brings the others down (SIGTERM to
//! its process group, SIGKILL after a grace period), and so does a stop request; a launcher
//! that dies takes its children with it (PR_SET_PDEATHSIG), so nothing is left behind.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::relay::{self, Sink, Stream};
use super::signals::{self, StopFlag};

/// How long stopped members get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);
/// How long output of exited members may still drain (a grandchild may hold the pipe).
const DRAIN: Duration = Duration::from_secs(2);
const POLL: Duration = Duration::from_millis(20);
/// How long the other members get after one failed to exit by themselves and say why.
const REPORT: Duration = Duration::from_secs(1);

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// `who` ended first with a failure (`how`); the launcher exits with `code`.
    Failed {
        who: String,
        how: String,
        code: u8,
    },
    /// The launcher was asked to stop by `signal`.
    Stopped {
        signal: i32,
    },
}

/// One process to start: its name in messages, its command and where its output goes.
pub struct Spec {
    pub who: String,
    pub command: Command,
    pub sink: Sink,
    /// Keep a pipe to its stdin open while it runs (node launchers watch it for the head).
    pub hold_stdin: bool,
}

struct Member {
    who: String,
    child: Child,
    stdin: Option<ChildStdin>,
    relays: Vec<JoinHandle<()>>,
    status: Option<ExitStatus>,
}

pub struct Gang {
    members: Vec<Member>,
}

impl Gang {
    /// Starts every member; if one cannot start, those already started are stopped.
    pub fn start(specs: Vec<Spec>) -> anyhow::Result<Gang> {
        let mut gang = Gang {
            members: Vec::new(),
        };
        for spec in specs {
            match start_member(spec) {
                Ok(m) => gang.members.push(m),
                Err(e) => {
                    gang.stop_all();
                    return Err(e);
                }
            }
        }
        Ok(gang)
    }

    /// Waits until every member has exited, one has failed, or `stop` is set.
    pub fn supervise(mut self, stop: &StopFlag) -> anyhow::Result<Outcome> {
        let outcome = loop {
            if let Some(signal) = stop.get() {
                break Outcome::Stopped { signal };
            }
            if let Some(failed) = self.poll()? {
                // a member that exited with an error may have learnt it from another, which
                // is about to say why; one killed by a signal is the cause itself
                if matches!(&failed, Outcome::Failed { how, .. } if how.starts_with("exited")) {
                    self.let_others_report();
                }
                break failed;
            }
            if self.members.iter().all(|m| m.status.is_some()) {
                break Outcome::Done;
            }
            std::thread::sleep(POLL);
        };
        self.stop_all();
        Ok(outcome)
    }

    /// Collects exits; the first failure found is returned.
    fn poll(&mut self) -> anyhow::Result<Option<Outcome>> {
        for m in self.members.iter_mut().filter(|m| m.status.is_none()) {
            let Some(status) = m
                .child
                .try_wait()
                .with_context(|| format!("waiting for {}", m.who))?
            else {
                continue;
            };
            m.status = Some(status);
            m.stdin = None;
            if !status.success() {
                return Ok(Some(failure(&m.who, status)));
            }
        }
        Ok(None)
    }

    /// After a member exited with an error: the others usually fail within moments for the
    /// same reason (a collective that learnt of it) and print their own error, often the
    /// cause (rank 0's checkpoint error behind rank 1's "rank 0 failed"). They get `REPORT` to
    /// exit by themselves before the SIGTERM.
    fn let_others_report(&mut self) {
        let deadline = Instant::now() + REPORT;
        while Instant::now() < deadline {
            let live = self.members.iter_mut().filter(|m| m.status.is_none());
            let mut any = false;
            for m in live {
                match m.child.try_wait() {
                    Ok(Some(status)) => m.status = Some(status),
                    _ => any = true,
                }
            }
            if !any {
                return;
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGTERM to every live member's process group, SIGKILL after the grace period, then
    /// reap them all and let their output drain.
    fn stop_all(&mut self) {
        let live: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.members[i].status.is_none())
            .collect();
        for &i in &live {
            self.members[i].stdin = None;
            signal_group(&self.members[i].child, libc::SIGTERM);
            // A stopped member (SIGSTOP, a debugger) acts on the SIGTERM only once continued;
            // without this it would sit out the grace period.
            signal_group(&self.members[i].child, libc::SIGCONT);
        }
        let deadline = Instant::now() + GRACE;
        while Instant::now() < deadline && live.iter().any(|&i| self.reap(i).is_none()) {
            std::thread::sleep(POLL);
        }
        for &i in &live {
            if self.reap(i).is_none() {
                signal_group(&self.members[i].child, libc::SIGKILL);
                self.members[i].status = self.members[i].child.wait().ok();
            }
        }
        // Members that exited by themselves may have left children in their group.
        for m in &self.members {
            signal_group(&m.child, libc::SIGKILL);
        }
        let drain_until = Instant::now() + DRAIN;
        for m in &mut self.members {
            for r in m.relays.drain(..) {
                while !r.is_finished() && Instant::now() < drain_until {
                    std::thread::sleep(POLL);
                }
                if r.is_finished() {
                    let _ = r.join();
                }
            }
        }
    }

    fn reap(&mut self, i: usize) -> Option<ExitStatus> {
        let m = &mut self.members[i];
        if m.status.is_none() {
            m.status = m.child.try_wait().ok().flatten();
        }
        m.status
    }
}

fn start_member(mut spec: Spec) -> anyhow::Result<Member> {
    spec.command
        .stdin(if spec.hold_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so that stopping it reaches whatever it started; and the
        // terminal's Ctrl-C reaches only the launcher, which then stops everyone in order.
        .process_group(0);
    // SAFETY: prctl is async-signal-safe and touches only the child's own attributes.
    unsafe {
        spec.command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let program = spec.command.get_program().to_string_lossy().into_owned();
    let mut child = spec
        .command
        .spawn()
        .with_context(|| format!("starting {} ({program})", spec.who))?;
    let mut relays = Vec::new();
    if let Some(out) = child.stdout.take() {
        relays.push(relay::spawn(out, Stream::Out, spec.sink.clone()));
    }
    if let Some(err) = child.stderr.take() {
        relays.push(relay::spawn(err, Stream::Err, spec.sink));
    }
    Ok(Member {
        who: spec.who,
        stdin: child.stdin.take(),
        child,
        relays,
        status: None,
    })
}

fn failure(who: &str, status: ExitStatus) -> Outcome {
    let (how, code) = match (status.code(), status.signal()) {
        (Some(c), _) => (format!("exited with status {c}"), c.clamp(1, 255) as u8),
        (None, Some(s)) => (
            format!("was killed by {}", signals::name(s)),
            (128 + s).min(255) as u8,
        ),
        (None, None) => (format!("ended ({status})"), 1),
    };
    Outcome::Failed {
        who: who.to_string(),
        how,
        code,
    }
}

fn signal_group(child: &Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill has no memory effects; a group that is gone yields ESRCH, ignored.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}
