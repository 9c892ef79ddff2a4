//! `preprocess` against the Python reference implementations (fixtures/tokenize, written by
//! gen_tokenize.py with the peer's Python): for a byte-level BPE and a SentencePiece-style
//! tokenizer trained on the licence texts, ds-rs's ids equal Python `tokenizers`' for every
//! sentence, and the datasets written equal megatron-core's IndexedDatasetBuilder's byte for
//! byte (built as Megatron's preprocess_data.py builds them, with --append-eod), whatever
//! the number of workers and however the input is cut into files.

mod common;

use common::Scratch;
use std::path::{Path, PathBuf};

use ds_data::{input_files, output_prefix, preprocess, PreprocessJob, TextTokenizer};
use serde_json::Value;

const TOKENIZERS: [&str; 2] = ["bytelevel", "sentencepiece"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenize")
}

fn job(inputs: Vec<PathBuf>, out: &Path, workers: usize) -> PreprocessJob {
    PreprocessJob {
        inputs,
        json_keys: vec!["text".into()],
        output_prefix: out.to_path_buf(),
        append_eod: true,
        workers,
    }
}

#[test]
fn ids_equal_python_tokenizers() {
    let docs = std::fs::read_to_string(fixtures().join("docs.jsonl")).unwrap();
    for name in TOKENIZERS {
        let tok = TextTokenizer::open(&fixtures().join(name)).unwrap();
        let want: Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join(name).join("ids.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(tok.vocab_size() as u64, want["vocab"].as_u64().unwrap());
        assert_eq!(tok.eod().map(u64::from), want["eod"].as_u64());
        let ids = want["ids"].as_array().unwrap();
        assert_eq!(ids.len(), docs.lines().count());
        for (line, doc_ids) in docs.lines().zip(ids) {
            let doc: Value = serde_json::from_str(line).unwrap();
            let sentences: Vec<&str> = match &doc["text"] {
                Value::String(s) => vec![s],
                Value::Array(a) => a.iter().map(|s| s.as_str().unwrap()).collect(),
                other => panic!("{other}"),
            };
            for (s, want) in sentences.iter().zip(doc_ids.as_array().unwrap()) {
                let want: Vec<u32> = serde_json::from_value(want.clone()).unwrap();
                assert_eq!(tok.encode(s).unwrap(), want, "{name}: {s:?}");
            }
        }
    }
}

/// docs.jsonl cut into files of `per_file` lines, named so that they sort in order.
fn cut(docs: &str, dir: &Path, per_file: usize) -> PathBuf {
    let lines: Vec<&str> = docs.lines().collect();
    let input = dir.join("input");
    std::fs::create_dir_all(&input).unwrap();
    for (i, part) in lines.chunks(per_file).enumerate() {
        std::fs::write(
            input.join(format!("part-{i:03}.jsonl")),
            part.join("\n") + "\n",
        )
        .unwrap();
    }
    input
}

#[test]
fn datasets_equal_megatron_cores_bytes() {
    let s = Scratch::new("preprocess");
    let docs = std::fs::read_to_string(fixtures().join("docs.jsonl")).unwrap();
    let split = cut(&docs, &s.0, 7);
    for name in TOKENIZERS {
        let tok = TextTokenizer::open(&fixtures().join(name)).unwrap();
        let cases = [
            (vec![fixtures().join("docs.jsonl")], 1),
            (input_files(&split).unwrap(), 3),
        ];
        for (i, (inputs, workers)) in cases.into_iter().enumerate() {
            let out = s.0.join(format!("{name}-{i}"));
            let report = preprocess(&job(inputs, &out, workers), &tok, |_, _| {}).unwrap();
            assert_eq!(report.documents as usize, docs.lines().count());
            assert_eq!(report.bytes as usize, docs.len());
            let prefix = output_prefix(&out, "text");
            for ext in ["bin", "idx"] {
                let want = std::fs::read(
                    fixtures()
                        .join(name)
                        .join(format!("eod_text_document.{ext}")),
                );
                let got = std::fs::read(prefix.with_extension(ext)).unwrap();
                assert!(
                    got == want.unwrap(),
                    "{name} case {i}: .{ext} differs from megatron-core's"
                );
            }
        }
    }
}

/// Each bad input is one error naming the file (and line), and nothing is left written.
#[test]
fn bad_inputs_are_named_and_leave_nothing() {
    let s = Scratch::new("preprocess-bad");
    let tok = TextTokenizer::open(&fixtures().join("bytelevel")).unwrap();
    let out = s.0.join("out");
    let write = |name: &str, text: &str| {
        let p = s.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let cases = [
        (
            write("nokey.jsonl", "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n"),
            "nokey.jsonl:2: no key \"text\"",
        ),
        (
            write("notjson.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \n"),
            "notjson.jsonl:3: not a JSON line",
        ),
        (
            write("number.jsonl", "{\"text\": 5}\n"),
            "number.jsonl:1: key \"text\" holds 5",
        ),
    ];
    for (input, why) in cases {
        let e = preprocess(&job(vec![input], &out, 2), &tok, |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(why), "{e}");
        let left: Vec<_> = std::fs::read_dir(&s.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("out"))
            .collect();
        assert!(left.is_empty(), "{why}: left {left:?}");
    }
    let bad = write("tokenizer.json", "{\"version\": \"1.0\", \"model\": 3}");
    let e = TextTokenizer::open(&bad).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.json: not a tokenizer.json that parses"),
        "{e}"
    );
    // No eos token known: --append-eod is refused up front, naming the tokenizer.
    std::fs::copy(fixtures().join("bytelevel/tokenizer.json"), &bad).unwrap();
    let bare = TextTokenizer::open(&bad).unwrap();
    let e = preprocess(
        &job(vec![fixtures().join("docs.jsonl")], &out, 1),
        &bare,
        |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--append-eod needs an end-of-document token"),
        "{e}"
    );
    let e = bare.with_eod_token("<|nope|>").unwrap_err().to_string();
    assert!(e.contains("\"<|nope|>\" is not in the vocabulary"), "{e}");
}
