//! Every `sh` block of README.md and docs/*.md, run as a reader would run it, so the documents
//! stay true. Each block runs in a fresh directory holding the files the documents name
//! (ds.json, MODEL_DIR, train.txt, ...: see `sandbox`), in a short form: the step counts
//! and save intervals scaled down, a few steps where none is given, small messages for `bench
//! comm` (see `short_form`). A block tagged `sh not-run: WHY` needs what CI lacks (other hosts,
//! a GPU, an MPI build); its ds-rs commands are parsed (DS_RS_CHECK_ARGS) and its scripts must
//! exist. `cargo build`/`cargo install` and `scripts/test.sh` are what CI itself runs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(300);

/// One command line of a block.
struct Line {
    file: String,
    number: usize,
    text: String,
}

/// The `sh` blocks of `path`: (reason it is not run, if tagged so; its command lines).
fn blocks(path: &Path, file: &str) -> Vec<(Option<String>, Vec<Line>)> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = Vec::new();
    let mut current: Option<(Option<String>, Vec<Line>)> = None;
    let mut pending = String::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if let Some(info) = line.strip_prefix("```") {
            match current.take() {
                Some(block) => out.push(block),
                None if info.starts_with("sh") => {
                    let why = info
                        .split_once("not-run:")
                        .map(|(_, w)| w.trim().to_string());
                    current = Some((why, Vec::new()));
                }
                None => current = Some((Some("not sh".into()), Vec::new())),
            }
            continue;
        }
        let Some((_, lines)) = &mut current else {
            continue;
        };
        let code = strip_comment(line);
        if let Some(head) = code.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        let whole = format!("{pending}{code}").trim().to_string();
        pending.clear();
        if !whole.is_empty() {
            lines.push(Line {
                file: file.to_string(),
                number: i + 1,
                text: whole,
            });
        }
    }
    out.retain(|(why, _)| why.as_deref() != Some("not sh"));
    out
}

/// `line` without a trailing `# comment` (a `#` after whitespace, outside quotes).
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev.is_whitespace() => return line[..i].trim_end(),
            _ => {}
        }
        prev = c;
    }
    line
}

/// The files the documents' commands name, in a fresh directory.
fn sandbox(s: &Scratch) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["configs", "scripts"] {
        std::os::unix::fs::symlink(root.join(dir), s.path(dir)).unwrap();
    }
    let examples = root.join("configs/examples");
    let real = root.join("configs/tests/fixtures/real");
    let deepspeed = root.join("tests/fixtures/deepspeed");
    let tokenizer = root.join("data/tests/fixtures/tokenize/bytelevel");
    let copies = [
        (deepspeed.join("zero1_bf16.json"), "ds.json"),
        (examples.join("zero3.json"), "zero3.json"),
        (examples.join("zero1.json"), "zero1.json"),
        (examples.join("zero2.json"), "ds_config.json"),
        (examples.join("zero3_offload.json"), "my_ds_config.json"),
        (
            real.join("huggingface__transformers__tests__deepspeed__ds_config_zero2.json"),
            "ds_config_zero2.json",
        ),
        (
            real.join("huggingface__transformers__tests__deepspeed__ds_config_zero3.json"),
            "hf_config_with_auto.json",
        ),
        (deepspeed.join("model.json"), "m.json"),
        (tokenizer.join("tokenizer.json"), "tokenizer.json"),
        (
            tokenizer.join("tokenizer_config.json"),
            "tokenizer_config.json",
        ),
    ];
    for (from, to) in copies {
        std::fs::copy(&from, s.path(to)).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    }
    copy_dir(&deepspeed.join("zero1_bf16"), &s.path("ds_ckpt"));
    for dir in ["MODEL_DIR", "DIR", "path/to/model"] {
        model_dir(root, &s.path(dir));
    }
    let text = sentences(400);
    for name in ["train.txt", "valid.txt", "input.txt"] {
        s.write(name, &text);
    }
    // enough documents that a 1% validation split holds a window of 1025 tokens
    let jsonl: Vec<String> = sentences(12_000)
        .lines()
        .map(|l| serde_json::json!({ "text": l }).to_string())
        .collect();
    for name in ["corpus.jsonl", "notes.jsonl", "val.jsonl"] {
        s.write(name, &jsonl.join("\n"));
    }
    let tokens: Vec<u8> = (0..40_000u32)
        .flat_map(|i| ((i * 37 % 500) as u16).to_le_bytes())
        .collect();
    std::fs::write(s.path("heldout.bin"), tokens).unwrap();
    // the blend's second dataset, made the way the page makes the first
    let made = Command::new(BIN)
        .current_dir(&s.0)
        .args([
            "data",
            "preprocess",
            "--input",
            "corpus.jsonl",
            "--tokenizer",
            "tokenizer.json",
        ])
        .args(["--output-prefix", "data/web", "--append-eod"])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
}

