//! Real data through `train`: text that ships with the machine, tokenized by a tokenizer.json,
//! learned below its unigram entropy; a blend of indexed datasets with a split, stopped in
//! the middle of an epoch and resumed in the same and in another layout; a resume that would
//! read other samples refused.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(180);
const LICENSES: &str = "/usr/share/common-licenses";

fn tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tests/fixtures/tokenize/bytelevel")
}

/// Runs `ds-rs CMD`, CMD split as a shell would (a blend is one quoted argument).
fn run_quoted(cmd: &str) -> Finished {
    finish(start_args(&shlex::split(cmd).unwrap()), LIMIT)
}

fn ok(cmd: &str) -> Finished {
    let f = run_quoted(cmd);
    assert!(f.status.success(), "{cmd}\n{}", f.stderr);
    f
}

/// The licence texts as JSON lines, a paragraph a document: Apache-2.0 in `val`, the others
/// in `train`. None when the machine ships no licences.
fn licence_documents(s: &Scratch) -> Option<(PathBuf, PathBuf)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(LICENSES)
        .ok()?
        .map(|e| e.unwrap().path())
        .filter(|p| !p.is_symlink() && p.is_file())
        .collect();
    files.sort();
    let (mut train, mut val) = (String::new(), String::new());
    for f in files {
        let text = std::fs::read_to_string(&f).ok()?;
        let out = match f.file_name().unwrap() == "Apache-2.0" {
            true => &mut val,
            false => &mut train,
        };
        for para in text.split("\n\n").filter(|p| !p.trim().is_empty()) {
            out.push_str(&serde_json::json!({ "text": para }).to_string());
            out.push('\n');
        }
    }
    (!val.is_empty()).then(|| (s.write("train.jsonl", &train), s.write("val.jsonl", &val)))
}

/// The unigram entropy (nats) of the uint16 tokens of the dataset cached beside `text`:
/// what the best model that ignores context reaches on them.
fn unigram_entropy(text: &Path) -> f64 {
    let dir = text.parent().unwrap();
    let stem = text.file_name().unwrap().to_string_lossy().to_string();
    let bin = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(&format!("{stem}.ds-rs-")) && n.ends_with("_text_document.bin")
        })
        .expect("the tokenized cache beside the text");
    let bytes = std::fs::read(bin).unwrap();
    let mut counts = vec![0u64; 1 << 16];
    for c in bytes.chunks_exact(2) {
        counts[u16::from_le_bytes([c[0], c[1]]) as usize] += 1;
    }
    let n = (bytes.len() / 2) as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| -(c as f64 / n) * (c as f64 / n).ln())
        .sum()
}

#[test]
fn licence_text_trains_below_its_unigram_entropy() {
    let s = Scratch::new("real-text");
    let Some((train, val)) = licence_documents(&s) else {
        eprintln!("skipped: no licence texts under {LICENSES} to train on");
        return;
    };
    let model = s.write(
        "m.json",
        r#"{"V": 1024, "T": 64, "d": 128, "H": 4, "L": 2}"#,
    );
    let config = s.write(
        "ds.json",
        r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 16,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 20, "total_num_steps": 120}}}"#,
    );
    let cmd = format!(
        "train --config {} --model {} --data {} --eval-data {} --tokenizer {} --steps 120 \
         --eval-interval 0 --eval-batches 4 --metrics-dir {}",
        config.display(),
        model.display(),
        train.display(),
        val.display(),
        tokenizer().display(),
        s.path("m").display()
    );
    let f = ok(&cmd);
    let floor = unigram_entropy(&val);
    let loss = eval_loss(&s.path("m"));
    assert!(
        loss < floor - 0.1,
        "validation loss {loss} is not below the validation text's unigram entropy {floor}\n{}",
        f.stdout
    );
    assert!(f.stdout.contains("epochs)"), "{}", f.stdout);
}

