//! Checkpoints of expert-parallel runs end to end with the real binary (issue 37): the
//! Mixtral fixture (2 sparse layers of 8 experts, models/tests/fixtures/hf/mixtral) saved at
//! ep 2 x dp 2 resumes at ep 4 and at ep 1 with the losses of a run that never stopped; so do
//! a ZeRO-3, a tensor-parallel and a pipelined save at ep 2, and an ep 1 save resumed at ep 2.
//! `--save-hf` and `checkpoint consolidate` of an ep 2 run hold every expert, equal to an
//! ep 1 run's, and a damaged shard of one rank's experts is named.
//!
//! Tolerance, 1e-5 relative (the issue's): across layouts gradients are summed in other
//! orders (over data-parallel, tensor-parallel and expert-parallel ranks), so losses agree to
//! fp32 noise (~1e-7 here, tests/hf_layouts.rs), not bit for bit; a resumed run that read a
//! wrong expert moves them by far more (its output is another function).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);
const REL: f64 = 1e-5;

/// Runs are several processes on two cores: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Mixtral's 2 sparse layers x 8 experts x (w1, w3, w2).
const EXPERT_TENSORS: usize = 2 * 8 * 3;

/// One layout of the job: `ranks` processes, `args` (--ep, --tp, --pp), a ZeRO stage.
#[derive(Clone, Copy)]
struct Layout {
    name: &'static str,
    ranks: usize,
    ep: u64,
    args: &'static str,
    stage: u8,
}

const EP1_DP4_Z1: Layout = Layout {
    name: "ep1 x dp4 ZeRO-1",
    ranks: 4,
    ep: 1,
    args: "",
    stage: 1,
};
const EP1_DP4_Z2: Layout = Layout {
    name: "ep1 x dp4 ZeRO-2",
    ranks: 4,
    ep: 1,
    args: "",
    stage: 2,
};
const EP2_DP2_Z2: Layout = Layout {
    name: "ep2 x dp2 ZeRO-2",
    ranks: 4,
    ep: 2,
    args: "--ep 2",
    stage: 2,
};
const EP2_DP2_Z3: Layout = Layout {
    name: "ep2 x dp2 ZeRO-3",
    ranks: 4,
    ep: 2,
    args: "--ep 2",
    stage: 3,
};
const EP4_Z1: Layout = Layout {
    name: "ep4 ZeRO-1",
    ranks: 4,
    ep: 4,
    args: "--ep 4",
    stage: 1,
};
/// Each expert split over two tensor-parallel ranks, in two experts' stores.
const EP2_TP2_Z1: Layout = Layout {
    name: "ep2 x tp2 ZeRO-1",
    ranks: 4,
    ep: 2,
    args: "--ep 2 --tp 2",
    stage: 1,
};
/// A sparse layer on each pipeline stage: an experts' store per (stage, expert-parallel rank).
const EP2_PP2_Z0: Layout = Layout {
    name: "ep2 x pp2 ZeRO-0",
    ranks: 4,
    ep: 2,
    args: "--ep 2 --pp 2",
    stage: 0,
};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/tests/fixtures/hf/mixtral")
}

/// Global batch 8 (micro-batch 2: one accumulation step at dp 4, two at dp 2), fp32, AdamW,
/// clipping at 1.0 so the global norm matters; ZeRO-3 gathers the weights for --save-hf.
fn config(stage: u8) -> String {
    let gather = match stage {
        3 => r#", "stage3_gather_16bit_weights_on_model_save": true"#,
        _ => "",
    };
    format!(
        r#"{{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3, "weight_decay": 0.1}}}},
        "zero_optimization": {{"stage": {stage}{gather}}}}}"#
    )
}

/// A scratch directory with one config per ZeRO stage, and the model trained.
struct Job {
    s: Scratch,
    model: PathBuf,
}

impl Job {
    /// The Mixtral fixture's job.
    fn new(tag: &str) -> Job {
        let s = Scratch::new(tag);
        for stage in 0..=3 {
            s.write(&format!("z{stage}.json"), &config(stage));
        }
        Job {
            s,
            model: fixture(),
        }
    }

    /// A job of the GPT model JSON `json`.
    fn of_gpt(tag: &str, json: &str) -> Job {
        let job = Job::new(tag);
        let model = job.s.write("model.json", json);
        Job { model, ..job }
    }

