//! Blends: several datasets mixed by weight, as Megatron-LM's `--data-path 0.3 P1 0.7 P2`
//! (`BlendedDataset`). Sample i goes to the dataset that is furthest behind its share
//! (megatron-core's `build_blending_indices`: the largest `w_d * max(i, 1) - taken_d`, the
//! first on ties) and reads that dataset's next sample, so the mix follows the weights at
//! every prefix and needs no random numbers.

use std::sync::{Arc, Mutex};

use super::error::{DataError, Result};
use super::Samples;

/// `--data` as Megatron's `--data-path` spells a blend: `W1 P1 W2 P2 ...` (weights, any
/// positive numbers, normalised), or `P1 P2 ...` (weights by size). One item is no blend.
pub fn parse_blend(spec: &str) -> Result<Vec<(Option<f64>, String)>> {
    let items: Vec<&str> = spec.split_whitespace().collect();
    let bad = |why: String| Err(DataError::Invalid(format!("--data {spec:?}: {why}")));
    if items.is_empty() {
        return bad("names no data".into());
    }
    let weighted = items.len().is_multiple_of(2) && items[0].parse::<f64>().is_ok();
    if !weighted {
        return Ok(items.iter().map(|p| (None, p.to_string())).collect());
    }
    let mut out = Vec::new();
    for pair in items.chunks(2) {
        let w = match pair[0].parse::<f64>() {
            Ok(w) if w.is_finite() && w > 0.0 => w,
            Ok(w) => return bad(format!("blend weight {w} of {} is not positive", pair[1])),
            Err(_) => return bad(format!("blend weight {:?} is not a number", pair[0])),
        };
        out.push((Some(w), pair[1].to_string()));
    }
    Ok(out)
}

/// Datasets mixed by weight.
pub struct Blend {
    parts: Vec<Arc<dyn Samples>>,
    weights: Vec<f64>,
    name: String,
    len: u64,
    /// The choices up to a sample, kept so that reading samples in order costs O(datasets)
    /// each; reading an earlier sample recomputes from 0.
    cursor: Mutex<Cursor>,
}

#[derive(Clone)]
struct Cursor {
    /// The sample the next choice is for.
    next: u64,
    /// Samples taken from each dataset before `next`.
    taken: Vec<u64>,
}

impl Blend {
    /// `parts` with `weights` (None: each part's size), normalised to sum to one.
    pub fn new(parts: Vec<(Option<f64>, Arc<dyn Samples>)>) -> Result<Blend> {
        let tokens = parts.first().map(|(_, p)| p.sample_tokens());
        if parts.is_empty() || parts.iter().any(|(_, p)| Some(p.sample_tokens()) != tokens) {
            return Err(DataError::Invalid(
                "a blend needs datasets of samples of the same length".into(),
            ));
        }
        let raw: Vec<f64> = parts
            .iter()
            .map(|(w, p)| w.unwrap_or(p.len() as f64))
            .collect();
        let total: f64 = raw.iter().sum();
        let name = parts
            .iter()
            .zip(&raw)
            .map(|((_, p), w)| format!("{:.3} {}", w / total, p.name()))
            .collect::<Vec<_>>()
            .join(" + ");
        let n = parts.len();
        Ok(Blend {
            len: parts.iter().map(|(_, p)| p.len()).sum(),
            weights: raw.iter().map(|w| w / total).collect(),
            parts: parts.into_iter().map(|(_, p)| p).collect(),
            name,
            cursor: Mutex::new(Cursor {
                next: 0,
                taken: vec![0; n],
            }),
        })
    }

    /// The dataset sample `g` reads from, and that dataset's sample index.
    pub fn locate(&self, g: u64) -> (usize, u64) {
        let mut c = self.cursor.lock().expect("no reader panics holding it");
        if g < c.next {
            *c = Cursor {
                next: 0,
                taken: vec![0; self.parts.len()],
            };
        }
        loop {
            let at = (c.next as f64).max(1.0);
            let error = |d: usize| self.weights[d] * at - c.taken[d] as f64;
            let d = (1..self.parts.len())
                .fold(0, |best, d| if error(d) > error(best) { d } else { best });
            let k = c.taken[d];
            c.taken[d] += 1;
            c.next += 1;
            if c.next > g {
                return (d, k);
            }
        }
    }
}

