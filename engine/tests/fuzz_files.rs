//! Hostile files: checkpoint manifests and shard headers (`checkpoint::verify`, `consolidate`,
//! as `checkpoint inspect` and `checkpoint consolidate` call them), weights files (`--init`,
//! `WeightsFile`), token files (`TokenFile`, `TextBytes`), and DeepSpeed's checkpoints
//! (`DeepSpeedCheckpoint`, the pickles of PyTorch files) as `checkpoint import-deepspeed` reads
//! them. Each must end in `Ok` or one
//! error, never a panic, a hang, or an allocation sized by a number in the file: a counting
//! allocator records this binary's largest allocation.
//!
//! Inputs are valid files with one JSON value replaced or removed, header lengths, offsets,
//! shapes and dtypes changed, bytes cut or altered, and arbitrary bytes. The case count is
//! small for CI; `PROPTEST_CASES` raises it (scripts/fuzz.sh).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use ds_comm::testkit::LargestAlloc;
use ds_data::{TextBytes, TokenFile, TokenSource, TokenWidth};
use ds_engine::checkpoint;
use ds_engine::checkpoint::deepspeed::{DeepSpeedCheckpoint, Part};
use ds_engine::checkpoint::torch::pickle;
use ds_engine::model::weights::{self, WeightsFile};
use ds_engine::model::{Init, ParamSpec};
use proptest::prelude::*;
use serde_json::{json, Value as Json};

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc;

/// The files here are a few KB; the checksum reads 1 MiB at a time.
const ALLOC_BOUND: usize = 8 << 20;

fn check_allocations() {
    let largest = LargestAlloc::largest();
    assert!(largest <= ALLOC_BOUND, "an allocation of {largest} bytes");
}