/// The blend and split the resume test trains on: the two tokenizer fixtures' datasets
/// (megatron-core's bytes), weighted 0.3 / 0.7, 90% of each document range for training.
fn blend_args() -> String {
    let f = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tests/fixtures/tokenize");
    format!(
        "--data \"0.3 {} 0.7 {}\" --split 90,10",
        f.join("bytelevel/eod_text_document").display(),
        f.join("sentencepiece/eod_text_document").display()
    )
}

fn blend_train(s: &Scratch, layout: &str, steps: u64, save: &str, metrics: &str) -> Finished {
    let config = s.write("ds.json", &config(1, ""));
    let model = s.write("m.json", r#"{"V": 1024, "T": 32, "d": 64, "H": 2, "L": 2}"#);
    ok(&format!(
        "launch --nproc_per_node 4 --config {} train {layout} --model {} {} --steps {steps} \
         --eval-interval 0 --eval-batches 1 --save-dir {} --resume --metrics-dir {}",
        config.display(),
        model.display(),
        blend_args(),
        s.path(save).display(),
        s.path(metrics).display()
    ))
}

#[test]
fn a_blend_resumes_at_the_next_sample_in_any_layout() {
    let s = Scratch::new("real-resume");
    // straight: 6 steps at tp2 x dp2
    blend_train(&s, "--tp 2", 6, "straight", "m-straight");
    let straight = losses(&s.path("m-straight"));
    assert_eq!(straight.len(), 6);
    // 3 steps at tp2 x dp2 (24 samples of an epoch of more than 400: mid-epoch), then the
    // rest in the same layout, and from the same checkpoint at dp4
    blend_train(&s, "--tp 2", 3, "ckpt", "m-first");
    std::fs::create_dir_all(s.path("ckpt4")).unwrap();
    copy_dir(&s.path("ckpt"), &s.path("ckpt4"));
    let f = blend_train(&s, "--tp 2", 6, "ckpt", "m-same");
    assert!(
        f.stdout.contains("at step 3, epoch 0, sample 24 of"),
        "{}",
        f.stdout
    );
    blend_train(&s, "--tp 1", 6, "ckpt4", "m-dp4");
    let first = losses(&s.path("m-first"));
    assert_eq!(first, straight[..3], "the first three steps");
    // the same layout continues bit for bit
    assert_eq!(
        losses(&s.path("m-same")),
        straight[3..],
        "resumed at tp2 x dp2"
    );
    // dp4 reads the same samples; its products are summed in another order than tp2's
    assert_same_losses(
        &losses(&s.path("m-dp4")),
        &straight[3..],
        1e-5,
        "resumed at dp4",
    );

    // A resume that would read other samples is refused, naming what changed.
    let config = s.path("ds.json");
    let f = run_quoted(&format!(
        "train --config {} --model {} {} --split 80,20 --steps 8 --save-dir {} --resume",
        config.display(),
        s.path("m.json").display(),
        blend_args().replace("--split 90,10", ""),
        s.path("ckpt").display()
    ));
    assert!(!f.status.success(), "{}", f.stdout);
    assert!(
        f.stderr.contains("resuming would read other samples")
            && f.stderr
                .contains("split was \"90,10\" and is now \"80,20\""),
        "{}",
        f.stderr
    );
    assert!(!f.stderr.contains("panicked"), "{}", f.stderr);
}

fn copy_dir(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dst = to.join(p.file_name().unwrap());
        if p.is_dir() {
            std::fs::create_dir_all(&dst).unwrap();
            copy_dir(&p, &dst);
        } else {
            std::fs::copy(&p, &dst).unwrap();
        }
    }
}

