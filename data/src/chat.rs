//! Chat templates: a conversation of `messages` rendered to text as transformers'
//! `apply_chat_template` renders it (the Jinja template of tokenizer_config.json, or of a
//! `chat_template.jinja` beside it; trim_blocks and lstrip_blocks, `raise_exception`,
//! `tojson`, the tokenizer's special tokens as variables, Python's string methods), through
//! minijinja.
//!
//! For training, a conversation is cut into segments: the text before each assistant turn
//! (the conversation so far rendered with `add_generation_prompt`), which does not count in
//! the loss, and the assistant turn (what rendering through it adds), which does.

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

use super::error::{DataError, Result};

/// A tokenizer's chat template and the special tokens it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// bos_token, eos_token, ... as tokenizer_config.json names them.
    tokens: Vec<(String, String)>,
    path: PathBuf,
}

fn invalid(path: &Path, what: impl std::fmt::Display) -> DataError {
    DataError::Invalid(format!("{}: {what}", path.display()))
}

/// A special token of tokenizer_config.json: a string, or an added token's `content`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// The chat template beside `tokenizer_json` (tokenizer_config.json's `chat_template`, a
    /// string or the "default" of a list, else chat_template.jinja), or None.
    pub fn beside(tokenizer_json: &Path) -> Result<Option<ChatTemplate>> {
        let config = tokenizer_json.with_file_name("tokenizer_config.json");
        let json: Json = match std::fs::read_to_string(&config) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| invalid(&config, format!("not JSON that parses: {e}")))?,
            Err(_) => Json::Null,
        };
        let jinja = tokenizer_json.with_file_name("chat_template.jinja");
        let (source, path) = match json.get("chat_template") {
            Some(Json::String(s)) => (s.clone(), config.clone()),
            Some(Json::Array(list)) => {
                let default = list
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"));
                let text = default
                    .and_then(|t| t.get("template"))
                    .and_then(Json::as_str);
                let text = text.ok_or_else(|| {
                    invalid(&config, "chat_template lists no template named \"default\"")
                })?;
                (text.to_string(), config.clone())
            }
            _ => match std::fs::read_to_string(&jinja) {
                Ok(text) => (text, jinja),
                Err(_) => return Ok(None),
            },
        };
        let tokens = [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
        ]
        .iter()
        .filter_map(|k| Some((k.to_string(), token_text(json.get(*k)?)?)))
        .collect();
        Ok(Some(ChatTemplate {
            env: environment(source).map_err(|e| invalid(&path, format!("chat_template: {e}")))?,
            tokens,
            path,
        }))
    }

    /// `messages` (a JSON array of {role, content}) rendered to text.
    pub fn render(&self, messages: &[Json], add_generation_prompt: bool) -> Result<String> {
        let mut ctx: std::collections::BTreeMap<String, Value> = self
            .tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let template = self
            .env
            .get_template("chat")
            .expect("added at construction");
        template
            .render(ctx)
            .map_err(|e| invalid(&self.path, format!("rendering the chat template: {e}")))
    }

    /// The conversation as segments of text, each counted in the loss (an assistant turn) or
    /// not; they join to the whole rendered conversation.
    pub fn segments(&self, messages: &[Json]) -> Result<Vec<(String, bool)>> {
        let (mut out, mut done) = (Vec::new(), String::new());
        let not_prefix = || {
            invalid(
                &self.path,
                "the chat template renders a conversation that does not start with its \
                 earlier turns, so the assistant turns cannot be told apart",
            )
        };
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(Json::as_str) != Some("assistant") {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let upto = self.render(&messages[..=i], false)?;
            let (Some(prompt), Some(turn)) =
                (before.strip_prefix(&done), upto.strip_prefix(&before))
            else {
                return Err(not_prefix());
            };
            out.push((prompt.to_string(), false));
            out.push((turn.to_string(), true));
            done = upto;
        }
        let full = self.render(messages, false)?;
        let rest = full.strip_prefix(&done).ok_or_else(not_prefix)?;
        out.push((rest.to_string(), false));
        out.retain(|(t, _)| !t.is_empty());
        Ok(out)
    }
}

/// transformers' Jinja environment (`_compile_jinja_template`): trim_blocks, lstrip_blocks,
/// `raise_exception`, a `tojson` that leaves non-ASCII and HTML characters as they are, and
/// Python's string and dict methods.
fn environment(source: String) -> std::result::Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_filter(
        "tojson",
        |v: Value| -> std::result::Result<String, minijinja::Error> {
            serde_json::to_string(&v)
                .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))
        },
    );
    env.add_template_owned("chat", source)?;
    Ok(env)
}
