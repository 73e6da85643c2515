//! The search: which option each table takes and which rank each shard goes to.
//!
//! TorchRec proposes whole-model option sets (grid search, greedy, uniform) and packs each
//! with a greedy partitioner. Here the two are interleaved:
//!
//! 1. **Starts.** TorchRec's own search reproduced ([`crate::reference`]: its proposers and
//!    greedy partitioner, same proposals, same plan), and several largest-first constructions
//!    (tables in decreasing cost, memory-critical ones first, each taking the option and
//!    placement that least raises the current makespan, or the least total cost, or a blend,
//!    or one sharding type where allowed).
//! 2. **Local search** from every start until nothing improves or the time budget is spent:
//!    moves and swaps of shards between the most loaded rank and the others, and re-choosing
//!    the option of any table with a shard on the most loaded rank.
//!
//! A change is kept only if it lowers the makespan, or keeps it and lowers the sum of squared
//! rank loads, so the search terminates; the best plan over all starts wins, so under
//! TorchRec's cost model the result is never worse than TorchRec's planner on the same input.
//! Placement rules follow TorchRec's partition types: row-wise/data-parallel shard `i` on
//! rank `i`; table-wise/column-wise shards anywhere; table-row-wise and table-column-wise
//! within one host; grid column blocks one host each.

use crate::config::Problem;
use crate::error::{PlannerError, Shortfall};
use crate::estimator::CostModel;
use crate::types::{PartitionBy, ShardingOption, ShardingType, Storage};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Knobs of the search.
#[derive(Debug, Clone)]
pub struct SearchSettings {
    /// Wall-time budget for the whole search; local search gets what TorchRec's search
    /// leaves of it, split between its starts.
    pub time_limit: Duration,
    /// Upper bound on improvement rounds.
    pub max_rounds: usize,
    /// Whether to run TorchRec's search (reproduced) as one of the starts.
    pub reference: bool,
    /// Wall-time budget for that search (TorchRec's own planner has no default limit).
    pub reference_time_limit: Duration,
}

impl Default for SearchSettings {
    fn default() -> Self {
        SearchSettings {
            time_limit: Duration::from_millis(800),
            max_rounds: 100_000,
            reference: true,
            reference_time_limit: Duration::from_secs(5),
        }
    }
}

/// The chosen option and shard ranks of every table.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// Per table: index into its option list.
    pub choice: Vec<usize>,
    /// Per table: rank of each shard of the chosen option.
    pub ranks: Vec<Vec<usize>>,
    /// What TorchRec's own search (reproduced) found on the same options, when it ran.
    pub reference: Option<ReferenceSummary>,
}

/// The outcome of TorchRec's search reproduced ([`crate::reference`]), for the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReferenceSummary {
    /// Its plan's max over ranks of the summed perf totals (ms), TorchRec's own rating.
    pub max_rank_perf: f64,
    /// Proposals it partitioned.
    pub proposals: usize,
    /// Whether its time limit cut it short.
    pub truncated: bool,
}

/// How the construction phase scores an option for the table being inserted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Construction {
    /// Lowest resulting makespan, then least total cost.
    MinPeak,
    /// Least total cost over all shards, then lowest makespan.
    MinTotal,
    /// Makespan plus the option's share of the total (cost per rank if spread evenly).
    Blend,
    /// Only options of one sharding type where the table allows it (TorchRec's uniform
    /// proposal), lowest makespan among them; local search then mixes types.
    Prefer(ShardingType),
}

/// Precomputed per-option numbers the search touches in its inner loops.
struct Opt<'a> {
    option: &'a ShardingOption,
    cost: Vec<f64>,
    total: f64,
}

struct State<'a> {
    w: usize,
    local: usize,
    opts: &'a [Vec<Opt<'a>>],
    cap: Vec<Storage>,
    load: Vec<f64>,
    used: Vec<Storage>,
    choice: Vec<Option<usize>>,
    ranks: Vec<Vec<usize>>,
}

const REL_EPS: f64 = 1e-12;

fn better(new_max: f64, new_sq: f64, old_max: f64, old_sq: f64) -> bool {
    if new_max < old_max * (1.0 - REL_EPS) {
        return true;
    }
    new_max <= old_max * (1.0 + REL_EPS) && new_sq < old_sq * (1.0 - 1e-12)
}

impl<'a> State<'a> {
    fn fits(&self, r: usize, s: &Storage) -> bool {
        self.used[r].plus(s).fits_in(&self.cap[r])
    }

