//! Chat templates against transformers' apply_chat_template (jinja2): fixtures/tokenize's
//! gen_chat.py rendered each conversation of chat.jsonl with ChatML (bytelevel/) and
//! Mistral's instruct template (sentencepiece/: bos_token, `.strip()`, raise_exception), and
//! cut it into the text before each assistant turn and the turn. ds-rs renders the same text
//! through minijinja, cuts the same segments, and its instruction tokens are Python
//! `tokenizers`' ids of those segments, with exactly the assistant turns counted.

mod common;

use common::Scratch;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ds_data::{ChatTemplate, InstructionTokens, TextTokenizer, TokenSource};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenize")
}

fn conversations() -> Vec<Vec<Value>> {
    let text = std::fs::read_to_string(fixtures().join("chat.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["messages"].as_array().unwrap().clone()
        })
        .collect()
}

#[test]
fn conversations_render_and_cut_as_transformers_does() {
    for name in ["bytelevel", "sentencepiece"] {
        let dir = fixtures().join(name);
        let template = ChatTemplate::beside(&dir.join("tokenizer.json"))
            .unwrap()
            .unwrap();
        let tokenizer = TextTokenizer::open(&dir).unwrap();
        let text = std::fs::read_to_string(dir.join("chat_expected.json")).unwrap();
        let expected: Vec<Value> = serde_json::from_str(&text).unwrap();
        let (mut want_ids, mut want_counted) = (Vec::new(), Vec::new());
        for (messages, want) in conversations().iter().zip(&expected) {
            assert_eq!(
                template.render(messages, false).unwrap(),
                want["full"],
                "{name}"
            );
            let want_segments: Vec<(String, bool)> = want["segments"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["text"] != "")
                .map(|s| {
                    (
                        s["text"].as_str().unwrap().into(),
                        s["counted"].as_bool().unwrap(),
                    )
                })
                .collect();
            let got = template.segments(messages).unwrap();
            assert_eq!(got, want_segments, "{name}");
            for s in want["segments"].as_array().unwrap() {
                let ids: Vec<u32> = serde_json::from_value(s["ids"].clone()).unwrap();
                let text = s["text"].as_str().unwrap();
                assert_eq!(tokenizer.encode(text).unwrap(), ids, "{name}: {text:?}");
                want_counted.extend(std::iter::repeat_n(
                    s["counted"].as_bool().unwrap(),
                    ids.len(),
                ));
                want_ids.extend(ids);
            }
        }
        // the instruction source of chat.jsonl holds those ids, the assistant turns counted
        // (tokenized into a cache beside a copy of the records)
        let s = Scratch::new(&format!("chat-{name}"));
        let records = s.0.join("chat.jsonl");
        std::fs::copy(fixtures().join("chat.jsonl"), &records).unwrap();
        let tokens: Arc<dyn TokenSource> =
            Arc::new(InstructionTokens::open(&records, &tokenizer).unwrap());
        let mut ids = vec![0; tokens.len()];
        let mut counted = vec![false; tokens.len()];
        tokens.read(0, &mut ids).unwrap();
        tokens.read_loss_mask(0, &mut counted).unwrap();
        assert_eq!((ids, counted), (want_ids, want_counted), "{name}");
        assert_eq!(
            tokens.document_starts().unwrap().len(),
            conversations().len() + 1
        );
    }
}

#[test]
fn a_template_that_raises_is_an_error_naming_it() {
    let dir = fixtures().join("sentencepiece");
    let template = ChatTemplate::beside(&dir.join("tokenizer.json"))
        .unwrap()
        .unwrap();
    let wrong = vec![serde_json::json!({"role": "assistant", "content": "I speak first."})];
    let e = template.render(&wrong, false).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer_config.json") && e.contains("Conversation roles must alternate"),
        "{e}"
    );
}
