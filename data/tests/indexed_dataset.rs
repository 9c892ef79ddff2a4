//! Megatron-LM's indexed datasets against megatron-core itself: fixtures/megatron holds the
//! .bin/.idx pairs its IndexedDatasetBuilder wrote (uint16 and int32 ids) for the documents
//! of documents.json (gen_indexed.py); ds-rs reads them back as those documents' tokens, in
//! order. A damaged index is one error naming the .idx and what is wrong.

mod common;

use common::Scratch;
use std::path::{Path, PathBuf};

use ds_data::{IndexedDataset, IndexedWriter, TokenSource};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/megatron")
}

fn documents() -> Vec<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(fixtures().join("documents.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn all(s: &dyn TokenSource) -> Vec<u32> {
    let mut out = vec![0; s.len()];
    s.read(0, &mut out).unwrap();
    out
}

#[test]
fn megatron_core_files_read_as_their_documents() {
    let want: Vec<u32> = documents().into_iter().flatten().flatten().collect();
    for name in ["u16", "i32"] {
        let prefix = fixtures().join(format!("{name}_text_document"));
        // the prefix, or either file of it
        for spec in [
            prefix.clone(),
            prefix.with_extension("bin"),
            prefix.with_extension("idx"),
        ] {
            let d = IndexedDataset::open(&spec, 50000).unwrap();
            assert_eq!(all(&d), want, "{}", spec.display());
            assert_eq!(d.documents(), documents().len());
        }
        // a window in the middle, across a document boundary
        let d = IndexedDataset::open(&prefix, 50000).unwrap();
        let mut mid = vec![0; 30];
        d.read(100, &mut mid).unwrap();
        assert_eq!(mid, want[100..130]);
        let e = IndexedDataset::open(&prefix, 100).unwrap();
        let err = e.read(0, &mut [0; 8]).unwrap_err().to_string();
        assert!(err.contains("not below the vocabulary size 100"), "{err}");
    }
}

#[test]
fn damaged_indexes_are_named() {
    let s = Scratch::new("indexed");
    let src = fixtures().join("u16_text_document");
    let idx = std::fs::read(src.with_extension("idx")).unwrap();
    let bin = std::fs::read(src.with_extension("bin")).unwrap();
    let u64_le = |v: u64| v.to_le_bytes().to_vec();
    let patch = |at: usize, bytes: &[u8]| {
        let mut v = idx.clone();
        v[at..at + bytes.len()].copy_from_slice(bytes);
        v
    };
    // the first sequence's length, doubled: it then overlaps the second
    let first_len = i32::from_le_bytes(idx[34..38].try_into().unwrap());
    let cases: Vec<(&str, Vec<u8>, Vec<u8>, &str)> = vec![
        ("magic", patch(0, b"MMIDIDY"), bin.clone(), "MMIDIDX"),
        ("version", patch(9, &u64_le(2)), bin.clone(), "version 2"),
        (
            "dtype",
            patch(17, &[7]),
            bin.clone(),
            "dtype code 7 (float32)",
        ),
        ("counts", patch(18, &u64_le(1 << 40)), bin.clone(), "need"),
        (
            "truncated",
            idx[..idx.len() - 8].to_vec(),
            bin.clone(),
            "need",
        ),
        (
            "overlap",
            patch(34, &(2 * first_len).to_le_bytes()),
            bin.clone(),
            "back to back",
        ),
        (
            "short-bin",
            idx.clone(),
            bin[..bin.len() - 2].to_vec(),
            "past the end of the .bin",
        ),
        (
            "documents",
            patch(idx.len() - 8, &u64_le(0)),
            bin.clone(),
            "document boundary",
        ),
    ];
    for (name, i, b, needle) in cases {
        let prefix = s.0.join(name);
        std::fs::write(prefix.with_extension("idx"), i).unwrap();
        std::fs::write(prefix.with_extension("bin"), b).unwrap();
        let e = IndexedDataset::open(&prefix, 50000)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{name}: {e}");
        assert!(
            e.contains(&format!("{name}.idx")),
            "{name}: the error names the file: {e}"
        );
    }
}

/// ds-rs's writer, given megatron-core's documents, writes megatron-core's bytes: uint16 for
/// a vocabulary below 65500 and int32 above, as Megatron's optimal_dtype picks.
#[test]
fn the_writer_writes_megatron_cores_bytes() {
    let s = Scratch::new("indexed-writer");
    for (name, vocab) in [("u16", 50_000), ("i32", 70_000)] {
        let prefix = s.0.join(format!("{name}_text_document"));
        let mut w = IndexedWriter::create(&prefix, vocab).unwrap();
        for doc in documents() {
            let lengths: Vec<usize> = doc.iter().map(Vec::len).collect();
            w.add_document(&doc.concat(), &lengths).unwrap();
        }
        w.finish().unwrap();
        for ext in ["bin", "idx"] {
            let want =
                std::fs::read(fixtures().join(format!("{name}_text_document.{ext}"))).unwrap();
            let got = std::fs::read(prefix.with_extension(ext)).unwrap();
            assert!(got == want, "{name}.{ext} differs from megatron-core's");
        }
    }
}
