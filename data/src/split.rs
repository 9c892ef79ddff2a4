//! `--split 969,30,1`: a dataset divided into train, validation and test parts as Megatron's
//! `--split` divides it (megatron-core's `parse_and_normalize_split` and
//! `get_split_indices`): the weights normalised, each part `round(w * n)` (ties to even, as
//! Python rounds) after the previous, the last boundary moved onto n. A source that knows its
//! documents (an indexed dataset) is divided by documents, any other by tokens.

use std::sync::Arc;

use super::error::{DataError, Result};
use super::{Slice, TokenSource};

/// The three parts a split makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Train = 0,
    Validation = 1,
    Test = 2,
}

/// Normalised train / validation / test weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    weights: [f64; 3],
    spec: &'static str,
}

impl Split {
    /// `spec`: up to three non-negative numbers separated by `,` or `/` (missing ones are 0).
    pub fn parse(spec: &str) -> Result<Split> {
        let bad = |why: String| Err(DataError::Invalid(format!("--split {spec:?}: {why}")));
        let items: Vec<&str> = spec.split([',', '/']).map(str::trim).collect();
        if items.len() > 3 {
            return bad("at most three parts: train, validation, test".into());
        }
        let mut weights = [0.0; 3];
        for (w, item) in weights.iter_mut().zip(&items) {
            *w = match item.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => v,
                _ => return bad(format!("{item:?} is not a non-negative number")),
            };
        }
        let total: f64 = weights.iter().sum();
        if total <= 0.0 {
            return bad("the parts add up to nothing".into());
        }
        Ok(Split {
            weights: weights.map(|w| w / total),
            spec: Box::leak(spec.to_string().into_boxed_str()),
        })
    }

    /// The boundaries of the parts among `n` elements: [0, a, b, n].
    pub fn bounds(&self, n: usize) -> [usize; 4] {
        let mut b = [0i64; 4];
        for i in 0..3 {
            b[i + 1] = b[i] + (self.weights[i] * n as f64).round_ties_even() as i64;
        }
        let diff = b[3] - n as i64;
        for x in &mut b[1..] {
            *x -= diff;
        }
        b.map(|x| x.clamp(0, n as i64) as usize)
    }

    /// The part `which` of `source`: whole documents when it knows them, else tokens.
    pub fn part(&self, source: Arc<dyn TokenSource>, which: Part) -> Result<Slice> {
        let i = which as usize;
        let (start, end) = match source.document_starts() {
            Some(starts) => {
                let b = self.bounds(starts.len().saturating_sub(1));
                (starts[b[i]], starts[b[i + 1]])
            }
            None => {
                let b = self.bounds(source.len());
                (b[i], b[i + 1])
            }
        };
        if start == end {
            return Err(DataError::Invalid(format!(
                "{}: --split {} leaves the {which:?} part empty",
                source.name(),
                self.spec
            )));
        }
        Slice::new(source, start, end - start)
    }
}

#[cfg(test)]
mod tests {
    use super::super::SyntheticTokens;
    use super::*;

    #[test]
    fn bounds_are_megatrons() {
        // get_split_indices([0.969, 0.03, 0.001], 1000) = [0, 969, 999, 1000]
        assert_eq!(
            Split::parse("969,30,1").unwrap().bounds(1000),
            [0, 969, 999, 1000]
        );
        // rounding ties to even: 2.5 -> 2, 5 -> 5, 2.5 -> 2, then shifted by -1 onto 10
        assert_eq!(Split::parse("1,2,1").unwrap().bounds(10), [0, 3, 8, 10]);
        assert_eq!(Split::parse("98/2").unwrap().bounds(7), [0, 7, 7, 7]);
        for bad in ["a,1", "1,-1", "0,0,0", "1,1,1,1"] {
            assert!(Split::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn parts_divide_tokens_and_an_empty_part_is_named() {
        let src: Arc<dyn TokenSource> = Arc::new(SyntheticTokens::new(10, 1000, 1).unwrap());
        let s = Split::parse("90,10").unwrap();
        let train = s.part(src.clone(), Part::Train).unwrap();
        let valid = s.part(src.clone(), Part::Validation).unwrap();
        assert_eq!((train.len(), valid.len()), (900, 100));
        let e = s.part(src, Part::Test).err().unwrap().to_string();
        assert!(
            e.contains("--split 90,10 leaves the Test part empty"),
            "{e}"
        );
    }
}
