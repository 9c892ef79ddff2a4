//! transformers' causal-LM example command line (`run_clm.py` under `deepspeed`) given to
//! `ds-rs launch ... train` as it is: a Llama directory whose config.json transformers wrote
//! (models/tests/fixtures/hf/llama, its vocabulary widened to the tokenizer's), a tokenizer.json
//! the tokenizers library wrote, a text file, and transformers' own "auto" ZeRO-2 config. Each
//! argument's effect is checked: the run's length, the log lines, the checkpoint schedule and
//! limit, the resume, the TensorBoard files and the exported model.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(180);
const CONFIG: &str =
    "configs/tests/fixtures/real/huggingface__transformers__tests__deepspeed__ds_config_zero2.json";

/// A Hugging Face model directory: the fixture Llama's config.json with room for the
/// byte-level tokenizer's 1025 ids, no weights (a new model, as run_clm.py's --config_name).
fn model_dir(s: &Scratch) -> std::path::PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = s.path("model");
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(root.join("models/tests/fixtures/hf/llama/config.json"));
    let mut config: serde_json::Value = serde_json::from_str(&text.unwrap()).unwrap();
    config["vocab_size"] = 1088.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tokenizer = root.join("data/tests/fixtures/tokenize/bytelevel/tokenizer.json");
    std::fs::copy(tokenizer, dir.join("tokenizer.json")).unwrap();
    dir
}

/// A few hundred lines of text (a fixed word list drawn by a fixed rule).
fn text_file(s: &Scratch) -> std::path::PathBuf {
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "slept",
    ];
    let lines: Vec<String> = (0..300)
        .map(|i| {
            let n = 5 + i % 23;
            let line: Vec<&str> = (0..n)
                .map(|j| words[(i * 7 + j * 3) % words.len()])
                .collect();
            line.join(" ")
        })
        .collect();
    s.write("train.txt", &lines.join("\n"))
}

/// run_clm.py's arguments for this test's files.
fn run_clm(model: &Path, text: &Path, out: &Path, extra: &str) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    format!(
        "launch --nproc_per_node 2 train --deepspeed {root}/{CONFIG} --model_name_or_path {} \
         --train_file {} --block_size 32 --per_device_train_batch_size 2 --do_train --do_eval \
         --max_steps 7 --logging_steps 2 --save_steps 3 --save_total_limit 1 --seed 7 \
         --output_dir {} {extra}",
        model.display(),
        text.display(),
        out.display()
    )
}

fn ok(cmd: &str) -> Finished {
    let f = run(cmd, LIMIT);
    assert!(f.status.success(), "{cmd}:\n{}\n{}", f.stdout, f.stderr);
    f
}

/// The progress lines' step numbers ("[rank0] step N/7 | loss ...").
fn logged_steps(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|l| {
            l.trim_start_matches("[rank0] ")
                .strip_prefix("step ")?
                .split_once("/7 |")
        })
        .map(|(n, _)| n.parse().unwrap())
        .collect()
}

