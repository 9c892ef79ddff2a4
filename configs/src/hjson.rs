//! Reads DeepSpeed config files into [`Value`]s. DeepSpeed parses them as Hjson (JSON plus
//! comments, optional quotes and optional commas) with Python's hjson 3.1.0, called as
//! `hjson.load(open(path), object_pairs_hook=dict_raise_error_on_duplicate_keys)`; this module
//! follows that call exactly, oddities included (a quoteless value runs to the end of its line,
//! a broken one-line document falls back to being one string).
//!
//! Why long: one grammar (hjson 3.1.0's, quirk for quirk) read in one pass; split, its
//! states would be harder to hold against the Python reader it follows.
//!
//! It is hand-written because the serde-based hjson crates give none of what that needs:
//! duplicate keys detected on the ordered pairs (DeepSpeed's hook), Python's int/float rule
//! (`5e8` is an int, `1e10` a float) and a nesting cap in place of a stack overflow.
//!
//! Deliberate departures from Python: integers beyond 64 bits, `\u` escapes that leave a lone
//! surrogate, and nesting deeper than [`MAX_DEPTH`] are errors (Python keeps a big int, keeps
//! the surrogate, and only fails near 500 levels, on its recursion limit); only ASCII digits
//! are digits (Python's `\d` and `int()` also take e.g. Arabic-Indic ones). Where hjson-py
//! crashes instead (IndexError on an unclosed `/*`, OverflowError on `1e400`), the error is a
//! [`HjsonError::Syntax`] with a message of ours.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Write as _;

use crate::value::{Dict, Value};

/// The deepest nesting of objects and arrays the reader accepts.
pub const MAX_DEPTH: usize = 256;

/// Why a document was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HjsonError {
    /// A syntax error (for Python's `HjsonDecodeError`, the same message), at a 1-based line and
    /// column counted in characters, as Python counts them.
    #[error("{message}: line {line} column {column}")]
    Syntax {
        message: String,
        line: usize,
        column: usize,
    },
    /// DeepSpeed's `object_pairs_hook` rejects an object with a repeated key. `keys` lists each
    /// repeated key once, in order of first appearance; `path` is where the object sits
    /// (`the top level`, or e.g. `zero_optimization.offload_param`, `[0].a`).
    #[error("duplicate keys {keys:?} in the object at {path}")]
    DuplicateKeys { path: String, keys: Vec<String> },
    /// The bytes are not UTF-8; `offset` is the first byte that is not.
    #[error("the file is not valid UTF-8 (byte {offset})")]
    NotUtf8 { offset: usize },
}

/// Reads the bytes of a config file: UTF-8 decoding, then [`parse`].
pub fn parse_bytes(bytes: &[u8]) -> Result<Value, HjsonError> {
    let text = std::str::from_utf8(bytes).map_err(|e| HjsonError::NotUtf8 {
        offset: e.valid_up_to(),
    })?;
    parse(text)
}

/// Reads the text of a config file. Line ends are first translated as Python's text-mode
/// `open()` does (`\r\n` and a lone `\r` become `\n`), so lines and columns match Python's.
pub fn parse(text: &str) -> Result<Value, HjsonError> {
    let text = universal_newlines(text);
    Parser::new(&text).document()
}

fn universal_newlines(text: &str) -> Cow<'_, str> {
    if text.contains('\r') {
        Cow::Owned(text.replace("\r\n", "\n").replace('\r', "\n"))
    } else {
        Cow::Borrowed(text)
    }
}

/// A failure while scanning. `retry` marks Python's `HjsonDecodeError`, the only kind after
/// which a document that is not an object without braces is retried as a single value; other
/// Python exceptions (the hook's `ValueError`, `IndexError`, `OverflowError`, recursion)
/// propagate at once.
struct Fail {
    error: HjsonError,
    retry: bool,
}

// Boxed: a small `Err` keeps the frames of the recursive descent small.
type Scan<T> = Result<T, Box<Fail>>;

/// One step of the path from the root to the value being read.
enum Step {
    Key(String),
    Index(usize),
}

/// What `Parser::container` reads.
#[derive(Clone, Copy)]
enum Container {
    Braces,
    /// The root object without braces, which ends at the end of the input.
    NoBraces,
    Array,
}

/// The four characters after a `\u`, as Python reads them.
enum Hex4 {
    /// Fewer than four characters, or an `x` second (`0x12`): rejected before `int()`.
    Malformed,
    /// Four characters that `int(s, 16)` rejects.
    NotInt,
    /// The value and the position after the four characters.
    Value(i64, usize),
}

/// What `NUMBER_RE` matches at the start of a quoteless value.
#[derive(Clone, Copy)]
struct NumberMatch {
    /// End of the number itself (integer, fraction and exponent parts).
    digits_end: usize,
    /// End of the match, after trailing blanks.
    end: usize,
    /// Whether there is a fraction or an exponent.
    float: bool,
}

