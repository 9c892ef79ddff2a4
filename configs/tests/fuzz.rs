//! Hostile ds_config files: the reader (`hjson::parse_bytes`, `load`) and the resolver
//! (`parallel_dims`, `resolve`, `resolve_with_auto`) must answer every input with `Ok` or one
//! `ConfigError`, never a panic, a stack overflow or a hang.
//!
//! Inputs are arbitrary bytes, soups of hjson tokens, deep nesting, and the real configs of
//! fixtures/real with one value replaced, one key removed, or the text cut or altered at a
//! random byte. The case count is small for CI; `PROPTEST_CASES` raises it (scripts/fuzz.sh).

use std::path::{Path, PathBuf};

use ds_config::hjson::{self, MAX_DEPTH};
use ds_config::value::Dict;
use ds_config::{FillContext, ParallelDims, TrainingArgs, Value};
use proptest::prelude::*;

fn config(default_cases: u32) -> ProptestConfig {
    // `ProptestConfig::default()` reads PROPTEST_CASES; only its absence falls back to ours.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cases);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn real_configs() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("fixtures/real is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (
                name,
                std::fs::read_to_string(&p).expect("a fixture is UTF-8"),
            )
        })
        .collect()
}

/// Resolving must end in `Ok` or an error; an error must say something.
fn resolve_all_ways(doc: &Value, dims: ParallelDims, auto: &(TrainingArgs, FillContext)) {
    for result in [
        ds_config::resolve(doc, &dims),
        ds_config::resolve_with_args(doc, &dims, &auto.0, &auto.1),
    ] {
        match result {
            Ok(c) => {
                serde_json::to_string(&c).expect("a resolved config serializes");
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}

fn hostile_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![
            Just(i64::MIN),
            Just(i64::MAX),
            Just(-1i64),
            Just(0),
            Just(1),
            Just(1 << 40),
            any::<i64>()
        ]
        .prop_map(Value::Int),
        prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
            Just(-0.0),
            Just(1e300),
            Just(5e-324),
            any::<f64>()
        ]
        .prop_map(Value::Float),
        prop_oneof![
            Just("auto".to_string()),
            Just(String::new()),
            Just("cpu".to_string()),
            ".{0,12}"
        ]
        .prop_map(Value::Str),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::List),
            prop::collection::vec(("[a-z_]{1,12}", inner), 0..4).prop_map(|kv| {
                let mut d = Dict::default();
                for (k, v) in kv {
                    d.insert(&k, v);
                }
                Value::Dict(d)
            }),
        ]
    })
}

fn dims() -> impl Strategy<Value = ParallelDims> {
    (1usize..=16, 1usize..=4, 1usize..=4).prop_map(|(dp, tp, pp)| ParallelDims {
        world_size: dp * tp * pp,
        tp,
        pp,
        ep: 1,
        sp: 1,
    })
}

/// Training arguments and context, hostile ones included (the argument check refuses
/// some; the rest reach the filling).
fn auto_values() -> impl Strategy<Value = (TrainingArgs, FillContext)> {
    let int = || prop::option::of(prop_oneof![Just(i64::MAX), Just(0i64), -2i64..1 << 20]);
    let float = || {
        prop::option::of(prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            any::<f64>(),
            0.0f64..1.0
        ])
    };
    (
        (int(), int(), int(), int(), int()),
        (float(), float(), float(), float(), float()),
        (any::<Option<bool>>(), any::<Option<bool>>()),
    )
        .prop_map(
            |((mb, ga, dp, total, hidden), (clip, lr, eps, wd, warm), (fp16, bf16))| {
                let args = TrainingArgs {
                    per_device_train_batch_size: mb,
                    gradient_accumulation_steps: ga,
                    max_grad_norm: clip,
                    learning_rate: lr,
                    adam_epsilon: eps,
                    weight_decay: wd,
                    warmup_steps: warm,
                    adam_beta1: warm,
                    max_steps: total,
                    fp16,
                    bf16,
                    ..TrainingArgs::default()
                };
                let ctx = FillContext {
                    data_parallel: dp.unwrap_or(1),
                    hidden_size: hidden,
                    run_steps: total,
                };
                (args, ctx)
            },
        )
}

/// Every (path, value) of the tree, depth first, paths as key lists.
fn paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Value::Dict(d) = v {
        for (k, child) in d.iter() {
            prefix.push(k.to_string());
            out.push(prefix.clone());
            paths(child, prefix, out);
            prefix.pop();
        }
    }
}

fn dict_at<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Dict> {
    let mut here = v;
    for k in path {
        let Value::Dict(d) = here else { return None };
        here = d.0.iter_mut().find(|(key, _)| key == k).map(|(_, v)| v)?;
    }
    match here {
        Value::Dict(d) => Some(d),
        _ => None,
    }
}

/// One change to a parsed config: replace the value at a path, remove its key, or add an
/// unknown key next to it.
#[derive(Debug, Clone)]
enum Edit {
    Replace(Value),
    Remove,
    AddKey(String, Value),
}

fn apply(doc: &mut Value, which: usize, edit: &Edit) {
    let mut all = Vec::new();
    paths(doc, &mut Vec::new(), &mut all);
    if all.is_empty() {
        return;
    }
    let path = &all[which % all.len()];
    let (key, parent) = path.split_last().expect("paths are non-empty");
    let Some(d) = dict_at(doc, parent) else {
        return;
    };
    match edit {
        Edit::Replace(v) => d.insert(key, v.clone()),
        Edit::Remove => {
            d.remove(key);
        }
        Edit::AddKey(k, v) => d.insert(k, v.clone()),
    }
}

