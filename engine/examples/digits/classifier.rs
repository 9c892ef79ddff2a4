//! A convolutional classifier of 8x8 handwritten digits in plain candle-nn, the data, and the
//! training loop through the engine: f32 images in, logits out, the program's cross-entropy,
//! accuracy from the returned logits.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{conv2d, linear, Conv2d, Conv2dConfig, Linear, VarBuilder};
use ds_engine::model::Model;
use ds_engine::{Engine, Inputs};

/// conv 3x3 (16 channels) -> ReLU -> 2x2 max-pool -> linear to the 10 classes.
pub struct Cnn {
    conv: Conv2d,
    fc: Linear,
}

impl Cnn {
    pub fn new(vb: VarBuilder) -> Result<Cnn> {
        let same = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        Ok(Cnn {
            conv: conv2d(1, 16, 3, same, vb.pp("conv"))?,
            fc: linear(16 * 4 * 4, 10, vb.pp("fc"))?,
        })
    }
}

impl Module for Cnn {
    /// Images [b, 1, 8, 8] to logits [b, 10].
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv.forward(x)?.relu()?.max_pool2d(2)?;
        self.fc.forward(&h.flatten_from(1)?)
    }
}

/// Images and labels: 64 pixel bytes (0..16) and a label byte per image (data/gen_digits.py).
pub struct Digits {
    pixels: Vec<f32>,
    labels: Vec<u32>,
}

pub const TRAIN: &[u8] = include_bytes!("data/train.u8");
pub const TEST: &[u8] = include_bytes!("data/test.u8");

impl Digits {
    pub fn read(bytes: &[u8]) -> Digits {
        let records = bytes.chunks_exact(65);
        Digits {
            // pixels scaled to [0, 1]
            pixels: records
                .clone()
                .flat_map(|r| r[..64].iter().map(|&p| p as f32 / 16.0))
                .collect(),
            labels: records.map(|r| r[64] as u32).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Images `at` as [n, 1, 8, 8] and their labels [n].
    pub fn batch(&self, at: &[usize]) -> Result<(Tensor, Tensor)> {
        let px = at
            .iter()
            .flat_map(|&i| self.pixels[i * 64..(i + 1) * 64].to_vec());
        let images = Tensor::from_vec(px.collect(), (at.len(), 1, 8, 8), &Device::Cpu)?;
        let labels = at.iter().map(|&i| self.labels[i]).collect::<Vec<_>>();
        Ok((images, Tensor::from_vec(labels, at.len(), &Device::Cpu)?))
    }
}

/// The training images of micro-batch `k` of `step` on this rank: each epoch a new order
/// (the same on every rank), each step the next global batch of it, each rank and
/// micro-batch its own part, so every layout trains on the same global batches.
pub fn micro_batch_indices(n: usize, engine: &Engine, step: u64, k: usize) -> Vec<usize> {
    let s = engine.settings();
    let dp = engine.groups().dp();
    let (micro, global) = (s.micro_batch, s.micro_batch * s.grad_accum * dp.size());
    let per_epoch = (n / global) as u64;
    let (epoch, within) = (step / per_epoch, (step % per_epoch) as usize);
    let order = permutation(n, epoch);
    let start = within * global + (k * dp.size() + dp.rank()) * micro;
    order[start..start + micro].to_vec()
}

/// A permutation of 0..n, Fisher-Yates driven by splitmix64 seeded with the epoch.
fn permutation(n: usize, epoch: u64) -> Vec<usize> {
    let mut state = epoch.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    order
}

/// The classifier as ds-rs trains it: one module, built by candle-nn code.
pub fn build() -> ds_engine::Result<Model> {
    Ok(Model::new().module("", Cnn::new)?)
}

/// Trains `steps` optimizer steps; returns each step's loss on this rank's samples (the mean
/// over its micro-batches).
pub fn train(engine: &mut Engine, data: &Digits, steps: u64) -> ds_engine::Result<Vec<f32>> {
    let accum = engine.settings().grad_accum;
    let mut losses = Vec::new();
    for step in 0..steps {
        let mut total = 0.0;
        for k in 0..accum {
            let at = micro_batch_indices(data.len(), engine, step, k);
            let (images, labels) = data.batch(&at)?;
            let logits = engine.forward(&Inputs::new().with("images", images))?;
            let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
            engine.backward(&loss)?;
            engine.step()?;
            total += loss.to_scalar::<f32>()? / accum as f32;
        }
        losses.push(total);
    }
    Ok(losses)
}

/// The share of `data` the model classifies right, from the logits it returns.
pub fn accuracy(engine: &mut Engine, data: &Digits) -> ds_engine::Result<f64> {
    let all: Vec<usize> = (0..data.len()).collect();
    let (images, labels) = data.batch(&all)?;
    let logits = engine.infer(&Inputs::new().with("images", images))?;
    let right = logits.argmax(1)?.eq(&labels)?.to_dtype(DType::F32)?;
    Ok(right.sum_all()?.to_scalar::<f32>()? as f64 / data.len() as f64)
}
