//! The set-associative directory of one table's cache: which row each slot holds, which slots
//! an in-flight batch has locked, and what the replacement policy needs (last use for LRU,
//! per-row access counts for LFU). FBGEMM's layout: 32-way sets, a row's set chosen by the
//! MurmurHash3 64-bit finaliser of its id modulo the number of sets.

use super::{CachePolicy, CacheStats, Move};
use crate::{Error, Result};

/// How many rows ahead lookups and data moves fetch their memory.
pub(crate) const AHEAD: usize = 8;

/// What admitting one table's ids decided.
pub(crate) struct TableAdmission {
    /// The cache row of each id, in the order given.
    pub loc: Vec<i64>,
    /// Slots locked for the batch.
    pub locked: Vec<usize>,
    /// Rows served by direct reads and their scratch rows.
    pub fallback: Vec<(u64, usize)>,
    /// The data moves the caller makes, in order: each slot's dirty row written back (if any),
    /// then its new row read in.
    pub moves: Vec<Move>,
}

/// Ways per set (FBGEMM's `kWarpSize` associativity).
pub(crate) const WAYS: usize = 32;

const EMPTY: u64 = u64::MAX;

/// Bytes of bookkeeping per slot (its tag and state).
pub(crate) const SLOT_BYTES: usize = 8 + std::mem::size_of::<Meta>();

/// The set of `row` in a cache of `sets` sets (MurmurHash3's 64-bit finaliser, as FBGEMM's
/// `cache_slot`).
pub(crate) fn set_of(row: u64, sets: usize) -> usize {
    let mut h = row;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    (h % sets as u64) as usize
}

/// What the directory keeps of one slot.
#[derive(Clone, Copy, Default)]
struct Meta {
    /// The tick of the slot's last use (LRU, and LFU's tie-break).
    stamp: u64,
    /// In-flight batches using the slot.
    locks: u32,
    /// Whether the slot differs from the store.
    dirty: bool,
}

/// The directory of one table's cache.
pub(crate) struct Directory {
    pub sets: usize,
    /// Row held by each slot (`EMPTY` when none); slot = set × WAYS + way.
    tags: Vec<u64>,
    /// Each slot's state, together so that a hit touches one cache line.
    meta: Vec<Meta>,
    /// LFU: accesses of every row of the table (saturating), cached or not.
    counts: Vec<u32>,
    policy: CachePolicy,
}

impl Directory {
    /// An empty directory of `sets` sets for a table of `rows` rows.
    pub(crate) fn new(sets: usize, rows: usize, policy: CachePolicy) -> Result<Self> {
        let slots = sets * WAYS;
        let mut counts = Vec::new();
        if policy == CachePolicy::Lfu {
            // 4 bytes per table row: refused in words when memory lacks, not an abort.
            counts.try_reserve_exact(rows).map_err(|_| {
                Error::invalid(
                    "cached TBE",
                    format!("out of memory for LFU's access counts of {rows} rows (use LRU)"),
                )
            })?;
            counts.resize(rows, 0);
        }
        Ok(Directory {
            sets,
            tags: vec![EMPTY; slots],
            meta: vec![Meta::default(); slots],
            counts,
            policy,
        })
    }

    /// Slots (sets × ways).
    pub(crate) fn slots(&self) -> usize {
        self.tags.len()
    }

    /// Bytes of bookkeeping.
    pub(crate) fn bytes(&self) -> usize {
        self.tags.len() * SLOT_BYTES + self.counts.len() * 4
    }

    /// The slot holding `row`, if any.
    pub(crate) fn find(&self, row: u64) -> Option<usize> {
        let base = set_of(row, self.sets) * WAYS;
        (base..base + WAYS).find(|&s| self.tags[s] == row)
    }

    /// Asks the CPU to fetch the tags of `row`'s set ahead of a lookup.
    pub(crate) fn prefetch(&self, row: u64) {
        let base = set_of(row, self.sets) * WAYS;
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        prefetch(self.tags[base..].as_ptr() as *const u8, WAYS * 8);
    }

    /// The row in `slot`, if any.
    pub(crate) fn row_of(&self, slot: usize) -> Option<u64> {
        Some(self.tags[slot]).filter(|&r| r != EMPTY)
    }

    /// Counts an access of `row` (LFU).
    pub(crate) fn count(&mut self, row: u64) {
        if let Some(c) = self.counts.get_mut(row as usize) {
            *c = c.saturating_add(1);
        }
    }

    /// Marks `slot` used at `tick` and locks it for an in-flight batch.
    pub(crate) fn touch_and_lock(&mut self, slot: usize, tick: u64) {
        let m = &mut self.meta[slot];
        m.stamp = tick;
        m.locks += 1;
    }

    /// Releases one lock of `slot`.
    pub(crate) fn unlock(&mut self, slot: usize) {
        let m = &mut self.meta[slot];
        debug_assert!(m.locks > 0, "slot {slot} unlocked more often than locked");
        m.locks = m.locks.saturating_sub(1);
    }

    /// The slot to receive `row` in its set: the first empty way, else the unlocked way the
    /// policy likes least (LRU: oldest use; LFU: fewest accesses, then oldest use; ties to
    /// the lowest way). `None` when every way is locked (a conflict miss).
    pub(crate) fn victim(&self, row: u64) -> Option<usize> {
        let base = set_of(row, self.sets) * WAYS;
        let ways = base..base + WAYS;
        if let Some(s) = ways.clone().find(|&s| self.tags[s] == EMPTY) {
            return Some(s);
        }
        let key = |s: usize| match self.policy {
            CachePolicy::Lru => (0, self.meta[s].stamp),
            CachePolicy::Lfu => (self.counts[self.tags[s] as usize], self.meta[s].stamp),
        };
        ways.filter(|&s| self.meta[s].locks == 0)
            .min_by_key(|&s| key(s))
    }

