use super::*;
use crate::hjson;

fn dict(text: &str) -> Dict {
    hjson::parse(text).unwrap().as_dict().unwrap().clone()
}

fn ctx(dp: i64, hidden: Option<i64>) -> FillContext {
    FillContext {
        data_parallel: dp,
        hidden_size: hidden,
        run_steps: Some(100),
    }
}

fn get(filled: &[Filled], path: &str) -> Option<Json> {
    filled
        .iter()
        .find(|(k, _)| k == path)
        .map(|(_, v)| v.clone())
}

#[test]
fn fills_like_the_hf_trainer() {
    let mut d = dict(
        r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 4, "optimizer": {"params": {"lr": "auto"}},
            "scheduler": {"params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}"#,
    );
    let args = TrainingArgs {
        per_device_train_batch_size: Some(2),
        learning_rate: Some(3e-4),
        warmup_steps: Some(0.1),
        ..TrainingArgs::default()
    };
    let filled = fill(&mut d, &args, &ctx(2, Some(64))).unwrap();
    assert_eq!(get(&filled, "train_batch_size"), Some(Json::from(16)));
    assert_eq!(
        get(&filled, "gradient_accumulation_steps"),
        None,
        "not auto, left alone"
    );
    assert_eq!(get(&filled, "optimizer.params.lr"), Some(Json::from(3e-4)));
    // HF: max(1, ceil(100 * 0.1)); the run's 100 steps are the schedule's total
    assert_eq!(
        get(&filled, "scheduler.params.warmup_num_steps"),
        Some(Json::from(10))
    );
    assert_eq!(
        get(&filled, "scheduler.params.total_num_steps"),
        Some(Json::from(100))
    );
    // HF: hidden^2, int(0.9 * hidden^2), 10 * hidden.
    assert_eq!(
        get(&filled, "zero_optimization.reduce_bucket_size"),
        Some(Json::from(4096))
    );
    assert_eq!(
        get(&filled, "zero_optimization.stage3_prefetch_bucket_size"),
        Some(Json::from(3686))
    );
    assert_eq!(
        get(
            &filled,
            "zero_optimization.stage3_param_persistence_threshold"
        ),
        Some(Json::from(640))
    );
    assert!(remaining(&d).is_empty(), "{:?}", remaining(&d));
}

/// HF's `is_zero3`: the stage-3 bucket keys stay "auto" below stage 3.
#[test]
fn stage3_keys_only_at_stage_3() {
    let mut d = dict(
        r#"{"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
              "stage3_prefetch_bucket_size": "auto"}}"#,
    );
    fill(&mut d, &TrainingArgs::default(), &ctx(1, Some(8))).unwrap();
    assert_eq!(
        remaining(&d),
        ["zero_optimization.stage3_prefetch_bucket_size"]
    );
}

/// See Note [given and default]: a config number wins over a default, loses to nothing.
#[test]
fn arguments_left_out_take_the_configs_numbers() {
    let text = r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
                   "fp16": {"enabled": true}}"#;
    let mut d = dict(text);
    let filled = fill(&mut d, &TrainingArgs::default(), &ctx(2, None)).unwrap();
    // DeepSpeed's triad rule: 32 / (4 x 2)
    assert_eq!(
        get(&filled, "train_micro_batch_size_per_gpu"),
        Some(Json::from(4))
    );
    let given = TrainingArgs {
        per_device_train_batch_size: Some(8),
        max_grad_norm: Some(1.0),
        ..TrainingArgs::default()
    };
    let err = fill(&mut dict(text), &given, &ctx(2, None)).unwrap_err();
    assert_eq!(err.paths(), ["train_batch_size", "gradient_clipping"]);
    let msg = err.to_string();
    assert!(
        msg.contains("gradient_clipping = 0.5 in the config vs 1.0 from --max_grad_norm"),
        "{msg}"
    );
    assert!(
        msg.contains("train_batch_size = 32 in the config vs 64 from"),
        "{msg}"
    );
}

#[test]
fn unknown_sources_stay_auto() {
    let mut d = dict(
        r#"{"bfloat16": {"enabled": "auto"}, "zero_optimization": {"reduce_bucket_size": "auto"}}"#,
    );
    assert!(fill(&mut d, &TrainingArgs::default(), &ctx(1, None))
        .unwrap()
        .is_empty());
    assert_eq!(
        remaining(&d),
        ["bfloat16.enabled", "zero_optimization.reduce_bucket_size"]
    );
}

/// A given flag with nothing to fill is a warning naming the key that would take it; with no
/// optimizer section the optimizer flags build the program's AdamW and say nothing.
#[test]
fn flags_with_nothing_to_fill_are_warned_about() {
    let args = TrainingArgs {
        learning_rate: Some(1e-3),
        bf16: Some(true),
        warmup_steps: Some(10.0),
        ..TrainingArgs::default()
    };
    let d = dict(r#"{"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95]}}}"#);
    let warned = unused_flags(&d, &args);
    assert_eq!(warned.len(), 3, "{warned:?}");
    assert!(
        warned[0].starts_with("--learning_rate: no effect: the config has no optimizer.params.lr"),
        "{warned:?}"
    );
    assert!(unused_flags(&dict(r#"{"bf16": {"enabled": "auto"}}"#), &args).is_empty());
}
