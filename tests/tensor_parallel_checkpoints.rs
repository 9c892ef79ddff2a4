//! Tensor-parallel checkpoints end to end with the real binary (issue 16, "Resharding"): a
//! checkpoint saved at one tensor-parallel degree resumes at another with the losses of a run
//! that never stopped, consolidates at tp > 1 into the weights the run gathered, and a damaged
//! shard of one tensor-parallel rank is named.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(240);

/// Four heads, so that tp 4 divides the heads as well as V and 4d.
const MODEL: &str = r#"{"V": 256, "T": 16, "d": 64, "H": 4, "L": 2}"#;

/// Across layouts gradients are summed in another order (over tp ranks, over dp ranks, over
/// accumulation steps), so losses agree to fp32 noise (~1e-7 relative here), not bit for bit.
const REL: f64 = 1e-5;

/// One layout of the job: `ranks` processes, `tp` of them per tensor-parallel group, the rest
/// data-parallel.
#[derive(Clone, Copy)]
struct Layout {
    name: &'static str,
    ranks: usize,
    tp: usize,
    stage: u8,
}

const TP1_DP2_Z1: Layout = Layout {
    name: "tp1 x dp2 ZeRO-1",
    ranks: 2,
    tp: 1,
    stage: 1,
};
const TP2_DP2_Z3: Layout = Layout {
    name: "tp2 x dp2 ZeRO-3",
    ranks: 4,
    tp: 2,
    stage: 3,
};
const TP2_DP2_Z0: Layout = Layout {
    name: "tp2 x dp2 ZeRO-0",
    ranks: 4,
    tp: 2,
    stage: 0,
};
const TP4_DP1_Z1: Layout = Layout {
    name: "tp4 x dp1 ZeRO-1",
    ranks: 4,
    tp: 4,
    stage: 1,
};
/// Three shards of an odd-sized buffer: the last one padded.
const TP1_DP3_Z3: Layout = Layout {
    name: "tp1 x dp3 ZeRO-3",
    ranks: 3,
    tp: 1,
    stage: 3,
};

/// A global batch of 24 whatever the layout (micro-batch 2: 6 accumulation steps at dp 2, 12
/// at dp 1, 4 at dp 3), fp32, AdamW, clipping at 1.0 so the global norm matters.
fn config(stage: u8) -> String {
    format!(
        r#"{{"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}}}}}"#
    )
}

/// A scratch directory with the model file and one config per stage.
struct Job {
    s: Scratch,
    model: PathBuf,
}

impl Job {
    fn new(tag: &str) -> Job {
        let s = Scratch::new(tag);
        let model = s.write("model.json", MODEL);
        for stage in 0..=3 {
            s.write(&format!("z{stage}.json"), &config(stage));
        }
        Job { s, model }
    }

    /// `launch ... train` at `l` for (up to) `steps` steps, metrics in `metrics`, then `extra`.
    fn command(&self, l: Layout, steps: u64, metrics: &Path, extra: &str) -> String {
        format!(
            "launch --nproc_per_node {} --config {} {} --tp {} {extra}",
            l.ranks,
            self.s.path(&format!("z{}.json", l.stage)).display(),
            train(&self.model, steps, metrics),
            l.tp
        )
    }

    /// Like `command`; it must succeed, in layout `l`.
    fn train(&self, l: Layout, steps: u64, metrics: &Path, extra: &str) -> Finished {
        let cmd = self.command(l, steps, metrics, extra);
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{}: {cmd}: {}", l.name, f.stderr);
        let layout = format!(
            "{} ranks (dp {} x tp {} x pp ",
            l.ranks,
            l.ranks / l.tp,
            l.tp
        );
        assert!(f.stdout.contains(&layout), "{}: {}", l.name, f.stdout);
        f
    }
}

fn save(dir: &Path) -> String {
    format!("--save-dir {}", dir.display())
}