    fn add(&mut self, r: usize, cost: f64, s: &Storage) {
        self.load[r] += cost;
        self.used[r] = self.used[r].plus(s);
    }

    fn sub(&mut self, r: usize, cost: f64, s: &Storage) {
        self.load[r] -= cost;
        self.used[r].hbm -= s.hbm;
        self.used[r].ddr -= s.ddr;
    }

    fn makespan(&self) -> f64 {
        self.load.iter().cloned().fold(0.0, f64::max)
    }

    fn sumsq(&self) -> f64 {
        self.load.iter().map(|x| x * x).sum()
    }

    fn argmax(&self) -> usize {
        let mut best = 0;
        for r in 1..self.w {
            if self.load[r] > self.load[best] {
                best = r;
            }
        }
        best
    }

    /// Places option `o` of table `t` greedily on the current loads; returns the shard ranks
    /// or `None` if some shard fits nowhere allowed. Leaves the state unchanged.
    fn try_place(&mut self, t: usize, o: usize) -> Option<Vec<usize>> {
        let opts = self.opts;
        let opt = &opts[t][o];
        let option = opt.option;
        let n = option.shards.len();
        let mut ranks = vec![usize::MAX; n];
        match option.partition_by() {
            PartitionBy::Uniform => {
                for (i, s) in option.shards.iter().enumerate() {
                    if !self.fits(i, &s.storage) {
                        return None;
                    }
                    ranks[i] = i;
                }
                Some(ranks)
            }
            PartitionBy::Device => self.place_on(t, o, 0..self.w),
            PartitionBy::Host => {
                let mut best: Option<(f64, Vec<usize>)> = None;
                for h in 0..self.w / self.local {
                    let base = h * self.local;
                    let placed = if option.sharding_type == ShardingType::TableRowWise {
                        let rs: Vec<usize> = (0..n).map(|i| base + i).collect();
                        let ok = rs
                            .iter()
                            .zip(&option.shards)
                            .all(|(&r, s)| self.fits(r, &s.storage));
                        ok.then_some(rs)
                    } else {
                        self.place_on(t, o, base..base + self.local)
                    };
                    if let Some(rs) = placed {
                        let peak = rs
                            .iter()
                            .zip(&opt.cost)
                            .map(|(&r, c)| self.load[r] + c)
                            .fold(0.0, f64::max);
                        if best.as_ref().is_none_or(|b| peak < b.0) {
                            best = Some((peak, rs));
                        }
                    }
                }
                best.map(|b| b.1)
            }
            PartitionBy::MultiHost => {
                // Column block k holds shards k*local .. (k+1)*local; each block takes the
                // host where it raises the peak least.
                let blocks = n / self.local;
                let mut applied: Vec<(usize, usize)> = Vec::new();
                let mut ok = true;
                for k in 0..blocks {
                    let mut best: Option<(f64, usize)> = None;
                    for h in 0..self.w / self.local {
                        let base = h * self.local;
                        let mut peak = 0.0f64;
                        let mut fit = true;
                        for i in 0..self.local {
                            let si = k * self.local + i;
                            let s = &option.shards[si].storage;
                            if !self.fits(base + i, s) {
                                fit = false;
                                break;
                            }
                            peak = peak.max(self.load[base + i] + opt.cost[si]);
                        }
                        if fit && best.is_none_or(|b| peak < b.0) {
                            best = Some((peak, h));
                        }
                    }
                    let Some((_, h)) = best else {
                        ok = false;
                        break;
                    };
                    for i in 0..self.local {
                        let si = k * self.local + i;
                        let r = h * self.local + i;
                        ranks[si] = r;
                        let (c, s) = (self.opts[t][o].cost[si], option.shards[si].storage);
                        self.add(r, c, &s);
                        applied.push((si, r));
                    }
                }
                for (si, r) in applied {
                    let (c, s) = (self.opts[t][o].cost[si], option.shards[si].storage);
                    self.sub(r, c, &s);
                }
                ok.then_some(ranks)
            }
        }
    }