    /// Puts `row` in `slot` (its previous row already written back), clean.
    pub(crate) fn install(&mut self, slot: usize, row: u64) {
        self.tags[slot] = row;
        self.meta[slot].dirty = false;
    }

    /// Whether `slot` differs from the store.
    pub(crate) fn is_dirty(&self, slot: usize) -> bool {
        self.meta[slot].dirty
    }

    /// Marks `slot` as differing from the store (or not).
    pub(crate) fn set_dirty(&mut self, slot: usize, dirty: bool) {
        self.meta[slot].dirty = dirty;
    }

    /// Every occupied slot and its row.
    pub(crate) fn occupied(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        (self.tags.iter().enumerate())
            .filter(|(_, &r)| r != EMPTY)
            .map(|(s, &r)| (s, r))
    }

    /// Admits the ids `ids` (rows of the table, in batch order) at `tick`, deciding only (the
    /// caller moves the data): each distinct row is looked up; hits are locked first, so that
    /// no miss of the batch can evict them; then each miss (in row order) takes its set's
    /// victim, installed and locked at once, or is served by a scratch row (numbered from
    /// [`slots`](Self::slots)) when every way is locked. `stats` counts the admission.
    pub(crate) fn admit(
        &mut self,
        ids: &[u64],
        tick: u64,
        stats: &mut CacheStats,
    ) -> TableAdmission {
        let n = ids.len();
        // Sort (row, position) pairs, packed into one u64 when they fit.
        let narrow = n < (1 << 24) && ids.iter().all(|&r| r < (1 << 40));
        let pairs: Vec<(u64, usize)> = if narrow {
            let mut keys: Vec<u64> = (ids.iter().enumerate())
                .map(|(k, &r)| (r << 24) | k as u64)
                .collect();
            keys.sort_unstable();
            keys.iter()
                .map(|&x| (x >> 24, (x & 0xff_ffff) as usize))
                .collect()
        } else {
            let mut pairs: Vec<(u64, usize)> = ids.iter().copied().zip(0..).collect();
            pairs.sort_unstable();
            pairs
        };
        // Distinct rows and where each one's run of pairs starts.
        let mut rows = Vec::new();
        let mut starts = Vec::new();
        for (i, &(r, _)) in pairs.iter().enumerate() {
            if rows.last() != Some(&r) {
                rows.push(r);
                starts.push(i);
            }
        }
        starts.push(pairs.len());
        let slots = self.slots();
        let mut loc = vec![0usize; rows.len()];
        let mut locked = Vec::new();
        let mut misses = Vec::new();
        // Sets are far apart in the directory: fetch a few rows ahead.
        for &r in rows.iter().take(AHEAD) {
            self.prefetch(r);
        }
        for (k, &r) in rows.iter().enumerate() {
            if let Some(&next) = rows.get(k + AHEAD) {
                self.prefetch(next);
            }
            self.count(r);
            match self.find(r) {
                Some(s) => {
                    self.touch_and_lock(s, tick);
                    locked.push(s);
                    loc[k] = s;
                }
                None => misses.push(k),
            }
        }
        let mut fallback = Vec::new();
        let mut moves: Vec<Move> = Vec::with_capacity(misses.len());
        for &k in &misses {
            let r = rows[k];
            match self.victim(r) {
                Some(s) => {
                    let old = self.row_of(s);
                    if old.is_some() {
                        stats.evictions += 1;
                    }
                    let dirty = old.filter(|_| self.is_dirty(s));
                    moves.push((s, dirty, r));
                    self.install(s, r);
                    self.touch_and_lock(s, tick);
                    locked.push(s);
                    loc[k] = s;
                }
                None => {
                    loc[k] = slots + fallback.len();
                    fallback.push((r, loc[k]));
                }
            }
        }
        stats.calls += 1;
        stats.requested_ids += n as u64;
        stats.unique_ids += rows.len() as u64;
        stats.unique_misses += misses.len() as u64;
        stats.conflict_misses += fallback.len() as u64;
        let mut out = vec![0i64; n];
        for (k, w) in starts.windows(2).enumerate() {
            for &(_, pos) in &pairs[w[0]..w[1]] {
                out[pos] = loc[k] as i64;
            }
        }
        TableAdmission {
            loc: out,
            locked,
            fallback,
            moves,
        }
    }

    /// Slots in use by in-flight batches.
    pub(crate) fn locked_slots(&self) -> usize {
        self.meta.iter().filter(|m| m.locks > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_hashing_matches_an_independent_murmur_finaliser() {
        // Values from a separate (Python) implementation of MurmurHash3's fmix64, whose
        // fmix64(1) = 0xb456bcfc34c2cb2c.
        assert_eq!(set_of(1, 1000), 604);
        assert_eq!(set_of(12345, 97), 3);
        assert_eq!(set_of((1 << 40) + 7, 4096), 2622);
        assert_eq!(set_of(0, 7), 0);
    }

    #[test]
    fn locked_ways_are_never_victims() {
        let mut d = Directory::new(1, 100, CachePolicy::Lru).unwrap();
        for r in 0..WAYS as u64 {
            let s = d.victim(r).unwrap();
            d.install(s, r);
            d.touch_and_lock(s, 1);
        }
        assert_eq!(d.victim(99), None);
        let s = d.find(5).unwrap();
        d.unlock(s);
        assert_eq!(d.victim(99), Some(s));
    }
}