/// The largest relative difference of `got` from `want`, each within `REL`.
fn compare(got: &[f64], want: &[f64], what: &str) -> f64 {
    assert_same_losses(got, want, REL, what);
    got.iter()
        .zip(want)
        .map(|(g, w)| ((g - w) / w).abs())
        .fold(0.0, f64::max)
}

/// 10 steps at `first`, saved at step 10, resumed at `then` to step 20: every step's loss
/// within REL of `want`, a straight 20-step run. Returns the largest relative difference.
fn reshard(job: &Job, first: Layout, then: Layout, want: &[f64]) -> f64 {
    let tag = format!("{}-to-{}", first.name, then.name).replace([' ', '-'], "_");
    let (ckpt, a, b) = (
        job.s.path(&format!("{tag}_ckpt")),
        job.s.path(&format!("{tag}_a")),
        job.s.path(&format!("{tag}_b")),
    );
    job.train(first, 10, &a, &save(&ckpt));
    let f = job.train(then, 20, &b, &format!("{} --resume", save(&ckpt)));
    assert!(f.stdout.contains("at step 10"), "{}", f.stdout);
    let resumed: Vec<u64> = steps(&b)
        .iter()
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(resumed, (10..20).collect::<Vec<_>>(), "{tag}: steps run");
    let what = format!("{} then {}", first.name, then.name);
    let before = compare(&losses(&a), &want[..10], &format!("{what}: steps 1-10"));
    let after = compare(&losses(&b), &want[10..], &format!("{what}: steps 11-20"));
    println!("{what}: max relative loss difference {before:.1e} (steps 1-10), {after:.1e} (steps 11-20, resumed)");
    after
}

/// The losses of 20 steps at tp 1 x dp 2, ZeRO-1, never stopped.
fn straight(job: &Job) -> Vec<f64> {
    let dir = job.s.path("straight");
    job.train(TP1_DP2_Z1, 20, &dir, "");
    losses(&dir)
}

#[test]
fn a_tp2_checkpoint_resumes_at_tp1_and_at_tp4_with_the_same_losses() {
    let job = Job::new("tp-ckpt-from-tp2");
    let want = straight(&job);
    for then in [TP1_DP2_Z1, TP4_DP1_Z1, TP1_DP3_Z3] {
        reshard(&job, TP2_DP2_Z3, then, &want);
    }
}

#[test]
fn a_tp1_or_tp4_checkpoint_resumes_at_tp2_with_the_same_losses() {
    let job = Job::new("tp-ckpt-to-tp2");
    let want = straight(&job);
    for first in [TP1_DP2_Z1, TP4_DP1_Z1, TP1_DP3_Z3] {
        reshard(&job, first, TP2_DP2_Z3, &want);
    }
}

/// The tensors of a safetensors file of f32 tensors, by name.
fn tensors(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .map(|(name, t)| {
            assert_eq!(t["dtype"], "F32", "{name}");
            let at = |i: usize| t["data_offsets"][i].as_u64().unwrap() as usize;
            let values = data[at(0)..at(1)]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name.clone(), values)
        })
        .collect()
}

