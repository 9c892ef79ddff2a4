//! The autotuner and `train` plan a job the same way: over the real ds_configs, every config
//! `train` accepts on 2 ranks, the autotuner accepts too (its search space, its workload and a
//! layout the job plan accepts), with no trial run.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::Tuner;
use crate::launch::LaunchArgs;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tests/fixtures")
}

/// Every real config DeepSpeed 0.19.8 gave a verdict on at world size 2.
fn corpus() -> Vec<String> {
    let verdicts =
        std::fs::read_to_string(fixtures().join("deepspeed-verdicts/real.ws2.jsonl")).unwrap();
    verdicts
        .lines()
        .map(|l| serde_json::from_str::<Json>(l).unwrap())
        .map(|v| v["file"].as_str().unwrap().to_string())
        .collect()
}

fn launch_args(words: &[&str]) -> LaunchArgs {
    #[derive(clap::Parser)]
    struct Launch {
        #[command(flatten)]
        args: LaunchArgs,
    }
    <Launch as clap::Parser>::try_parse_from(words)
        .unwrap()
        .args
}

#[test]
fn the_autotuner_accepts_every_real_config_train_accepts() {
    let dir = std::env::temp_dir().join(format!("ds-rs-tune-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // the tests' small GPT (tests/common's SMALL_MODEL)
    let model = dir.join("model.json");
    std::fs::write(&model, r#"{"V": 512, "T": 32, "d": 64, "H": 2, "L": 2}"#).unwrap();
    let model = model.display().to_string();
    let (mut accepted, mut refused_by_tuner) = (0, Vec::new());
    let files = corpus();
    for (i, file) in files.iter().enumerate() {
        // read as DeepSpeed reads it (hjson); one DeepSpeed refuses to read is no job
        let Ok(doc) = ds_config::load(&fixtures().join("real").join(file)) else {
            continue;
        };
        let mut doc = doc.to_json();
        // NVMe offload's paths, and the tuner's directories, inside the scratch directory
        scratch_paths(&mut doc, &dir);
        let cfg = dir.join(format!("{i}.json"));
        std::fs::write(&cfg, doc.to_string()).unwrap();
        let cfg = cfg.display().to_string();
        let program = ["train", "--model", &model, "--steps", "2"];
        // as the launcher passes the config to its ranks
        let mut train = super::parse_train(&program.map(String::from)).unwrap();
        train.config = Some(PathBuf::from(&cfg));
        if let Err(e) = crate::train::plan(&train, 2) {
            eprintln!("train refuses {file}: {e:#}");
            continue;
        }
        accepted += 1;
        let mut words = vec!["launch", "--nproc_per_node", "2", "--config", &cfg];
        words.extend(program);
        if let Err(e) = Tuner::plan(&launch_args(&words)) {
            refused_by_tuner.push(format!("{file}: {e:#}"));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    eprintln!(
        "{} configs: train accepts {accepted}, the autotuner refuses {} of them",
        files.len(),
        refused_by_tuner.len()
    );
    assert!(accepted >= 70, "train accepts only {accepted} configs");
    assert!(refused_by_tuner.is_empty(), "{refused_by_tuner:#?}");
}

/// `nvme_path` values and the autotuning section's directories -> under `dir`.
fn scratch_paths(doc: &mut Json, dir: &Path) {
    for key in ["offload_optimizer", "offload_param"] {
        let offload = doc
            .get_mut("zero_optimization")
            .and_then(|z| z.get_mut(key));
        if let Some(o) = offload.and_then(Json::as_object_mut) {
            if o.contains_key("nvme_path") {
                o.insert("nvme_path".into(), dir.display().to_string().into());
            }
        }
    }
    if let Some(at) = doc.get_mut("autotuning").and_then(Json::as_object_mut) {
        at.insert(
            "results_dir".into(),
            dir.join("results").display().to_string().into(),
        );
        at.insert(
            "exps_dir".into(),
            dir.join("exps").display().to_string().into(),
        );
    }
}
