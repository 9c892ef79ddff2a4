//! The parameter stores a rank's layers take their parameters from: the dense parameters,
//! this expert-parallel rank's experts, the frozen parameters. Each is one `ParamStore`: a
//! store (where its values live and who holds which slice: a ZeRO store over its
//! data-parallel group, trained, or a frozen one) and a `StoreLayout` (which flat range each
//! layer reads). The layout is a pure function of the layers' parameter kinds
//! (`StoreLayout::plan`); materialising a layer, adding its gradients, prefetching the next,
//! and a checkpoint's share out and back are the same code for every group.
//!
//! Note [expert gradients]: DeepSpeed averages an expert's gradient over the whole
//! data-parallel world (`_reduce_expert_gradients` divides by its size), though only the
//! expert-data-parallel group reduces it: the tokens of the other expert-parallel ranks reach
//! this rank's experts through the all-to-all, so the sum over the group already covers every
//! token. The experts' store averages over its group; each gradient enters it divided by
//! `ep` too.

use std::ops::Range;

use candle_core::Device;
use ds_comm::Group;
use ds_partition::{FlatIndex, Frozen, Values, Zero};

use super::layers::{Dtype, Kind, LayerGrads, LayerParams};
use super::offload::OffloadedStates;
use crate::checkpoint::RankState;
use crate::optim::OptimizerState;
use crate::Result;

/// Which part of a group's flat buffer each layer reads: per layer, the ids of its
/// parameters in the group's index and their flat range.
pub(super) struct StoreLayout {
    pub index: FlatIndex,
    pub layer_ids: Vec<Range<usize>>,
    pub layer_flat: Vec<Range<usize>>,
}

impl StoreLayout {
    /// The group of `kind` among the layers' parameters (`layer_kinds`, per layer in
    /// declaration order), whose flat layout is `index`: each layer's parameters of that kind
    /// are consecutive in it, in layer order.
    pub fn plan(index: FlatIndex, layer_kinds: &[Vec<Kind>], kind: Kind) -> StoreLayout {
        let layer_ids = ids_of(layer_kinds, kind);
        let layer_flat = layer_ids.iter().map(|r| index.span(r.clone())).collect();
        StoreLayout {
            index,
            layer_ids,
            layer_flat,
        }
    }
}

/// Per layer: the ids of its parameters of `kind`, consecutive over the layers.
fn ids_of(layer_kinds: &[Vec<Kind>], kind: Kind) -> Vec<Range<usize>> {
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

/// Where a group's values live, as its layers read them.
pub(super) trait Store<T: Dtype> {
    fn get(&mut self, range: Range<usize>) -> ds_partition::Result<Values<'_, T>>;
    fn prefetch(&mut self, range: Range<usize>) -> ds_partition::Result<()>;
}

impl<T: Dtype> Store<T> for Zero<T> {
    fn get(&mut self, range: Range<usize>) -> ds_partition::Result<Values<'_, T>> {
        self.params(range)
    }
    fn prefetch(&mut self, range: Range<usize>) -> ds_partition::Result<()> {
        Zero::prefetch(self, range)
    }
}

impl<T: Dtype> Store<T> for Frozen<T> {
    fn get(&mut self, range: Range<usize>) -> ds_partition::Result<Values<'_, T>> {
        self.params(range)
    }
    fn prefetch(&mut self, range: Range<usize>) -> ds_partition::Result<()> {
        Frozen::prefetch(self, range)
    }
}

/// One group of parameters: its store and its layout.
pub(super) struct ParamStore<S> {
    pub store: S,
    pub layout: StoreLayout,
    /// The ranks holding the group's other parameters (the experts' expert-parallel group):
    /// the gradient norms add up over it, and each gradient enters the store divided by its
    /// size (Note [expert gradients]). None: the store's own group holds them all.
    pub spread_over: Option<Group>,
}

impl<S> ParamStore<S> {
    /// Layer `i`'s flat range in the group.
    pub fn layer_range(&self, i: usize) -> Range<usize> {
        self.layout.layer_flat[i].clone()
    }

