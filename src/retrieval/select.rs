//! Bounded selection: the `k` largest of a stream of scored ids.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A scored id, ordered so that the heap's top is the *worst* kept: lower score first, and
/// among equal scores the larger id (so ties keep the smaller ids, deterministically).
#[derive(Clone, Copy, Debug)]
struct Entry {
    score: f32,
    id: i64,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed score: the max-heap's top holds the smallest score.
        other
            .score
            .total_cmp(&self.score)
            .then(self.id.cmp(&other.id))
    }
}

/// Keeps the `k` largest scores pushed (ties: smaller ids win).
pub(crate) struct TopK {
    k: usize,
    heap: BinaryHeap<Entry>,
}

impl TopK {
    pub(crate) fn new(k: usize) -> Self {
        TopK {
            k,
            heap: BinaryHeap::with_capacity(k + 1),
        }
    }

    /// Offers one scored id.
    #[inline]
    pub(crate) fn push(&mut self, score: f32, id: i64) {
        if self.heap.len() < self.k {
            self.heap.push(Entry { score, id });
        } else if let Some(worst) = self.heap.peek() {
            let entry = Entry { score, id };
            if entry < *worst {
                // `entry` orders before the worst kept, i.e. it is better.
                *self.heap.peek_mut().expect("non-empty") = entry;
            }
        }
    }

    /// The score a new entry must beat once `k` are kept (−∞ before).
    #[inline]
    pub(crate) fn threshold(&self) -> f32 {
        if self.heap.len() < self.k {
            f32::NEG_INFINITY
        } else {
            self.heap.peek().map_or(f32::NEG_INFINITY, |e| e.score)
        }
    }

    /// The kept entries, best first, padded to `k` with `(-∞, -1)`.
    pub(crate) fn into_sorted(self) -> Vec<(f32, i64)> {
        let k = self.k;
        let mut out: Vec<(f32, i64)> = self
            .heap
            .into_sorted_vec()
            .into_iter()
            .map(|e| (e.score, e.id))
            .collect();
        out.resize(k, (f32::NEG_INFINITY, -1));
        out
    }
}
