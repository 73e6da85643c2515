//! The set-associative directory of one table's cache: which row each slot holds, which slots
//! an in-flight batch has locked, and what the replacement policy needs (last use for LRU,
//! per-row access counts for LFU). FBGEMM's layout: 32-way sets, a row's set chosen by the
//! MurmurHash3 64-bit finaliser of its id modulo the number of sets.

use super::{CachePolicy, CacheStats, Move};
use crate::{Error, Result};
use strength_reduce::StrengthReducedU64;

/// How many rows ahead data moves and victim choices fetch their memory.
pub(crate) const AHEAD: usize = 8;

/// How many ids ahead an admission's lookups fetch their sets: a lookup is a few instructions
/// and a cache miss or two, so more of them are kept in flight than moves.
const LOOKUP_AHEAD: usize = 16;

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

/// Bytes of bookkeeping per slot (its tag, fingerprint and state).
pub(crate) const SLOT_BYTES: usize = 8 + 2 + std::mem::size_of::<Meta>();

/// MurmurHash3's 64-bit finaliser.
fn fmix64(row: u64) -> u64 {
    let mut h = row;
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The fingerprints of one set's ways, a cache line together: 16 bits of each row's hash
/// (never 0), 0 for an empty way. A lookup compares its row's fingerprint with all 32 at once
/// and reads a way's full tag only where they agree, so a set costs one cache line instead of
/// the four its tags fill.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct SetPrints([u16; WAYS]);

impl SetPrints {
    const EMPTY: Self = SetPrints([0; WAYS]);

    /// The ways whose fingerprint is `fp`, as bits (way `w` is bit `w`).
    #[cfg(target_arch = "x86_64")]
    fn matching(&self, fp: u16) -> u32 {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of x86_64; the four unaligned loads read the 64 bytes of
        // `self.0`.
        unsafe {
            let want = _mm_set1_epi16(fp as i16);
            let at = |i: usize| {
                let v = _mm_loadu_si128(self.0.as_ptr().add(8 * i) as *const __m128i);
                _mm_cmpeq_epi16(v, want)
            };
            // Equal lanes are all ones: packing keeps that per lane, one byte each.
            let low = _mm_movemask_epi8(_mm_packs_epi16(at(0), at(1))) as u32;
            let high = _mm_movemask_epi8(_mm_packs_epi16(at(2), at(3))) as u32;
            low | high << 16
        }
    }

    /// The ways whose fingerprint is `fp`, as bits (way `w` is bit `w`).
    #[cfg(not(target_arch = "x86_64"))]
    fn matching(&self, fp: u16) -> u32 {
        let mut mask = 0u32;
        for (w, &f) in self.0.iter().enumerate() {
            mask |= u32::from(f == fp) << w;
        }
        mask
    }
}

/// Where a row belongs: its set's first slot and its fingerprint.
#[derive(Clone, Copy)]
struct Place {
    base: usize,
    fp: u16,
}

/// What the directory keeps of one slot.
#[derive(Clone, Copy, Default)]
pub(crate) struct Meta {
    /// The tick of the slot's last use (LRU, and LFU's tie-break).
    pub stamp: u64,
    /// In-flight batches using the slot.
    pub locks: u32,
    /// Whether the slot differs from the store.
    pub dirty: bool,
}

/// A directory's contents as they are stored (for copies to and from a GPU).
pub(crate) struct RawDirectory<'a> {
    pub tags: &'a [u64],
    pub meta: &'a [Meta],
    /// LFU's access counts (empty for LRU).
    pub counts: &'a [u32],
}

