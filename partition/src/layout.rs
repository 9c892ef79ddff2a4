//! How a flat buffer is cut into one shard per data-parallel rank.

use std::ops::Range;

/// `numel` elements padded to `world` equal shards of `shard_len` (DeepSpeed pads the flat
/// group the same way, so every rank's optimizer state has one length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    numel: usize,
    world: usize,
    shard_len: usize,
}

impl ShardLayout {
    pub fn new(numel: usize, world: usize) -> ShardLayout {
        let world = world.max(1);
        ShardLayout {
            numel,
            world,
            shard_len: numel.div_ceil(world),
        }
    }
    pub fn numel(&self) -> usize {
        self.numel
    }
    pub fn world(&self) -> usize {
        self.world
    }
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }
    /// Length with the padding: `world * shard_len`.
    pub fn padded(&self) -> usize {
        self.world * self.shard_len
    }

    /// The shard of group rank `rank`, in padded coordinates.
    pub fn shard(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The part of `range` that lies in `rank`'s shard (possibly empty, and then anywhere:
    /// callers skip empty parts).
    pub fn owned_within(&self, range: &Range<usize>, rank: usize) -> Range<usize> {
        let s = self.shard(rank);
        let start = range.start.clamp(s.start, s.end);
        start..range.end.clamp(start, s.end)
    }

    /// How many elements of `range` each rank owns; they sum to `range.len()` and follow
    /// rank order, which is the `counts` argument of the `_v` collectives.
    pub fn counts_within(&self, range: &Range<usize>) -> Vec<usize> {
        (0..self.world)
            .map(|r| self.owned_within(range, r).len())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_padded_buffer() {
        for numel in [0usize, 1, 7, 97, 1000, 65_537] {
            for world in [1usize, 2, 3, 4, 8] {
                let l = ShardLayout::new(numel, world);
                assert!(l.padded() >= numel && l.padded() - numel < world.max(1));
                let mut next = 0;
                for r in 0..world {
                    assert_eq!(l.shard(r).start, next);
                    next = l.shard(r).end;
                }
                assert_eq!(next, l.padded());
            }
        }
    }

    #[test]
    fn counts_of_any_range_sum_to_its_length() {
        let l = ShardLayout::new(103, 4); // shards of 26
        for (a, b) in [(0, 103), (5, 30), (26, 52), (51, 53), (10, 10), (100, 104)] {
            let c = l.counts_within(&(a..b));
            assert_eq!(c.iter().sum::<usize>(), b - a, "{a}..{b}");
            // reference: count element by element
            for (r, &n) in c.iter().enumerate() {
                let expect = (a..b).filter(|i| i / 26 == r).count();
                assert_eq!(n, expect, "{a}..{b} rank {r}");
            }
        }
    }
}
