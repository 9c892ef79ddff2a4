//! Checkpoints end to end with the real binary: exact resume, loading into other layouts,
//! consolidation checked by Python's safetensors, corrupted files named, and crashes (SIGKILL
//! mid-save, launcher restarts) that lose nothing.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(240);

fn launch(nproc: usize, cfg: &Path) -> String {
    format!("launch --nproc_per_node {nproc} --config {}", cfg.display())
}

fn ok(cmd: &str) -> Finished {
    let f = run(cmd, LIMIT);
    assert!(f.status.success(), "{cmd}: {}", f.stderr);
    f
}

/// A 2-rank job of `steps` steps saving into `ckpt` after every one.
fn saving_every_step(
    cfg: &Path,
    model: &Path,
    steps: u64,
    metrics: &Path,
    ckpt: &Path,
    extra: &str,
) -> Finished {
    let cmd = format!(
        "{} {} --save-dir {} --save-interval 1 {extra}",
        launch(2, cfg),
        train(model, steps, metrics),
        ckpt.display()
    );
    run(&cmd, LIMIT)
}

/// `ds-rs checkpoint consolidate` of `dir`'s latest into `out`; returns the file's bytes.
fn consolidate(dir: &Path, out: &Path) -> Vec<u8> {
    ok(&format!(
        "checkpoint consolidate {} --out {}",
        dir.display(),
        out.display()
    ));
    std::fs::read(out).unwrap()
}

/// Training 6 steps straight and 3 + (stop, resume) 3 give the same losses and parameters,
/// bit for bit: the same layout computes the same operations in the same order.
fn exact_resume(stage: u8, extra: &str) {
    let s = Scratch::new(&format!("ckpt-resume-{stage}"));
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("cfg.json", &config(stage, extra));
    let (straight, split) = (s.path("straight"), s.path("split"));
    let save = |dir: &PathBuf| format!("--save-dir {}", dir.join("ckpt").display());
    ok(&format!(
        "{} {} {}",
        launch(2, &cfg),
        train(&model, 6, &straight),
        save(&straight)
    ));
    ok(&format!(
        "{} {} {}",
        launch(2, &cfg),
        train(&model, 3, &split),
        save(&split)
    ));
    let resumed = ok(&format!(
        "{} {} {} --resume",
        launch(2, &cfg),
        train(&model, 6, &split),
        save(&split)
    ));
    assert!(resumed.stdout.contains("at step 3"), "{}", resumed.stdout);
    let what = format!("ZeRO-{stage} {extra}");
    assert_eq!(losses(&split), losses(&straight), "{what}: losses");
    let a = consolidate(&straight.join("ckpt"), &s.path("a.safetensors"));
    let b = consolidate(&split.join("ckpt"), &s.path("b.safetensors"));
    assert!(a == b, "{what}: the parameters differ after resuming");
}

#[test]
fn resuming_at_dp2_is_exact_for_every_stage_fp32() {
    for stage in 0..=3 {
        exact_resume(stage, "");
    }
}