struct Parser<'a> {
    src: &'a str,
    depth: usize,
    path: Vec<Step>,
    /// Characters after the document's last `\n` (`None`: there is no `\n`); see `ml_indent`.
    tail: Option<usize>,
    /// `chars_back`'s last answer: position, characters, whether a `\n` precedes.
    col_memo: (usize, usize, bool),
    /// Where the first `\u` escape leaving a lone surrogate is; see `unicode_escape`.
    lone_surrogate: Cell<Option<usize>>,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        let bytes = src.as_bytes();
        let tail = bytes
            .iter()
            .rposition(|&b| b == b'\n')
            .map(|i| char_count(bytes.get(i + 1..).unwrap_or_default()));
        Parser {
            src,
            depth: 0,
            path: Vec::new(),
            tail,
            col_memo: (0, 0, false),
            lone_surrogate: Cell::new(None),
        }
    }

    /// Python's `HjsonDecoder.decode`: one document, then only whitespace and comments.
    fn document(&mut self) -> Result<Value, HjsonError> {
        let (value, end) = self.root().map_err(|f| f.error)?;
        let end = self.next(end).map_err(|f| f.error)?;
        if end != self.src.len() {
            return Err(self.syntax("Extra data", end));
        }
        if let Some(at) = self.lone_surrogate.get() {
            let message = "Unpaired surrogate in a \\uXXXX escape sequence (not supported)";
            return Err(self.syntax(message, at));
        }
        Ok(value)
    }

    /// Python's `raw_decode`.
    fn root(&mut self) -> Scan<(Value, usize)> {
        let start = bom_len(self.src);
        let idx = self.next(start)?;
        match self.at(idx) {
            // Blank or comments only: an empty object, but only when there is no BOM.
            None if start == 0 => Ok((Value::Dict(Dict::default()), idx)),
            Some(b'{' | b'[') => self.value(idx),
            _ => match self.container(idx, Container::NoBraces) {
                // Not an object without braces: retried as a single value (`5`, `"text"`, or
                // the first line as a quoteless string); if that fails too, the first error.
                Err(first) if first.retry => {
                    self.lone_surrogate.set(None);
                    self.value(idx).map_err(|_| first)
                }
                other => other,
            },
        }
    }

    /// Python's `_scan_once`: the value starting exactly at `idx`.
    fn value(&mut self, idx: usize) -> Scan<(Value, usize)> {
        match self.at(idx) {
            None => Err(self.decode("Expecting value", idx)),
            Some(b'\'') if self.starts(idx, b"'''") => {
                let (text, end) = self.ml_string(idx)?;
                Ok((Value::Str(text), end))
            }
            Some(quote @ (b'"' | b'\'')) => {
                let (text, end) = self.string(idx, quote)?;
                Ok((Value::Str(text), end))
            }
            Some(b'{') => self.container(idx, Container::Braces),
            Some(b'[') => self.container(idx, Container::Array),
            Some(first) => self.quoteless(idx, first),
        }
    }

    /// An object or array one level deeper; `open` is its `{` or `[` (for a root object
    /// without braces, its first key).
    fn container(&mut self, open: usize, kind: Container) -> Scan<(Value, usize)> {
        if self.depth >= MAX_DEPTH {
            let message = format!("nesting deeper than {MAX_DEPTH} levels");
            return Err(self.fatal(message, open));
        }
        self.depth += 1;
        let result = match kind {
            Container::Braces => self.object(open + 1, true),
            Container::NoBraces => self.object(open, false),
            Container::Array => self.array(open + 1),
        };
        self.depth -= 1;
        result
    }

    /// Python's `JSONObject`, from just after `{`, or from the first key of a root object
    /// without braces (which ends at the end of the input instead of at `}`).
    fn object(&mut self, start: usize, braces: bool) -> Scan<(Value, usize)> {
        let mut pairs = Vec::new();
        let mut end = self.next(start)?;
        if braces && self.at(end) == Some(b'}') {
            return Ok((Value::Dict(Dict::default()), end + 1));
        }
        loop {
            let (key, at) = self.key_and_colon(end)?;
            self.path.push(Step::Key(key.clone()));
            let result = self.value(at);
            self.path.pop();
            let (value, after) = result?;
            pairs.push((key, value));
            end = self.separator(after)?;
            match (braces, self.at(end)) {
                (true, Some(b'}')) => {
                    end += 1;
                    break;
                }
                (false, None) => break,
                _ => {}
            }
        }
        Ok((Value::Dict(self.dict(pairs)?), end))
    }

    /// A member's key and its `:`; returns the key and where its value starts.
    fn key_and_colon(&self, pos: usize) -> Scan<(String, usize)> {
        let (key, after_key) = self.key(pos)?;
        let colon = self.next(after_key)?;
        if self.at(colon) != Some(b':') {
            return Err(self.decode("Expecting ':' delimiter", colon));
        }
        Ok((key, self.next(colon + 1)?))
    }

    /// Python's `JSONArray`, from just after `[`.
    fn array(&mut self, start: usize) -> Scan<(Value, usize)> {
        let mut items = Vec::new();
        let mut end = self.next(start)?;
        match self.at(end) {
            Some(b']') => return Ok((Value::List(items), end + 1)),
            None => {
                let message = "End of input while parsing an array (did you forget a closing ']'?)";
                return Err(self.decode(message, end));
            }
            Some(_) => {}
        }
        loop {
            self.path.push(Step::Index(items.len()));
            let result = self.value(end);
            self.path.pop();
            let (value, after) = result?;
            items.push(value);
            end = self.separator(after)?;
            if self.at(end) == Some(b']') {
                return Ok((Value::List(items), end + 1));
            }
        }
    }

    /// After a member: skips whitespace and comments, then at most one comma and what follows it.
    fn separator(&self, pos: usize) -> Scan<usize> {
        let end = self.next(pos)?;
        if self.at(end) == Some(b',') {
            self.next(end + 1)
        } else {
            Ok(end)
        }
    }

    /// DeepSpeed's `dict_raise_error_on_duplicate_keys`, applied to every object.
    fn dict(&self, pairs: Vec<(String, Value)>) -> Scan<Dict> {
        let mut counts: HashMap<&str, usize> = HashMap::with_capacity(pairs.len());
        for (key, _) in &pairs {
            *counts.entry(key.as_str()).or_default() += 1;
        }
        if counts.len() == pairs.len() {
            return Ok(Dict(pairs));
        }
        // Like the hook's `collections.Counter`: each repeated key once, by first appearance.
        let mut keys = Vec::new();
        for (key, _) in &pairs {
            if counts.remove(key.as_str()).is_some_and(|n| n > 1) {
                keys.push(key.clone());
            }
        }
        let path = self.path_text();
        let error = HjsonError::DuplicateKeys { path, keys };
        Err(Box::new(Fail {
            error,
            retry: false,
        }))
    }

    fn path_text(&self) -> String {
        if self.path.is_empty() {
            return "the top level".to_string();
        }
        let mut text = String::new();
        for step in &self.path {
            match step {
                Step::Key(key) if text.is_empty() => text.push_str(key),
                Step::Key(key) => {
                    text.push('.');
                    text.push_str(key);
                }
                Step::Index(i) => {
                    let _ = write!(text, "[{i}]");
                }
            }
        }
        text
    }

    /// Python's `scanKeyName`: a quoted key, or the text before the next `:`.
    fn key(&self, pos: usize) -> Scan<(String, usize)> {
        let begin = self.next(pos)?;
        if let Some(quote @ (b'"' | b'\'')) = self.at(begin) {
            return self.string(begin, quote);
        }
        // The last blank of the first run of blanks: a key may only have blanks before its ':'.
        let mut space: Option<usize> = None;
        let mut end = begin;
        loop {
            match self.at(end) {
                None => return Err(self.decode("Bad key name (eof)", end)),
                Some(b':') => return self.unquoted_key(begin, end, space),
                Some(b' ' | b'\t' | b'\n' | b'\r') => {
                    if !matches!(space, Some(s) if s + 1 != end) {
                        space = Some(end);
                    }
                }
                Some(c @ (b'{' | b'}' | b'[' | b']' | b',')) => {
                    let message = format!(
                        "Found '{}' where a key name was expected (check your syntax or use \
                         quotes if the key name includes {{}}[],: or whitespace)",
                        char::from(c)
                    );
                    return Err(self.decode(message, begin));
                }
                Some(_) => {}
            }
            end += 1;
        }
    }

    fn unquoted_key(
        &self,
        begin: usize,
        colon: usize,
        space: Option<usize>,
    ) -> Scan<(String, usize)> {
        let text = self.src.get(begin..colon).unwrap_or_default();
        match space {
            _ if begin == colon => {
                let message = "Found ':' but no key name (for an empty key name use quotes)";
                Err(self.decode(message, begin))
            }
            Some(s) if s + 1 != colon => {
                let message = "Found whitespace in your key name (use quotes to include)";
                Err(self.decode(message, s))
            }
            // `str.rstrip()`: drops any Unicode whitespace before the blanks, too.
            Some(_) => Ok((text.trim_end_matches(py_space).to_string(), colon)),
            None => Ok((text.to_string(), colon)),
        }
    }

    /// Python's `scanstring`: a `"..."` or `'...'` string whose opening quote is at `open`.
    fn string(&self, open: usize, quote: u8) -> Scan<(String, usize)> {
        let mut out = String::new();
        let mut end = open + 1;
        loop {
            let special = |b: u8| b == b'"' || b == b'\'' || b == b'\\' || b < 0x20;
            let Some(stop) = self.find(end, special) else {
                return Err(self.decode("Unterminated string starting at", open));
            };
            out.push_str(self.src.get(end..stop).unwrap_or_default());
            end = stop + 1;
            match self.at(stop) {
                Some(b) if b == quote => break,
                Some(b @ (b'"' | b'\'')) => out.push(char::from(b)),
                Some(b'\\') => end = self.escape(end, open, &mut out)?,
                // Python reports the position after the control character, and the one there.
                _ => {
                    let message = format!("Invalid control character {} at", self.repr_at(end));
                    return Err(self.decode(message, end));
                }
            }
        }
        Ok((out, end))
    }

    /// One escape sequence, `at` being just after the backslash; returns the position after it.
    fn escape(&self, at: usize, open: usize, out: &mut String) -> Scan<usize> {
        let unescaped = match self.at(at) {
            None => return Err(self.decode("Unterminated string starting at", open)),
            Some(b'u') => return self.unicode_escape(at, out),
            Some(b'"') => '"',
            Some(b'\'') => '\'',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(_) => {
                let message = format!("Invalid \\X escape sequence {}", self.repr_at(at));
                return Err(self.decode(message, at));
            }
        };
        out.push(unescaped);
        Ok(at + 1)
    }

    /// A `\uXXXX` escape (with `u` at `u`), joined with a following `\uXXXX` when the two make
    /// a surrogate pair. Python keeps a lone surrogate, which a Rust string cannot hold: it is
    /// noted, kept as a private-use stand-in (so that keys stay distinct), and the document
    /// rejected only once it has been read to the end, so that any error Python reports wins.
    fn unicode_escape(&self, u: usize, out: &mut String) -> Scan<usize> {
        const MESSAGE: &str = "Invalid \\uXXXX escape sequence";
        let backslash = u.saturating_sub(1);
        let (mut code, mut end) = match self.hex4(u + 1) {
            Hex4::Value(code, end) => (code, end),
            Hex4::Malformed | Hex4::NotInt => return Err(self.decode(MESSAGE, backslash)),
        };
        if code & 0xfc00 == 0xd800 && self.starts(end, b"\\u") {
            match self.hex4(end + 2) {
                Hex4::Value(low, after) if low & 0xfc00 == 0xdc00 => {
                    code = 0x10000 + (((code - 0xd800) << 10) | (low - 0xdc00));
                    end = after;
                }
                Hex4::NotInt => return Err(self.decode(MESSAGE, end)),
                // Not a pair: the next escape is read on its own.
                Hex4::Value(..) | Hex4::Malformed => {}
            }
        }
        let Ok(code) = u32::try_from(code) else {
            // `int()` took a sign (`\u-001`); Python's chr() then raises ValueError.
            let message = "Invalid \\uXXXX escape sequence (chr() arg not in range(0x110000))";
            return Err(self.fatal(message, backslash));
        };
        let stand_in = || {
            let first = self.lone_surrogate.get().unwrap_or(backslash);
            self.lone_surrogate.set(Some(first));
            char::from_u32(0xf0000 + (code & 0x7ff)).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
        out.push(char::from_u32(code).unwrap_or_else(stand_in));
        Ok(end)
    }

    /// The four characters of a `\u` escape starting at `pos`, read as Python reads them.
    fn hex4(&self, pos: usize) -> Hex4 {
        let rest = self.src.get(pos..).unwrap_or_default();
        let len = rest.char_indices().nth(4).map_or(rest.len(), |(i, _)| i);
        let four = rest.get(..len).unwrap_or_default();
        if four.chars().count() != 4 || matches!(four.chars().nth(1), Some('x' | 'X')) {
            return Hex4::Malformed;
        }
        match py_int_base16(four) {
            Some(code) => Hex4::Value(code, pos + len),
            None => Hex4::NotInt,
        }
    }

    /// Python's `mlscanstring`: a `'''` string opening at `at`. Lines after the first lose up
    /// to as many leading blanks as the `'''` is indented; one final newline is dropped.
    fn ml_string(&mut self, at: usize) -> Scan<(String, usize)> {
        let indent = self.ml_indent(at)?;
        let mut end = self.skip_indent(at + 3, usize::MAX);
        match self.at(end) {
            // Python indexes past the end here (IndexError).
            None => return Err(self.fatal("Bad multiline string (end of input after ''')", end)),
            Some(b'\n') => end = self.skip_indent(end + 1, indent),
            Some(_) => {}
        }
        let mut out = String::new();
        let mut quotes = 0;
        loop {
            let Some(byte) = self.at(end) else {
                return Err(self.decode("Bad multiline string", end));
            };
            if byte == b'\'' {
                quotes += 1;
                end += 1;
                if quotes == 3 {
                    if out.ends_with('\n') {
                        out.pop();
                    }
                    return Ok((out, end));
                }
                continue;
            }
            for _ in 0..std::mem::take(&mut quotes) {
                out.push('\'');
            }
            end = self.ml_chunk(end, byte, indent, &mut out);
        }
    }

    /// Copies the text at `pos` (starting with `byte`, not a quote) up to the next quote or
    /// line end; returns where it stopped.
    fn ml_chunk(&self, pos: usize, byte: u8, indent: usize, out: &mut String) -> usize {
        match byte {
            b'\n' => {
                out.push('\n');
                self.skip_indent(pos + 1, indent)
            }
            b'\r' => pos + 1,
            _ => {
                let stop = self.find(pos, |b| matches!(b, b'\'' | b'\n' | b'\r'));
                let stop = stop.unwrap_or(self.src.len());
                out.push_str(self.src.get(pos..stop).unwrap_or_default());
                stop
            }
        }
    }

    /// The indentation of a `'''` at `at`: the characters back to the previous `\n`. On the
    /// first line Python's negative index wraps around to the end of the document, so the
    /// count goes on back from the end to the last `\n`; with no `\n` at all it fails
    /// (IndexError).
    fn ml_indent(&mut self, at: usize) -> Scan<usize> {
        match (self.chars_back(at), self.tail) {
            ((chars, true), _) => Ok(chars),
            ((chars, false), Some(tail)) => Ok(chars + tail),
            ((_, false), None) => {
                let message =
                    "Bad multiline string (''' on the first line of a file without a newline)";
                Err(self.fatal(message, at))
            }
        }
    }

    /// Characters from the line start (the document start when no `\n` precedes) to `pos`,
    /// and whether a `\n` precedes; remembered, so many `'''` on one line stay linear.
    fn chars_back(&mut self, pos: usize) -> (usize, bool) {
        let (from, mut chars, mut newline) = match self.col_memo {
            (memo_pos, chars, newline) if memo_pos <= pos => (memo_pos, chars, newline),
            _ => (0, 0, false),
        };
        let bytes = self.src.as_bytes().get(from..pos).unwrap_or_default();
        match bytes.iter().rposition(|&b| b == b'\n') {
            Some(i) => {
                chars = char_count(bytes.get(i + 1..).unwrap_or_default());
                newline = true;
            }
            None => chars += char_count(bytes),
        }
        self.col_memo = (pos, chars, newline);
        (chars, newline)
    }

    /// Python's `scantfnns`: `null`, `true`, `false`, a number, or a quoteless string running
    /// to the end of the line. At `,` `}` `]` `#` `//` `/*` the text so far ends the value only
    /// if it is one of the first four; otherwise those characters belong to the string.
    fn quoteless(&self, begin: usize, first: u8) -> Scan<(Value, usize)> {
        // (Python first calls getNext, a no-op: callers already skipped blanks and comments.)
        if b"{}[],:".contains(&first) {
            let message =
                "Found a punctuator character when expecting a quoteless string (check your syntax)";
            return Err(self.decode(message, begin));
        }
        let number = match first {
            b'-' | b'0'..=b'9' => number_match(self.src.as_bytes(), begin),
            _ => None,
        };
        let mut end = begin;
        loop {
            let byte = self.at(end);
            let eol = matches!(byte, None | Some(b'\n' | b'\r'));
            let stop = matches!(byte, Some(b',' | b'}' | b']' | b'#'))
                || (byte == Some(b'/') && matches!(self.at(end + 1), Some(b'/' | b'*')));
            if eol || stop {
                let text = self.src.get(begin..end).unwrap_or_default();
                let number = number.filter(|m| m.end == end);
                if let Some(value) = self.literal(first, text, begin, number)? {
                    return Ok((value, end));
                }
                if eol {
                    return Ok((Value::Str(py_strip(text).to_string()), end));
                }
            }
            end += 1;
        }
    }

    /// `text` as `null`, `true`, `false` or (given `NUMBER_RE`'s match ending with it) a number.
    fn literal(
        &self,
        first: u8,
        text: &str,
        begin: usize,
        number: Option<NumberMatch>,
    ) -> Scan<Option<Value>> {
        Ok(match first {
            b'n' if py_strip(text) == "null" => Some(Value::Null),
            b't' if py_strip(text) == "true" => Some(Value::Bool(true)),
            b'f' if py_strip(text) == "false" => Some(Value::Bool(false)),
            _ => match number {
                Some(m) => Some(self.number(begin, m)?),
                None => None,
            },
        })
    }

    /// Python's `int(text)` or `float(text)`, then hjson's rule: a float that is a whole number
    /// below 1e10 in magnitude becomes an int (`5e8`, `1.0`, `-0.0`; not `1e10` nor `0.5`).
    fn number(&self, begin: usize, m: NumberMatch) -> Scan<Value> {
        let text = self.src.get(begin..m.digits_end).unwrap_or_default();
        if !m.float {
            // Python would keep a big int here; ds-rs values are 64-bit.
            let too_large = || self.fatal("Integer too large (beyond 64 bits)", begin);
            return text.parse().map(Value::Int).map_err(|_| too_large());
        }
        let x: f64 = text
            .parse()
            .map_err(|_| self.fatal("Invalid number", begin))?;
        if x.is_infinite() {
            // hjson's `int(res)` on an infinite float raises OverflowError.
            let message = "Number too large (cannot convert float infinity to integer)";
            return Err(self.fatal(message, begin));
        }
        if x.fract() == 0.0 && x.abs() < 1e10 {
            Ok(Value::Int(x as i64))
        } else {
            Ok(Value::Float(x))
        }
    }

    /// Python's `getNext`: the position of the next character that is neither whitespace
    /// (` \t\n\r`) nor in a comment (`#`, `//` to the end of the line, `/* */`).
    fn next(&self, mut pos: usize) -> Scan<usize> {
        loop {
            while matches!(self.at(pos), Some(b' ' | b'\t' | b'\n' | b'\r')) {
                pos += 1;
            }
            match (self.at(pos), self.at(pos + 1)) {
                (Some(b'#'), _) | (Some(b'/'), Some(b'/')) => {
                    pos = self
                        .find(pos, |b| b == b'\n' || b == b'\r')
                        .unwrap_or(self.src.len());
                }
                (Some(b'/'), Some(b'*')) => pos = self.comment_end(pos)?,
                _ => return Ok(pos),
            }
        }
    }

    /// The position after the `*/` closing the comment opened at `open`.
    fn comment_end(&self, open: usize) -> Scan<usize> {
        let body = self.src.as_bytes().get(open + 2..).unwrap_or_default();
        match body.windows(2).position(|w| w == b"*/") {
            Some(i) => Ok(open + 2 + i + 2),
            // Python's getNext indexes past the end here: an IndexError, not a decode error.
            None => Err(self.fatal("Unterminated /* comment", open)),
        }
    }

    /// Python's `skipIndent`: skips at most `n` of ` \t\r`.
    fn skip_indent(&self, mut pos: usize, n: usize) -> usize {
        let mut left = n;
        while left > 0 && matches!(self.at(pos), Some(b' ' | b'\t' | b'\r')) {
            pos += 1;
            left -= 1;
        }
        pos
    }

    fn at(&self, pos: usize) -> Option<u8> {
        self.src.as_bytes().get(pos).copied()
    }

    fn starts(&self, pos: usize, prefix: &[u8]) -> bool {
        self.src
            .as_bytes()
            .get(pos..)
            .is_some_and(|rest| rest.starts_with(prefix))
    }

    fn find(&self, from: usize, pred: impl Fn(u8) -> bool) -> Option<usize> {
        let rest = self.src.as_bytes().get(from..)?;
        rest.iter().position(|&b| pred(b)).map(|i| from + i)
    }

    /// Python's `repr()` of the character at `pos` (`''` at the end), for messages.
    fn repr_at(&self, pos: usize) -> String {
        py_repr_char(self.src.get(pos..).and_then(|rest| rest.chars().next()))
    }

    /// An `HjsonDecodeError`: the root may still be retried as a single value.
    fn decode(&self, message: impl Into<String>, pos: usize) -> Box<Fail> {
        let error = self.syntax(message, pos);
        Box::new(Fail { error, retry: true })
    }

    /// Any other exception in Python: reported as it is.
    fn fatal(&self, message: impl Into<String>, pos: usize) -> Box<Fail> {
        let error = self.syntax(message, pos);
        Box::new(Fail {
            error,
            retry: false,
        })
    }

    /// A syntax error at byte `pos`, with Python's line and column.
    fn syntax(&self, message: impl Into<String>, pos: usize) -> HjsonError {
        let bytes = self.src.as_bytes();
        let before = bytes.get(..pos).unwrap_or(bytes);
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        HjsonError::Syntax {
            message: message.into(),
            line: before.iter().filter(|&&b| b == b'\n').count() + 1,
            column: char_count(before.get(line_start..).unwrap_or_default()) + 1,
        }
    }
}

