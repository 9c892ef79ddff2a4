//! The default sequence length of a Hugging Face directory: its max_position_embeddings, up to
//! `DEFAULT_MAX_SEQ` (a Llama 3 config.json says 131,072, which no machine here holds).

use super::{ModelSpec, DEFAULT_MAX_SEQ};

/// A model directory holding the llama fixture's config.json with `max_position_embeddings`
/// set to `max`.
fn hf_dir(max: u64) -> std::path::PathBuf {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf/llama/config.json"
    );
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    config["max_position_embeddings"] = max.into();
    let dir = std::env::temp_dir().join(format!("ds-rs-seq-len-{}-{max}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn a_long_context_config_trains_at_2048_positions_unless_asked() {
    let dir = hf_dir(131_072);
    let name = dir.to_str().unwrap();
    let spec = ModelSpec::resolve(name, None).unwrap();
    assert_eq!((spec.seq_len, spec.max_positions()), (2048, 131_072));
    assert_eq!(DEFAULT_MAX_SEQ, 2048);
    assert_eq!(ModelSpec::resolve(name, Some(4096)).unwrap().seq_len, 4096);
    std::fs::remove_dir_all(&dir).unwrap();
    // a shorter model keeps its own length
    let short = hf_dir(512);
    let spec = ModelSpec::resolve(short.to_str().unwrap(), None).unwrap();
    assert_eq!(spec.seq_len, 512);
    std::fs::remove_dir_all(&short).unwrap();
}