#[test]
fn resuming_at_dp2_is_exact_in_bf16() {
    for stage in 0..=3 {
        exact_resume(stage, r#", "bf16": {"enabled": true}"#);
    }
}

#[test]
fn a_dp4_zero3_checkpoint_loads_at_dp2_zero1_and_at_dp1() {
    let s = Scratch::new("ckpt-reshard");
    let model = s.write("model.json", SMALL_MODEL);
    let z3 = s.write("z3.json", &config(3, ""));
    let ckpt = s.path("ckpt");
    // The run that never changes layout: 4 steps at dp 4, ZeRO-3.
    let never = s.path("never");
    ok(&format!("{} {}", launch(4, &z3), train(&model, 4, &never)));
    let want = losses(&never)[3];
    ok(&format!(
        "{} {} --save-dir {}",
        launch(4, &z3),
        train(&model, 3, &s.path("first")),
        ckpt.display()
    ));
    for (name, nproc, stage) in [("dp2z1", 2, 1), ("dp1z0", 1, 0)] {
        let cfg = s.write(&format!("{name}.json"), &config(stage, ""));
        let dir = s.path(name);
        let cmd = format!(
            "{} --save-dir {} --resume",
            train(&model, 4, &dir),
            ckpt.display()
        );
        let f = ok(&format!("{} {cmd}", launch(nproc, &cfg)));
        assert!(
            f.stdout.contains("saved at dp 4 x tp 1 x pp 1 ZeRO-3"),
            "{}",
            f.stdout
        );
        // Only step 4 ran here; fp32 noise: the new layout sums gradients in another order.
        let got = steps(&dir);
        assert_eq!(got.len(), 1, "{name}: {got:?}");
        assert_eq!(got[0]["step"].as_u64(), Some(3));
        let loss = got[0]["loss"].as_f64().unwrap();
        let what = format!("step 4 after loading at {name}");
        assert_same_losses(&[loss], &[want], 1e-5, &what);
        std::fs::remove_dir_all(ckpt.join("global_step4")).unwrap();
        std::fs::write(ckpt.join("latest"), "global_step3").unwrap();
    }
}

#[test]
fn consolidated_weights_equal_the_gathered_ones_and_python_reads_them() {
    let s = Scratch::new("ckpt-consolidate");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z3.json", &config(3, ""));
    let (ckpt, gathered) = (s.path("ckpt"), s.path("gathered.safetensors"));
    let extra = format!(
        "--save-dir {} --save-weights {}",
        ckpt.display(),
        gathered.display()
    );
    ok(&format!(
        "{} {} {extra}",
        launch(2, &cfg),
        train(&model, 3, &s.path("m"))
    ));
    let out = s.path("model.safetensors");
    assert!(consolidate(&ckpt, &out) == std::fs::read(&gathered).unwrap());
    let Ok(python) = std::env::var("DS_RS_PYTHON") else {
        println!("skipped the Python check: DS_RS_PYTHON (a Python with safetensors and numpy) is not set");
        return;
    };
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/checkpoint/check_consolidated.py");
    let py = std::process::Command::new(python)
        .arg(script)
        .args([&out, &gathered, &model])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&py.stdout);
    assert!(
        py.status.success() && said.trim() == "ok",
        "{said}{}",
        String::from_utf8_lossy(&py.stderr)
    );
}

#[test]
fn keep_checkpoints_prunes_the_oldest() {
    let s = Scratch::new("ckpt-prune");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z1.json", &config(1, ""));
    let ckpt = s.path("ckpt");
    let extra = format!(
        "--save-dir {} --save-interval 1 --keep-checkpoints 2",
        ckpt.display()
    );
    ok(&format!(
        "{} {} {extra}",
        launch(2, &cfg),
        train(&model, 5, &s.path("m"))
    ));
    let mut tags: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    tags.sort();
    assert_eq!(tags, ["global_step4", "global_step5"]);
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "global_step5"
    );
}

/// Checkpoint flags without --save-dir once did nothing, silently: each is now refused by
/// the launcher, naming the flag and the one it needs, before any rank starts or writes.
#[test]
fn checkpoint_flags_without_a_save_dir_are_refused_by_name() {
    let s = Scratch::new("ckpt-flags");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z1.json", &config(1, ""));
    for flag in ["--resume", "--save-interval 1", "--keep-checkpoints 2"] {
        let metrics = s.path(&format!("m{}", flag.len()));
        let cmd = format!("{} {} {flag}", launch(2, &cfg), train(&model, 2, &metrics));
        let f = run(&cmd, LIMIT);
        assert!(
            !f.status.success(),
            "{flag} without --save-dir was accepted"
        );
        let name = flag.split(' ').next().unwrap();
        assert!(
            f.stderr.contains(&format!("{name} needs --save-dir")),
            "{flag}: {}",
            f.stderr
        );
        assert!(!f.stderr.contains("panicked"), "{flag}: {}", f.stderr);
        assert!(is_empty_dir(&metrics), "{flag}: a rank started");
    }
}

/// --resume on a --save-dir without checkpoints says so once and trains from step 0.
#[test]
fn resume_on_an_empty_save_dir_says_it_starts_fresh() {
    let s = Scratch::new("ckpt-fresh");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z1.json", &config(1, ""));
    let ckpt = s.path("ckpt");
    let f = ok(&format!(
        "{} {} --save-dir {} --resume",
        launch(2, &cfg),
        train(&model, 2, &s.path("m")),
        ckpt.display()
    ));
    let said = f.stdout.matches("holds no checkpoint yet").count();
    assert_eq!(said, 1, "said {said} times: {}", f.stdout);
    assert_eq!(steps(&s.path("m")).len(), 2);
}

