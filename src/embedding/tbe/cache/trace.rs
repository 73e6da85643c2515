//! The planner's cache statistics measured on a trace of real batches: for `embers-plan`'s
//! `constraints.cache_stats` (TorchRec's `EmbeddingOffloadStats`), so that its cost of a
//! `fused_uvm_caching` table follows the ids the model will see.
//!
//! Each batch's distinct ids are one access each, in id order, batch after batch. An access's
//! reuse distance is the number of distinct other ids accessed since the same id's previous
//! access (first accesses have none and are left out): an LRU cache of `k` rows hits exactly
//! the accesses of distance below `k`. The histogram of distances over `bins` equal bins of
//! `[0, rows]` is the miss-ratio curve the planner reads.

use embers_planner::config::CacheStats as PlannerCacheStats;

use crate::{Error, Result};

/// Fenwick tree of counts over access times.
struct Fenwick(Vec<i64>);

impl Fenwick {
    fn add(&mut self, mut i: usize, v: i64) {
        i += 1;
        while i < self.0.len() {
            self.0[i] += v;
            i += i & i.wrapping_neg();
        }
    }
    /// Sum over times `0..i`.
    fn prefix(&self, mut i: usize) -> i64 {
        let mut s = 0;
        while i > 0 {
            s += self.0[i];
            i &= i - 1;
        }
        s
    }
}

/// Bins a miss-ratio histogram may have (TorchRec's traces use 100).
pub const MAX_CACHE_STATS_BINS: usize = 1 << 20;

/// The planner's cache statistics of a table of `rows` rows from the ids its feature(s) looked
/// up in each of `batches` (ids outside `0..rows` are an error naming the batch), with a
/// miss-ratio histogram of `bins` bins (1 to [`MAX_CACHE_STATS_BINS`]).
pub fn planner_cache_stats<I, B>(rows: u64, batches: I, bins: usize) -> Result<PlannerCacheStats>
where
    I: IntoIterator<Item = B>,
    B: AsRef<[i64]>,
{
    const OP: &str = "planner_cache_stats";
    if rows == 0 || bins == 0 || bins > MAX_CACHE_STATS_BINS {
        return Err(Error::invalid(
            OP,
            format!("need at least one row ({rows}) and 1 to {MAX_CACHE_STATS_BINS} bins ({bins})"),
        ));
    }
    let mut accesses: Vec<u64> = Vec::new();
    let mut batch_count = 0usize;
    for (i, batch) in batches.into_iter().enumerate() {
        let mut ids: Vec<u64> = Vec::with_capacity(batch.as_ref().len());
        for &id in batch.as_ref() {
            if id < 0 || id as u64 >= rows {
                return Err(Error::invalid(
                    OP,
                    format!("batch {i}: id {id} is outside the table's {rows} rows"),
                ));
            }
            ids.push(id as u64);
        }
        ids.sort_unstable();
        ids.dedup();
        accesses.extend(ids);
        batch_count += 1;
    }
    if batch_count == 0 {
        return Err(Error::invalid(OP, "no batches to measure"));
    }
    let mut hist = vec![0.0f64; bins];
    let mut last = std::collections::HashMap::<u64, usize>::new();
    // A mark at each id's latest access time: the marks after an id's previous access count
    // the distinct ids seen since.
    let mut marks = Fenwick(vec![0; accesses.len() + 1]);
    for (now, &id) in accesses.iter().enumerate() {
        if let Some(prev) = last.insert(id, now) {
            let distance = (marks.prefix(now) - marks.prefix(prev + 1)) as u64;
            let bin = ((distance as u128 * bins as u128) / rows as u128) as usize;
            hist[bin.min(bins - 1)] += 1.0;
            marks.add(prev, -1);
        }
        marks.add(now, 1);
    }
    let expected_lookups = accesses.len() as f64 / batch_count as f64;
    // Area under the miss-ratio curve, over cache sizes 0..rows (1: nothing is ever reused).
    let total: f64 = hist.iter().sum();
    let cacheability = (total > 0.0).then(|| {
        let mut cum = 0.0;
        let mut area = 0.0;
        for h in &hist {
            cum += h;
            area += 1.0 - cum / total;
        }
        area / bins as f64
    });
    Ok(PlannerCacheStats {
        expected_lookups,
        mrc_hist_counts: hist,
        height: rows,
        cacheability,
    })
}
