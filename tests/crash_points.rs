//! SIGKILL at every moment of a checkpoint save (issue 20, item 1): a rank, the other rank, or
//! the launcher (which takes every rank with it) is killed at a named crash point
//! (`DS_RS_CRASH_AT`, checkpoint/src/crash_point.rs) of the second or third save of a 2-rank
//! ZeRO-3 job that saves every step and keeps two checkpoints, or while one of them removes
//! the oldest. After each kill: `checkpoint inspect` verifies every checkpoint, `latest` names
//! the step the moment implies, no process is left, and `--resume` ends with the losses of an
//! uninterrupted run, bit for bit, and the two newest checkpoints, nothing else.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);
const STEPS: usize = 4;
const SIGKILL: i32 = 9;

/// Rank 0 writes three files per save (its shard, the manifest, `latest`), rank 1 one (its
/// shard): the `hit` of a `file.*` point says which file of which save.
fn rank0_file(save: u64, file: u64) -> u64 {
    3 * (save - 1) + file
}

/// (DS_RS_CRASH_AT, the step `latest` must name afterwards): every point of rank 0 in the
/// second save, the same moments killing the launcher in the third, and rank 1's points in
/// both, killing rank 1 and, separately, the launcher: 31 moments kill a rank and 30 the
/// launcher.
fn moments() -> Vec<(String, usize)> {
    let mut m = Vec::new();
    for (save, tail) in [(2, ""), (3, ":launcher")] {
        let (before, after) = (save as usize - 1, save as usize);
        let file = |n| rank0_file(save, n);
        let plan = [
            ("save.start", save, before),
            ("save.partial", save, before),
            ("file.written", file(1), before), // its shard
            ("file.synced", file(1), before),
            ("file.renamed", file(1), before),
            ("save.shards", save, before),
            ("file.written", file(2), before), // the manifest
            ("file.synced", file(2), before),
            ("file.renamed", file(2), before),
            ("commit.renamed", save, before),
            ("file.written", file(3), before), // `latest`
            ("file.synced", file(3), before),
            ("file.renamed", file(3), after),
            ("commit.published", save, after),
            ("save.end", save, after),
        ];
        m.extend(plan.map(|(p, hit, latest)| (format!("rank0:{p}:{hit}{tail}"), latest)));
    }
    for (save, tail) in [(2u64, ""), (3, ""), (2, ":launcher"), (3, ":launcher")] {
        let before = save as usize - 1;
        let points = [
            "save.start",
            "save.partial",
            "file.written",
            "file.synced",
            "file.renamed",
            "save.shards",
        ];
        m.extend(points.map(|p| (format!("rank1:{p}:{save}{tail}"), before)));
        m.push((format!("rank1:save.end:{save}{tail}"), before + 1));
    }
    // --keep-checkpoints 2: saves 3 and 4 each remove the oldest tag
    m.push(("rank0:remove.renamed:1".into(), 3));
    m.push(("rank0:remove.renamed:1:launcher".into(), 3));
    m.push(("rank0:remove.renamed:2".into(), 4));
    m
}

struct Job<'a> {
    s: &'a Scratch,
    model: std::path::PathBuf,
    cfg: std::path::PathBuf,
}

impl Job<'_> {
    /// The job's command line, its metrics in `dir/metrics`, checkpoints in `dir/ckpt`.
    fn command(&self, dir: &Path, metrics: &str, resume: bool) -> Vec<String> {
        let mut cmd = words(&format!(
            "launch --nproc_per_node 2 --config {} {} --save-dir {} --save-interval 1 --keep-checkpoints 2",
            self.cfg.display(),
            train(&self.model, STEPS as u64, &dir.join(metrics)),
            dir.join("ckpt").display()
        ));
        if resume {
            cmd.push("--resume".into());
        }
        cmd
    }

    fn run(&self, dir: &Path, metrics: &str, crash_at: Option<&str>, resume: bool) -> Finished {
        let mut cmd = Command::new(BIN);
        cmd.args(self.command(dir, metrics, resume));
        match crash_at {
            Some(at) => cmd.env("DS_RS_CRASH_AT", at),
            None => cmd.env_remove("DS_RS_CRASH_AT"),
        };
        finish(spawn_captured(&mut cmd), LIMIT)
    }

    fn dir(&self, name: &str) -> std::path::PathBuf {
        self.s.path(name)
    }
}