fn config(default_cases: u32) -> ProptestConfig {
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

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("ds-fuzz-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file of f32 tensors: header length, header JSON, data.
fn safetensors_bytes(header: &Json, data: &[u8]) -> Vec<u8> {
    let text = serde_json::to_vec(header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(data);
    out
}

fn f32_bytes(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values.flat_map(|v| v.to_le_bytes()).collect()
}

/// A shard holding flat elements `start..end` as the tensor "master".
fn shard(start: usize, end: usize) -> (Json, Vec<u8>) {
    let n = end - start;
    let header = json!({
        "__metadata__": {"format": "ds-rs"},
        "master": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
    });
    (header, f32_bytes((start..end).map(|i| i as f32)))
}

/// A valid two-shard checkpoint of parameters a [2, 3] and b [4]: its manifest and shards.
fn checkpoint_parts() -> (Json, Vec<(Json, Vec<u8>)>) {
    let shards = vec![shard(0, 4), shard(4, 10)];
    let entries: Vec<Json> = shards
        .iter()
        .enumerate()
        .map(|(r, (h, d))| {
            let bytes = safetensors_bytes(h, d);
            let (start, end) = [(0, 4), (4, 10)][r];
            json!({
                "file": format!("zero_rank{r:05}.safetensors"), "rank": r,
                "start": start, "end": end,
                "bytes": bytes.len(), "crc32c": crc32c::crc32c(&bytes),
            })
        })
        .collect();
    let manifest = json!({
        "format": checkpoint::manifest::FORMAT, "tag": "global_step1",
        "global_steps": 1, "skipped_steps": 0,
        "loss_scaler": {"cur_scale": 1.0, "cur_iter": 1, "last_overflow_iter": -1, "cur_hysteresis": 2},
        "layout": {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "zero_stage": 1, "dtype": "f32"},
        "params": [
            {"name": "a", "shape": [2, 3], "offset": 0},
            {"name": "b", "shape": [4], "offset": 6},
        ],
        "numel": 10, "optimizer_buffers": [], "optimizer_step": 1,
        "shards": entries, "client_state": null, "config": {},
    });
    (manifest, shards)
}

/// Writes a checkpoint; each shard's size and checksum in the manifest follow its bytes, so
/// a changed header is read rather than refused by the checksum.
fn write_checkpoint(dir: &Path, manifest: &Json, shards: &[Vec<u8>], fix_sums: bool) {
    let mut manifest = manifest.clone();
    for (r, bytes) in shards.iter().enumerate() {
        std::fs::write(dir.join(format!("zero_rank{r:05}.safetensors")), bytes).unwrap();
        if let Some(e) = manifest.pointer_mut(&format!("/shards/{r}")) {
            if fix_sums && e.is_object() {
                e["bytes"] = json!(bytes.len());
                e["crc32c"] = json!(crc32c::crc32c(bytes));
            }
        }
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
}

/// What `checkpoint inspect` and `checkpoint consolidate` do with a checkpoint.
fn read_checkpoint(dir: &Path) {
    if let Err(e) = checkpoint::verify(dir) {
        assert!(
            e.to_string().contains(dir.to_str().unwrap()),
            "unnamed: {e}"
        );
    }
    match checkpoint::consolidate(dir) {
        Ok((m, flat)) => {
            // What the consolidate command slices out of the result.
            for p in &m.params {
                let n: usize = p.shape.iter().product();
                assert!(
                    p.offset + n <= flat.len(),
                    "{} lies outside the model",
                    p.name
                );
            }
        }
        Err(e) => assert!(
            e.to_string().contains(dir.to_str().unwrap()),
            "unnamed: {e}"
        ),
    }
    check_allocations();
}

fn hostile_json() -> impl Strategy<Value = Json> {
    prop_oneof![
        Just(json!(null)),
        Just(json!(u64::MAX)),
        Just(json!(1u64 << 62)),
        Just(json!(1u64 << 32)),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(7)),
        Just(json!(1.5)),
        Just(json!("../../etc/passwd")),
        Just(json!("/etc/passwd")),
        Just(json!("")),
        Just(json!([1u64 << 32, 1u64 << 32])),
        Just(json!([usize::MAX, 2])),
        Just(json!([])),
        Just(json!({"dim": 0, "blocks": 0})),
        Just(json!({"dim": 7, "blocks": 3})),
        Just(json!({"dim": 0, "blocks": usize::MAX})),
        any::<i64>().prop_map(|v| json!(v)),
        "[a-z.]{0,8}".prop_map(|s| json!(s)),
    ]
}

/// Every JSON pointer of the tree.
fn pointers(v: &Json, at: String, out: &mut Vec<String>) {
    match v {
        Json::Object(o) => o.iter().for_each(|(k, c)| {
            let p = format!("{at}/{k}");
            out.push(p.clone());
            pointers(c, p, out);
        }),
        Json::Array(a) => a.iter().enumerate().for_each(|(i, c)| {
            let p = format!("{at}/{i}");
            out.push(p.clone());
            pointers(c, p, out);
        }),
        _ => {}
    }
}

/// Replaces (or, with `None`, removes) the value at the `which`-th pointer.
fn edit(doc: &mut Json, which: usize, new: Option<Json>) {
    let mut all = Vec::new();
    pointers(doc, String::new(), &mut all);
    let at = &all[which % all.len()];
    let (parent, key) = at.rsplit_once('/').unwrap();
    match (doc.pointer_mut(parent), new) {
        (Some(Json::Object(o)), None) => {
            o.remove(key);
        }
        (Some(Json::Array(a)), None) => {
            a.remove(key.parse::<usize>().unwrap());
        }
        (_, Some(v)) => *doc.pointer_mut(at).unwrap() = v,
        _ => {}
    }
}

/// A change to a safetensors header.
#[derive(Debug, Clone)]
enum HeaderEdit {
    /// The 8-byte header length.
    Length(u64),
    /// A value of the header JSON.
    Value(usize, Option<Json>),
    /// One tensor's (the `usize`-th's) dtype, shape or data_offsets.
    Field(usize, &'static str, Json),
    Cut(usize),
    Byte(usize, u8),
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let length = prop_oneof![
        Just(u64::MAX),
        Just(u64::MAX - 7),
        Just(1u64 << 60),
        Just(200u64 << 20),
        0u64..200
    ];
    let dtype = prop::sample::select(&["F64", "I64", "BF16", "F16", "U8", "BOOL", "F32", "X"][..])
        .prop_map(|d| json!(d));
    let offsets = prop_oneof![
        Just(json!([0, u64::MAX])),
        Just(json!([u64::MAX - 3, u64::MAX])),
        Just(json!([8, 4])),
        Just(json!([0, 1 << 20])),
        Just(json!([0])),
        (0u64..64, 0u64..64).prop_map(|(a, b)| json!([a, b])),
    ];
    let shape = prop_oneof![
        Just(json!([1u64 << 32, 1u64 << 32])),
        Just(json!([usize::MAX, 2])),
        Just(json!([0])),
        Just(json!([])),
        prop::collection::vec(0u64..8, 0..3).prop_map(|s| json!(s)),
    ];
    prop_oneof![
        length.prop_map(HeaderEdit::Length),
        (any::<usize>(), prop::option::of(hostile_json()))
            .prop_map(|(w, v)| HeaderEdit::Value(w, v)),
        (any::<usize>(), dtype).prop_map(|(t, v)| HeaderEdit::Field(t, "dtype", v)),
        (any::<usize>(), offsets).prop_map(|(t, v)| HeaderEdit::Field(t, "data_offsets", v)),
        (any::<usize>(), shape).prop_map(|(t, v)| HeaderEdit::Field(t, "shape", v)),
        any::<usize>().prop_map(HeaderEdit::Cut),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| HeaderEdit::Byte(at, b)),
    ]
}

fn edited_safetensors(header: &Json, data: &[u8], e: &HeaderEdit) -> Vec<u8> {
    match e {
        HeaderEdit::Length(n) => {
            let mut b = safetensors_bytes(header, data);
            b[..8].copy_from_slice(&n.to_le_bytes());
            b
        }
        HeaderEdit::Value(which, v) => {
            let mut h = header.clone();
            edit(&mut h, *which, v.clone());
            safetensors_bytes(&h, data)
        }
        HeaderEdit::Field(t, key, v) => {
            let mut h = header.clone();
            let names: Vec<String> = h
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "__metadata__")
                .cloned()
                .collect();
            h[&names[t % names.len()]][*key] = v.clone();
            safetensors_bytes(&h, data)
        }
        HeaderEdit::Cut(at) => {
            let mut b = safetensors_bytes(header, data);
            b.truncate(at % b.len());
            b
        }
        HeaderEdit::Byte(at, byte) => {
            let mut b = safetensors_bytes(header, data);
            let at = at % b.len();
            b[at] = *byte;
            b
        }
    }
}

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("a", &[2, 3], Init::Zeros),
        ParamSpec::new("b", &[4], Init::Zeros),
    ]
}