/// A Llama directory as transformers writes one (the fixture's config.json), sized for the
/// byte-level tokenizer and 1024 positions, with that tokenizer.
fn model_dir(root: &Path, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let text = std::fs::read_to_string(root.join("models/tests/fixtures/hf/llama/config.json"));
    let mut config: serde_json::Value = serde_json::from_str(&text.unwrap()).unwrap();
    config["vocab_size"] = 1088.into();
    config["max_position_embeddings"] = 1024.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tokenizer = root.join("data/tests/fixtures/tokenize/bytelevel");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer.join(file), dir.join(file)).unwrap();
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        match e.file_type().unwrap().is_dir() {
            true => copy_dir(&e.path(), &to.join(e.file_name())),
            false => drop(std::fs::copy(e.path(), to.join(e.file_name())).unwrap()),
        }
    }
}

/// `n` lines of words drawn by a fixed rule.
fn sentences(n: usize) -> String {
    let words = [
        "the", "model", "learns", "a", "rule", "from", "data", "and", "then", "stops",
    ];
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let line: Vec<&str> = (0..6 + i % 17)
                .map(|j| words[(i * 7 + j * 3) % 10])
                .collect();
            line.join(" ")
        })
        .collect();
    lines.join("\n")
}

/// The flags whose numbers are scaled down in the short form, and to at least what.
const STEP_FLAGS: [(&str, u64); 8] = [
    ("--steps", 2),
    ("--max_steps", 2),
    ("--max-steps", 2),
    ("--save-interval", 1),
    ("--save_steps", 1),
    ("--logging_steps", 1),
    ("--eval_steps", 1),
    ("--eval-interval", 1),
];

/// `words` in the short form: step counts / 250, a few steps where the command trains without
/// a count, small messages for `bench comm`, a small Adam for `bench adam`.
fn short_form(words: &mut Vec<String>, example: bool) {
    for i in 1..words.len() {
        if let Some((_, floor)) = STEP_FLAGS.iter().find(|(f, _)| *f == words[i - 1]) {
            if let Ok(n) = words[i].parse::<u64>() {
                words[i] = (n / 250).max(*floor).to_string();
            }
        }
    }
    let has = |w: &Vec<String>, f: &str| w.iter().any(|x| x == f);
    let trains = example
        || words
            .iter()
            .any(|w| w == "train" || w.contains("/release/examples/"));
    let counted = ["--steps", "--max_steps", "--epochs"]
        .iter()
        .any(|f| has(words, f));
    if trains && !counted {
        words.extend(["--steps".into(), "2".into()]);
    }
    if has(words, "comm") && !has(words, "--max-bytes") {
        words.extend(["--max-bytes".into(), "64K".into()]);
    }
    let adam = has(words, "adam");
    if let Some(i) = words.iter().position(|w| w == "--params").filter(|_| adam) {
        let n = words[i + 1..]
            .iter()
            .take_while(|w| !w.starts_with("--"))
            .count();
        words.splice(i + 1..i + 1 + n, ["1M".to_string()]);
    }
}

/// What a documented program runs as here: ds-rs itself, or a built engine example.
fn program(words: &mut Vec<String>, examples: &dyn Fn(&str) -> PathBuf) -> Option<PathBuf> {
    let first = words.first()?.clone();
    let example = |w: &str| w.strip_prefix("target/release/examples/").map(examples);
    if first == "ds-rs" || first.ends_with("/release/ds-rs") {
        words.remove(0);
    } else if words.starts_with(&[
        "cargo".into(),
        "run".into(),
        "--release".into(),
        "--".into(),
    ]) {
        words.drain(..4);
    } else if first == "cargo" && words.iter().any(|w| w == "--example") && words[1] == "run" {
        let i = words.iter().position(|w| w == "--example").unwrap();
        let exe = examples(&words[i + 1]);
        let rest = words
            .iter()
            .position(|w| w == "--")
            .map_or(vec![], |j| words[j + 1..].to_vec());
        *words = rest;
        return Some(exe);
    } else if let Some(exe) = example(&first) {
        words.remove(0);
        return Some(exe);
    } else {
        return None;
    }
    for w in words.iter_mut() {
        if let Some(exe) = example(w) {
            *w = exe.display().to_string();
        }
    }
    Some(PathBuf::from(BIN))
}