/// `NUMBER_RE` (`[\t ]*(-?(?:0|[1-9]\d*))(\.\d+)?([eE][-+]?\d+)?[\t ]*`) matched at `begin`,
/// which is never a blank.
fn number_match(bytes: &[u8], begin: usize) -> Option<NumberMatch> {
    let digit = |i: usize| bytes.get(i).is_some_and(u8::is_ascii_digit);
    let digits_from = |mut i: usize| {
        while digit(i) {
            i += 1;
        }
        i
    };
    let mut pos = begin + usize::from(bytes.get(begin) == Some(&b'-'));
    pos = match bytes.get(pos) {
        Some(b'0') => pos + 1,
        Some(b'1'..=b'9') => digits_from(pos),
        _ => return None,
    };
    let int_end = pos;
    if bytes.get(pos) == Some(&b'.') && digit(pos + 1) {
        pos = digits_from(pos + 1);
    }
    if matches!(bytes.get(pos), Some(b'e' | b'E')) {
        let sign = usize::from(matches!(bytes.get(pos + 1), Some(b'+' | b'-')));
        if digit(pos + 1 + sign) {
            pos = digits_from(pos + 1 + sign);
        }
    }
    let digits_end = pos;
    while matches!(bytes.get(pos), Some(b' ' | b'\t')) {
        pos += 1;
    }
    Some(NumberMatch {
        digits_end,
        end: pos,
        float: digits_end > int_end,
    })
}

