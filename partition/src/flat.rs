//! The flat buffer's index: each parameter's name, shape and place, in layer order. Under
//! tensor parallelism a rank's buffer holds its slice of each parameter: the entry keeps the
//! logical shape and the split beside the local shape.

use std::ops::Range;

use crate::slice::{self, Run, Split, TpRank};

/// A stable handle of one parameter: its position in the flat index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(pub usize);

#[derive(Debug, Clone, PartialEq)]
pub struct FlatEntry {
    pub name: String,
    /// The shape this rank holds (the logical one without tensor parallelism).
    pub shape: Vec<usize>,
    /// Offset of the first element in the flat buffer.
    pub offset: usize,
    /// The shape of the whole tensor.
    pub logical_shape: Vec<usize>,
    pub split: Split,
}

impl FlatEntry {
    pub fn logical_numel(&self) -> usize {
        self.logical_shape.iter().product()
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// Parameters packed back to back in the order they were pushed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlatIndex {
    entries: Vec<FlatEntry>,
    numel: usize,
    tp: TpRank,
}

impl FlatIndex {
    pub fn new() -> FlatIndex {
        FlatIndex::default()
    }

    /// An index of the slices tensor-parallel rank `tp` holds.
    pub fn sliced(tp: TpRank) -> FlatIndex {
        FlatIndex {
            tp,
            ..FlatIndex::default()
        }
    }

    pub fn tp(&self) -> TpRank {
        self.tp
    }

    /// Appends a whole parameter; names must be unique.
    pub fn push(&mut self, name: &str, shape: &[usize]) -> crate::Result<ParamId> {
        self.push_split(name, shape, Split::Replicated)
    }

    /// Appends this rank's slice of a parameter of logical `shape`; names must be unique.
    pub fn push_split(
        &mut self,
        name: &str,
        shape: &[usize],
        split: Split,
    ) -> crate::Result<ParamId> {
        if self.find(name).is_some() {
            return Err(crate::PartitionError::Invalid(format!(
                "parameter '{name}' is declared twice"
            )));
        }
        let local = slice::local_shape(shape, split, self.tp)
            .map_err(|e| crate::PartitionError::Invalid(format!("parameter '{name}': {e}")))?;
        let entry = FlatEntry {
            name: name.to_string(),
            shape: local,
            offset: self.numel,
            logical_shape: shape.to_vec(),
            split,
        };
        self.numel += entry.numel();
        self.entries.push(entry);
        Ok(ParamId(self.entries.len() - 1))
    }

    pub fn numel(&self) -> usize {
        self.numel
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn entry(&self, id: ParamId) -> &FlatEntry {
        &self.entries[id.0]
    }
    pub fn entries(&self) -> &[FlatEntry] {
        &self.entries
    }
    pub fn find(&self, name: &str) -> Option<ParamId> {
        self.entries
            .iter()
            .position(|e| e.name == name)
            .map(ParamId)
    }

    /// Parameter `id`'s slice as runs of logical elements, in local order.
    pub fn runs(&self, id: ParamId) -> Vec<Run> {
        let e = &self.entries[id.0];
        slice::runs(&e.logical_shape, e.split, self.tp)
    }

    /// The flat range spanned by consecutive parameters `ids` (empty when `ids` is empty).
    pub fn span(&self, ids: Range<usize>) -> Range<usize> {
        match (self.entries.get(ids.start), ids.end.checked_sub(1)) {
            (Some(first), Some(last)) if ids.end > ids.start => {
                first.offset..self.entries[last].range().end
            }
            _ => 0..0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_back_to_back_and_spans_cover_them() {
        let mut f = FlatIndex::new();
        f.push("a", &[2, 3]).unwrap();
        f.push("b", &[5]).unwrap();
        f.push("c", &[]).unwrap();
        assert_eq!(f.numel(), 12);
        assert_eq!(f.entry(ParamId(1)).range(), 6..11);
        assert_eq!(f.entry(ParamId(2)).range(), 11..12);
        assert_eq!(f.span(1..3), 6..12);
        assert_eq!(f.span(0..0), 0..0);
        assert!(f.push("b", &[1]).is_err());
    }
}