/// The names in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The step `checkpoint inspect` reports for `latest`; asserts every checkpoint verifies.
fn inspected_latest(ckpt: &Path, what: &str) -> usize {
    let f = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
    assert!(
        f.status.success(),
        "{what}: inspect: {}{}",
        f.stdout,
        f.stderr
    );
    let line = f
        .stdout
        .lines()
        .find(|l| l.contains("(latest): step"))
        .unwrap_or_else(|| panic!("{what}: no latest: {}", f.stdout));
    let step = line.split("(latest): step ").nth(1).unwrap();
    step.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn a_kill_at_any_moment_of_a_save_loses_nothing() {
    let s = Scratch::new("crash-points");
    let job = Job {
        s: &s,
        model: s.write("model.json", SMALL_MODEL),
        cfg: s.write("z3.json", &config(3, "")),
    };
    let calm = job.dir("calm");
    let f = job.run(&calm, "metrics", None, false);
    assert!(f.status.success(), "{}", f.stderr);
    let want = losses(&calm.join("metrics"));
    assert_eq!(want.len(), STEPS);

    let moments = moments();
    assert!(moments.len() >= 30, "{} moments", moments.len());
    let mut slowest = Duration::ZERO;
    for (i, (at, latest)) in moments.iter().enumerate() {
        let dir = job.dir(&format!("m{i}"));
        let crashed = job.run(&dir, "metrics", Some(at), false);
        slowest = slowest.max(crashed.took);
        let launcher_killed = crashed.status.signal() == Some(SIGKILL);
        match at.ends_with(":launcher") {
            true => assert!(launcher_killed, "{at}: launcher {:?}", crashed.status),
            false => assert!(
                crashed.stderr.contains(&format!(
                    "rank {} on host localhost was killed by SIGKILL",
                    &at[4..5]
                )),
                "{at}: {:?} {}",
                crashed.status,
                crashed.stderr
            ),
        }
        let gone = wait_for(Duration::from_secs(10), || {
            processes_with(dir.to_str().unwrap()).is_empty()
        });
        assert!(gone, "{at}: {:?}", processes_with(dir.to_str().unwrap()));
        let ckpt = dir.join("ckpt");
        assert_eq!(inspected_latest(&ckpt, at), *latest, "{at}: latest");

        let resumed = job.run(&dir, "resumed", None, true);
        assert!(resumed.status.success(), "{at}: resume: {}", resumed.stderr);
        assert_eq!(
            losses(&dir.join("resumed")),
            want[*latest..],
            "{at}: the resumed run's losses"
        );
        assert_eq!(inspected_latest(&ckpt, at), STEPS, "{at}: after resuming");
        assert_eq!(
            entries(&ckpt),
            ["global_step3", "global_step4", "latest"],
            "{at}: the checkpoints kept, and no leftover"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
    eprintln!(
        "{} crash moments, each resumed exactly; the slowest crashed job ended {slowest:?} after \
         it started",
        moments.len()
    );
}

#[test]
fn a_bad_crash_plan_is_an_error_before_training() {
    let s = Scratch::new("crash-bad");
    let model = s.write("model.json", SMALL_MODEL);
    let mut cmd = Command::new(BIN);
    cmd.args(words(&train(&model, 1, &s.path("m"))))
        .env("DS_RS_CRASH_AT", "rank0:save.middle:1");
    let f = finish(spawn_captured(&mut cmd), LIMIT);
    assert_eq!(f.status.code(), Some(1), "{}", f.stderr);
    assert_eq!(error_lines(&f.stderr).len(), 1, "{}", f.stderr);
    assert!(
        f.stderr.contains("no crash point \"save.middle\""),
        "{}",
        f.stderr
    );
    assert!(steps(&s.path("m")).is_empty(), "trained despite the error");
}