impl Samples for Blend {
    fn name(&self) -> &str {
        &self.name
    }
    /// An epoch of a blend is as many samples as its parts hold together.
    fn len(&self) -> u64 {
        self.len
    }
    fn sample_tokens(&self) -> usize {
        self.parts[0].sample_tokens()
    }
    fn vocab(&self) -> usize {
        self.parts.iter().map(|p| p.vocab()).max().unwrap_or(0)
    }
    fn read(&self, g: u64, out: &mut [u32]) -> Result<()> {
        let (d, k) = self.locate(g);
        self.parts[d].read(k, out)
    }
    fn has_loss_mask(&self) -> bool {
        self.parts.iter().any(|p| p.has_loss_mask())
    }
    fn read_loss_mask(&self, g: u64, out: &mut [bool]) -> Result<()> {
        let (d, k) = self.locate(g);
        self.parts[d].read_loss_mask(k, out)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{SyntheticTokens, TokenSource, Windows};
    use super::*;

    fn windows(len: usize, seed: u64) -> Arc<dyn Samples> {
        let s: Arc<dyn TokenSource> = Arc::new(SyntheticTokens::new(50, len, seed).unwrap());
        Arc::new(Windows::new(s, 4).unwrap())
    }

    /// megatron-core's build_blending_indices, written out on its own: the first 20 choices
    /// for weights 0.3 / 0.7 and 0.2 / 0.5 / 0.3.
    #[test]
    fn choices_follow_megatrons_rule() {
        let b = Blend::new(vec![
            (Some(3.0), windows(100, 1)),
            (Some(7.0), windows(100, 2)),
        ])
        .unwrap();
        let got: Vec<usize> = (0..20).map(|g| b.locate(g).0).collect();
        let want = reference(&[0.3, 0.7], 20);
        assert_eq!(got, want);
        let parts = (0..3)
            .map(|i| (Some([2.0, 5.0, 3.0][i]), windows(100, i as u64)))
            .collect();
        let b = Blend::new(parts).unwrap();
        let got: Vec<(usize, u64)> = (0..50).map(|g| b.locate(g)).collect();
        let want = reference(&[0.2, 0.5, 0.3], 50);
        assert_eq!(got.iter().map(|c| c.0).collect::<Vec<_>>(), want);
        // each dataset's samples are taken in order: the k-th choice of d reads its sample k
        for d in 0..3 {
            let ks: Vec<u64> = got.iter().filter(|c| c.0 == d).map(|c| c.1).collect();
            assert_eq!(ks, (0..ks.len() as u64).collect::<Vec<_>>());
        }
        // random access agrees with sequential access
        assert_eq!(b.locate(7), got[7]);
        assert_eq!(b.locate(49), got[49]);
        assert_eq!(b.locate(3), got[3]);
    }

    fn reference(w: &[f64], n: usize) -> Vec<usize> {
        let mut taken = vec![0i64; w.len()];
        let mut out = Vec::new();
        for i in 0..n {
            let x = (i as f64).max(1.0);
            let mut best = 0;
            for d in 1..w.len() {
                if w[d] * x - taken[d] as f64 > w[best] * x - taken[best] as f64 {
                    best = d;
                }
            }
            taken[best] += 1;
            out.push(best);
        }
        out
    }

    #[test]
    fn blends_parse_as_megatrons_data_path() {
        let p = parse_blend("0.3 a 0.7 b").unwrap();
        assert_eq!(p, vec![(Some(0.3), "a".into()), (Some(0.7), "b".into())]);
        assert_eq!(
            parse_blend("a b").unwrap(),
            vec![(None, "a".into()), (None, "b".into())]
        );
        assert_eq!(parse_blend("only").unwrap(), vec![(None, "only".into())]);
        let e = parse_blend("0.3 a x b").unwrap_err().to_string();
        assert!(e.contains("blend weight \"x\" is not a number"), "{e}");
        let e = parse_blend("0.3 a -1 b").unwrap_err().to_string();
        assert!(e.contains("blend weight -1 of b is not positive"), "{e}");
        // unweighted parts weigh by size
        let b = Blend::new(vec![(None, windows(40, 1)), (None, windows(120, 2))]).unwrap();
        assert_eq!(b.len(), 8 + 24);
        let from_first = (0..32).filter(|&g| b.locate(g).0 == 0).count();
        assert_eq!(from_first, 8);
    }
}