    /// `launch ... train` of the fixture at `l` for (up to) `steps` steps, metrics in
    /// `metrics`, then `extra`.
    fn command(&self, l: Layout, steps: u64, metrics: &Path, extra: &str) -> String {
        format!(
            "launch --nproc_per_node {} --config {} train --model {} --seq-len 16 --steps {steps} \
             {} --eval-interval 0 --eval-batches 1 --metrics-dir {} {extra}",
            l.ranks,
            self.s.path(&format!("z{}.json", l.stage)).display(),
            self.model.display(),
            l.args,
            metrics.display()
        )
    }

    /// Like `command`; it must succeed, at layout `l`'s expert-parallel size.
    fn train(&self, l: Layout, steps: u64, metrics: &Path, extra: &str) -> Finished {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let cmd = self.command(l, steps, metrics, extra);
        let f = run(&cmd, LIMIT);
        assert!(f.status.success(), "{}: {cmd}\n{}", l.name, f.stderr);
        let text = std::fs::read_to_string(metrics.join("summary.json")).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(summary["layout"]["ep"].as_u64(), Some(l.ep), "{}", l.name);
        f
    }

    /// Like `command`, to its end, whatever the outcome.
    fn attempt(&self, l: Layout, steps: u64, metrics: &Path, extra: &str) -> Finished {
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        run(&self.command(l, steps, metrics, extra), LIMIT)
    }

    /// The losses of 10 steps at ep 1 x dp 4, ZeRO-1, never stopped.
    fn straight(&self) -> Vec<f64> {
        let dir = self.s.path("straight");
        self.train(EP1_DP4_Z1, 10, &dir, "");
        losses(&dir)
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

/// 5 steps at `first`, saved at step 5, resumed at `then` to step 10: every step's loss
/// within REL of `want`, the straight 10-step run.
fn reshard(job: &Job, first: Layout, then: Layout, want: &[f64]) {
    let tag = format!("{}-to-{}", first.name, then.name).replace([' ', '-'], "_");
    let (ckpt, a, b) = (
        job.s.path(&format!("{tag}_ckpt")),
        job.s.path(&format!("{tag}_a")),
        job.s.path(&format!("{tag}_b")),
    );
    job.train(first, 5, &a, &save(&ckpt));
    let f = job.train(then, 10, &b, &format!("{} --resume", save(&ckpt)));
    assert!(f.stdout.contains("at step 5"), "{}", f.stdout);
    let resumed: Vec<u64> = steps(&b)
        .iter()
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(resumed, (5..10).collect::<Vec<_>>(), "{tag}: steps run");
    let what = format!("{} then {}", first.name, then.name);
    let before = compare(&losses(&a), &want[..5], &format!("{what}: steps 1-5"));
    let after = compare(&losses(&b), &want[5..], &format!("{what}: steps 6-10"));
    println!(
        "{what}: max relative loss difference {before:.1e} (steps 1-5), {after:.1e} (steps 6-10, resumed)"
    );
}

/// Issue 37's acceptance: a checkpoint saved at ep 2 x dp 2 resumes at ep 4 and at ep 1.
#[test]
fn an_ep2_checkpoint_resumes_at_ep4_and_at_ep1_with_the_same_losses() {
    let job = Job::new("ep-ckpt-from-ep2");
    let want = job.straight();
    for then in [EP4_Z1, EP1_DP4_Z2] {
        reshard(&job, EP2_DP2_Z2, then, &want);
    }
}

/// DeepSpeed-MoE's GPT (8 experts, top-2 every other block) with a capacity that drops most
/// routes: its experts cross from ep 2 x dp 2 to ep 4 and to ep 1 as Mixtral's do.
#[test]
fn an_moe_gpt_checkpoint_with_dropping_resumes_at_another_ep() {
    let json = r#"{"V": 128, "T": 16, "d": 32, "H": 4, "L": 4,
        "moe": {"num_experts": 8, "k": 2, "capacity_factor": 0.25, "min_capacity": 1}}"#;
    let job = Job::of_gpt("ep-ckpt-moe-gpt", json);
    let want = job.straight();
    for then in [EP4_Z1, EP1_DP4_Z2] {
        reshard(&job, EP2_DP2_Z2, then, &want);
    }
}

/// The other directions and stores: ZeRO-3's sharded experts to ep 1, ep 1's dense store
/// to ep 2's experts' stores, experts split by tensor parallelism and spread over pipeline
/// stages.
#[test]
fn zero3_ep1_tensor_and_pipeline_checkpoints_cross_to_another_ep() {
    let job = Job::new("ep-ckpt-cross");
    let want = job.straight();
    reshard(&job, EP2_DP2_Z3, EP1_DP4_Z1, &want);
    reshard(&job, EP1_DP4_Z1, EP2_DP2_Z3, &want);
    reshard(&job, EP2_TP2_Z1, EP4_Z1, &want);
    reshard(&job, EP2_PP2_Z0, EP1_DP4_Z2, &want);
}

/// Every tensor of the safetensors files in `dir` (a Hugging Face directory) by name.
fn hf_tensors(dir: &Path) -> HashMap<String, Vec<f32>> {
    let mut all = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            all.extend(read_weights(&e.path()));
        }
    }
    all
}