/// Opens a weights file as `--init` does and reads every element of every parameter.
fn read_weights(path: &Path) {
    let specs = specs();
    match WeightsFile::open(path, &specs, &specs) {
        Ok(f) => {
            for (i, s) in specs.iter().enumerate() {
                let n: usize = s.shape.iter().product();
                let mut out = vec![0f32; n];
                f.read(i, 0, &mut out).expect("a checked file reads");
            }
        }
        Err(e) => assert!(
            e.to_string().contains(path.to_str().unwrap()),
            "unnamed: {e}"
        ),
    }
    check_allocations();
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn manifests_with_one_value_changed(which in any::<usize>(), new in prop::option::of(hostile_json())) {
        let dir = TempDir::new();
        let (mut manifest, shards) = checkpoint_parts();
        edit(&mut manifest, which, new);
        let bytes: Vec<Vec<u8>> = shards.iter().map(|(h, d)| safetensors_bytes(h, d)).collect();
        write_checkpoint(&dir.0, &manifest, &bytes, false);
        read_checkpoint(&dir.0);
    }

    #[test]
    fn manifest_shapes_offsets_and_ranges(
        param in 0usize..2,
        shape in prop_oneof![
            Just(json!([1u64 << 32, 3])),
            Just(json!([1u64 << 40])),
            Just(json!([u64::MAX, 2])),
            Just(json!([3, 1u64 << 62])),
            prop::collection::vec(0u64..8, 0..3).prop_map(|s| json!(s)),
        ],
        offset in prop_oneof![Just(u64::MAX), Just(1u64 << 40), 0u64..12],
        shard in 0usize..2,
        range in (prop_oneof![Just(u64::MAX), 0u64..12], prop_oneof![Just(u64::MAX), 0u64..12]),
        tp in prop_oneof![Just(u64::MAX), Just(1u64 << 40), 0u64..4],
    ) {
        let dir = TempDir::new();
        let (mut manifest, shards) = checkpoint_parts();
        manifest["params"][param]["shape"] = shape;
        manifest["params"][param]["offset"] = json!(offset);
        manifest["shards"][shard]["start"] = json!(range.0);
        manifest["shards"][shard]["end"] = json!(range.1);
        manifest["layout"]["tp"] = json!(tp);
        let bytes: Vec<Vec<u8>> = shards.iter().map(|(h, d)| safetensors_bytes(h, d)).collect();
        write_checkpoint(&dir.0, &manifest, &bytes, false);
        read_checkpoint(&dir.0);
    }

    #[test]
    fn manifests_cut_or_altered(at in any::<usize>(), byte in any::<u8>(), cut in any::<bool>()) {
        let dir = TempDir::new();
        let (manifest, shards) = checkpoint_parts();
        let bytes: Vec<Vec<u8>> = shards.iter().map(|(h, d)| safetensors_bytes(h, d)).collect();
        write_checkpoint(&dir.0, &manifest, &bytes, false);
        let path = dir.0.join("manifest.json");
        let mut text = std::fs::read(&path).unwrap();
        let at = at % text.len();
        if cut { text.truncate(at) } else { text[at] = byte }
        std::fs::write(&path, text).unwrap();
        read_checkpoint(&dir.0);
    }

    #[test]
    fn shard_headers_changed(which in 0usize..2, e in header_edit()) {
        let dir = TempDir::new();
        let (manifest, shards) = checkpoint_parts();
        let mut bytes: Vec<Vec<u8>> = shards.iter().map(|(h, d)| safetensors_bytes(h, d)).collect();
        bytes[which] = edited_safetensors(&shards[which].0, &shards[which].1, &e);
        write_checkpoint(&dir.0, &manifest, &bytes, true);
        read_checkpoint(&dir.0);
    }

    #[test]
    fn weights_files_changed(e in header_edit()) {
        let dir = TempDir::new();
        let header = json!({
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
        });
        let path = dir.0.join("init.safetensors");
        std::fs::write(&path, edited_safetensors(&header, &f32_bytes((0..10).map(|i| i as f32)), &e)).unwrap();
        read_weights(&path);
    }

    #[test]
    fn arbitrary_bytes_as_weights_and_shards(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let dir = TempDir::new();
        let path = dir.0.join("init.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        read_weights(&path);
        let (manifest, _) = checkpoint_parts();
        write_checkpoint(&dir.0, &manifest, &[bytes.clone(), bytes], true);
        read_checkpoint(&dir.0);
    }

    #[test]
    fn token_files(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        wide in any::<bool>(),
        vocab in prop_oneof![Just(0usize), Just(usize::MAX), 1usize..70_000],
        start in prop_oneof![Just(usize::MAX), Just(usize::MAX / 2), 0usize..40],
        len in 0usize..40,
    ) {
        let dir = TempDir::new();
        let path = dir.0.join("tokens.bin");
        std::fs::write(&path, &bytes).unwrap();
        let width = if wide { TokenWidth::U32 } else { TokenWidth::U16 };
        let mut out = vec![0u32; len];
        match TokenFile::open(&path, width, vocab) {
            Ok(f) => {
                prop_assert_eq!(f.len() * width.bytes(), bytes.len());
                if let Ok(()) = f.read(start, &mut out) {
                    prop_assert!(out.iter().all(|&t| (t as usize) < vocab));
                }
            }
            Err(e) => prop_assert!(e.to_string().contains("tokens.bin"), "unnamed: {e}"),
        }
        let text = TextBytes::open(&path).expect("any bytes are text bytes");
        if let Err(e) = text.read(start, &mut out) {
            prop_assert!(e.to_string().contains("tokens.bin"), "unnamed: {e}");
        }
        check_allocations();
    }
}

/// DeepSpeed's own ZeRO-2 and ZeRO-3 checkpoints (tests/fixtures/deepspeed/make.sh).
fn deepspeed_tag(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../tests/fixtures/deepspeed/{case}/global_step5"))
}

/// A copy of a DeepSpeed tag with file `which` (in name order) given to `change`.
fn deepspeed_copy(
    dir: &Path,
    case: &str,
    which: usize,
    mut change: impl FnMut(&mut Vec<u8>),
) -> PathBuf {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deepspeed_tag(case))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let which = which % files.len();
    for (i, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        if i == which {
            change(&mut bytes);
        }
        std::fs::write(dir.join(f.file_name().unwrap()), bytes).unwrap();
    }
    dir.to_path_buf()
}