const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    "\"",
    "'",
    "'''",
    "\n",
    " ",
    "#",
    "//",
    "/*",
    "*/",
    "\\",
    "\\u",
    "\\ud800",
    "true",
    "false",
    "null",
    "1",
    "-0",
    "1e400",
    "5e8",
    "0x1f",
    "1.5",
    "99999999999999999999999",
    "\"a\"",
    "a",
    "auto",
    "zero_optimization",
    "stage",
    "train_batch_size",
    "\u{feff}",
    "\u{0}",
    "\r",
    "é",
];

fn token_soup() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(TOKENS), 0..64).prop_map(|t| t.concat())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn arbitrary_bytes_parse_or_fail(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Err(e) = hjson::parse_bytes(&bytes) {
            prop_assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn token_soups_parse_or_fail(text in token_soup(), dims in dims()) {
        if let Ok(doc) = hjson::parse(&text) {
            resolve_all_ways(&doc, dims, &(TrainingArgs::default(), FillContext { data_parallel: 1, hidden_size: None, run_steps: None }));
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_overflowed(
        depth in prop_oneof![0usize..300, 300usize..20_000],
        opener in prop::sample::select(&["[", "{\"a\":", "{a:\n", "[{\"b\": "][..]),
        closed in any::<bool>(),
    ) {
        let mut text = opener.repeat(depth);
        if closed {
            let closer = if opener.starts_with('[') && opener.len() == 1 { "]" } else { "}" };
            text.push_str(&closer.repeat(depth));
        }
        let result = hjson::parse(&text);
        // An opener of two levels reaches MAX_DEPTH at half the count.
        let levels = depth * if opener.len() > 6 { 2 } else { 1 };
        if levels > MAX_DEPTH {
            let err = result.expect_err("nesting past MAX_DEPTH is refused");
            prop_assert!(err.to_string().contains("nesting") || !closed, "{err}");
        }
    }

    #[test]
    fn real_configs_with_one_value_changed(
        file in 0usize..1000,
        which in any::<usize>(),
        edit in prop_oneof![
            hostile_value().prop_map(Edit::Replace),
            Just(Edit::Remove),
            ("[a-z_]{1,24}", hostile_value()).prop_map(|(k, v)| Edit::AddKey(k, v)),
        ],
        dims in dims(),
        auto in auto_values(),
    ) {
        let files = real_configs();
        let (name, text) = &files[file % files.len()];
        let mut doc = hjson::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        apply(&mut doc, which, &edit);
        resolve_all_ways(&doc, dims, &auto);
        let _ = ds_config::parallel_dims(&doc, dims.world_size, None, None);
        let _ = ds_config::summary_json(&ds_config::resolve(&doc, &dims));
    }

    #[test]
    fn real_configs_cut_or_altered_bytes(
        file in 0usize..1000,
        at in any::<usize>(),
        cut in any::<bool>(),
        byte in any::<u8>(),
        dims in dims(),
    ) {
        let files = real_configs();
        let (_, text) = &files[file % files.len()];
        let mut bytes = text.as_bytes().to_vec();
        let at = at % bytes.len().max(1);
        if cut {
            bytes.truncate(at);
        } else if let Some(b) = bytes.get_mut(at) {
            *b = byte;
        }
        if let Ok(doc) = hjson::parse_bytes(&bytes) {
            resolve_all_ways(&doc, dims, &(TrainingArgs::default(), FillContext { data_parallel: 1, hidden_size: None, run_steps: None }));
        }
    }

    #[test]
    fn parallel_degrees_from_the_file(
        tp in prop_oneof![Just(i64::MAX), Just(i64::MIN), Just(1i64 << 32), -3i64..70],
        pp in prop_oneof![Just(i64::MAX), Just(1i64 << 32), -3i64..70],
        world in prop_oneof![Just(usize::MAX), Just(0usize), 1usize..64],
        cli_tp in prop::option::of(prop_oneof![Just(usize::MAX), Just(1usize << 32), 0usize..9]),
        cli_pp in prop::option::of(prop_oneof![Just(usize::MAX), Just(1usize << 32), 0usize..9]),
    ) {
        let text = format!(
            r#"{{"train_batch_size": 8, "tensor_parallel": {{"autotp_size": {tp}}},
                "pipeline": {{"stages": {pp}}}}}"#
        );
        let doc = hjson::parse(&text).expect("a well-formed file");
        if let Ok(dims) = ds_config::parallel_dims(&doc, world, cli_tp, cli_pp) {
            prop_assert!(dims.tp * dims.pp * dims.dp() == dims.world_size);
        }
        let _ = ParallelDims::new(world, cli_tp.unwrap_or(1), cli_pp.unwrap_or(1));
    }
}

/// The reader as the binary calls it, on a file: bytes that are not UTF-8 name the offset.
#[test]
fn load_names_the_file_and_the_byte() {
    let dir = std::env::temp_dir().join(format!("ds-config-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ds_config.json");
    std::fs::write(&path, b"{\"train_batch_size\": \xff}").unwrap();
    let err = ds_config::load(&path).expect_err("not UTF-8");
    let text = err.to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        text.contains("ds_config.json") && text.contains("byte 21"),
        "{text}"
    );
}
