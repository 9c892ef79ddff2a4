//! Rows summed by index, `zeros(rows, d).index_add(ids, src, 0)`: an embedding table's
//! gradient, each token's row the sum of the output's gradients at the positions holding it.
//!
//! Constraint: candle's CUDA index_add gives each of the d columns one thread, which walks
//! every position in turn and adds in the storage type: for GPT-2's 16,384 positions that is
//! 768 threads in one block, each 16,384 dependent steps through global memory (milliseconds
//! a micro-step, and a bf16 running sum over a frequent token's hundreds of rows). Solution: on
//! a GPU the host groups the positions by index (a counting sort of one u32 a position) and
//! one kernel (kernels/fused.cu `sum_rows_by_index`) gives each output row a block that sums
//! its positions' rows in position order in f32, rounded once: no atomics, the same bits every
//! run. The indices' copy to the host waits for the stream once. Elsewhere candle's index_add.

use candle_core::{Result, Tensor};

/// The positions of a list of indices grouped by index, stably: `order[first[r]..first[r +
/// 1]]` are the positions holding r, in increasing order.
#[cfg(any(feature = "cuda", test))]
#[derive(Debug, PartialEq)]
pub(crate) struct Grouped {
    pub order: Vec<u32>,
    pub first: Vec<u32>,
}

/// `ids` (each below `rows`) grouped by a counting sort.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn group_positions(ids: &[u32], rows: usize) -> Result<Grouped> {
    let mut first = vec![0u32; rows + 1];
    for (p, &id) in ids.iter().enumerate() {
        if id as usize >= rows {
            candle_core::bail!("index {id} at position {p} is outside the {rows} rows");
        }
        first[id as usize + 1] += 1;
    }
    for r in 0..rows {
        first[r + 1] += first[r];
    }
    let mut next = first[..rows].to_vec();
    let mut order = vec![0u32; ids.len()];
    for (p, &id) in ids.iter().enumerate() {
        let slot = &mut next[id as usize];
        order[*slot as usize] = p as u32;
        *slot += 1;
    }
    Ok(Grouped { order, first })
}

/// `zeros(rows, d).index_add(ids, src, 0)` for `ids` [n] and `src` [n, d].
pub fn sum_into_rows(ids: &Tensor, src: &Tensor, rows: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if src.device().is_cuda() {
        if let Some(out) = on_gpu(ids, src, rows)? {
            return Ok(out);
        }
    }
    Tensor::zeros((rows, src.dim(1)?), src.dtype(), src.device())?.index_add(ids, src, 0)
}

/// `sum_into_rows` by the kernel; None where candle's index_add must do it (an integer or
/// tracked `src`, sizes past u32).
#[cfg(feature = "cuda")]
fn on_gpu(ids: &Tensor, src: &Tensor, rows: usize) -> Result<Option<Tensor>> {
    use super::gpu::{self, cuda::on_tensors};
    use candle_core::{DType, Shape};
    let ((n, d), dtype) = (src.dims2()?, src.dtype());
    let fits = [n, d, rows + 1].iter().all(|&x| x <= u32::MAX as usize);
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) || !fits {
        return Ok(None);
    }
    let host: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    if host.len() != n {
        candle_core::bail!("sum_into_rows: {} indices for {n} rows of src", host.len());
    }
    let g = group_positions(&host, rows)?;
    let order = Tensor::from_vec(g.order, n, src.device())?;
    let first = Tensor::from_vec(g.first, rows + 1, src.device())?;
    let shape = Shape::from((rows, d));
    let out = on_tensors(&[src, &order, &first], &[(dtype, shape)], |k, a, o| {
        gpu::sum_rows_by_index(k, dtype, [a[0], a[1], a[2]], o[0], (rows, d))
    })?;
    Ok(out.map(|mut v| v.remove(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_grouped_by_index_in_order() {
        let ids = [3, 0, 3, 1, 3, 0];
        let g = group_positions(&ids, 5).unwrap();
        // index 0 at 1 and 5, 1 at 3, none at 2, 3 at 0, 2 and 4, none at 4
        assert_eq!(g.first, vec![0, 2, 3, 3, 6, 6]);
        assert_eq!(g.order, vec![1, 5, 3, 0, 2, 4]);
        for r in 0..5 {
            let at = &g.order[g.first[r] as usize..g.first[r + 1] as usize];
            assert!(at.iter().all(|&p| ids[p as usize] == r as u32));
            assert!(at.windows(2).all(|w| w[0] < w[1]), "stable");
        }
    }

    #[test]
    fn an_index_outside_the_rows_is_an_error_naming_it() {
        let err = group_positions(&[0, 7, 1], 4).unwrap_err().to_string();
        assert!(err.contains("index 7 at position 1"), "{err}");
    }

    #[test]
    fn no_positions_give_empty_groups() {
        let g = group_positions(&[], 3).unwrap();
        assert_eq!((g.first, g.order), (vec![0; 4], vec![]));
    }
}