/// Opens a DeepSpeed tag and reads every parameter's values: Ok, or one error naming a file
/// of the tag.
fn read_deepspeed(dir: &Path) {
    let read = DeepSpeedCheckpoint::open(dir).and_then(|ck| {
        for i in 0..ck.params.len() {
            ck.read(i, Part::Master)?;
            for b in 0..ck.buffers.len() {
                ck.read(i, Part::Buffer(b))?;
            }
        }
        Ok(())
    });
    if let Err(e) = read {
        assert!(
            e.to_string().contains(dir.to_str().unwrap()),
            "unnamed: {e}"
        );
    }
    check_allocations();
}

/// The data.pkl of rank 0's optimizer states in the ZeRO-3 fixture.
fn deepspeed_pickle() -> Vec<u8> {
    let path = deepspeed_tag("zero3_fp32").join("zero_pp_rank_0_mp_rank_00_optim_states.pt");
    let mut zip = zip::ZipArchive::new(std::fs::File::open(path).unwrap()).unwrap();
    let name = zip
        .file_names()
        .map(|n| n.unwrap().into_owned())
        .find(|n| n.ends_with("/data.pkl"))
        .unwrap();
    let mut data = Vec::new();
    std::io::Read::read_to_end(&mut zip.by_name(&name).unwrap(), &mut data).unwrap();
    data
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn deepspeed_files_cut_or_altered(
        zero3 in any::<bool>(),
        which in any::<usize>(),
        at in any::<usize>(),
        byte in any::<u8>(),
        cut in any::<bool>(),
    ) {
        let dir = TempDir::new();
        let case = if zero3 { "zero3_fp32" } else { "zero2_fp32" };
        let tag = deepspeed_copy(&dir.0, case, which, |b| {
            let at = at % b.len();
            if cut { b.truncate(at) } else { b[at] = byte }
        });
        read_deepspeed(&tag);
    }

    #[test]
    fn pickles_with_bytes_changed(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4), cut in any::<usize>()) {
        let mut data = deepspeed_pickle();
        for (at, byte) in edits {
            let at = at % data.len();
            data[at] = byte;
        }
        data.truncate(cut % (data.len() + 1));
        let _ = pickle::parse(&data);
        check_allocations();
    }

    #[test]
    fn pickles_of_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = pickle::parse(&bytes);
        check_allocations();
    }
}

