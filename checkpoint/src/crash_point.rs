//! Named crash points: moments at which a process kills itself (or its launcher) with SIGKILL,
//! so the reliability tests can crash a save at each of its steps rather than at a random time.
//!
//! `DS_RS_CRASH_AT=rank<R>:<point>:<hit>[:launcher]` makes rank R, the `hit`-th time it reaches
//! `point`, send SIGKILL to itself, or with `:launcher` to its parent: the launcher, whose
//! death takes every rank with it (PR_SET_PDEATHSIG). Unset, which is every real run, a point
//! costs one read of a `OnceLock`. The points are listed in `POINTS`; a name not in it is an
//! error at start-up, so a test cannot aim at a moment that does not exist.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::{CheckpointError, Result};

pub const VAR: &str = "DS_RS_CRASH_AT";

/// Every crash point, in the order a checkpoint save passes them (see `checkpoint::save`),
/// then the removal of an old tag's (`prune`, or a save replacing an unpublished tag).
/// The `file.*` points are inside every atomic file write (a shard, the manifest, `latest`).
pub const POINTS: &[&str] = &[
    "save.start",       // nothing of this save exists yet
    "save.partial",     // the `.<tag>.partial/` directory exists, empty
    "file.written",     // a file's bytes written to its temporary name, not yet fsynced
    "file.synced",      // fsynced, not yet renamed to its name
    "file.renamed",     // renamed, the directory not yet fsynced
    "save.shards",      // every rank's shard is written
    "commit.renamed",   // the tag directory renamed into place, `latest` not yet replaced
    "commit.published", // `latest` names the new tag, the ranks have not yet agreed it is done
    "save.end",         // every rank knows the save succeeded
    "remove.renamed",   // a tag pruned or replaced: renamed away, not yet deleted
];

struct Plan {
    rank: usize,
    point: String,
    hit: u64,
    launcher: bool,
    seen: AtomicU64,
}

static PLAN: OnceLock<Option<Plan>> = OnceLock::new();

/// Reads `DS_RS_CRASH_AT` once; a malformed value is an error naming the variable.
pub fn check() -> Result<()> {
    plan().map(|_| ())
}

fn plan() -> Result<&'static Option<Plan>> {
    if let Some(p) = PLAN.get() {
        return Ok(p);
    }
    let parsed = match std::env::var(VAR) {
        Ok(text) => Some(parse(&text).map_err(|why| {
            CheckpointError::Invalid(format!(
                "{VAR}={text:?}: {why} (expected rank<R>:<point>:<hit>[:launcher])"
            ))
        })?),
        Err(_) => None,
    };
    Ok(PLAN.get_or_init(|| parsed))
}

fn parse(text: &str) -> std::result::Result<Plan, String> {
    let parts: Vec<&str> = text.split(':').collect();
    let (rank, point, hit, launcher) = match parts.as_slice() {
        [r, p, h] => (r, p, h, false),
        [r, p, h, "launcher"] => (r, p, h, true),
        _ => return Err("the fields are not those below".into()),
    };
    let rank = rank
        .strip_prefix("rank")
        .and_then(|r| r.parse().ok())
        .ok_or(format!("{rank:?} is not rank<N>"))?;
    if !POINTS.contains(point) {
        return Err(format!("no crash point {point:?}; there are {POINTS:?}"));
    }
    let hit = hit
        .parse()
        .ok()
        .filter(|&h: &u64| h > 0)
        .ok_or(format!("hit {hit:?} is not a count from 1"))?;
    Ok(Plan {
        rank,
        point: point.to_string(),
        hit,
        launcher,
        seen: AtomicU64::new(0),
    })
}

/// The moment `name` (one of `POINTS`): kills as the plan says, when it says.
pub fn point(name: &str) {
    debug_assert!(POINTS.contains(&name), "unlisted crash point {name}");
    let Ok(Some(plan)) = plan() else { return };
    if plan.point != name || plan.rank != this_rank() {
        return;
    }
    if plan.seen.fetch_add(1, Ordering::SeqCst) + 1 != plan.hit {
        return;
    }
    // SAFETY: kill and getppid/getpid have no memory-safety preconditions.
    unsafe {
        if plan.launcher {
            libc::kill(libc::getppid(), libc::SIGKILL);
            // The launcher's death signals this rank (PR_SET_PDEATHSIG); without a launcher
            // (a rank started by hand) it dies here, at the same moment.
            std::thread::sleep(Duration::from_secs(5));
        }
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// The job rank the launcher gave this process (0 alone).
fn this_rank() -> usize {
    std::env::var("RANK")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_bad_ones_are_named() {
        let p = parse("rank1:file.synced:3:launcher").unwrap();
        assert_eq!(
            (p.rank, p.point.as_str(), p.hit, p.launcher),
            (1, "file.synced", 3, true)
        );
        assert!(!parse("rank0:save.end:1").unwrap().launcher);
        for (bad, says) in [
            ("rank0:save.end", "fields are not"),
            ("r0:save.end:1", "rank<N>"),
            ("rank0:save.middle:1", "no crash point"),
            ("rank0:save.end:0", "count from 1"),
            ("rank0:save.end:1:self", "fields are not"),
        ] {
            let err = parse(bad).err().unwrap_or_default();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
