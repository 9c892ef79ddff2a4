//! ds-rs's MoE layer against DeepSpeed 0.19.8's (`deepspeed.moe.layer.MoE`, ep_size 1, run on
//! the CPU by models/tests/fixtures/moe_layer/gen_moe_layer.py): on the same weights and tokens, top-1, 2
//! and 3 with and without dropping, the output, `l_aux`, and the gradients of
//! `(output * R).sum() + 0.01 * l_aux` for the router, every expert weight and the input. The
//! layer adds `0.01 * l_aux` itself (`Context::add_loss`), as the engine then differentiates.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use candle_nn::VarBuilder;
use ds_engine::model::{Context, Layer};
use ds_engine::Inputs;
use ds_models::moe::gating::{DropPolicy, GateConfig};
use ds_models::moe::MoeLayer;
use serde_json::Value;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn shape(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

/// The largest difference relative to the largest reference value.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    max_abs(got, want) / scale
}

fn max_abs(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
}

/// A gradient's bar: 1e-4 of its largest value, but not below 2e-6. The router's gradient
/// is a sum over 20 tokens of terms of order 1 (hidden state x the output's gradient through
/// the softmax) that nearly cancel, to ~1e-4: f32 rounding of those terms (~20 x 3 x 6e-8)
/// alone is a few 1e-6 of it in absolute terms, however right the arithmetic.
fn grad_ok(got: &[f32], want: &[f32]) -> bool {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    max_abs(got, want) <= (1e-4 * scale).max(2e-6)
}

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/tests/fixtures/moe_layer/moe_layer.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The layer of fixture case `c`.
fn layer_of(f: &Value, c: &Value) -> MoeLayer {
    let n = |k: &str| f[k].as_u64().unwrap() as usize;
    let gate = GateConfig {
        k: c["k"].as_u64().unwrap() as usize,
        capacity_factor: c["capacity_factor"].as_f64().unwrap(),
        min_capacity: n("min_capacity"),
        drop_tokens: c["drop_tokens"].as_bool().unwrap(),
        drop_policy: DropPolicy::Probs,
    };
    let coef = f["coef"].as_f64().unwrap();
    MoeLayer::new(n("d"), n("ffn"), n("experts"), gate, coef).unwrap()
}

#[test]
fn moe_layer_equals_deepspeeds() {
    let f = fixture();
    let n = |k: &str| f[k].as_u64().unwrap() as usize;
    let (d, tokens) = (n("d"), n("tokens"));
    let dev = Device::Cpu;
    for c in f["cases"].as_array().unwrap() {
        let layer = layer_of(&f, c);
        let name = format!("k {} drop {}", layer.gate.k, layer.gate.drop_tokens);
        // the parameters as autograd variables, under the layer's names
        let mut vars: HashMap<String, Var> = HashMap::new();
        for spec in layer.params() {
            assert_eq!(
                shape(&c["shapes"][&spec.name]),
                spec.shape,
                "{name}: {}",
                spec.name
            );
            let t = Tensor::from_vec(
                floats(&c["params"][&spec.name]),
                spec.shape.as_slice(),
                &dev,
            )
            .unwrap();
            vars.insert(spec.name.clone(), Var::from_tensor(&t).unwrap());
        }
        let map = vars
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        let vb = VarBuilder::from_tensors(map, candle_core::DType::F32, &dev);
        let x =
            Var::from_tensor(&Tensor::from_vec(floats(&c["x"]), (2, tokens / 2, d), &dev).unwrap())
                .unwrap();
        let r = Tensor::from_vec(floats(&c["r"]), (2, tokens / 2, d), &dev).unwrap();

        let (inputs, added) = (Inputs::new(), RefCell::new(Vec::new()));
        let cx = Context::new(&inputs).adding_into(&added);
        let out = layer.forward(&vb, x.as_tensor(), &cx).unwrap();
        let added = added.into_inner();
        assert_eq!(added.len(), 1, "{name}: the layer adds its l_aux");
        let coef_l_aux = added[0].to_scalar::<f32>().unwrap();
        let want_l_aux = c["l_aux"].as_f64().unwrap() as f32 * f["coef"].as_f64().unwrap() as f32;
        assert!(
            (coef_l_aux - want_l_aux).abs() <= 1e-7,
            "{name}: coef x l_aux {coef_l_aux} against {want_l_aux}"
        );
        let got_out = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // f32 sums in another order: a few ulps of the largest value
        let e = rel(&got_out, &floats(&c["output"]));
        assert!(e <= 1e-5, "{name}: output {e:e} off");

        let loss = ((out * &r).unwrap().sum_all().unwrap() + &added[0]).unwrap();
        let grads = loss.backward().unwrap();
        for (pname, var) in &vars {
            let g = grads
                .get(var.as_tensor())
                .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let want = floats(&c["grads"][pname]);
            let g = g.unwrap_or_else(|| vec![0.0; want.len()]);
            let e = max_abs(&g, &want);
            assert!(grad_ok(&g, &want), "{name}: gradient of {pname} {e:e} off");
        }
        let gx = grads
            .get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let e = max_abs(&gx, &floats(&c["grad_x"]));
        assert!(
            grad_ok(&gx, &floats(&c["grad_x"])),
            "{name}: gradient of the input {e:e} off"
        );
    }
}