/// The fixtures above are what the engine writes: the unchanged ones load.
#[test]
fn unchanged_fixtures_load() {
    let dir = TempDir::new();
    let (manifest, shards) = checkpoint_parts();
    let bytes: Vec<Vec<u8>> = shards
        .iter()
        .map(|(h, d)| safetensors_bytes(h, d))
        .collect();
    write_checkpoint(&dir.0, &manifest, &bytes, false);
    checkpoint::verify(&dir.0).expect("a valid checkpoint verifies");
    let (_, flat) = checkpoint::consolidate(&dir.0).expect("and consolidates");
    assert_eq!(flat, (0..10).map(|i| i as f32).collect::<Vec<_>>());
    let path = dir.0.join("init.safetensors");
    let specs = specs();
    let values = vec![vec![1.0; 6], vec![2.0; 4]];
    weights::save(&path, &specs, &values).unwrap();
    let f = WeightsFile::open(&path, &specs, &specs).expect("a saved weights file opens");
    let mut b = [0f32; 4];
    f.read(1, 0, &mut b).unwrap();
    assert_eq!(b, [2.0; 4]);
    for case in ["zero2_fp32", "zero3_fp32"] {
        let ck = DeepSpeedCheckpoint::open(&deepspeed_tag(case))
            .expect("DeepSpeed's own checkpoint opens");
        assert_eq!((ck.world, ck.params.len()), (2, 17), "{case}");
        pickle::parse(&deepspeed_pickle()).expect("and its pickles parse");
    }
}
