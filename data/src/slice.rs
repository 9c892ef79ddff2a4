//! A contiguous part of another source: how a train job holds out the tail of its data for
//! evaluation, so that no evaluated window was ever trained on.

use std::sync::Arc;

use super::error::{DataError, Result};
use super::TokenSource;

/// Tokens `start .. start + len` of `inner`.
pub struct Slice {
    inner: Arc<dyn TokenSource>,
    start: usize,
    len: usize,
    name: String,
    /// The inner source's documents that lie within, rebased (for splits by document).
    starts: Option<Vec<usize>>,
}

impl Slice {
    pub fn new(inner: Arc<dyn TokenSource>, start: usize, len: usize) -> Result<Slice> {
        if start.checked_add(len).is_none_or(|end| end > inner.len()) {
            return Err(DataError::Invalid(format!(
                "{}: tokens {start}..{start}+{len} are outside its {} tokens",
                inner.name(),
                inner.len()
            )));
        }
        let name = format!("{} [tokens {start}..{}]", inner.name(), start + len);
        let starts = inner.document_starts().map(|all| {
            let mut within: Vec<usize> = all
                .iter()
                .filter(|&&s| s >= start && s <= start + len)
                .map(|s| s - start)
                .collect();
            if within.first() != Some(&0) {
                within.insert(0, 0);
            }
            if within.last() != Some(&len) {
                within.push(len);
            }
            within
        });
        Ok(Slice {
            inner,
            start,
            len,
            name,
            starts,
        })
    }

    /// The first part for training and the last `held_out` tokens (rounded to whole windows of
    /// `window` tokens) for evaluation.
    pub fn split(
        inner: Arc<dyn TokenSource>,
        held_out: usize,
        window: usize,
    ) -> Result<(Slice, Slice)> {
        let held = held_out.div_ceil(window.max(1)) * window.max(1);
        let train = inner.len().checked_sub(held).filter(|&t| t >= window).ok_or_else(|| {
            DataError::Invalid(format!(
                "{}: {} tokens cannot hold out {held} for evaluation and keep a window of {window} for training",
                inner.name(),
                inner.len()
            ))
        })?;
        Ok((
            Slice::new(inner.clone(), 0, train)?,
            Slice::new(inner, train, held)?,
        ))
    }
}

impl TokenSource for Slice {
    fn name(&self) -> &str {
        &self.name
    }
    fn len(&self) -> usize {
        self.len
    }
    fn vocab(&self) -> usize {
        self.inner.vocab()
    }
    fn read(&self, start: usize, out: &mut [u32]) -> Result<()> {
        if start
            .checked_add(out.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(DataError::Invalid(format!(
                "{}: read of {} tokens at {start} is past its end",
                self.name,
                out.len()
            )));
        }
        self.inner.read(self.start + start, out)
    }
    fn document_starts(&self) -> Option<&[usize]> {
        self.starts.as_deref()
    }
    fn has_loss_mask(&self) -> bool {
        self.inner.has_loss_mask()
    }
    fn read_loss_mask(&self, start: usize, out: &mut [bool]) -> Result<()> {
        super::error::span(&self.name, start, out.len(), self.len)?;
        self.inner.read_loss_mask(self.start + start, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SyntheticTokens;

    #[test]
    fn split_parts_read_the_parents_tokens_without_overlap() {
        let src: Arc<dyn TokenSource> = Arc::new(SyntheticTokens::new(100, 1000, 7).unwrap());
        let (train, eval) = Slice::split(src.clone(), 90, 33).unwrap();
        assert_eq!(eval.len(), 99);
        assert_eq!(train.len() + eval.len(), 1000);
        let mut whole = vec![0u32; 1000];
        src.read(0, &mut whole).unwrap();
        let mut tail = vec![0u32; 99];
        eval.read(0, &mut tail).unwrap();
        assert_eq!(tail, whole[901..]);
        let mut head = vec![0u32; 5];
        train.read(896, &mut head).unwrap();
        assert_eq!(head, whole[896..901]);
        assert!(train.read(897, &mut head).is_err());
        assert!(Slice::split(src, 990, 33).is_err());
    }
}