/// The directory of one table's cache.
pub(crate) struct Directory {
    pub sets: usize,
    /// `sets` as a divisor by multiplication (a lookup's division took as long as its hash).
    divisor: StrengthReducedU64,
    /// Row held by each slot (`EMPTY` when none); slot = set × WAYS + way.
    tags: Vec<u64>,
    /// Each set's fingerprints of its `tags` (kept with them: host only, not part of the
    /// stored contents).
    prints: Vec<SetPrints>,
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
            divisor: StrengthReducedU64::new(sets as u64),
            tags: vec![EMPTY; slots],
            prints: vec![SetPrints::EMPTY; sets],
            meta: vec![Meta::default(); slots],
            counts,
            policy,
        })
    }

    /// The contents as stored.
    pub(crate) fn raw(&self) -> RawDirectory<'_> {
        RawDirectory {
            tags: &self.tags,
            meta: &self.meta,
            counts: &self.counts,
        }
    }

    /// Replaces the contents: each slot's row (`u64::MAX`: none), stamp, locks and dirtiness
    /// (non-zero: dirty), and the LFU counts (ignored for LRU). The lengths are this
    /// directory's.
    pub(crate) fn set_raw(
        &mut self,
        tags: &[u64],
        stamp: &[u64],
        locks: &[u32],
        dirty: &[u32],
        counts: &[u32],
    ) {
        for (s, &row) in tags.iter().enumerate() {
            self.set_tag(s, row);
        }
        for (((m, &s), &l), &d) in self.meta.iter_mut().zip(stamp).zip(locks).zip(dirty) {
            *m = Meta {
                stamp: s,
                locks: l,
                dirty: d != 0,
            };
        }
        if self.policy == CachePolicy::Lfu {
            self.counts.copy_from_slice(counts);
        }
    }

    /// Slots (sets × ways).
    pub(crate) fn slots(&self) -> usize {
        self.tags.len()
    }

    /// Bytes of bookkeeping.
    pub(crate) fn bytes(&self) -> usize {
        self.tags.len() * SLOT_BYTES + self.counts.len() * 4
    }

    /// The first slot of `row`'s set — MurmurHash3's 64-bit finaliser of the row modulo the
    /// number of sets, as FBGEMM's `cache_slot` — and the row's fingerprint (the hash's top 16
    /// bits, 0 made 1).
    fn place(&self, row: u64) -> Place {
        let h = fmix64(row);
        Place {
            base: (h % self.divisor) as usize * WAYS,
            fp: ((h >> 48) as u16).max(1),
        }
    }

    /// The ways of the set at `at` whose fingerprint is `at`'s, as bits.
    fn matching(&self, at: Place) -> u32 {
        self.prints[at.base / WAYS].matching(at.fp)
    }

    /// The slot holding `row`, if any.
    pub(crate) fn find(&self, row: u64) -> Option<usize> {
        let at = self.place(row);
        let mut mask = self.matching(at);
        while mask != 0 {
            let s = at.base + mask.trailing_zeros() as usize;
            if self.tags[s] == row {
                return Some(s);
            }
            mask &= mask - 1;
        }
        None
    }

    /// Asks the CPU to fetch the fingerprints of `row`'s set ahead of a lookup.
    pub(crate) fn prefetch(&self, row: u64) {
        self.prefetch_prints(self.place(row));
    }

    /// Asks the CPU to fetch the fingerprints of the set at `at`.
    fn prefetch_prints(&self, at: Place) {
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        prefetch(
            &self.prints[at.base / WAYS] as *const SetPrints as *const u8,
            1,
        );
    }

    /// Asks the CPU to fetch the tags of the set starting at slot `base`.
    fn prefetch_tags(&self, base: usize) {
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        prefetch(self.tags[base..].as_ptr() as *const u8, WAYS * 8);
    }

    /// Asks the CPU to fetch `row`'s access count (LFU).
    fn prefetch_count(&self, row: u64) {
        if let Some(c) = self.counts.get(row as usize) {
            let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
            prefetch(c as *const u32 as *const u8, 1);
        }
    }

    /// Asks the CPU to fetch what choosing a victim for `row` reads: its set's fingerprints, tags
    /// and state.
    fn prefetch_victim(&self, row: u64) {
        let at = self.place(row);
        let base = at.base;
        self.prefetch_prints(at);
        self.prefetch_tags(base);
        self.prefetch_count(row);
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        let meta = std::mem::size_of::<Meta>();
        prefetch(self.meta[base..].as_ptr() as *const u8, WAYS * meta);
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
        let at = self.place(row);
        let base = at.base;
        let ways = base..base + WAYS;
        // Fingerprint 0 is an empty way's and only an empty way's.
        let empty = self.prints[base / WAYS].matching(0);
        if empty != 0 {
            return Some(base + empty.trailing_zeros() as usize);
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
        self.set_tag(slot, row);
        self.meta[slot].dirty = false;
    }

    /// Makes `slot` hold `row` (`EMPTY`: none), its fingerprint with it: the one place tags
    /// change after `new`.
    fn set_tag(&mut self, slot: usize, row: u64) {
        self.tags[slot] = row;
        let fp = if row == EMPTY { 0 } else { self.place(row).fp };
        self.prints[slot / WAYS].0[slot % WAYS] = fp;
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
    /// caller moves the data), with no sort of the whole batch: the directory itself finds the
    /// batch's distinct rows. A first pass looks every id up in batch order; a second locks
    /// each hit's slot at its row's first occurrence (its stamp not yet `tick`: an
    /// admission's ticks are its own), so that no miss of the batch can evict a row the batch
    /// uses. Then each distinct missed row (in row order: the file's order) takes its set's
    /// victim, installed and locked at once, or is served by a scratch row (numbered from
    /// [`slots`](Self::slots)) when every way is locked. `stats` counts the admission.
    pub(crate) fn admit(
        &mut self,
        ids: &[u64],
        tick: u64,
        stats: &mut CacheStats,
    ) -> TableAdmission {
        let n = ids.len();
        let slots = self.slots();
        let mut loc = vec![0i64; n];
        let mut locked = Vec::new();
        let mut missed = Vec::new();
        // Sets are far apart in the directory: fetch a few ids ahead. The first pass reads
        // only the fingerprints, noting each id's first candidate way (-1: certainly missed).
        for &r in ids.iter().take(LOOKUP_AHEAD) {
            self.prefetch(r);
        }
        for (p, &r) in ids.iter().enumerate() {
            if let Some(&next) = ids.get(p + LOOKUP_AHEAD) {
                self.prefetch(next);
            }
            let at = self.place(r);
            let mask = self.matching(at);
            loc[p] = if mask == 0 {
                -1
            } else {
                (at.base + mask.trailing_zeros() as usize) as i64
            };
        }
        // A candidate's tag and state are fetched in a second pass, a few ids ahead; a
        // candidate whose tag is another row's (fingerprints agree about once in 2^16
        // compares) has its set searched in full.
        let prefetch = crate::embedding::tbe::cpu::pool::prefetch_lines::<false>;
        for p in 0..n {
            if let Some(&next) = loc.get(p + LOOKUP_AHEAD) {
                if next >= 0 {
                    prefetch(&self.tags[next as usize] as *const u64 as *const u8, 1);
                    prefetch(&self.meta[next as usize] as *const Meta as *const u8, 1);
                    self.prefetch_count(ids[p + LOOKUP_AHEAD]);
                }
            }
            let r = ids[p];
            let found = match usize::try_from(loc[p]) {
                Ok(s) if self.tags[s] == r => Some(s),
                Ok(_) => self.find(r),
                Err(_) => None,
            };
            let Some(s) = found else {
                loc[p] = -1;
                missed.push(p);
                continue;
            };
            loc[p] = s as i64;
            if self.meta[s].stamp != tick {
                self.count(r);
                self.touch_and_lock(s, tick);
                locked.push(s);
            }
        }
        let hits = locked.len();
        // The missed ids in row order (positions rising within a row): each distinct miss
        // chooses its victim in row order, as FBGEMM's sorted unique ids do.
        let missed: Vec<(u64, usize)> = if n < (1 << 24)
            && missed.iter().all(|&p| ids[p] < (1 << 40))
        {
            let mut keys: Vec<u64> = missed.iter().map(|&p| (ids[p] << 24) | p as u64).collect();
            crate::embedding::tbe::sort::sort_keys_by_row(&mut keys, 24);
            keys.iter()
                .map(|&k| (k >> 24, (k & 0xff_ffff) as usize))
                .collect()
        } else {
            let mut pairs: Vec<(u64, usize)> = missed.iter().map(|&p| (ids[p], p)).collect();
            pairs.sort_unstable();
            pairs
        };
        let mut fallback: Vec<(u64, usize)> = Vec::new();
        let mut moves: Vec<Move> = Vec::new();
        for &(r, _) in missed.iter().take(AHEAD) {
            self.prefetch_victim(r);
        }
        let mut last: Option<(u64, usize)> = None;
        for (i, &(r, p)) in missed.iter().enumerate() {
            if let Some(&(next, _)) = missed.get(i + AHEAD) {
                self.prefetch_victim(next);
            }
            // A later occurrence of the row just admitted.
            if let Some((_, s)) = last.filter(|&(row, _)| row == r) {
                loc[p] = s as i64;
                continue;
            }
            self.count(r);
            let s = match self.victim(r) {
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
                    s
                }
                None => {
                    let s = slots + fallback.len();
                    fallback.push((r, s));
                    s
                }
            };
            last = Some((r, s));
            loc[p] = s as i64;
        }
        stats.calls += 1;
        stats.requested_ids += n as u64;
        stats.unique_ids += (locked.len() + fallback.len()) as u64;
        stats.unique_misses += (locked.len() - hits + fallback.len()) as u64;
        stats.conflict_misses += fallback.len() as u64;
        TableAdmission {
            loc,
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
        let set_of = |row: u64, sets: usize| {
            let d = Directory::new(sets, 1, CachePolicy::Lru).unwrap();
            d.place(row).base / WAYS
        };
        assert_eq!(set_of(1, 1000), 604);
        assert_eq!(set_of(12345, 97), 3);
        assert_eq!(set_of((1 << 40) + 7, 4096), 2622);
        assert_eq!(set_of(0, 7), 0);
    }

    #[test]
    fn fingerprint_matches_are_every_equal_way() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for _ in 0..200 {
            // A few values (0xffff among them: sign bits in the compare) so that many ways agree.
            let set = SetPrints(std::array::from_fn(|_| {
                [0, 1, 0x8000, 0xffff][rng.random_range(0..4)]
            }));
            for fp in [0u16, 1, 0x8000, 0xffff, 7] {
                let want = (0..WAYS)
                    .filter(|&w| set.0[w] == fp)
                    .fold(0u32, |m, w| m | 1 << w);
                assert_eq!(set.matching(fp), want, "{:?} for {fp}", set.0);
            }
        }
    }

    #[test]
    fn rows_whose_fingerprints_agree_are_told_apart_by_their_tags() {
        // One set: every row lands in it. Rows whose 16-bit fingerprints collide, found by
        // search.
        let mut d = Directory::new(1, 1 << 20, CachePolicy::Lru).unwrap();
        let mut by_print = std::collections::HashMap::new();
        let (a, b) = (0u64..1 << 20)
            .find_map(|r| {
                let fp = d.place(r).fp;
                by_print.insert(fp, r).map(|other| (other, r))
            })
            .expect("two rows with one fingerprint");
        assert_eq!(d.place(a).fp, d.place(b).fp);
        assert_eq!(d.find(a), None);
        let sa = d.victim(a).unwrap();
        d.install(sa, a);
        // `b` looks like `a` by fingerprint only: still a miss, and a different slot.
        assert_eq!(d.find(b), None);
        let sb = d.victim(b).unwrap();
        assert_ne!(sa, sb);
        d.install(sb, b);
        assert_eq!((d.find(a), d.find(b)), (Some(sa), Some(sb)));
        // An admission of both (and of a third row) finds each in its own slot.
        let mut stats = CacheStats::empty(String::new(), 0);
        let c = (0u64..).find(|&r| r != a && r != b).unwrap();
        let got = d.admit(&[b, a, c, b], 1, &mut stats);
        assert_eq!(got.loc[..2], [sb as i64, sa as i64]);
        assert_eq!(got.loc[3], sb as i64);
        assert_eq!(d.row_of(got.loc[2] as usize), Some(c));
        assert_eq!(stats.unique_misses, 1);
        // Contents set wholesale (as from a GPU) rebuild the fingerprints: b evicted, a moved.
        let raw = d.raw();
        let mut tags = raw.tags.to_vec();
        tags.swap(sa, 7);
        tags[sb] = EMPTY;
        let zeros = vec![0u32; d.slots()];
        let stamps = vec![0u64; d.slots()];
        d.set_raw(&tags, &stamps, &zeros, &zeros, &[]);
        assert_eq!(d.find(a), Some(7));
        assert_eq!(d.find(b), None);
        // The first empty way, by a scan of the tags.
        assert_eq!(d.victim(b), tags.iter().position(|&t| t == EMPTY));
        for (s, &row) in tags.iter().enumerate().filter(|(_, &r)| r != EMPTY) {
            assert_eq!(d.find(row), Some(s));
        }
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

    #[test]
    fn an_admission_gives_each_distinct_row_one_locked_slot_or_one_scratch_row() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        // Two sets for 500 rows: later batches find full sets, and some sets all locked.
        let mut d = Directory::new(2, 500, CachePolicy::Lfu).unwrap();
        let mut stats = CacheStats::empty(String::new(), 0);
        for tick in 1..=6 {
            let ids: Vec<u64> = (0..300).map(|_| rng.random_range(0..500u64)).collect();
            let cached_before: std::collections::HashSet<u64> =
                d.occupied().map(|(_, r)| r).collect();
            let before = stats.clone();
            let locks: Vec<u32> = d.meta.iter().map(|m| m.locks).collect();
            let a = d.admit(&ids, tick, &mut stats);
            let mut slot_of = std::collections::HashMap::new();
            for (&r, &l) in ids.iter().zip(&a.loc) {
                assert_eq!(
                    *slot_of.entry(r).or_insert(l),
                    l,
                    "row {r} got two cache rows"
                );
                let l = l as usize;
                if l < d.slots() {
                    assert_eq!(d.row_of(l), Some(r));
                    assert_eq!(d.meta[l].locks, locks[l] + 1, "slot {l} locked once");
                } else {
                    assert!(a.fallback.contains(&(r, l)));
                }
            }
            let distinct = slot_of.len() as u64;
            assert_eq!(a.locked.len() + a.fallback.len(), slot_of.len());
            assert_eq!(stats.unique_ids - before.unique_ids, distinct);
            let misses = slot_of
                .keys()
                .filter(|r| !cached_before.contains(r))
                .count();
            assert_eq!(
                (stats.unique_misses - before.unique_misses) as usize,
                misses
            );
            assert_eq!(a.moves.len() + a.fallback.len(), misses);
            assert!(
                a.moves.windows(2).all(|m| m[0].2 < m[1].2),
                "moves in row order"
            );
            if tick % 2 == 0 {
                for &s in &a.locked {
                    d.unlock(s);
                }
            }
        }
        assert!(
            stats.conflict_misses > 0,
            "the test reaches all-locked sets"
        );
    }
}
