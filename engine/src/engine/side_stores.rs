//! The stores beside the dense one that a rank's layers take parameters from: its experts'
//! under expert parallelism (a second ZeRO store over the expert-data-parallel group) and the
//! frozen parameters'.

use std::ops::Range;

use candle_core::Device;
use ds_comm::Group;
use ds_partition::{FlatIndex, Frozen, Values, Zero};

use super::layers::{Dtype, Kind, LayerGrads, LayerParams};
use crate::Result;

/// The frozen parameters' store, their flat layout and each layer's ids and range in it.
pub(super) struct FrozenParams<T: Dtype> {
    pub store: Frozen<T>,
    pub index: FlatIndex,
    pub layer_ids: Vec<Range<usize>>,
    pub layer_flat: Vec<Range<usize>>,
}

/// This expert-parallel rank's experts: their store, over the expert-data-parallel group
/// (the ranks holding the same experts), their flat layout and each layer's ids and range in
/// it.
///
/// Note [expert gradients]: DeepSpeed averages an expert's gradient over the whole
/// data-parallel world (`_reduce_expert_gradients` divides by its size), though only the
/// expert-data-parallel group reduces it: the tokens of the other expert-parallel ranks reach
/// this rank's experts through the all-to-all, so the sum over the group already covers every
/// token. The store averages over its group; each gradient enters it divided by `ep` too.
pub(super) struct ExpertParams<T: Dtype> {
    pub zero: Zero<T>,
    pub index: FlatIndex,
    pub layer_ids: Vec<Range<usize>>,
    pub layer_flat: Vec<Range<usize>>,
    /// The expert-parallel group: the experts' gradient norms add up over it.
    pub ep: Group,
}

/// What the trainer builds this rank's experts' store from.
pub(crate) struct ExpertPart {
    pub index: FlatIndex,
    pub expert_dp: Group,
    pub ep: Group,
}

/// Per layer: the ids of its parameters of `kind`, consecutive over the layers.
pub(super) fn ids_of(layer_kinds: &[Vec<Kind>], kind: Kind) -> Vec<Range<usize>> {
    let mut next = 0;
    layer_kinds
        .iter()
        .map(|kinds| {
            let n = kinds.iter().filter(|k| **k == kind).count();
            next += n;
            next - n..next
        })
        .collect()
}

/// Layer `i`'s expert gradients into the experts' store (Note [expert gradients]).
pub(super) fn add_expert_grads<T: Dtype>(
    e: &mut ExpertParams<T>,
    i: usize,
    mut grads: LayerGrads<T>,
) -> Result<()> {
    grads.scale(1.0 / e.ep.size() as f64)?;
    let range = e.layer_flat[i].clone();
    let to_gpu = !e.zero.placements().grads.is_host();
    grads.with_parts(to_gpu, |parts| Ok(e.zero.add_grad(range, parts)?))
}

/// A store beside the dense one that layers take parameters from: the experts', the frozen
/// ones'.
pub(super) trait SideStore<T: Dtype> {
    fn get(&mut self, range: Range<usize>) -> ds_partition::Result<Values<'_, T>>;
    fn prefetch(&mut self, range: Range<usize>) -> ds_partition::Result<()>;
}

impl<T: Dtype> SideStore<T> for Zero<T> {
    fn get(&mut self, range: Range<usize>) -> ds_partition::Result<Values<'_, T>> {
        self.params(range)
    }
    fn prefetch(&mut self, range: Range<usize>) -> ds_partition::Result<()> {
        Zero::prefetch(self, range)
    }
}

impl<T: Dtype> SideStore<T> for Frozen<T> {
    fn get(&mut self, range: Range<usize>) -> ds_partition::Result<Values<'_, T>> {
        self.params(range)
    }
    fn prefetch(&mut self, range: Range<usize>) -> ds_partition::Result<()> {
        Frozen::prefetch(self, range)
    }
}

/// Layer `i`'s parameters in a side store (`index`, and per layer its `ids` and `flat`
/// range), None when it has none there; starts gathering layer `next`'s.
pub(super) fn side_params<T: Dtype>(
    store: &mut impl SideStore<T>,
    index: &FlatIndex,
    ids: &[Range<usize>],
    flat: &[Range<usize>],
    i: usize,
    next: Option<usize>,
    dev: &Device,
) -> Result<Option<LayerParams>> {
    if ids[i].is_empty() {
        return Ok(None);
    }
    let values = store.get(flat[i].clone())?;
    let p = LayerParams::new::<T>(index, ids[i].clone(), flat[i].start, values, dev)?;
    if let Some(n) = next.filter(|&n| !ids[n].is_empty()) {
        store.prefetch(flat[n].clone())?;
    }
    Ok(Some(p))
}