/// Python's `int(s, 16)` for the four characters of a `\u` escape: surrounding whitespace, a
/// sign, a `0x` prefix and single underscores between digits are all accepted.
fn py_int_base16(s: &str) -> Option<i64> {
    // int() strips Unicode whitespace, but not \x1c..\x1f (unlike str.strip()).
    let s = s.trim_matches(char::is_whitespace);
    let (negative, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let s = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(rest) => rest.strip_prefix('_').unwrap_or(rest),
        None => s,
    };
    if s.is_empty() || s.starts_with('_') || s.ends_with('_') || s.contains("__") {
        return None;
    }
    let mut value = 0i64;
    for c in s.chars().filter(|&c| c != '_') {
        value = value * 16 + i64::from(c.to_digit(16)?);
    }
    Some(if negative { -value } else { value })
}

/// Bytes of a leading BOM, which Python skips: U+FEFF, or its UTF-8 bytes read as Latin-1.
fn bom_len(text: &str) -> usize {
    if text.starts_with('\u{feff}') {
        '\u{feff}'.len_utf8()
    } else if text.starts_with("\u{ef}\u{bb}\u{bf}") {
        "\u{ef}\u{bb}\u{bf}".len()
    } else {
        0
    }
}

/// Python's `str.isspace()`: Unicode whitespace plus the separators \x1c..\x1f.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()`.
fn py_strip(s: &str) -> &str {
    s.trim_matches(py_space)
}

