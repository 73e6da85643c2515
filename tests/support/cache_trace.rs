//! Traces and a plain cache simulation shared by the cache tests (`tbe_cache`,
//! `quantized_cache`): a seeded generator, Zipf ids over a table's rows, batches in FBGEMM's
//! layout, and one table's 32-way cache simulated one batch at a time, written independently of
//! the library.
#![allow(dead_code)]

use std::path::PathBuf;

use embers::embedding::{CacheStats, TbeConfig, TbeInput};

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("embers-cache-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small deterministic generator (SplitMix64).
pub struct Gen(pub u64);
impl Gen {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Ids drawn from Zipf(`s`) over `rows` rows (s = 0: uniform), through a scrambled rank so the
/// hot rows are spread over the table.
pub struct Zipf {
    cdf: Vec<f64>,
    rows: usize,
}
impl Zipf {
    pub fn new(rows: usize, s: f64) -> Self {
        let mut cdf = Vec::with_capacity(rows);
        let mut acc = 0.0;
        for k in 1..=rows {
            acc += 1.0 / (k as f64).powf(s);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf, rows }
    }
    pub fn draw(&self, g: &mut Gen) -> i64 {
        let u = g.unit();
        let rank = self.cdf.partition_point(|&c| c < u).min(self.rows - 1);
        ((rank as u64 * 2_654_435_761) % self.rows as u64) as i64
    }
}

/// One batch in FBGEMM's layout.
#[derive(Clone)]
pub struct Step {
    pub ids: Vec<i64>,
    pub offsets: Vec<i64>,
    pub weights: Option<Vec<f32>>,
}

impl Step {
    pub fn input(&self) -> TbeInput<'_> {
        let input = TbeInput::new(&self.ids[..], &self.offsets[..]);
        match &self.weights {
            Some(w) => input.with_weights(w),
            None => input,
        }
    }
}

/// `n` batches of `b` bags per feature of up to `max_len` ids, per feature from Zipf(`s`).
pub fn batches(
    cfg: &TbeConfig,
    n: usize,
    b: usize,
    max_len: u64,
    s: f64,
    weighted: bool,
    seed: u64,
) -> Vec<Step> {
    let mut g = Gen(seed);
    let zipfs: Vec<Zipf> = (cfg.tables.iter()).map(|t| Zipf::new(t.rows, s)).collect();
    (0..n)
        .map(|_| {
            let mut ids = Vec::new();
            let mut offsets = vec![0i64];
            for &t in &cfg.feature_table_map {
                for _ in 0..b {
                    for _ in 0..g.next() % (max_len + 1) {
                        ids.push(zipfs[t].draw(&mut g));
                    }
                    offsets.push(ids.len() as i64);
                }
            }
            let weights =
                weighted.then(|| ids.iter().map(|_| (g.unit() * 2.0 - 0.5) as f32).collect());
            Step {
                ids,
                offsets,
                weights,
            }
        })
        .collect()
}

/// The set of `row` among `sets`: MurmurHash3's fmix64 (written again here, independently of
/// the library).
pub fn set_of(row: u64, sets: u64) -> u64 {
    let mut h = row;
    for (shift, mul) in [(33, 0xff51_afd7_ed55_8ccdu64), (33, 0xc4ce_b9fe_1a85_ec53)] {
        h ^= h >> shift;
        h = h.wrapping_mul(mul);
    }
    (h ^ (h >> 33)) % sets
}

/// A plain simulation of one table's 32-way cache, one batch at a time (no batch outlives its
/// step): counts unique misses, conflict misses and evictions.
pub struct Simulated {
    sets: Vec<Vec<Option<(u64, u64)>>>, // per set, per way: (row, last use)
    counts: std::collections::HashMap<u64, u64>,
    lfu: bool,
    pub misses: u64,
    pub conflicts: u64,
    pub evictions: u64,
}

impl Simulated {
    pub fn new(slots: usize, lfu: bool) -> Self {
        Simulated {
            sets: vec![vec![None; 32]; slots / 32],
            counts: Default::default(),
            lfu,
            misses: 0,
            conflicts: 0,
            evictions: 0,
        }
    }

    pub fn batch(&mut self, tick: u64, ids: &[i64]) {
        let mut rows: Vec<u64> = ids.iter().map(|&r| r as u64).collect();
        rows.sort();
        rows.dedup();
        let n = self.sets.len() as u64;
        let mut missing = Vec::new();
        for &r in &rows {
            *self.counts.entry(r).or_default() += 1;
            let set = &mut self.sets[set_of(r, n) as usize];
            match set.iter_mut().flatten().find(|(row, _)| *row == r) {
                Some(entry) => entry.1 = tick,
                None => missing.push(r),
            }
        }
        self.misses += missing.len() as u64;
        for r in missing {
            let set = &mut self.sets[set_of(r, n) as usize];
            let way = match set.iter().position(Option::is_none) {
                Some(w) => Some(w),
                None => {
                    // Rows of this batch (used at `tick`) cannot go.
                    let candidates = (0..32).filter(|&w| set[w].unwrap().1 != tick);
                    let counts = &self.counts;
                    let lfu = self.lfu;
                    let victim = candidates.min_by_key(|&w| {
                        let (row, used) = set[w].unwrap();
                        (if lfu { counts[&row] } else { 0 }, used, w)
                    });
                    if victim.is_some() {
                        self.evictions += 1;
                    }
                    victim
                }
            };
            match way {
                Some(w) => set[w] = Some((r, tick)),
                None => self.conflicts += 1,
            }
        }
    }
}

/// One simulated cache per table (`stats` gives each table's slots), LRU or LFU.
pub fn simulations(stats: &[CacheStats], lfu: bool) -> Vec<Simulated> {
    stats
        .iter()
        .map(|st| Simulated::new(st.slots, lfu))
        .collect()
}

/// Feeds `step` (batch number `i`, 0-based; `b` bags per feature) to each table's simulation:
/// the ids of the features `map` sends to that table, in batch order.
pub fn simulate_step(sims: &mut [Simulated], step: &Step, map: &[usize], b: usize, i: usize) {
    for (t, sim) in sims.iter_mut().enumerate() {
        let ids: Vec<i64> = (map.iter().enumerate())
            .filter(|(_, &ft)| ft == t)
            .flat_map(|(f, _)| {
                let (a, z) = (step.offsets[f * b], step.offsets[(f + 1) * b]);
                step.ids[a as usize..z as usize].to_vec()
            })
            .collect();
        sim.batch(i as u64 + 1, &ids);
    }
}

/// Asserts that each table's counters equal its simulation's after `calls` admissions, and
/// that the trace both hit and missed.
pub fn assert_counts_match(stats: &[CacheStats], sims: &[Simulated], calls: usize, what: &str) {
    for (st, sim) in stats.iter().zip(sims) {
        let what = format!("{what}, table {}", st.table);
        assert_eq!(st.unique_misses, sim.misses, "{what}");
        assert_eq!(st.conflict_misses, sim.conflicts, "{what}");
        assert_eq!(st.evictions, sim.evictions, "{what}");
        assert_eq!(st.calls, calls as u64, "{what}");
        assert!(
            st.unique_misses > 0 && st.unique_misses < st.unique_ids,
            "{what}"
        );
    }
}
