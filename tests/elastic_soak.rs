//! Elastic soak (issue 20, item 2): a 4-rank job launched with `--max_restarts 5` whose ranks
//! are SIGKILLed one at a time, at random, on the test's own seeded schedule. Each kill costs
//! one restart, which resumes from the newest checkpoint; the job finishes, and its losses and
//! consolidated weights equal (==) an uninterrupted run's of the same steps.
//!
//! CI runs a short schedule (2 kills, 2-4 s apart); scripts/soak.sh runs the long one (5
//! kills, 30-60 s apart) through these variables: DS_RS_SOAK_STEPS, DS_RS_SOAK_KILLS,
//! DS_RS_SOAK_GAP_S ("MIN-MAX" seconds between kills) and DS_RS_SOAK_SEED.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::*;

const RANKS: u64 = 4;

struct Plan {
    steps: u64,
    kills: usize,
    gap_ms: (u64, u64),
    seed: u64,
}

impl Plan {
    fn from_env() -> Plan {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or(default.into());
        let num = |name: &str, default: &str| -> u64 {
            let v = var(name, default);
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?}: not a number"))
        };
        let gap = var("DS_RS_SOAK_GAP_S", "2-4");
        let (lo, hi) = gap
            .split_once('-')
            .and_then(|(a, b)| Some((a.parse::<f64>().ok()?, b.parse::<f64>().ok()?)))
            .filter(|(a, b)| a <= b)
            .unwrap_or_else(|| panic!("DS_RS_SOAK_GAP_S={gap:?}: expected MIN-MAX seconds"));
        Plan {
            steps: num("DS_RS_SOAK_STEPS", "1500"),
            kills: num("DS_RS_SOAK_KILLS", "2") as usize,
            gap_ms: ((lo * 1e3) as u64, (hi * 1e3) as u64),
            seed: num("DS_RS_SOAK_SEED", "20"),
        }
    }

    /// How long the killed job may take: the calm run's time per kill on top of it.
    fn limit(&self, calm: Duration) -> Duration {
        calm * (self.kills as u32 + 2) + Duration::from_millis(self.gap_ms.1) * self.kills as u32
    }
}

/// xorshift64: the schedule is the seed's, the same on every run.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Sleeps `ms`, returning early (false) if the job ends meanwhile.
fn sleep_while_running(child: &mut Child, ms: u64) -> bool {
    let until = Instant::now() + Duration::from_millis(ms);
    while Instant::now() < until {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[test]
fn ranks_killed_at_random_lose_nothing() {
    let plan = Plan::from_env();
    let s = Scratch::new("soak");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z2.json", &config(2, ""));
    let job = |dir: &str, restarts: u32| {
        let dir = s.path(dir);
        format!(
            "launch --nproc_per_node {RANKS} --max_restarts {restarts} --config {} {} --save-dir {} --save-interval 50",
            cfg.display(),
            train(&model, plan.steps, &dir),
            dir.join("ckpt").display()
        )
    };
    let t0 = Instant::now();
    let calm = run(&job("calm", 0), Duration::from_secs(3600));
    assert!(calm.status.success(), "{}", calm.stderr);
    let calm_took = t0.elapsed();

    let hit = s.path("hit");
    let needle = hit.to_string_lossy().into_owned();
    let soak_start = Instant::now();
    let mut child = start(&job("hit", 5));
    let mut state = plan.seed.max(1);
    let mut kills = Vec::new();
    while kills.len() < plan.kills {
        let (lo, hi) = plan.gap_ms;
        let gap = lo + next(&mut state) % (hi - lo + 1);
        if !sleep_while_running(&mut child, gap) {
            break;
        }
        let rank = (next(&mut state) % RANKS) as usize;
        // between a failure and the restarted ranks there may be no such rank: try again
        let pid = (0..100).find_map(|_| {
            rank_pid(&needle, rank).or_else(|| {
                std::thread::sleep(Duration::from_millis(50));
                None
            })
        });
        let Some(pid) = pid else { continue };
        signal(pid, "KILL");
        kills.push((rank, steps(&hit).len()));
        eprintln!("killed rank {rank} at {:?}", soak_start.elapsed());
    }
    let f = finish(child, plan.limit(calm_took));
    assert!(f.status.success(), "{}", f.stderr);
    assert_eq!(
        kills.len(),
        plan.kills,
        "the job ended before its schedule; raise DS_RS_SOAK_STEPS"
    );
    let restarts = f.stderr.matches("restarting the job").count();
    assert_eq!(restarts, plan.kills, "kills {kills:?}: {}", f.stderr);
    let (got, want) = (losses(&hit), losses(&s.path("calm")));
    let first = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i));
    assert!(
        first.is_none(),
        "the losses differ from step {first:?} ({} vs {} steps)",
        got.len(),
        want.len()
    );
    let consolidate = |name: &str| {
        let out = s.path(&format!("{name}.safetensors"));
        let cmd = format!(
            "checkpoint consolidate {} --out {}",
            s.path(name).join("ckpt").display(),
            out.display()
        );
        let f = run(&cmd, Duration::from_secs(120));
        assert!(f.status.success(), "{}", f.stderr);
        std::fs::read(out).unwrap()
    };
    assert!(
        consolidate("hit") == consolidate("calm"),
        "the final weights differ"
    );
    assert_nothing_left(&needle);
    eprintln!(
        "{} kills {kills:?} (rank, steps logged), {} steps, calm {calm_took:?}, soak {:?}",
        kills.len(),
        plan.steps,
        soak_start.elapsed()
    );
}