/// Leading `VAR=value` words, taken off.
fn env_prefix(words: &mut Vec<String>) -> Vec<(String, String)> {
    let n = words
        .iter()
        .take_while(|w| {
            w.split_once('=')
                .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
        })
        .count();
    words
        .drain(..n)
        .map(|w| {
            let (k, v) = w.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Commands a page may use to prepare a file, run with `sh -c`.
const SHELL_TOOLS: [&str; 4] = ["printf", "echo", "mkdir", "cp"];

/// What CI runs itself rather than this test.
fn run_by_ci(words: &[String]) -> bool {
    matches!(words.first().map(String::as_str), Some("cargo"))
        && matches!(words.get(1).map(String::as_str), Some("build" | "install"))
        || words.first().is_some_and(|w| w == "scripts/test.sh")
}

fn run_line(line: &Line, dir: &Path, check_only: bool, examples: &dyn Fn(&str) -> PathBuf) {
    let at = format!("{}:{}: {}", line.file, line.number, line.text);
    let mut words = shlex::split(&line.text).unwrap_or_else(|| panic!("{at}: unbalanced quotes"));
    let env = env_prefix(&mut words);
    if run_by_ci(&words) {
        return;
    }
    if words[0] == "mpirun" {
        let i = words
            .iter()
            .position(|w| w.ends_with("ds-rs"))
            .expect("mpirun of ds-rs");
        words.drain(..i);
    }
    if words[0] == "python" {
        words.remove(0);
    }
    // the shell's own small tools (a hostfile written with printf): run as the shell runs them
    if SHELL_TOOLS.contains(&words[0].as_str()) {
        let sh = Command::new("sh")
            .arg("-c")
            .arg(&line.text)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            sh.status.success(),
            "{at}: {}",
            String::from_utf8_lossy(&sh.stderr)
        );
        return;
    }
    let Some(exe) = program(&mut words, examples) else {
        // a script of the repository: it must be there to run
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(&words[0]);
        assert!(script.is_file(), "{at}: no such file {}", script.display());
        assert!(
            check_only || words[0].starts_with("scripts/"),
            "{at}: not a command this test knows"
        );
        return;
    };
    short_form(&mut words, exe != Path::new(BIN));
    let mut cmd = Command::new(&exe);
    cmd.args(&words).current_dir(dir).envs(env);
    if check_only {
        cmd.env("DS_RS_CHECK_ARGS", "1");
    }
    let f = finish(spawn_captured(&mut cmd), LIMIT);
    // a command for a feature this build lacks (the MPI backend) names the build it needs
    let other_build = check_only && f.stderr.contains("was built without");
    assert!(
        f.status.success() || other_build,
        "{at}\nran: {} {}\n{}\n{}",
        exe.display(),
        words.join(" "),
        tail(&f.stdout),
        tail(&f.stderr)
    );
}

/// The last lines of `text`, and its error lines (a rank's, among the others' output).
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let errors = lines.iter().filter(|l| l.contains("error"));
    let last = &lines[lines.len().saturating_sub(15)..];
    errors.chain(last).copied().collect::<Vec<_>>().join("\n")
}

#[test]
fn every_documented_command_runs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    // DS_RS_DOCS=docs/data.md: that page alone (while editing it)
    if let Ok(only) = std::env::var("DS_RS_DOCS") {
        files.retain(|f| f.ends_with(&only));
    }
    let examples = |name: &str| example_exe(name).clone();
    let (mut ran, mut checked) = (0, 0);
    for path in files {
        let file = path.strip_prefix(root).unwrap().display().to_string();
        for (i, (why, lines)) in blocks(&path, &file).into_iter().enumerate() {
            let s = Scratch::new(&format!("docs-{}-{i}", file.replace(['/', '.'], "-")));
            sandbox(&s);
            for line in &lines {
                run_line(line, &s.0, why.is_some(), &examples);
            }
            match why {
                Some(why) => {
                    checked += lines.len();
                    println!("{file}: {} parsed, not run: {why}", lines.len());
                }
                None => ran += lines.len(),
            }
        }
    }
    println!("{ran} command lines run, {checked} parsed only");
    if std::env::var_os("DS_RS_DOCS").is_none() {
        assert!(
            ran > 30,
            "the documents' runnable commands went missing ({ran})"
        );
    }
}

/// The comments and continuations of a block are read as a shell reads them.
#[test]
fn block_lines_are_read_as_a_shell_reads_them() {
    assert_eq!(strip_comment("ds-rs train   # alone"), "ds-rs train");
    assert_eq!(
        strip_comment("ds-rs train --data \"a # b\""),
        "ds-rs train --data \"a # b\""
    );
    let mut w: Vec<String> = [
        "ds-rs",
        "train",
        "--steps",
        "1000",
        "--save-interval",
        "100",
    ]
    .map(String::from)
    .into();
    let exe = program(&mut w, &|n| PathBuf::from(n)).unwrap();
    short_form(&mut w, false);
    assert_eq!(exe, PathBuf::from(BIN));
    assert_eq!(w, ["train", "--steps", "4", "--save-interval", "1"]);
}
