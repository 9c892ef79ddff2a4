//! The vocabulary-parallel cross-entropy for users' autograd models
//! (`parallel::vocab_parallel_cross_entropy`): with the logits' columns split over two
//! tensor-parallel ranks, each rank's loss and the gradient of its columns equal those of
//! candle-nn's cross-entropy over the whole logits (an independent composition: log-softmax
//! and a gather on one process).

use std::time::Duration;

use candle_core::{Device, Tensor, Var};
use ds_comm::testkit::run_ranks;
use ds_engine::parallel::{vocab_parallel_cross_entropy, Tp};

const N: usize = 6;
const V: usize = 10;

fn logits() -> Tensor {
    let v: Vec<f32> = (0..N * V)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.31)
        .collect();
    Tensor::from_vec(v, (N, V), &Device::Cpu).unwrap()
}

fn targets() -> Tensor {
    // targets on both halves of the vocabulary
    Tensor::from_vec(vec![0u32, 9, 4, 5, 7, 2], N, &Device::Cpu).unwrap()
}

#[test]
fn vocab_parallel_cross_entropy_equals_the_whole_one() {
    let whole = Var::from_tensor(&logits()).unwrap();
    let want_loss = candle_nn::loss::cross_entropy(whole.as_tensor(), &targets()).unwrap();
    let want_grad = want_loss
        .backward()
        .unwrap()
        .get(whole.as_tensor())
        .unwrap()
        .clone();
    let (want_loss, want_grad) = (
        want_loss.to_scalar::<f32>().unwrap(),
        want_grad.to_vec2::<f32>().unwrap(),
    );
    let ranks = run_ranks(2, Duration::from_secs(30), |comm| {
        let tp = Tp::new(comm.world());
        let cols = V / 2;
        let mine = Var::from_tensor(&logits().narrow(1, tp.rank() * cols, cols)?)?;
        let loss = vocab_parallel_cross_entropy(&tp, mine.as_tensor(), &targets())?;
        let grad = loss.backward()?.get(mine.as_tensor()).cloned();
        let grad = grad.ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?;
        Ok::<_, candle_core::Error>((tp.rank(), loss.to_scalar::<f32>()?, grad.to_vec2::<f32>()?))
    })
    .unwrap();
    for (rank, loss, grad) in ranks {
        // f32 sums of ten exponentials: a few ulps
        assert!(
            (loss - want_loss).abs() < 1e-6,
            "rank {rank}: {loss} against {want_loss}"
        );
        for (row, (g, w)) in grad.iter().zip(&want_grad).enumerate() {
            for (c, v) in g.iter().enumerate() {
                let w = w[rank * V / 2 + c];
                assert!(
                    (v - w).abs() < 1e-6,
                    "rank {rank}: d[{row}, {c}] = {v}, not {w}"
                );
            }
        }
    }
}