/// One SGD step (learning rate 1, no clipping) of the MoE layer through the engine, in
/// every case: the parameters move by DeepSpeed's gradients, the router's load-balancing loss
/// included (the engine seeds the loss the layer added with the model's). The engine runs
/// the layer's own backward (its tape), not autograd. `added_loss` reports DeepSpeed's
/// `0.01 * l_aux`.
#[test]
fn one_engine_step_moves_the_parameters_by_deepspeeds_gradients() {
    let f = fixture();
    for c in f["cases"].as_array().unwrap() {
        engine_step(&f, c);
    }
}

fn engine_step(f: &Value, c: &Value) {
    use ds_engine::model::Model;
    use ds_engine::{EngineOptions, Job};
    let n = |k: &str| f[k].as_u64().unwrap() as usize;
    let (d, tokens) = (n("d"), n("tokens"));
    let layer = layer_of(f, c);
    let case = format!("k {} drop {}", layer.gate.k, layer.gate.drop_tokens);
    let dir = std::env::temp_dir().join(format!("ds-rs-moe-step-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let init = dir.join("init.safetensors");
    let value = |name: &str, shape: &[usize]| {
        Tensor::from_vec(floats(&c["params"][name]), shape, &Device::Cpu).unwrap()
    };
    let tensors: HashMap<String, Tensor> = layer
        .params()
        .iter()
        .map(|p| (p.name.clone(), value(&p.name, &p.shape)))
        .collect();
    candle_core::safetensors::save(&tensors, &init).unwrap();
    let config = r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}"#;
    let (x, r) = (floats(&c["x"]), floats(&c["r"]));
    let model_layer = layer.clone();
    let opts = EngineOptions {
        init: Some(init),
        ..EngineOptions::default()
    };
    let mut ranks =
        ds_comm::testkit::run_ranks(1, std::time::Duration::from_secs(60), move |comm| {
            let job = Job::join(&comm, config)?;
            let mut engine = job.initialize(Model::new().layer("", model_layer.clone()), &opts)?;
            let shape = (2, tokens / 2, d);
            let x = Tensor::from_vec(x.clone(), shape, &Device::Cpu)?;
            let r = Tensor::from_vec(r.clone(), shape, &Device::Cpu)?;
            let out = engine.forward(&Inputs::new().with("x", x))?;
            let added = engine.added_loss()?;
            engine.backward(&(out * r)?.sum_all()?)?;
            engine.step()?;
            Ok::<_, ds_engine::EngineError>((added, engine.gather_params()?))
        })
        .unwrap();
    let (added, after) = ranks.remove(0);
    let want = c["l_aux"].as_f64().unwrap() as f32 * f["coef"].as_f64().unwrap() as f32;
    assert!(
        (added - want).abs() <= 1e-7,
        "{case}: added loss {added} against {want}"
    );
    for (name, after) in &after {
        let before = floats(&c["params"][name]);
        let moved: Vec<f32> = before.iter().zip(after).map(|(b, a)| b - a).collect();
        let want = floats(&c["grads"][name]);
        let e = max_abs(&moved, &want);
        assert!(
            grad_ok(&moved, &want),
            "{case}: {name} moved by {e:e} off DeepSpeed's gradient"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_top_k_above_the_expert_count_is_an_error() {
    let gate = GateConfig {
        k: 5,
        capacity_factor: 1.0,
        min_capacity: 4,
        drop_tokens: true,
        drop_policy: DropPolicy::Probs,
    };
    let e = MoeLayer::new(8, 16, 4, gate, 0.01).unwrap_err();
    assert!(e.contains("top-k 5") && e.contains("4"), "{e}");
    let gate = GateConfig {
        k: 2,
        capacity_factor: 0.0,
        ..gate
    };
    assert!(MoeLayer::new(8, 16, 4, gate, 0.01)
        .unwrap_err()
        .contains("capacity_factor"));
}

/// Under expert parallelism no rank holds every expert: `gather_params` is an error that
/// names it (and what writes the whole model), not a model missing its experts.
#[test]
fn gathering_the_parameters_under_expert_parallelism_is_an_error() {
    use ds_engine::model::Model;
    use ds_engine::parallel::Tp;
    use ds_engine::{EngineOptions, Job};
    let config = r#"{"train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "expert_parallel": {"enabled": true, "autoep_size": 2}}"#;
    let errors = ds_comm::testkit::run_ranks(2, std::time::Duration::from_secs(60), |comm| {
        let job = Job::join(&comm, config)?;
        let gate = GateConfig {
            k: 1,
            capacity_factor: 1.0,
            min_capacity: 1,
            drop_tokens: true,
            drop_policy: DropPolicy::Probs,
        };
        let layer = MoeLayer::new(8, 12, 4, gate, 0.01)
            .unwrap()
            .parallel(&Tp::none(), &job.ep())
            .unwrap();
        let engine = job.initialize(Model::new().layer("", layer), &EngineOptions::default())?;
        Ok::<_, ds_engine::EngineError>(engine.gather_params().unwrap_err().to_string())
    })
    .unwrap();
    for e in errors {
        assert!(
            e.contains("expert parallelism (ep 2)") && e.contains("save_weights"),
            "{e}"
        );
    }
}