    /// Each shard, largest first, on the least loaded rank of `range` where it fits.
    fn place_on(
        &mut self,
        t: usize,
        o: usize,
        range: std::ops::Range<usize>,
    ) -> Option<Vec<usize>> {
        let option = self.opts[t][o].option;
        let n = option.shards.len();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| self.opts[t][o].cost[b].total_cmp(&self.opts[t][o].cost[a]));
        let mut ranks = vec![usize::MAX; n];
        let mut ok = true;
        for &si in &order {
            let s = option.shards[si].storage;
            let c = self.opts[t][o].cost[si];
            let mut best: Option<usize> = None;
            for r in range.clone() {
                if self.fits(r, &s) && best.is_none_or(|b| self.load[r] < self.load[b]) {
                    best = Some(r);
                }
            }
            match best {
                Some(r) => {
                    ranks[si] = r;
                    self.add(r, c, &s);
                }
                None => {
                    ok = false;
                    break;
                }
            }
        }
        for &si in &order {
            if ranks[si] != usize::MAX {
                let (c, s) = (self.opts[t][o].cost[si], option.shards[si].storage);
                self.sub(ranks[si], c, &s);
            }
        }
        ok.then_some(ranks)
    }

    fn apply(&mut self, t: usize, o: usize, ranks: Vec<usize>) {
        for (si, &r) in ranks.iter().enumerate() {
            let (c, s) = (
                self.opts[t][o].cost[si],
                self.opts[t][o].option.shards[si].storage,
            );
            self.add(r, c, &s);
        }
        self.choice[t] = Some(o);
        self.ranks[t] = ranks;
    }

    fn remove(&mut self, t: usize) -> Option<(usize, Vec<usize>)> {
        let o = self.choice[t].take()?;
        let ranks = std::mem::take(&mut self.ranks[t]);
        for (si, &r) in ranks.iter().enumerate() {
            let (c, s) = (
                self.opts[t][o].cost[si],
                self.opts[t][o].option.shards[si].storage,
            );
            self.sub(r, c, &s);
        }
        Some((o, ranks))
    }

    /// Best option and placement for an unplaced table: lowest resulting peak over the ranks
    /// it touches (capped below by the current makespan), then least total cost.
    fn best_insert(&mut self, t: usize, mode: Construction) -> Option<(usize, Vec<usize>)> {
        let current = self.makespan();
        let w = self.w as f64;
        let mut best: Option<(f64, f64, usize, Vec<usize>)> = None;
        if let Construction::Prefer(st) = mode {
            let mut best_pref: Option<(f64, usize, Vec<usize>)> = None;
            for o in 0..self.opts[t].len() {
                if self.opts[t][o].option.sharding_type != st {
                    continue;
                }
                let Some(rs) = self.try_place(t, o) else {
                    continue;
                };
                let peak = rs
                    .iter()
                    .enumerate()
                    .map(|(si, &r)| self.load[r] + self.opts[t][o].cost[si])
                    .fold(current, f64::max);
                if best_pref.as_ref().is_none_or(|b| peak < b.0) {
                    best_pref = Some((peak, o, rs));
                }
            }
            if let Some((_, o, rs)) = best_pref {
                return Some((o, rs));
            }
        }
        for o in 0..self.opts[t].len() {
            let Some(rs) = self.try_place(t, o) else {
                continue;
            };
            let mut added = self.load.clone();
            for (si, &r) in rs.iter().enumerate() {
                added[r] += self.opts[t][o].cost[si];
            }
            let peak_raw = added.iter().cloned().fold(current, f64::max);
            let total_raw = self.opts[t][o].total;
            let (peak, total) = match mode {
                Construction::MinPeak | Construction::Prefer(_) => (peak_raw, total_raw),
                Construction::MinTotal => (total_raw, peak_raw),
                Construction::Blend => (peak_raw + total_raw / w, total_raw),
            };
            let take = match &best {
                None => true,
                Some((bp, bt, _, _)) => {
                    peak < bp * (1.0 - REL_EPS) || (peak <= bp * (1.0 + REL_EPS) && total < *bt)
                }
            };
            if take {
                best = Some((peak, total, o, rs));
            }
        }
        best.map(|b| (b.2, b.3))
    }

    /// Moves or swaps device-placed shards off the most loaded rank. Returns whether anything
    /// improved.
    fn improve_placement(&mut self) -> bool {
        let m = self.argmax();
        let lm = self.load[m];
        // Shards on m that may move: (table, shard, cost, storage, allowed rank range).
        let mut on_m = Vec::new();
        for t in 0..self.ranks.len() {
            let Some(o) = self.choice[t] else { continue };
            let opt = &self.opts[t][o];
            let pb = opt.option.partition_by();
            if !(pb == PartitionBy::Device
                || (pb == PartitionBy::Host
                    && opt.option.sharding_type == ShardingType::TableColumnWise))
            {
                continue;
            }
            for (si, &r) in self.ranks[t].iter().enumerate() {
                if r == m {
                    let range = if pb == PartitionBy::Device {
                        0..self.w
                    } else {
                        let h = m / self.local;
                        h * self.local..(h + 1) * self.local
                    };
                    on_m.push((t, si, opt.cost[si], opt.option.shards[si].storage, range));
                }
            }
        }
        // Best single move: minimise the larger of the two new loads.
        let mut best: Option<(f64, usize, usize, usize)> = None;
        for &(t, si, c, s, ref range) in &on_m {
            for r in range.clone() {
                if r == m || self.load[r] + c >= lm * (1.0 - REL_EPS) || !self.fits(r, &s) {
                    continue;
                }
                let peak = (self.load[r] + c).max(lm - c);
                if best.is_none_or(|b| peak < b.0) {
                    best = Some((peak, t, si, r));
                }
            }
        }
        if let Some((_, t, si, r)) = best {
            let o = self.choice[t].unwrap_or(0);
            let (c, s) = (
                self.opts[t][o].cost[si],
                self.opts[t][o].option.shards[si].storage,
            );
            self.sub(m, c, &s);
            self.add(r, c, &s);
            self.ranks[t][si] = r;
            return true;
        }
        // Swaps: a (on m) with a smaller b (on r).
        // (peak, shard on m as (table, shard), shard elsewhere, its rank)
        type Swap = (f64, (usize, usize), (usize, usize), usize);
        let mut best_swap: Option<Swap> = None;
        for t2 in 0..self.ranks.len() {
            let Some(o2) = self.choice[t2] else { continue };
            let opt2 = &self.opts[t2][o2];
            let pb2 = opt2.option.partition_by();
            let movable = pb2 == PartitionBy::Device
                || (pb2 == PartitionBy::Host
                    && opt2.option.sharding_type == ShardingType::TableColumnWise);
            if !movable {
                continue;
            }
            for (sj, &r) in self.ranks[t2].iter().enumerate() {
                if r == m {
                    continue;
                }
                if pb2 == PartitionBy::Host && r / self.local != m / self.local {
                    continue;
                }
                let cb = opt2.cost[sj];
                let sb = opt2.option.shards[sj].storage;
                for &(t, si, ca, sa, ref range) in &on_m {
                    if ca <= cb || !range.contains(&r) || (t == t2) {
                        continue;
                    }
                    let new_r = self.load[r] - cb + ca;
                    let new_m = lm - ca + cb;
                    if new_r >= lm * (1.0 - REL_EPS) {
                        continue;
                    }
                    let fit_r = Storage {
                        hbm: self.used[r].hbm - sb.hbm,
                        ddr: self.used[r].ddr - sb.ddr,
                    }
                    .plus(&sa)
                    .fits_in(&self.cap[r]);
                    let fit_m = Storage {
                        hbm: self.used[m].hbm - sa.hbm,
                        ddr: self.used[m].ddr - sa.ddr,
                    }
                    .plus(&sb)
                    .fits_in(&self.cap[m]);
                    if !(fit_r && fit_m) {
                        continue;
                    }
                    let peak = new_r.max(new_m);
                    if best_swap.is_none_or(|b| peak < b.0) {
                        best_swap = Some((peak, (t, si), (t2, sj), r));
                    }
                }
            }
        }
        if let Some((_, (t, si), (t2, sj), r)) = best_swap {
            let (oa, ob) = (self.choice[t].unwrap_or(0), self.choice[t2].unwrap_or(0));
            let (ca, sa) = (
                self.opts[t][oa].cost[si],
                self.opts[t][oa].option.shards[si].storage,
            );
            let (cb, sb) = (
                self.opts[t2][ob].cost[sj],
                self.opts[t2][ob].option.shards[sj].storage,
            );
            self.sub(m, ca, &sa);
            self.sub(r, cb, &sb);
            self.add(r, ca, &sa);
            self.add(m, cb, &sb);
            self.ranks[t][si] = r;
            self.ranks[t2][sj] = m;
            return true;
        }
        false
    }

    /// Re-chooses the option of tables with a shard on the most loaded rank.
    fn improve_options(&mut self) -> bool {
        let m = self.argmax();
        let candidates: Vec<usize> = (0..self.ranks.len())
            .filter(|&t| self.ranks[t].contains(&m) && self.opts[t].len() > 1)
            .collect();
        let mut order = candidates;
        order.sort_by(|&a, &b| {
            let ca = self.opts[a][self.choice[a].unwrap_or(0)].total;
            let cb = self.opts[b][self.choice[b].unwrap_or(0)].total;
            cb.total_cmp(&ca)
        });
        for t in order {
            let (old_max, old_sq) = (self.makespan(), self.sumsq());
            let Some((o_old, r_old)) = self.remove(t) else {
                continue;
            };
            let mut best: Option<(f64, f64, usize, Vec<usize>)> = None;
            for o in 0..self.opts[t].len() {
                let Some(rs) = self.try_place(t, o) else {
                    continue;
                };
                self.apply(t, o, rs.clone());
                let (mx, sq) = (self.makespan(), self.sumsq());
                self.remove(t);
                if better(mx, sq, old_max, old_sq)
                    && best.as_ref().is_none_or(|b| better(mx, sq, b.0, b.1))
                {
                    best = Some((mx, sq, o, rs));
                }
            }
            match best {
                Some((_, _, o, rs)) => {
                    self.apply(t, o, rs);
                    return true;
                }
                None => self.apply(t, o_old, r_old),
            }
        }
        false
    }
}