#[test]
fn damaged_checkpoints_are_named_and_nothing_is_trained() {
    let s = Scratch::new("ckpt-damaged");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z2.json", &config(2, ""));
    let ckpt = s.path("ckpt");
    ok(&format!(
        "{} {} --save-dir {}",
        launch(2, &cfg),
        train(&model, 2, &s.path("m")),
        ckpt.display()
    ));
    let tag = ckpt.join("global_step2");
    let shard = tag.join("zero_rank00001.safetensors");
    let pristine = std::fs::read(&shard).unwrap();
    let other = s.write(
        "other.json",
        r#"{"V": 512, "T": 32, "d": 64, "H": 2, "L": 3}"#,
    );
    type Damage = fn(&Path, &[u8]);
    let cases: [(&str, Damage, &Path, &str); 4] = [
        (
            "truncated",
            |p, b| std::fs::write(p, &b[..b.len() / 2]).unwrap(),
            &model,
            "truncated",
        ),
        (
            "corrupted",
            |p, b| {
                let mut b = b.to_vec();
                let i = b.len() - 10;
                b[i] ^= 0x40;
                std::fs::write(p, b).unwrap()
            },
            &model,
            "corrupted",
        ),
        (
            "missing",
            |p, _| std::fs::remove_file(p).unwrap(),
            &model,
            "zero_rank00001.safetensors",
        ),
        ("another model", |_, _| {}, &other, "another model"),
    ];
    for (what, damage, model, needle) in cases {
        damage(&shard, &pristine);
        let dir = s.path(what.replace(' ', "-").as_str());
        let cmd = format!(
            "{} {} --save-dir {} --resume",
            launch(2, &cfg),
            train(model, 3, &dir),
            ckpt.display()
        );
        let f = run(&cmd, LIMIT);
        assert!(!f.status.success(), "{what}");
        // The rank that read the file names it and the problem; the others say which rank.
        let named = f
            .stderr
            .lines()
            .any(|l| l.contains("error:") && l.contains(needle));
        assert!(named, "{what}: {}", f.stderr);
        assert!(!f.stderr.contains("panicked"), "{what}: {}", f.stderr);
        assert!(steps(&dir).is_empty(), "{what}: trained anyway");
        std::fs::write(&shard, &pristine).unwrap();
    }
    let f = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
    assert!(
        f.status.success() && f.stdout.contains("global_step2 (latest)"),
        "{}",
        f.stdout
    );
}

#[test]
fn a_rank_killed_while_saving_never_leaves_latest_incomplete() {
    let s = Scratch::new("ckpt-kill");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z3.json", &config(3, ""));
    let ckpt = s.path("ckpt");
    // Saving every step, a kill lands inside a save (a third of a step's time here) often;
    // different delays hit different moments of it.
    for (attempt, delay_ms) in [0u64, 7, 23, 61, 130].into_iter().enumerate() {
        let dir = s.path(&format!("m{attempt}"));
        let cmd = format!(
            "{} {} --save-dir {} --save-interval 1 --resume",
            launch(2, &cfg),
            train(&model, 100_000, &dir),
            ckpt.display()
        );
        let child = start(&cmd);
        assert!(
            wait_for(LIMIT, || ckpt.join("latest").exists()
                && !steps(&dir).is_empty()),
            "no checkpoint written"
        );
        std::thread::sleep(Duration::from_millis(delay_ms));
        signal(
            rank_pid(dir.to_str().unwrap(), 1).expect("rank 1 is running"),
            "KILL",
        );
        let f = finish(child, Duration::from_secs(15));
        assert!(!f.status.success());
        let inspect = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
        assert!(
            inspect.stdout.contains("(latest): step"),
            "attempt {attempt}: {}",
            inspect.stdout
        );
        let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
        assert!(ckpt.join(latest.trim()).join("manifest.json").exists());
    }
    // The last one loads and training goes on from it.
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    let at: u64 = latest
        .trim()
        .trim_start_matches("global_step")
        .parse()
        .unwrap();
    ok(&format!(
        "{} {} --save-dir {} --resume",
        launch(2, &cfg),
        train(&model, at + 1, &s.path("end")),
        ckpt.display()
    ));
}

#[test]
fn a_restarted_job_resumes_and_ends_like_an_uninterrupted_one() {
    let s = Scratch::new("ckpt-restart");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z2.json", &config(2, ""));
    let (calm, hit) = (s.path("calm"), s.path("hit"));
    let job = |dir: &Path, restarts: u32| {
        format!(
            "launch --nproc_per_node 2 --max_restarts {restarts} --config {} {} --save-dir {} --save-interval 5",
            cfg.display(),
            train(&model, 400, dir),
            dir.join("ckpt").display()
        )
    };
    ok(&job(&calm, 0));
    let child = start(&job(&hit, 1));
    wait_for_steps(&hit, 12);
    signal(
        rank_pid(hit.to_str().unwrap(), 1).expect("rank 1 is running"),
        "KILL",
    );
    let f = finish(child, LIMIT);
    assert!(f.status.success(), "{}", f.stderr);
    assert!(f.stdout.contains("resumed from"), "{}", f.stdout);
    assert_eq!(losses(&hit), losses(&calm));
    let a = consolidate(&calm.join("ckpt"), &s.path("a.safetensors"));
    let b = consolidate(&hit.join("ckpt"), &s.path("b.safetensors"));
    assert!(a == b, "the final parameters differ");
}