#[test]
fn a_tp2_checkpoint_consolidates_into_the_gathered_weights() {
    let job = Job::new("tp-ckpt-consolidate");
    // The reference trained without tensor parallelism, to check the whole tensors
    // independently of the gather both other files come from.
    let whole = job.s.path("whole.safetensors");
    let extra = format!("--save-weights {}", whole.display());
    job.train(TP1_DP2_Z1, 5, &job.s.path("whole"), &extra);
    let whole = tensors(&whole);
    for l in [TP2_DP2_Z3, TP2_DP2_Z0] {
        let tag = format!("z{}", l.stage);
        let (ckpt, gathered, out) = (
            job.s.path(&format!("{tag}_ckpt")),
            job.s.path(&format!("{tag}_gathered.safetensors")),
            job.s.path(&format!("{tag}_consolidated.safetensors")),
        );
        let extra = format!("{} --save-weights {}", save(&ckpt), gathered.display());
        job.train(l, 5, &job.s.path(&tag), &extra);
        let cmd = format!(
            "checkpoint consolidate {} --out {}",
            ckpt.display(),
            out.display()
        );
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{}: {cmd}: {}", l.name, f.stderr);
        let bytes = std::fs::read(&out).unwrap();
        assert!(
            bytes == std::fs::read(&gathered).unwrap(),
            "{}: the consolidated checkpoint differs from the gathered weights",
            l.name
        );
        // 5 AdamW steps of lr 1e-3 move an element by at most ~5e-3; the layouts differ by
        // fp32 noise that the steps carry along (~1e-5 observed), a misplaced slice by the
        // size of the weights themselves (initial std 0.02).
        let got = tensors(&out);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            whole.keys().collect::<Vec<_>>()
        );
        for (name, values) in &got {
            let want = &whole[name];
            assert_eq!(values.len(), want.len(), "{}: {name}", l.name);
            let worst = values
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "{}: {name} differs by {worst}", l.name);
        }
        let f = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
        assert!(
            f.status.success()
                && f.stdout.contains("global_step5 (latest)")
                && f.stdout.contains("checksums ok"),
            "{}: {}{}",
            l.name,
            f.stdout,
            f.stderr
        );
    }
}

/// The file of the last shard that holds tensor-parallel rank `tp_rank`'s slices.
fn shard_of(tag_dir: &Path, tp_rank: u64) -> String {
    let text = std::fs::read_to_string(tag_dir.join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shard = m["shards"]
        .as_array()
        .unwrap()
        .iter()
        .rfind(|s| s["tp_rank"].as_u64() == Some(tp_rank))
        .expect("a shard of tensor-parallel rank 1");
    shard["file"].as_str().unwrap().to_string()
}

#[test]
fn a_damaged_shard_of_one_tp_rank_is_named() {
    let job = Job::new("tp-ckpt-damaged");
    let ckpt = job.s.path("ckpt");
    job.train(TP2_DP2_Z3, 2, &job.s.path("m"), &save(&ckpt));
    let tag = ckpt.join("global_step2");
    let file = shard_of(&tag, 1);
    let shard = tag.join(&file);
    let pristine = std::fs::read(&shard).unwrap();
    type Damage = fn(&Path, &[u8]);
    let cases: [(&str, Damage); 2] = [
        ("corrupted", |p, b| {
            let mut b = b.to_vec();
            let i = b.len() - 10;
            b[i] ^= 0x40;
            std::fs::write(p, b).unwrap()
        }),
        ("missing", |p, _| std::fs::remove_file(p).unwrap()),
    ];
    let named = |f: &Finished| {
        let text = format!("{}{}", f.stdout, f.stderr);
        f.status.code() == Some(1)
            && !text.contains("panicked")
            && text
                .lines()
                .any(|l| (l.contains("error:") || l.contains("CORRUPT")) && l.contains(&file))
    };
    for (what, damage) in cases {
        damage(&shard, &pristine);
        // Through resharding (tp 1) and through the same slices (tp 2).
        for l in [TP1_DP2_Z1, TP2_DP2_Z3] {
            let dir = job.s.path(&format!("{what}_{}", l.tp));
            let f = run(
                &job.command(l, 3, &dir, &format!("{} --resume", save(&ckpt))),
                LIMIT,
            );
            assert!(named(&f), "{what}, loading at {}: {}", l.name, f.stderr);
            assert!(steps(&dir).is_empty(), "{what}: trained anyway");
        }
        let out = job.s.path("out.safetensors");
        let consolidate = format!(
            "checkpoint consolidate {} --out {}",
            ckpt.display(),
            out.display()
        );
        let f = run(&consolidate, LIMIT);
        assert!(named(&f), "{what}, consolidate: {}", f.stderr);
        let f = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
        assert!(named(&f), "{what}, inspect: {}{}", f.stdout, f.stderr);
        std::fs::write(&shard, &pristine).unwrap();
    }
    let f = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
    assert!(
        f.status.success() && f.stdout.contains("global_step2 (latest)"),
        "{}",
        f.stdout
    );
}