fn shortfall(problem: &Problem, state: &State, t: usize) -> Shortfall {
    let table = &problem.tables[t];
    let needed = state.opts[t]
        .iter()
        .map(|o| {
            o.option
                .shards
                .iter()
                .fold(Storage::default(), |a, s| Storage {
                    hbm: a.hbm.max(s.storage.hbm),
                    ddr: a.ddr.max(s.storage.ddr),
                })
        })
        .min_by_key(|s| (s.hbm.saturating_add(s.ddr), s.hbm))
        .unwrap_or_default();
    let left = (0..state.w).fold(Storage::default(), |a, r| Storage {
        hbm: a
            .hbm
            .max(state.cap[r].hbm.saturating_sub(state.used[r].hbm)),
        ddr: a
            .ddr
            .max(state.cap[r].ddr.saturating_sub(state.used[r].ddr)),
    });
    let c = &table.constraints;
    let mut parts = Vec::new();
    if let Some(st) = &c.sharding_types {
        parts.push(format!(
            "sharding_types = [{}]",
            st.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        ));
    }
    if let Some(k) = &c.compute_kernels {
        parts.push(format!(
            "compute_kernels = [{}]",
            k.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        ));
    }
    Shortfall {
        table: table.name.clone(),
        needed,
        left,
        constraint: if parts.is_empty() {
            "none (every option was tried)".to_string()
        } else {
            parts.join(", ")
        },
    }
}