/// `got` holds the tensors of `want`, each within `tol` of it, every expert among them.
fn same_tensors(got: &HashMap<String, Vec<f32>>, want: &HashMap<String, Vec<f32>>, what: &str) {
    let names = |m: &HashMap<String, Vec<f32>>| {
        let mut n: Vec<String> = m.keys().cloned().collect();
        n.sort();
        n
    };
    assert_eq!(names(got), names(want), "{what}: tensor names");
    let experts = got.keys().filter(|n| n.contains(".experts.")).count();
    assert_eq!(experts, EXPERT_TENSORS, "{what}: every expert");
    // 5 AdamW steps of lr 1e-3 move an element by at most ~5e-3; the layouts differ by fp32
    // noise the steps carry along (~1e-6 observed), a wrong expert by the size of the weights.
    for (name, values) in got {
        let worst = values
            .iter()
            .zip(&want[name])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert_eq!(values.len(), want[name].len(), "{what}: {name}");
        assert!(worst < 1e-4, "{what}: {name} differs by {worst}");
    }
}

/// `--save-hf` and `--save-weights` at ep 2 gather every rank's experts: they equal an ep 1
/// run's, and so does the consolidated ep 2 checkpoint; `checkpoint inspect` reads its
/// layout.
#[test]
fn an_ep2_run_exports_and_consolidates_every_expert() {
    let job = Job::new("ep-ckpt-export");
    let (hf1, hf2) = (job.s.path("hf1"), job.s.path("hf2"));
    let weights1 = job.s.path("ep1.safetensors");
    let extra = format!(
        "--save-hf {} --save-weights {}",
        hf1.display(),
        weights1.display()
    );
    job.train(EP1_DP4_Z1, 5, &job.s.path("m1"), &extra);
    let (ckpt, weights2) = (job.s.path("ckpt"), job.s.path("ep2.safetensors"));
    let extra = format!(
        "--save-hf {} --save-weights {} {}",
        hf2.display(),
        weights2.display(),
        save(&ckpt)
    );
    job.train(EP2_DP2_Z3, 5, &job.s.path("m2"), &extra);
    let want = hf_tensors(&hf1);
    same_tensors(&hf_tensors(&hf2), &want, "--save-hf at ep 2");
    let weights1 = read_weights(&weights1);
    same_tensors(
        &read_weights(&weights2),
        &weights1,
        "--save-weights at ep 2",
    );

    let out = job.s.path("consolidated.safetensors");
    let cmd = format!(
        "checkpoint consolidate {} --out {}",
        ckpt.display(),
        out.display()
    );
    let f = run(&cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}", f.stderr);
    same_tensors(&read_weights(&out), &weights1, "consolidate at ep 2");
    let f = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
    assert!(
        f.status.success()
            && f.stdout.contains("global_step5 (latest)")
            && f.stdout.contains("(ep 2) ZeRO-3")
            && f.stdout.contains("checksums ok"),
        "{}{}",
        f.stdout,
        f.stderr
    );
}

/// The file of the last shard of expert-parallel rank `ep_rank`'s experts.
fn expert_shard(tag_dir: &Path, ep_rank: u64) -> String {
    let text = std::fs::read_to_string(tag_dir.join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let shard = m["shards"]
        .as_array()
        .unwrap()
        .iter()
        .rfind(|s| s["ep_rank"].as_u64() == Some(ep_rank))
        .expect("a shard of expert-parallel rank 1's experts");
    shard["file"].as_str().unwrap().to_string()
}

#[test]
fn a_damaged_shard_of_one_ranks_experts_is_named() {
    let job = Job::new("ep-ckpt-damaged");
    let ckpt = job.s.path("ckpt");
    job.train(EP2_DP2_Z2, 2, &job.s.path("m"), &save(&ckpt));
    let tag = ckpt.join("global_step2");
    let file = expert_shard(&tag, 1);
    assert!(file.starts_with("expert_rank"), "{file}");
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
        // Through the same stores (ep 2) and through resharding (ep 1, ep 4).
        for l in [EP2_DP2_Z2, EP1_DP4_Z1, EP4_Z1] {
            let dir = job.s.path(&format!("{what}_{}", l.ep));
            let f = job.attempt(l, 3, &dir, &format!("{} --resume", save(&ckpt)));
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