/// Each bad data argument is one error line naming what is wrong, before any step.
#[test]
fn bad_data_arguments_are_named() {
    let s = Scratch::new("real-bad");
    let f = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tests/fixtures/tokenize");
    let prefix = f.join("bytelevel/eod_text_document");
    let model = s.write("m.json", r#"{"V": 1024, "T": 32, "d": 64, "H": 2, "L": 1}"#);
    let bad_tokenizer = s.write("tokenizer.json", "{\"model\": ");
    let text = s.write("t.txt", "some text to tokenize");
    let p = prefix.display();
    let cases = [
        (
            format!("--data \"0.3 {p} x {p}\""),
            "blend weight \"x\" is not a number".to_string(),
        ),
        (
            format!("--data {p} --split 100,0,0"),
            "leaves the Validation part empty".to_string(),
        ),
        (
            format!("--data {p} --split 1,a"),
            "--split \"1,a\": \"a\" is not a non-negative number".to_string(),
        ),
        (
            format!(
                "--data {} --tokenizer {}",
                text.display(),
                bad_tokenizer.display()
            ),
            format!(
                "{}: not a tokenizer.json that parses",
                bad_tokenizer.display()
            ),
        ),
    ];
    for (args, why) in cases {
        let cmd = format!("train --model {} {args} --steps 1", model.display());
        let f = run_quoted(&cmd);
        assert!(!f.status.success(), "{cmd}");
        assert!(
            f.stderr.contains(&why),
            "{cmd}: expected {why:?} in\n{}",
            f.stderr
        );
        assert!(!f.stderr.contains("panicked"), "{cmd}: {}", f.stderr);
    }
}

/// Instruction records with prompts and completions of uneven lengths, from the licence
/// paragraphs of the tokenizer fixture's docs.jsonl.
fn instruction_records(s: &Scratch) -> PathBuf {
    let f = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/tests/fixtures/tokenize");
    let docs = std::fs::read_to_string(f.join("docs.jsonl")).unwrap();
    let mut out = String::new();
    for (i, line) in docs.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let Some(text) = v["text"].as_str().filter(|t| t.len() > 40) else {
            continue;
        };
        let words: Vec<&str> = text.split_whitespace().collect();
        let cut = 3 + i % 7;
        let (prompt, completion) = words.split_at(cut.min(words.len() - 1));
        let completion = &completion[..completion.len().min(2 + (i * 5) % 23)];
        let record =
            serde_json::json!({"prompt": prompt.join(" "), "completion": completion.join(" ")});
        out.push_str(&record.to_string());
        out.push('\n');
    }
    s.write("sft.jsonl", &out)
}

/// With only completions counted, the loss is the mean over the global batch's counted
/// targets: the same at dp1 with micro-batch 8, dp2 with micro-batch 2 x 2 accumulation, and
/// tp2 with micro-batch 4 x 2, though each micro-batch counts a different number of tokens
/// (a mean per micro-batch, averaged, would differ between these).
#[test]
fn instruction_data_averages_completion_tokens_over_the_global_batch() {
    let s = Scratch::new("real-sft");
    let data = instruction_records(&s);
    let config = s.write(
        "ds.json",
        r#"{"train_batch_size": 8, "gradient_clipping": 1.0, "steps_per_print": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}"#,
    );
    let model = s.write("m.json", r#"{"V": 1024, "T": 48, "d": 64, "H": 2, "L": 2}"#);
    let run_layout = |tag: &str, layout: &str, extra: &str| {
        ok(&format!(
            "launch --config {} {layout} train --model {} --data {} --tokenizer {} {extra} \
             --steps 4 --eval-interval 0 --eval-batches 1 --metrics-dir {}",
            config.display(),
            model.display(),
            data.display(),
            tokenizer().display(),
            s.path(tag).display()
        ));
        losses(&s.path(tag))
    };
    for packing in ["", "--packing"] {
        let one = run_layout(
            "dp1",
            "--nproc_per_node 1",
            &format!("--micro-batch 8 {packing}"),
        );
        let dp2 = run_layout(
            "dp2",
            "--nproc_per_node 2",
            &format!("--micro-batch 2 {packing}"),
        );
        let tp2 = run_layout(
            "tp2",
            "--nproc_per_node 2",
            &format!("--tp 2 --micro-batch 4 {packing}"),
        );
        assert_same_losses(&dp2, &one, 1e-5, &format!("dp2 {packing}"));
        assert_same_losses(&tp2, &one, 1e-5, &format!("tp2 {packing}"));
    }
}