#[test]
fn run_clm_arguments_do_what_they_say() {
    let s = Scratch::new("run-clm");
    let (model, text) = (model_dir(&s), text_file(&s));
    let out = s.path("out");
    let straight = ok(&run_clm(&model, &text, &out, "--report_to tensorboard"));

    // --max_steps 7 is the run's length, --logging_steps 2 the progress lines
    let losses = common::losses(&out);
    assert_eq!(losses.len(), 7, "{}", straight.stdout);
    assert_eq!(
        logged_steps(&straight.stdout),
        [2, 4, 6, 7],
        "{}",
        straight.stdout
    );
    // --save_steps 3: checkpoints after steps 3 and 6, none after the last;
    // --save_total_limit 1 keeps the newest alone
    for tag in ["global_step3", "global_step6"] {
        assert!(
            straight.stdout.contains(&format!("{tag} in")),
            "{}",
            straight.stdout
        );
    }
    assert!(
        !straight.stdout.contains("global_step7"),
        "{}",
        straight.stdout
    );
    let kept: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("global_step"))
        .collect();
    assert_eq!(kept, ["global_step6"]);
    // trainer.save_model(): the trained model as a Hugging Face directory in --output_dir
    assert!(out.join("model.safetensors").is_file() && out.join("config.json").is_file());
    // --report_to tensorboard: an event file under OUTPUT_DIR/runs
    let runs: Vec<_> = std::fs::read_dir(out.join("runs")).unwrap().collect();
    assert_eq!(runs.len(), 1);
    trainer_tags_read_back(&runs[0].as_ref().unwrap().path(), &losses);

    // --resume_from_checkpoint PATH continues from step 6 with the straight run's last loss
    let resumed_dir = s.path("resumed");
    let from = out.join("global_step6");
    let extra = format!("--resume_from_checkpoint {}", from.display());
    let resumed = ok(&run_clm(&model, &text, &resumed_dir, &extra));
    assert!(resumed.stdout.contains("at step 6"), "{}", resumed.stdout);
    assert_eq!(
        common::losses(&resumed_dir),
        losses[6..],
        "resumed vs straight"
    );

    // the same --output_dir again resumes from its newest checkpoint, as run_clm.py does
    let again = ok(&run_clm(&model, &text, &out, ""));
    assert!(again.stdout.contains("resumed from"), "{}", again.stdout);
    assert_eq!(
        common::losses(&out),
        losses,
        "output_dir resumed vs straight"
    );
}

/// The event file read back by TensorBoard's own reader (when DS_RS_PYTHON names a Python
/// with it): the Trainer's tags at the global step, train/loss the losses of metrics.jsonl.
fn trainer_tags_read_back(file: &Path, losses: &[f64]) {
    let Some(scalars) = tensorboard_scalars(file) else {
        return;
    };
    let of = |tag: &str| scalars.get(tag).cloned().unwrap_or_default();
    let want: Vec<(u64, f32)> = losses
        .iter()
        .enumerate()
        .map(|(i, l)| (i as u64 + 1, *l as f32))
        .collect();
    assert_eq!(of("train/loss"), want);
    for tag in ["train/learning_rate", "train/grad_norm"] {
        assert_eq!(of(tag).len(), losses.len(), "{tag}");
    }
    let eval = of("eval/loss");
    assert_eq!(eval.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [7]);
}

/// Each Trainer argument that would act on nothing without another is refused by name before
/// any rank starts, and a non-empty --output_dir without a checkpoint is not trained into.
#[test]
fn trainer_arguments_without_what_they_need_are_refused() {
    let s = Scratch::new("run-clm-refused");
    let (model, text) = (model_dir(&s), text_file(&s));
    let full = s.path("full");
    std::fs::create_dir_all(&full).unwrap();
    s.write("full/notes.txt", "kept");
    let base = format!(
        "launch --nproc_per_node 2 train --model_name_or_path {} --train_file {} --max_steps 1",
        model.display(),
        text.display()
    );
    let cases = [
        (
            format!("--output_dir {}", full.display()),
            "--overwrite_output_dir",
        ),
        ("--save_steps 2".to_string(), "--output_dir"),
        ("--overwrite_output_dir".to_string(), "--output_dir"),
        ("--eval_steps 2".to_string(), "--eval_strategy steps"),
        ("--do_eval".to_string(), "--do_train"),
        ("--report_to wandb".to_string(), "--report_to wandb"),
        ("--logging_dir logs".to_string(), "--report_to tensorboard"),
        ("--resume_from_checkpoint".to_string(), "--output_dir"),
        ("--block_size 16 --seq-len 32".to_string(), "--block_size"),
    ];
    for (extra, named) in cases {
        let f = run(&format!("{base} {extra}"), LIMIT);
        assert!(!f.status.success(), "{extra}: {}", f.stdout);
        let errors = error_lines(&f.stderr);
        assert_eq!(errors.len(), 1, "{extra}: {}", f.stderr);
        assert!(errors[0].contains(named), "{extra}: {}", errors[0]);
        assert!(!f.stderr.contains("panicked"), "{extra}: {}", f.stderr);
    }
    assert_eq!(
        std::fs::read_to_string(full.join("notes.txt")).unwrap(),
        "kept"
    );
}
