//! Expert parallelism as a model's layers see it (DeepSpeed-MoE's `ep_size`): which of a
//! mixture's experts this rank holds, and the exchange of token rows with the ranks holding
//! the others, an all-to-all over the expert-parallel group (tokens travel to their experts'
//! ranks and their outputs back). The engine keeps each rank's experts apart from the dense
//! parameters (`ParamSpec::expert`): averaged and sharded over the expert-data-parallel group.

use std::ops::Range;

use candle_core::{DType, Result, Tensor};
use ds_comm::{Element, Group};

/// This rank's place among the expert-parallel ranks.
#[derive(Clone, Default)]
pub struct Ep {
    group: Option<Group>,
}

impl Ep {
    /// No expert parallelism: every expert here.
    pub fn none() -> Ep {
        Ep::default()
    }

    /// Expert parallelism over `group` (a group of one is the same as `none`).
    pub fn new(group: Group) -> Ep {
        Ep {
            group: (group.size() > 1).then_some(group),
        }
    }

    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, Group::size)
    }

    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, Group::rank)
    }

    /// The experts of `experts` this rank holds.
    pub fn local(&self, experts: usize) -> Range<usize> {
        let n = experts / self.size();
        self.rank() * n..(self.rank() + 1) * n
    }

    /// Each rank's `counts` (one per destination rank, `per` numbers each) exchanged: the
    /// numbers every rank sent this one, in rank order.
    pub fn exchange_counts(&self, counts: &[usize], per: usize) -> Result<Vec<usize>> {
        let Some(g) = &self.group else {
            return Ok(counts.to_vec());
        };
        // exact in f32 below 2^24 tokens a step
        let send: Vec<f32> = counts.iter().map(|&c| c as f32).collect();
        let mut recv = vec![0f32; per * g.size()];
        g.all_to_all(&send, &mut recv)
            .map_err(|e| comm_error("all-to-all of counts", e))?;
        Ok(recv.into_iter().map(|c| c as usize).collect())
    }

    /// Rows [n, w]: the first `send[0]` go to the group's rank 0, the next `send[1]` to rank
    /// 1, ...; returns the rows every rank sent this one [sum recv, w], in rank order, `recv`
    /// being how many from each (`exchange_counts` says).
    pub fn exchange(&self, rows: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        let Some(g) = &self.group else {
            return Ok(rows.clone());
        };
        let (_, w) = rows.dims2()?;
        let host = rows.to_device(&candle_core::Device::Cpu)?;
        let out = match host.dtype() {
            DType::F32 => exchange_as::<f32>(g, &host, send, recv, w)?,
            DType::BF16 => exchange_as::<half::bf16>(g, &host, send, recv, w)?,
            DType::F16 => exchange_as::<half::f16>(g, &host, send, recv, w)?,
            d => candle_core::bail!("expert-parallel exchange of {d:?} rows"),
        };
        out.to_device(rows.device())
    }
}

fn exchange_as<T: Element + candle_core::WithDType>(
    g: &Group,
    rows: &Tensor,
    send: &[usize],
    recv: &[usize],
    w: usize,
) -> Result<Tensor> {
    let input = rows.flatten_all()?.to_vec1::<T>()?;
    let times = |c: &[usize]| c.iter().map(|n| n * w).collect::<Vec<_>>();
    let n: usize = recv.iter().sum();
    let mut out = vec![T::default(); n * w];
    g.all_to_all_v(&input, &times(send), &mut out, &times(recv))
        .map_err(|e| comm_error("all-to-all", e))?;
    Tensor::from_vec(out, (n, w), rows.device())
}

fn comm_error(what: &str, e: ds_comm::CommError) -> candle_core::Error {
    candle_core::Error::Msg(format!("expert-parallel {what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::time::Duration;

    /// Three ranks send each other rows of uneven counts; every rank gets the rows meant for
    /// it from each sender, in rank order, and sending them back restores its own.
    #[test]
    fn rows_reach_their_ranks_and_come_back() {
        let got = ds_comm::testkit::run_ranks(3, Duration::from_secs(30), |comm| {
            let ep = Ep::new(comm.world());
            let me = comm.rank();
            // rank r sends (r + j) rows to rank j, each row [r, j, k]
            let send: Vec<usize> = (0..3).map(|j| me + j).collect();
            let rows: Vec<f32> = (0..3)
                .flat_map(|j| (0..me + j).flat_map(move |k| [me as f32, j as f32, k as f32]))
                .collect();
            let n = rows.len() / 3;
            let rows = Tensor::from_vec(rows, (n, 3), &Device::Cpu).unwrap();
            let recv = ep.exchange_counts(&send, 1).unwrap();
            let there = ep.exchange(&rows, &send, &recv).unwrap();
            let back = ep.exchange(&there, &recv, &send).unwrap();
            let same = back.to_vec2::<f32>().unwrap() == rows.to_vec2::<f32>().unwrap();
            Ok::<_, ds_comm::CommError>((recv, there.to_vec2::<f32>().unwrap(), same))
        })
        .unwrap();
        let (recv, there, same) = &got[1];
        assert_eq!(recv, &vec![1, 2, 3]);
        let want: Vec<Vec<f32>> = (0..3)
            .flat_map(|s| (0..s + 1).map(move |k| vec![s as f32, 1.0, k as f32]))
            .collect();
        assert_eq!(there, &want);
        assert!(got.iter().all(|g| g.2), "{same}");
    }

    #[test]
    fn experts_split_in_consecutive_blocks() {
        let ep = Ep::none();
        assert_eq!(ep.local(8), 0..8);
    }
}
