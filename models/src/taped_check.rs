//! For the tests of every family: each layer's hand-written backward (its `Tape`) against
//! candle's autograd of its `forward`, on the output, the input gradient and every parameter
//! gradient. A layer that adds a loss (`Context::add_loss`, an MoE router's) is checked on
//! the model's loss with that loss added at a seed of its own.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use ds_nn::model::{Context, Model};

/// Values in [-1, 1) from a fixed linear congruential sequence.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Checks every layer of `model` (token ids in, then activations of `width`, logits of `vocab`
/// into the loss) on a [b, t] batch; `what` names the model in failures.
pub fn check_layers(model: &Model, (b, t): (usize, usize), width: usize, vocab: usize, what: &str) {
    let dev = Device::Cpu;
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % vocab) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), &dev).unwrap();
    let targets: Vec<u32> = (0..b * t).map(|i| (i * 5 % vocab) as u32).collect();
    let targets = ds_nn::Targets::all(Tensor::from_vec(targets, (b, t), &dev).unwrap());
    // the seed of added losses: unlike 1, so that a tape that ignores it fails
    const ADDED_SEED: f64 = 0.75;
    let last = model.layers().len() - 1;
    for (li, layer) in model.layers().iter().enumerate() {
        let specs = layer.layer.params();
        let vars: Vec<Var> = specs
            .iter()
            .enumerate()
            .map(|(k, p)| {
                // norm weights near 1, like trained ones
                let offset = if p.norm && p.name.ends_with("weight") {
                    1.0
                } else {
                    0.0
                };
                let v: Vec<f32> = values(p.numel(), (li * 100 + k) as u64)
                    .into_iter()
                    .map(|x| x * 0.5 + offset)
                    .collect();
                Var::from_vec(v, p.shape.as_slice(), &dev).unwrap()
            })
            .collect();
        let vb = |tracked: bool| {
            let map: HashMap<String, Tensor> = specs
                .iter()
                .zip(&vars)
                .map(|(p, v)| {
                    let t = v.as_tensor();
                    (p.name.clone(), if tracked { t.clone() } else { t.detach() })
                })
                .collect();
            VarBuilder::from_tensors(map, DType::F32, &dev)
        };
        let input = match li {
            0 => Var::from_tensor(&ids).unwrap(),
            _ if li == last => {
                Var::from_vec(values(b * t * vocab, 9), (b, t, vocab), &dev).unwrap()
            }
            _ => Var::from_vec(values(b * t * width, 7 + li as u64), (b, t, width), &dev).unwrap(),
        };
        // the upstream gradient: random for activations, a loss seed for the loss
        let added = RefCell::new(Vec::new());
        let cx = Context::of_targets(&targets).adding_into(&added);
        let y = layer
            .layer
            .forward(&vb(true), input.as_tensor(), &cx)
            .unwrap();
        let dy = match y.rank() {
            0 => Tensor::new(3.0f32, &dev).unwrap(),
            _ => Tensor::from_vec(values(y.elem_count(), 11), y.shape(), &dev).unwrap(),
        };
        let mut loss = (&y * &dy).unwrap().sum_all().unwrap();
        let added = added.into_inner();
        for a in &added {
            loss = (loss + a.affine(ADDED_SEED, 0.0).unwrap()).unwrap();
        }
        let reference = loss.backward().unwrap();
        let taped_added = RefCell::new(Vec::new());
        let cx = Context::of_targets(&targets).adding_into(&taped_added);
        let mut taped = layer
            .layer
            .forward_taped(&vb(false), &input.as_tensor().detach(), &cx)
            .unwrap()
            .expect("the layers are taped");
        taped.tape.seed_added_loss(ADDED_SEED);
        let grads = taped.tape.backward(&dy, &vb(false)).unwrap();
        let mut pairs = vec![("output".to_string(), flat(&taped.output), flat(&y))];
        let values = |l: &[Tensor]| l.iter().map(|a| a.to_scalar::<f32>().unwrap()).collect();
        pairs.push((
            "added losses".into(),
            values(&taped_added.into_inner()),
            values(&added),
        ));
        if li > 0 {
            let dx = grads.input.as_ref().expect("an input gradient");
            pairs.push((
                "input".into(),
                flat(dx),
                flat(reference.get(&input).unwrap()),
            ));
        }
        assert_eq!(grads.params.len(), specs.len(), "{what} layer {li}");
        for ((p, v), g) in specs.iter().zip(&vars).zip(&grads.params) {
            pairs.push((p.name.clone(), flat(g), flat(reference.get(v).unwrap())));
        }
        for (name, got, want) in pairs {
            assert_eq!(got.len(), want.len(), "{what} layer {li} {name}");
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                // two f32 evaluations of the same derivative in different orders
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + scale),
                    "{what} layer {li} {name}: {g} vs {w}"
                );
            }
        }
    }
}