/// Note [unpublished tags]: a tag `latest` names is never overwritten; a complete tag newer
/// than `latest` (left by a save killed between its rename and `latest`) is written afresh
/// by the resumed run that reaches its step again.
#[test]
fn published_tags_are_kept_and_unpublished_leftovers_replaced() {
    let s = Scratch::new("ckpt-leftover");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z1.json", &config(1, ""));
    let ckpt = s.path("ckpt");
    let job = |steps: u64, dir: &str, extra: &str| {
        saving_every_step(&cfg, &model, steps, &s.path(dir), &ckpt, extra)
    };
    assert!(job(3, "first", "").status.success());
    // again from the start: global_step1 is published history, refused
    let again = job(3, "again", "");
    assert_eq!(again.status.code(), Some(1), "{}", again.stderr);
    assert!(again.stderr.contains("exists already"), "{}", again.stderr);
    // as if the save of step 3 was killed before `latest` named it
    std::fs::write(ckpt.join("latest"), "global_step2").unwrap();
    let resumed = job(3, "resumed", "--resume");
    assert!(resumed.status.success(), "{}", resumed.stderr);
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    assert_eq!(latest.trim(), "global_step3");
}

/// A save into a disk that fills up (a 3 MB tmpfs holds one 2 MB checkpoint): the job exits
/// non-zero with one error per rank naming the file and the cause, `latest` and the previous
/// checkpoint intact and loadable, the failed save's partial files removed (the space given
/// back), and the metrics of the steps before it kept.
#[test]
fn a_full_disk_fails_the_save_by_name_and_keeps_latest() {
    let s = Scratch::new("ckpt-full");
    let model = s.write("model.json", SMALL_MODEL);
    let cfg = s.write("z3.json", &config(3, ""));
    let disk = match Tmpfs::mount(s.path("disk"), "size=3m") {
        Ok(d) => d,
        Err(why) => {
            println!("skipped: cannot mount a tmpfs ({why}); needs root");
            return;
        }
    };
    let ckpt = disk.0.join("ckpt");
    let full = saving_every_step(&cfg, &model, 4, &s.path("full"), &ckpt, "");
    assert_eq!(full.status.code(), Some(1), "{}", full.stderr);
    let errors: Vec<&str> = (full.stderr.lines())
        .filter(|l| l.contains("] error: "))
        .collect();
    assert_eq!(errors.len(), 2, "one error per rank: {}", full.stderr);
    for e in &errors {
        let saving = "saving checkpoint global_step2";
        assert!(
            e.contains(saving) && e.contains("latest still names global_step1"),
            "{e}"
        );
    }
    // a rank whose own shard still fitted names the one that failed
    let full_disk = |e: &&str| {
        e.contains(".global_step2.partial/zero_rank0000") && e.contains("No space left on device")
    };
    assert!(errors.iter().any(full_disk), "{}", full.stderr);
    for e in errors.iter().filter(|e| !full_disk(e)) {
        assert!(
            e.contains("rank 0 failed") || e.contains("rank 1 failed"),
            "{e}"
        );
    }
    assert!(!full.stderr.contains("panicked"), "{}", full.stderr);
    assert_eq!(
        losses(&s.path("full")).len(),
        2,
        "the trained steps' metrics"
    );
    let mut names: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["global_step1", "latest"],
        "what the failed save left"
    );
    let inspect = run(&format!("checkpoint inspect {}", ckpt.display()), LIMIT);
    assert!(inspect.status.success(), "{}", inspect.stdout);
    assert!(inspect.stdout.contains("global_step1 (latest): step 1"));
    // the checkpoint it kept resumes exactly (from a copy on a disk with room)
    let copy = s.path("copy");
    let cp = std::process::Command::new("cp")
        .args(["-a", ckpt.to_str().unwrap(), copy.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(cp.success());
    let resumed = run(
        &format!(
            "{} {} --save-dir {} --resume",
            launch(2, &cfg),
            train(&model, 2, &s.path("resumed")),
            copy.display()
        ),
        LIMIT,
    );
    assert!(resumed.status.success(), "{}", resumed.stderr);
    assert_eq!(losses(&s.path("resumed")), losses(&s.path("full"))[1..]);
}