/// Characters (code points) in UTF-8 bytes: the bytes that do not continue a character.
fn char_count(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b & 0xc0 != 0x80).count()
}

/// Python's `repr()` of a one-character string (approximate for unusual non-ASCII).
fn py_repr_char(c: Option<char>) -> String {
    let Some(c) = c else {
        return "''".to_string();
    };
    match c {
        '\'' => "\"'\"".to_string(),
        '\\' => "'\\\\'".to_string(),
        '\t' => "'\\t'".to_string(),
        '\n' => "'\\n'".to_string(),
        '\r' => "'\\r'".to_string(),
        _ if c < ' ' || ('\u{7f}'..='\u{a0}').contains(&c) || c == '\u{ad}' => {
            format!("'\\x{:02x}'", u32::from(c))
        }
        _ if (c.is_whitespace() && c != ' ') || c == '\u{feff}' => {
            format!("'\\u{:04x}'", u32::from(c))
        }
        _ => format!("'{c}'"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> Value {
        parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"))
    }

    /// The error's message, line and column; panics unless it is a syntax error.
    fn syntax_err(text: &str) -> (String, usize, usize) {
        match parse(text) {
            Err(HjsonError::Syntax {
                message,
                line,
                column,
            }) => (message, line, column),
            other => panic!("{text:?}: expected a syntax error, got {other:?}"),
        }
    }

    fn dict(pairs: &[(&str, Value)]) -> Value {
        Value::Dict(Dict(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        ))
    }

    fn s(text: &str) -> Value {
        Value::Str(text.to_string())
    }

    fn int(i: i64) -> Value {
        Value::Int(i)
    }

    #[test]
    fn comments_of_all_three_kinds() {
        let text =
            "# hash\n{ // slashes\n a: 1, /* block\n over lines */ b: 2 # end\n}\n/* tail */";
        assert_eq!(ok(text), dict(&[("a", int(1)), ("b", int(2))]));
        assert_eq!(syntax_err("{a: 1} /* open").0, "Unterminated /* comment");
    }

    #[test]
    fn blank_documents_and_bom() {
        for text in ["", " \t\r\n", "# just a comment\n", "/* c */"] {
            assert_eq!(ok(text), dict(&[]), "{text:?}");
        }
        assert_eq!(ok("\u{feff}{\"a\": 1}"), dict(&[("a", int(1))]));
        assert_eq!(ok("\u{ef}\u{bb}\u{bf}a: 1"), dict(&[("a", int(1))]));
        // With a BOM, an empty document is no longer the empty-object special case.
        assert_eq!(syntax_err("\u{feff}"), ("Bad key name (eof)".into(), 1, 2));
    }

    #[test]
    fn root_without_braces_and_its_fallback() {
        assert_eq!(
            ok("a: 1\nb: x y\n"),
            dict(&[("a", int(1)), ("b", s("x y"))])
        );
        assert_eq!(ok("5"), int(5));
        assert_eq!(ok("'text'"), s("text"));
        // A broken one-line document becomes one quoteless string.
        assert_eq!(ok("a: [1, 2"), s("a: [1, 2"));
        // When the retry fails too, the object's error is reported.
        assert_eq!(syntax_err("a b: 1\nc: 2"), ("Extra data".into(), 2, 1));
        assert_eq!(syntax_err("\"a\" \"b\""), ("Extra data".into(), 1, 5));
        assert_eq!(
            syntax_err("'''abc\n"),
            ("Expecting ':' delimiter".into(), 1, 3)
        );
    }

    #[test]
    fn keys() {
        let text = "{\"dq\": 1, 'sq': 2, bare-key: 3, spaced  : 4, \"\": 5}";
        let want = [
            ("dq", int(1)),
            ("sq", int(2)),
            ("bare-key", int(3)),
            ("spaced", int(4)),
            ("", int(5)),
        ];
        assert_eq!(ok(text), dict(&want));
        let whitespace = "Found whitespace in your key name (use quotes to include)";
        assert_eq!(syntax_err("{\n  a b: 1}"), (whitespace.into(), 2, 4));
        let (message, line, column) = syntax_err("{a: 1, [b]: 2}");
        assert!(
            message.starts_with("Found '[' where a key name was expected"),
            "{message}"
        );
        assert_eq!((line, column), (1, 8));
        assert_eq!(syntax_err("{a: 1, b"), ("Bad key name (eof)".into(), 1, 9));
        let empty = "Found ':' but no key name (for an empty key name use quotes)";
        assert_eq!(syntax_err("{: 1}"), (empty.into(), 1, 2));
        assert_eq!(
            syntax_err("{\"a\" 1}"),
            ("Expecting ':' delimiter".into(), 1, 6)
        );
    }

    #[test]
    fn quoted_strings() {
        let text = r#"["a\"b\\c\/d\b\f\n\r\t", 'it\'s', "it\'s", 'say "hi"', "caf\u00e9", "\ud83d\ude00"]"#;
        let want = [
            "a\"b\\c/d\u{8}\u{c}\n\r\t",
            "it's",
            "it's",
            "say \"hi\"",
            "café",
            "😀",
        ];
        assert_eq!(ok(text), Value::List(want.iter().map(|t| s(t)).collect()));
        // int(s, 16) is lenient: blanks, a sign, a 0x prefix, underscores.
        assert_eq!(
            ok(r#"["\u 41 ", "\u+0x1", "\u1_23"]"#),
            Value::List(vec![s("A"), s("\u{1}"), s("\u{123}")])
        );
        assert_eq!(
            syntax_err("[\"a\tb\"]"),
            ("Invalid control character 'b' at".into(), 1, 5)
        );
        assert_eq!(
            syntax_err("[\"\\q\"]"),
            ("Invalid \\X escape sequence 'q'".into(), 1, 4)
        );
        assert_eq!(
            syntax_err("[\"\\u12\"]"),
            ("Invalid \\uXXXX escape sequence".into(), 1, 3)
        );
        assert_eq!(
            syntax_err("[\"\\u0x12\"]"),
            ("Invalid \\uXXXX escape sequence".into(), 1, 3)
        );
        assert_eq!(
            syntax_err("[\"abc]"),
            ("Unterminated string starting at".into(), 1, 2)
        );
    }

    #[test]
    fn lone_surrogates_are_rejected_after_the_whole_document() {
        let (message, line, column) = syntax_err("{a: \"\\ud800\"}");
        assert!(message.starts_with("Unpaired surrogate"), "{message}");
        assert_eq!((line, column), (1, 6));
        // An error Python reports later in the document wins.
        assert_eq!(syntax_err("{a: \"\\ud800\"} x").0, "Extra data");
        // Two different lone surrogates are still two different keys.
        assert!(!matches!(
            parse("{\"\\ud800\": 1, \"\\ud801\": 2}"),
            Err(HjsonError::DuplicateKeys { .. })
        ));
        assert!(syntax_err("\"\\u-001\"")
            .0
            .contains("chr() arg not in range"));
    }

    #[test]
    fn multiline_strings() {
        let text =
            "{\n  a:\n    '''\n    first\n      indented\n   short\n    '''\n  b: '''one'''\n}";
        assert_eq!(
            ok(text),
            dict(&[("a", s("first\n  indented\nshort")), ("b", s("one"))])
        );
        assert_eq!(ok("a: '''x''y'''\n"), dict(&[("a", s("x''y"))]));
        // On the first line the indent counts on from the end of the file (Python's s[-1]):
        // 3 with a final newline, 3 + 8 (the last line) without.
        assert_eq!(ok("a: '''x\n    y'''\n"), dict(&[("a", s("x\n y"))]));
        assert_eq!(ok("a: '''x\n    y'''"), dict(&[("a", s("x\ny"))]));
        assert!(syntax_err("a: '''x'''")
            .0
            .starts_with("Bad multiline string"));
        assert_eq!(
            syntax_err("{x: 1\na: '''").0,
            "Bad multiline string (end of input after ''')"
        );
        assert_eq!(
            syntax_err("[\n'''abc\n"),
            ("Bad multiline string".into(), 3, 1)
        );
    }

    #[test]
    fn quoteless_values_run_to_the_end_of_the_line() {
        let text = "{\n a: hello world  \n b: x, y # z\n c: CONFIG_BATCH_SIZE,\n d: http://h/p\n e: 5 # c\n f: true // c\n g: null,\n h: nullx\n}";
        let want = [
            ("a", s("hello world")),
            ("b", s("x, y # z")),
            ("c", s("CONFIG_BATCH_SIZE,")),
            ("d", s("http://h/p")),
            ("e", int(5)),
            ("f", Value::Bool(true)),
            ("g", Value::Null),
            ("h", s("nullx")),
        ];
        assert_eq!(ok(text), dict(&want));
        // `x}` is one string: the object is never closed.
        assert_eq!(syntax_err("{a: x}\n").0, "Bad key name (eof)");
        let punctuator =
            "Found a punctuator character when expecting a quoteless string (check your syntax)";
        assert_eq!(syntax_err("[\n,]"), (punctuator.into(), 2, 1));
    }

    #[test]
    fn numbers_follow_pythons_int_and_float_rule() {
        let cases = [
            ("42", int(42)),
            ("-0", int(0)),
            ("-0.0", int(0)),
            ("5e8", int(500_000_000)),
            ("1.0", int(1)),
            ("0.5e1", int(5)),
            ("9999999999.0", int(9_999_999_999)),
            ("1e-400", int(0)),
            ("1e10", Value::Float(1e10)),
            ("0.5", Value::Float(0.5)),
            ("3e-5", Value::Float(3e-5)),
            ("-1.5E+3", int(-1500)),
            ("-1.25E+1", Value::Float(-12.5)),
            ("9223372036854775807", int(i64::MAX)),
            ("-9223372036854775808", int(i64::MIN)),
            ("01", s("01")),
            ("1.", s("1.")),
            ("+1", s("+1")),
            ("1 2", s("1 2")),
            ("1_000", s("1_000")),
        ];
        for (text, want) in cases {
            assert_eq!(
                ok(&format!("[\n{text}\n]")),
                Value::List(vec![want]),
                "{text}"
            );
        }
        assert!(syntax_err("[12345678901234567890]")
            .0
            .starts_with("Integer too large"));
        assert!(syntax_err("{a: 1e400}")
            .0
            .contains("cannot convert float infinity"));
    }

    #[test]
    fn objects_and_arrays() {
        assert_eq!(ok("{a: 1\nb: 2,}"), dict(&[("a", int(1)), ("b", int(2))]));
        assert_eq!(ok("[1\n2,\n3,]"), Value::List(vec![int(1), int(2), int(3)]));
        assert_eq!(ok("[\"a\" 'b']"), Value::List(vec![s("a"), s("b")]));
        assert_eq!(ok("{}"), dict(&[]));
        assert_eq!(ok("[]"), Value::List(vec![]));
        let eoi = "End of input while parsing an array (did you forget a closing ']'?)";
        assert_eq!(syntax_err("{a: [\n"), (eoi.into(), 2, 1));
        assert_eq!(syntax_err("[1, 2"), ("Expecting value".into(), 1, 6));
        assert_eq!(syntax_err("{a: 1,, b: 2}").0.get(..9), Some("Found ','"));
        assert_eq!(syntax_err("{} {}"), ("Extra data".into(), 1, 4));
    }

    #[test]
    fn duplicate_keys_name_the_object() {
        let dup = |text: &str| match parse(text) {
            Err(HjsonError::DuplicateKeys { path, keys }) => (path, keys),
            other => panic!("{text:?}: {other:?}"),
        };
        assert_eq!(
            dup("a: 1\na: 2"),
            ("the top level".into(), vec!["a".into()])
        );
        let nested = "{zero_optimization: {offload_param: {device: cpu\ndevice: 'nvme'}}}";
        assert_eq!(
            dup(nested),
            (
                "zero_optimization.offload_param".into(),
                vec!["device".into()]
            )
        );
        assert_eq!(
            dup("{l: [{}, {a: 1, \"a\": 2}]}"),
            ("l[1]".into(), vec!["a".into()])
        );
        // Each repeated key once, in order of first appearance; the inner object fails first.
        assert_eq!(dup("{b: 1, c: 2, c: 3, b: 4, b: 5}").1, ["b", "c"]);
        assert_eq!(
            dup("{x: {k: 1, k: 2}, x: 3}"),
            ("x".into(), vec!["k".into()])
        );
        let message = parse("{a: 1, a: 2}").unwrap_err().to_string();
        assert_eq!(
            message,
            "duplicate keys [\"a\"] in the object at the top level"
        );
    }

    /// Runs `f` on a thread with an ordinary 2 MiB stack.
    fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let thread = std::thread::Builder::new().stack_size(2 << 20).spawn(f);
        thread.expect("spawn").join().expect("no stack overflow")
    }

    #[test]
    fn nesting_is_capped() {
        let deep = |n: usize| "[".repeat(n) + &"]".repeat(n);
        assert!(parse(&deep(MAX_DEPTH)).is_ok());
        let err = parse(&deep(MAX_DEPTH + 1)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "nesting deeper than 256 levels: line 1 column 257"
        );
        let huge = 10 << 20;
        let inputs = [
            "[".repeat(huge),
            "{\"a\":".repeat(huge / 5),
            "a:{".repeat(huge / 3),
        ];
        for text in inputs {
            let started = std::time::Instant::now();
            let message = match on_small_stack(move || parse(&text)) {
                Ok(_) => "parsed".to_string(),
                Err(e) => e.to_string(),
            };
            assert!(
                message.starts_with("nesting deeper than 256 levels"),
                "{message}"
            );
            assert!(
                started.elapsed().as_secs() < 10,
                "took {:?}",
                started.elapsed()
            );
        }
    }

    #[test]
    fn long_inputs_stay_linear() {
        let many_ml = "a: [".to_string() + &"'''x'''".repeat(200_000) + "]\n";
        let started = std::time::Instant::now();
        let Ok(Value::Dict(d)) = parse(&many_ml) else {
            panic!("not a dict")
        };
        assert!(matches!(d.get("a"), Some(Value::List(l)) if l.len() == 200_000));
        let long_quoteless = "a: -1".to_string() + &"1,".repeat(500_000) + "\n";
        assert!(parse(&long_quoteless).is_ok());
        assert!(
            started.elapsed().as_secs() < 10,
            "took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn bytes_and_line_ends() {
        assert_eq!(
            parse_bytes(b"{\"a\": \"caf\xe9\"}"),
            Err(HjsonError::NotUtf8 { offset: 10 })
        );
        let crlf = b"a: 1\r\nb: '''\r\n  x\r\n  y\r\n  '''\r\n";
        assert_eq!(
            parse_bytes(crlf),
            Ok(dict(&[("a", int(1)), ("b", s("x\ny"))]))
        );
        // A lone \r ends a line too (Python's universal newlines), and counts in line numbers.
        assert_eq!(
            parse("a: 1\rb: two\r"),
            Ok(dict(&[("a", int(1)), ("b", s("two"))]))
        );
        assert_eq!(syntax_err("a: 1\r\rb c: 2").1, 3);
    }

    #[test]
    fn never_panics_on_random_input() {
        const PIECES: [&str; 24] = [
            "{", "}", "[", "]", ",", ":", " ", "\n", "'", "'''", "\"", "\\", "\\u", "d800", "#",
            "/", "*", "a", "1", "-", ".", "e", "é", "\u{feff}",
        ];
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let len = next() % 24;
            let text: String = (0..len).map(|_| PIECES[(next() % 24) as usize]).collect();
            let _ = parse(&text);
            let _ = parse_bytes(&text.as_bytes()[..text.len() / 2]);
        }
    }

    /// Differential check against Python: every `tests/fixtures/hjson/cases/*.hjson` against
    /// the `.expected.json` that `regen.py` wrote with hjson 3.1.0.
    #[test]
    fn fixtures_match_python_hjson() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hjson/cases");
        let mut checked = 0;
        for entry in std::fs::read_dir(&dir).expect("fixture directory") {
            let path = entry.expect("entry").path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(stem) = name.strip_suffix(".hjson") else {
                continue;
            };
            let expected_path = dir.join(format!("{stem}.expected.json"));
            let expected_text = std::fs::read_to_string(&expected_path).expect("expected file");
            let expected: serde_json::Value = serde_json::from_str(&expected_text).expect("json");
            let got = parse_bytes(&std::fs::read(&path).expect("case"));
            check_fixture(stem, &expected, got);
            checked += 1;
        }
        assert!(checked >= 40, "only {checked} fixtures");
    }

    fn check_fixture(name: &str, expected: &serde_json::Value, got: Result<Value, HjsonError>) {
        if expected["ok"] == true {
            let want = decode_expected(&expected["value"]);
            assert_eq!(got.as_ref().ok(), Some(&want), "{name}: {got:?}");
            return;
        }
        let python = expected["error"].as_str().unwrap_or_default();
        let error = got.expect_err(name);
        if let Some(keys) = expected.get("duplicate_keys") {
            let keys: Vec<String> = serde_json::from_value(keys.clone()).expect("keys");
            assert!(
                matches!(&error, HjsonError::DuplicateKeys { keys: k, .. } if *k == keys),
                "{name}: {error:?}"
            );
        }
        if expected["type"] == "HjsonDecodeError" {
            // Same message, line and column as Python's.
            let rest = python.strip_prefix(&error.to_string()).unwrap_or_default();
            let same = rest.starts_with(" (char") || rest.starts_with(" - line");
            assert!(same, "{name}: {error} vs {python}");
        }
        if expected["type"] == "UnicodeDecodeError" {
            let offset = python
                .split("position ")
                .nth(1)
                .and_then(|r| r.split(':').next());
            let want = HjsonError::NotUtf8 {
                offset: offset.and_then(|o| o.parse().ok()).expect("offset"),
            };
            assert_eq!(error, want, "{name}");
        }
    }

    /// The fixture encoding: `{"int": "5"}`, `{"float": "0.5"}`, `{"dict": [[k, v], ...]}`.
    fn decode_expected(json: &serde_json::Value) -> Value {
        use serde_json::Value as J;
        match json {
            J::Null => Value::Null,
            J::Bool(b) => Value::Bool(*b),
            J::String(text) => Value::Str(text.clone()),
            J::Array(items) => Value::List(items.iter().map(decode_expected).collect()),
            J::Object(o) => match (o.get("int"), o.get("float"), o.get("dict")) {
                (Some(J::String(i)), _, _) => Value::Int(i.parse().expect("int")),
                (_, Some(J::String(f)), _) => Value::Float(f.parse().expect("float")),
                (_, _, Some(J::Array(pairs))) => Value::Dict(Dict(
                    pairs
                        .iter()
                        .map(|p| {
                            (
                                p[0].as_str().expect("key").to_string(),
                                decode_expected(&p[1]),
                            )
                        })
                        .collect(),
                )),
                _ => panic!("bad fixture value {json}"),
            },
            J::Number(_) => panic!("bad fixture value {json}"),
        }
    }
}
