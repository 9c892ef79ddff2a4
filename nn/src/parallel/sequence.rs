//! Sequence parallelism as a model's layers see it (DeepSpeed-Ulysses,
//! `sequence_parallel_size`): each of the `sp` ranks of a group holds a contiguous slice of
//! every sample's positions; attention, which needs every position, swaps the split for one
//! by heads with an all-to-all before it and swaps back after it.
//!
//! Note [ulysses]: with the positions split, everything but attention is position-wise and
//! runs on the rank's T/sp positions. Attention's q, k and v [B, T/sp, A, H, C] (A = 3 fused
//! projections, H heads of C channels) go through `to_heads`: rank j sends its positions of
//! heads j H/sp .. (j+1) H/sp to rank j, and receives every rank's positions of its own heads,
//! [B, T, A, H/sp, C]: whole sequences, a slice of the heads. Attention over whole sequences
//! is then the ordinary one; its output [B, T, 1, H/sp, C] goes back through `to_sequence`.
//! Backward swaps the gradients the other way round. Each rank's loss covers its positions,
//! weighted so that the group's losses add up to the samples' (`Batch::sequence_shard`).

use candle_core::{DType, Device, Result, Tensor};
use ds_comm::{Element, Group};

/// This rank's place among the ranks that split the same samples' sequences.
#[derive(Clone, Default)]
pub struct Sp {
    group: Option<Group>,
}

impl Sp {
    /// No sequence parallelism: whole sequences here.
    pub fn none() -> Sp {
        Sp::default()
    }

    /// Sequence parallelism over `group` (a group of one is the same as `none`).
    pub fn new(group: Group) -> Sp {
        Sp {
            group: (group.size() > 1).then_some(group),
        }
    }

    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, Group::size)
    }

    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, Group::rank)
    }

    /// The position of this rank's first token when it holds `local` of each sequence.
    pub fn offset(&self, local: usize) -> usize {
        self.rank() * local
    }

    /// Note [ulysses]: [B, T/sp, A, H, C] split by positions to [B, T, A, H/sp, C] split by
    /// heads.
    pub fn to_heads(&self, x: &Tensor) -> Result<Tensor> {
        let Some(g) = &self.group else {
            return Ok(x.clone());
        };
        let (b, t, a, h, c) = x.dims5()?;
        let n = g.size();
        if h % n != 0 {
            candle_core::bail!("sequence parallelism: {h} heads do not split over {n} ranks");
        }
        // [sp (destination), B, T/sp, A, H/sp, C]
        let send = x
            .reshape((b, t, a, n, h / n, c))?
            .permute((3, 0, 1, 2, 4, 5))?;
        let got = all_to_all(g, &send)?;
        // got [sp (source: its positions), B, T/sp, A, H/sp, C]
        got.permute((1, 0, 2, 3, 4, 5))?
            .reshape((b, n * t, a, h / n, c))
    }

    /// Note [ulysses]: [B, T, A, H/sp, C] split by heads back to [B, T/sp, A, H, C] split by
    /// positions (the inverse of `to_heads`).
    pub fn to_sequence(&self, x: &Tensor) -> Result<Tensor> {
        let Some(g) = &self.group else {
            return Ok(x.clone());
        };
        let (b, t, a, h, c) = x.dims5()?;
        let n = g.size();
        if t % n != 0 {
            candle_core::bail!("sequence parallelism: {t} positions do not split over {n} ranks");
        }
        // [sp (destination: its positions), B, T/sp, A, H/sp, C]
        let send = x
            .reshape((b, n, t / n, a, h, c))?
            .permute((1, 0, 2, 3, 4, 5))?;
        let got = all_to_all(g, &send)?;
        // got [sp (source: its heads), B, T/sp, A, H/sp, C]
        got.permute((1, 2, 3, 0, 4, 5))?
            .reshape((b, t / n, a, n * h, c))
    }
}

/// `send` [sp, ...] exchanged over `g`: entry j goes to rank j; the result's entry i came
/// from rank i. Through the host, as the other collectives of layers.
fn all_to_all(g: &Group, send: &Tensor) -> Result<Tensor> {
    let host = send.to_device(&Device::Cpu)?.contiguous()?;
    let got = match host.dtype() {
        DType::F32 => exchange::<f32>(g, &host)?,
        DType::BF16 => exchange::<half::bf16>(g, &host)?,
        DType::F16 => exchange::<half::f16>(g, &host)?,
        d => candle_core::bail!("sequence-parallel all-to-all of {d:?}"),
    };
    got.to_device(send.device())
}

fn exchange<T: Element + candle_core::WithDType>(g: &Group, send: &Tensor) -> Result<Tensor> {
    let input = send.flatten_all()?.to_vec1::<T>()?;
    let mut out = vec![T::default(); input.len()];
    g.all_to_all(&input, &mut out)
        .map_err(|e| candle_core::Error::Msg(format!("sequence-parallel all-to-all: {e}")))?;
    Tensor::from_vec(out, send.shape(), send.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Element (b, position, a, head, c) of the whole tensor, as a number that names it.
    fn value(b: usize, t: usize, a: usize, h: usize, c: usize) -> f32 {
        (b * 10000 + t * 1000 + a * 100 + h * 10 + c) as f32
    }

    fn tensor(
        dims: (usize, usize, usize, usize, usize),
        at: impl Fn(usize, usize, usize, usize, usize) -> f32,
    ) -> Tensor {
        let (b, t, a, h, c) = dims;
        let mut v = Vec::new();
        for i in 0..b {
            for j in 0..t {
                for k in 0..a {
                    for l in 0..h {
                        for m in 0..c {
                            v.push(at(i, j, k, l, m));
                        }
                    }
                }
            }
        }
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// Three ranks hold positions 2r, 2r+1 of six, all six heads; after `to_heads` rank r
    /// holds every position of heads 2r, 2r+1, and `to_sequence` gives back its own.
    #[test]
    fn positions_become_heads_and_back() {
        let (b, t, a, h, c) = (2, 6, 3, 6, 2);
        let got = ds_comm::testkit::run_ranks(3, Duration::from_secs(30), move |comm| {
            let sp = Sp::new(comm.world());
            let r = comm.rank();
            let mine = tensor((b, t / 3, a, h, c), |i, j, k, l, m| {
                value(i, 2 * r + j, k, l, m)
            });
            let heads = sp.to_heads(&mine).unwrap();
            let want = tensor((b, t, a, h / 3, c), |i, j, k, l, m| {
                value(i, j, k, 2 * r + l, m)
            });
            let back = sp.to_sequence(&heads).unwrap();
            let same = |x: &Tensor, y: &Tensor| {
                x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                    == y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            };
            Ok::<_, ds_comm::CommError>((same(&heads, &want), same(&back, &mine), sp.offset(2)))
        })
        .unwrap();
        for (r, (heads, back, offset)) in got.into_iter().enumerate() {
            assert!(heads && back, "rank {r}: heads {heads}, back {back}");
            assert_eq!(offset, 2 * r);
        }
    }

    #[test]
    fn heads_that_do_not_split_are_an_error() {
        let got = ds_comm::testkit::run_ranks(2, Duration::from_secs(30), |comm| {
            let x = Tensor::zeros((1, 2, 1, 3, 1), DType::F32, &Device::Cpu).unwrap();
            Ok::<_, ds_comm::CommError>(Sp::new(comm.world()).to_heads(&x).is_err())
        })
        .unwrap();
        assert!(got.iter().all(|e| *e));
    }
}