fn placement_error(
    problem: &Problem,
    options: &[Vec<ShardingOption>],
    capacity: &[Storage],
    state: &State,
    failed: &[usize],
) -> PlannerError {
    let tables: Vec<Shortfall> = failed
        .iter()
        .map(|&t| shortfall(problem, state, t))
        .collect();
    let needed = options.iter().fold(Storage::default(), |acc, os| {
        let min = os
            .iter()
            .map(|o| o.total_storage())
            .min_by_key(|s| (s.hbm.saturating_add(s.ddr), s.hbm))
            .unwrap_or_default();
        acc.plus(&min)
    });
    let available = capacity.iter().fold(Storage::default(), |a, c| a.plus(c));
    if needed.fits_in(&available) {
        PlannerError::StrictConstraints { tables }
    } else {
        PlannerError::InsufficientStorage {
            needed,
            available,
            tables,
        }
    }
}

/// Finds a placement of every table, or an error naming the tables that do not fit.
pub fn search(
    problem: &Problem,
    options: &[Vec<ShardingOption>],
    capacity: &[Storage],
    model: CostModel,
    settings: &SearchSettings,
) -> Result<Placement, PlannerError> {
    let topo = &problem.topology;
    let opts: Vec<Vec<Opt>> = options
        .iter()
        .map(|os| {
            os.iter()
                .map(|o| {
                    let cost: Vec<f64> =
                        o.shards.iter().map(|s| model.shard_cost(&s.perf)).collect();
                    let total = cost.iter().sum();
                    Opt {
                        option: o,
                        cost,
                        total,
                    }
                })
                .collect()
        })
        .collect();
    let n = options.len();
    let fresh = || State {
        w: topo.world_size,
        local: topo.local_world_size,
        opts: &opts,
        cap: capacity.to_vec(),
        load: vec![0.0; topo.world_size],
        used: vec![Storage::default(); topo.world_size],
        choice: vec![None; n],
        ranks: vec![Vec::new(); n],
    };

    // Memory-critical tables (whose smallest option needs over a quarter of a rank) first,
    // then by decreasing cheapest cost.
    let rank_hbm = capacity.iter().map(|c| c.hbm).max().unwrap_or(0).max(1);
    let keys: Vec<(bool, f64)> = opts
        .iter()
        .map(|os| {
            let min_cost = os.iter().map(|o| o.total).fold(f64::INFINITY, f64::min);
            let min_mem = os
                .iter()
                .map(|o| {
                    o.option
                        .shards
                        .iter()
                        .map(|s| s.storage.hbm)
                        .max()
                        .unwrap_or(0)
                })
                .min()
                .unwrap_or(0);
            (min_mem > rank_hbm / 4, min_cost)
        })
        .collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        keys[b]
            .0
            .cmp(&keys[a].0)
            .then(keys[b].1.total_cmp(&keys[a].1))
            .then(a.cmp(&b))
    });

    let t_ref = Instant::now();
    // TorchRec's own search: local search from its plan keeps embers at or below it.
    let reference = settings.reference.then(|| {
        crate::reference::torchrec_search(
            options,
            capacity,
            topo.local_world_size,
            Instant::now() + settings.reference_time_limit,
        )
    });
    let reference = reference.flatten();

    let modes = [
        Construction::MinTotal,
        Construction::Blend,
        Construction::MinPeak,
        Construction::Prefer(ShardingType::TableRowWise),
        Construction::Prefer(ShardingType::RowWise),
        Construction::Prefer(ShardingType::DataParallel),
    ];
    let starts = modes.len() + usize::from(reference.is_some());
    // Local search gets what TorchRec's search left of the budget (at least 20 ms a start):
    // every start is already a complete plan, local search only improves it.
    let budget = (settings.time_limit.saturating_sub(t_ref.elapsed()) / starts as u32)
        .max(Duration::from_millis(20));
    let mut best: Option<State> = None;
    let mut first_error = None;
    for start in 0..starts {
        // Each construction places every shard on every candidate rank: with many shards on
        // many ranks one takes long. Past the time limit, once a plan is in hand (one built,
        // or TorchRec's, found), the other constructions are skipped and one under way is
        // given up (the limit bounds the search, not a first plan; a first construction of
        // 16384-shard options on 65536 ranks ran for tens of minutes); TorchRec's plan is
        // still taken.
        let in_hand = best.is_some() || reference.is_some();
        let late = || in_hand && t_ref.elapsed() > settings.time_limit;
        if start < modes.len() && late() {
            continue;
        }
        let mut state = fresh();
        if let Some(mode) = modes.get(start) {
            let mut failed = Vec::new();
            let mut given_up = false;
            for &t in &order {
                if late() {
                    given_up = true;
                    break;
                }
                match state.best_insert(t, *mode) {
                    Some((o, rs)) => state.apply(t, o, rs),
                    None => failed.push(t),
                }
            }
            if given_up {
                continue;
            }
            if !failed.is_empty() {
                if first_error.is_none() {
                    first_error =
                        Some(placement_error(problem, options, capacity, &state, &failed));
                }
                continue;
            }
        } else if let Some(r) = &reference {
            for t in 0..n {
                state.apply(t, r.choice[t], r.ranks[t].clone());
            }
        }
        let start = Instant::now();
        for _ in 0..settings.max_rounds {
            if start.elapsed() > budget {
                break;
            }
            if state.improve_placement() {
                continue;
            }
            if !state.improve_options() {
                break;
            }
        }
        let replace = match &best {
            None => true,
            Some(b) => better(state.makespan(), state.sumsq(), b.makespan(), b.sumsq()),
        };
        if replace {
            best = Some(state);
        }
    }
    let Some(state) = best else {
        return Err(first_error.unwrap_or(PlannerError::StrictConstraints { tables: Vec::new() }));
    };
    Ok(Placement {
        choice: state.choice.iter().map(|c| c.unwrap_or(0)).collect(),
        ranks: state.ranks,
        reference: reference.map(|r| ReferenceSummary {
            max_rank_perf: r.rating,
            proposals: r.proposals,
            truncated: r.truncated,
        }),
    })
}