    /// Layer `i`'s parameters in the group (none where it has none here); starts gathering
    /// layer `next`'s.
    pub fn layer_params<T: Dtype>(
        &mut self,
        i: usize,
        next: Option<usize>,
        dev: &Device,
    ) -> Result<LayerParams>
    where
        S: Store<T>,
    {
        let (range, ids) = (self.layer_range(i), self.layout.layer_ids[i].clone());
        let values = match range.is_empty() {
            true => Values::Lent(&[]),
            false => self.store.get(range.clone())?,
        };
        // Note [one copy per layer] in layers.rs
        let params = LayerParams::new::<T>(&self.layout.index, ids, range.start, values, dev)?;
        if let Some(n) = next.filter(|&n| !self.layout.layer_flat[n].is_empty()) {
            self.store.prefetch(self.layer_range(n))?;
        }
        Ok(params)
    }
}

impl<T: Dtype> ParamStore<Zero<T>> {
    /// Layer `i`'s gradients into the store (divided by the size of the group the parameters
    /// are spread over: Note [expert gradients]).
    pub fn add_grads(&mut self, i: usize, mut grads: LayerGrads<T>) -> Result<()> {
        if grads.is_empty() {
            return Ok(());
        }
        if let Some(spread) = &self.spread_over {
            grads.scale(1.0 / spread.size() as f64)?;
        }
        let range = self.layer_range(i);
        let to_gpu = !self.store.placements().grads.is_host();
        grads.with_parts(to_gpu, |parts| Ok(self.store.add_grad(range, parts)?))
    }
}

impl<T: Dtype> ParamStore<Zero<T>> {
    /// This rank's share of the group for a checkpoint: its master range and its optimizer's
    /// state `opt`, read back from disk where `offloaded` holds them (the same files as
    /// without offload).
    pub fn rank_state(
        &self,
        opt: OptimizerState<'_>,
        offloaded: Option<&OffloadedStates>,
    ) -> Result<RankState> {
        let (master, buffers) = match offloaded {
            None => (
                self.store.master().to_vec(),
                opt.buffers
                    .iter()
                    .map(|(n, b)| (n.to_string(), b.to_vec()))
                    .collect(),
            ),
            Some(o) => {
                let names: Vec<&str> = opt.buffers.iter().map(|(n, _)| *n).collect();
                (o.master()?, o.states(&names)?)
            }
        };
        Ok(RankState {
            owned: self.store.owned(),
            master,
            optimizer_step: opt.step,
            buffers,
        })
    }

    /// A checkpoint's master range back into the group (through the disk where `offloaded`
    /// holds it); the compute-dtype parameters follow (a collective).
    pub fn restore_master(
        &mut self,
        master: &[f32],
        offloaded: Option<&OffloadedStates>,
    ) -> Result<()> {
        match offloaded {
            Some(o) => o.restore_master(master, &mut self.store),
            None => {
                self.store.master_mut().copy_from_slice(master);
                Ok(self.store.publish()?)
            }
        }
    }
}

/// What the trainer builds this rank's experts' group from.
pub(crate) struct ExpertPart {
    pub index: FlatIndex,
    pub expert_dp: Group,
    pub ep: Group,
}

#[cfg(test)]
mod tests {
    use super::*;
    use Kind::{Dense, Expert, Frozen};

    #[test]
    fn each_kind_takes_its_parameters_in_layer_order() {
        let layers = vec![
            vec![Dense, Dense],
            vec![Dense, Expert, Expert, Frozen],
            vec![],
            vec![Frozen, Dense, Expert],
        ];
        assert_eq!(ids_of(&layers, Dense), vec![0..2, 2..3, 3..3, 3..4]);
        assert_eq!(ids_of(&layers, Expert), vec![0..0, 0..2, 2..2, 2..3]);
        assert_eq!(ids_of(&layers, Frozen), vec![0..0, 0..1, 1..1, 1..2]);
    }

    #[test]
    fn a_layout_reads_each_layers_span_of_the_flat_buffer() {
        let mut index = FlatIndex::new();
        for (name, shape) in [("a", &[2, 3][..]), ("b", &[4]), ("c", &[5])] {
            index.push(name, shape).unwrap();
        }
        let layers = vec![vec![Dense, Expert], vec![Dense, Dense]];
        let layout = StoreLayout::plan(index, &layers, Dense);
        assert_eq!(layout.layer_ids, vec![0..1, 1..3]);
        // independent arithmetic: a's 6 elements, then b's 4 and c's 5
        assert_eq!(layout.layer_flat, vec![0..6, 6..15]);
    }
}
