//! TorchRec 1.9.2's own search, reproduced: its proposers (grid search when the space is small,
//! greedy by max shard perf, greedy by summed perf, uniform) and its greedy perf partitioner,
//! rated by its no-op perf model (max over ranks of the summed shard perf totals).
//!
//! [`crate::search`] starts its local search from the plan found here as well as from its own
//! constructions, and local search only keeps changes that lower the makespan; so under
//! TorchRec's cost model an embers plan is never worse than the plan TorchRec's planner picks
//! on the same options (`benches/peers/plan_compare.sh` checks this against TorchRec itself).
//!
//! What is reproduced, from TorchRec's `proposers.py`, `partitioners.py` and `planners.py`:
//! - options of each table sorted (stably) by max shard perf ("depth") or summed perf;
//! - greedy proposals: start from every table's first option; after each proposal advance the
//!   table whose current option has the largest (max shard HBM, total HBM, max shard DDR,
//!   total DDR), ties to the earlier table, until no table has a next option;
//! - uniform proposals: one per sharding type that every table offers, each table's best option
//!   of that type;
//! - the partitioner: uniform options first (shard `i` on rank `i`), then the others in
//!   decreasing total storage (HBM, then DDR; stable); device-partitioned shards on the rank
//!   with the least summed perf among those where they fit (ties: `rank % local`, then rank);
//!   host-partitioned options on the first host, by summed perf, where the whole option fits;
//!   grid options over consecutive hosts by summed perf.

use crate::types::{PartitionBy, Perf, ShardingOption, ShardingType, Storage};
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeSet, BinaryHeap};
use std::time::Instant;

/// Most proposals the grid-search proposer enumerates (TorchRec's `MAX_PROPOSALS`).
const MAX_GRID_PROPOSALS: u128 = 10_000;

/// The best plan TorchRec's search finds.
#[derive(Debug, Clone)]
pub struct ReferencePlan {
    /// Per table: index into its option list.
    pub choice: Vec<usize>,
    /// Per table: rank of each shard of the chosen option.
    pub ranks: Vec<Vec<usize>>,
    /// TorchRec's rating: max over ranks of the summed shard perf totals (ms).
    pub rating: f64,
    /// Distinct proposals partitioned (TorchRec's `num_proposals`).
    pub proposals: usize,
    /// Whether the time limit cut the search short (the plan is then TorchRec's best so far).
    pub truncated: bool,
}

/// Device state during one partition.
#[derive(Clone)]
struct Device {
    perf: Perf,
    free: Storage,
}

/// The uniform phase's per-rank sums, kept up to date as proposals change one table at a time.
#[derive(Clone)]
struct Base {
    perf: Vec<Perf>,
    /// Summed (HBM, DDR) bytes, wide so that "cannot fit" sizes near `u64::MAX` add and
    /// subtract exactly.
    used: Vec<(u128, u128)>,
    /// Uniform options whose shard count is not the world size (TorchRec raises on them).
    mismatched: usize,
    /// The other tables in the partitioner's order: decreasing total (HBM, DDR) of their
    /// option, ties by table index (Python's stable sort).
    order: BTreeSet<(Reverse<(u64, u64)>, usize)>,
}

impl Base {
    /// Adds (`add`) or removes table `t`'s option `opt` (whose total storage is `total`).
    fn apply(&mut self, t: usize, opt: &ShardingOption, total: Storage, add: bool) {
        if opt.partition_by() != PartitionBy::Uniform {
            let key = (Reverse((total.hbm, total.ddr)), t);
            if add {
                self.order.insert(key);
            } else {
                self.order.remove(&key);
            }
            return;
        }
        if opt.shards.len() != self.perf.len() {
            if add {
                self.mismatched += 1;
            } else {
                self.mismatched -= 1;
            }
            return;
        }
        for (r, s) in opt.shards.iter().enumerate() {
            if add {
                self.perf[r].add(&s.perf);
                self.used[r].0 += u128::from(s.storage.hbm);
                self.used[r].1 += u128::from(s.storage.ddr);
            } else {
                self.perf[r].sub(&s.perf);
                self.used[r].0 -= u128::from(s.storage.hbm);
                self.used[r].1 -= u128::from(s.storage.ddr);
            }
        }
    }
}

/// Per host: its ranks' summed perf totals and whether they changed since last summed.
struct HostSums {
    sums: Vec<f64>,
    dirty: Vec<bool>,
}

impl HostSums {
    fn new(hosts: usize) -> HostSums {
        HostSums {
            sums: vec![0.0; hosts],
            dirty: vec![true; hosts],
        }
    }
}

fn take(d: &mut Device, s: &Storage, p: &Perf) {
    d.free.hbm -= s.hbm;
    d.free.ddr -= s.ddr;
    d.perf.add(p);
}

/// Heap key of TorchRec's `OrderedDeviceHardware`: (perf total, rank % local, rank), least first.
#[derive(PartialEq)]
struct Key(f64, usize, usize);

impl Key {
    /// The key of `device`, rank `rank` of hosts of `local` ranks.
    fn of(device: &Device, rank: usize, local: usize) -> Key {
        Key(device.perf.total(), rank % local, rank)
    }
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0
            .total_cmp(&other.0)
            .then(self.1.cmp(&other.1))
            .then(self.2.cmp(&other.2))
    }
}

struct Partitioner<'a> {
    options: &'a [Vec<ShardingOption>],
    capacity: &'a [Storage],
    local: usize,
    /// Per table: its total storage per option (the partitioner's sort key), precomputed.
    totals: Vec<Vec<Storage>>,
}

impl<'a> Partitioner<'a> {
    /// The uniform phase of a proposal (shard `i` of every uniform option on rank `i`, in
    /// table order), from scratch.
    fn uniform_base(&self, proposal: &[usize]) -> Base {
        let w = self.capacity.len();
        let mut base = Base {
            perf: vec![Perf::default(); w],
            used: vec![(0, 0); w],
            mismatched: 0,
            order: BTreeSet::new(),
        };
        for (t, &o) in proposal.iter().enumerate() {
            base.apply(t, &self.options[t][o], self.totals[t][o], true);
        }
        base
    }

    /// Places the proposal's non-uniform options on top of its uniform phase `base`; returns
    /// TorchRec's rating (max rank perf total) and, when `ranks` is given, fills each placed
    /// table's shard ranks. `None` where TorchRec's partitioner raises.
    fn partition(
        &self,
        proposal: &[usize],
        base: &Base,
        mut ranks: Option<&mut Vec<Vec<usize>>>,
    ) -> Option<f64> {
        let w = self.capacity.len();
        let mut dev: Vec<Device> = Vec::with_capacity(w);
        for r in 0..w {
            let (u, c) = (base.used[r], self.capacity[r]);
            // Uniform shards that do not fit (the final sums fit iff every prefix does).
            if u.0 > u128::from(c.hbm) || u.1 > u128::from(c.ddr) {
                return None;
            }
            dev.push(Device {
                perf: base.perf[r],
                free: Storage {
                    hbm: c.hbm - u.0 as u64,
                    ddr: c.ddr - u.1 as u64,
                },
            });
        }
        if base.mismatched > 0 {
            return None;
        }
        let mut hosts = HostSums::new(w / self.local);
        let mut heap: Option<BinaryHeap<Reverse<Key>>> = None;
        let mut rs = Vec::new();
        for &(_, t) in &base.order {
            let opt = &self.options[t][proposal[t]];
            rs.clear();
            match opt.partition_by() {
                PartitionBy::Device => {
                    let heap = heap.get_or_insert_with(|| {
                        (0..w)
                            .map(|r| Reverse(Key::of(&dev[r], r, self.local)))
                            .collect()
                    });
                    for s in &opt.shards {
                        let mut stash = Vec::new();
                        let mut placed = None;
                        while let Some(Reverse(k)) = heap.pop() {
                            let r = k.2;
                            if s.storage.fits_in(&dev[r].free) {
                                take(&mut dev[r], &s.storage, &s.perf);
                                hosts.dirty[r / self.local] = true;
                                heap.push(Reverse(Key::of(&dev[r], r, self.local)));
                                placed = Some(r);
                                break;
                            }
                            stash.push(Reverse(k));
                        }
                        heap.extend(stash);
                        rs.push(placed?);
                    }
                }
                PartitionBy::Host => {
                    heap = None;
                    self.cohost(
                        &mut dev,
                        &mut hosts,
                        opt,
                        self.totals[t][proposal[t]],
                        &mut rs,
                    )?;
                }
                PartitionBy::MultiHost => {
                    heap = None;
                    self.multi_host(&mut dev, &mut hosts, opt, &mut rs)?;
                }
                PartitionBy::Uniform => unreachable!("uniform options are in the base"),
            }
            if let Some(ranks) = ranks.as_deref_mut() {
                ranks[t] = rs.clone();
            }
        }
        if let Some(ranks) = ranks {
            for (t, &o) in proposal.iter().enumerate() {
                if self.options[t][o].partition_by() == PartitionBy::Uniform {
                    ranks[t] = (0..w).collect();
                }
            }
        }
        Some(dev.iter().map(|d| d.perf.total()).fold(0.0, f64::max))
    }

    /// Hosts ordered by the summed perf totals of their ranks (stable); sums are recomputed
    /// (in rank order, as TorchRec adds them) only for hosts changed since the last call.
    fn hosts_by_perf(&self, dev: &[Device], hosts: &mut HostSums) -> Vec<usize> {
        let l = self.local;
        for (h, dirty) in hosts.dirty.iter_mut().enumerate() {
            if *dirty {
                hosts.sums[h] = dev[h * l..(h + 1) * l].iter().map(|d| d.perf.total()).sum();
                *dirty = false;
            }
        }
        let mut order: Vec<usize> = (0..hosts.sums.len()).collect();
        order.sort_by(|&a, &b| hosts.sums[a].total_cmp(&hosts.sums[b]));
        order
    }

    fn cohost(
        &self,
        dev: &mut [Device],
        hosts: &mut HostSums,
        opt: &ShardingOption,
        total: Storage,
        rs: &mut Vec<usize>,
    ) -> Option<()> {
        let l = self.local;
        for h in self.hosts_by_perf(dev, hosts) {
            let base = h * l;
            rs.clear();
            let mut copy: Vec<Device> = dev[base..base + l].to_vec();
            let free = copy.iter().fold(Storage::default(), |a, d| a.plus(&d.free));
            if !total.fits_in(&free) {
                continue;
            }
            let ok = if opt.sharding_type == ShardingType::TableRowWise {
                // Uniform over the host's ranks.
                opt.shards.len() == l
                    && opt.shards.iter().enumerate().all(|(i, s)| {
                        if !s.storage.fits_in(&copy[i].free) {
                            return false;
                        }
                        take(&mut copy[i], &s.storage, &s.perf);
                        rs.push(base + i);
                        true
                    })
            } else {
                // Table-column-wise: device partition within the host, by the same key (the
                // host's heap uses the host size as `local_world_size`, which is `l`).
                opt.shards.iter().all(|s| {
                    let best = (0..l)
                        .filter(|&i| s.storage.fits_in(&copy[i].free))
                        .min_by_key(|&i| Key::of(&copy[i], base + i, l));
                    match best {
                        Some(i) => {
                            take(&mut copy[i], &s.storage, &s.perf);
                            rs.push(base + i);
                            true
                        }
                        None => false,
                    }
                })
            };
            if ok {
                dev[base..base + l].clone_from_slice(&copy);
                hosts.dirty[h] = true;
                return Some(());
            }
        }
        None
    }

    fn multi_host(
        &self,
        dev: &mut [Device],
        hosts_sums: &mut HostSums,
        opt: &ShardingOption,
        rs: &mut Vec<usize>,
    ) -> Option<()> {
        let l = self.local;
        let n = opt.shards.len();
        if n % l != 0 {
            return None;
        }
        let need = n / l;
        let hosts = self.hosts_by_perf(dev, hosts_sums);
        let mut start = 0;
        loop {
            let all = need >= hosts.len();
            let chosen: Vec<usize> = if all {
                (0..need).map(|i| hosts[i % hosts.len()]).collect()
            } else {
                hosts[start..start + need].to_vec()
            };
            start += 1;
            // Each position works on its own copy of its device (TorchRec deep-copies the
            // device list, so a host listed twice is checked against its state before both).
            let ranks: Vec<usize> = chosen
                .iter()
                .flat_map(|&h| (h * l..(h + 1) * l).collect::<Vec<_>>())
                .collect();
            let mut copies: Vec<Device> = ranks.iter().map(|&r| dev[r].clone()).collect();
            let ok = opt.shards.iter().enumerate().all(|(i, s)| {
                if !s.storage.fits_in(&copies[i].free) {
                    return false;
                }
                take(&mut copies[i], &s.storage, &s.perf);
                true
            });
            if ok {
                for (c, &r) in copies.into_iter().zip(&ranks) {
                    dev[r] = c;
                    hosts_sums.dirty[r / l] = true;
                }
                *rs = ranks;
                return Some(());
            }
            if all || start + need > hosts.len() {
                return None;
            }
        }
    }
}

/// Per table, its option indices sorted (stably) by TorchRec's score: max shard perf total
/// (`depth`) or the sum.
fn sorted_options(options: &[Vec<ShardingOption>], depth: bool) -> Vec<Vec<usize>> {
    options
        .iter()
        .map(|os| {
            let score: Vec<f64> = os
                .iter()
                .map(|o| {
                    let it = o.shards.iter().map(|s| s.perf.total());
                    if depth {
                        it.fold(f64::NEG_INFINITY, f64::max)
                    } else {
                        it.sum()
                    }
                })
                .collect();
            let mut idx: Vec<usize> = (0..os.len()).collect();
            idx.sort_by(|&a, &b| score[a].total_cmp(&score[b]));
            idx
        })
        .collect()
}

/// Runs TorchRec's proposers and partitioner until they are exhausted or `deadline` passes.
/// `None` when no proposal partitions (TorchRec's planner then raises).
pub fn torchrec_search(
    options: &[Vec<ShardingOption>],
    capacity: &[Storage],
    local_world_size: usize,
    deadline: Instant,
) -> Option<ReferencePlan> {
    let n = options.len();
    if n == 0 || options.iter().any(|os| os.is_empty()) {
        return None;
    }
    let part = Partitioner {
        options,
        capacity,
        local: local_world_size.max(1),
        totals: options
            .iter()
            .map(|os| os.iter().map(|o| o.total_storage()).collect())
            .collect(),
    };
    // The best proposal so far and its rating.
    let mut best: Option<(Vec<usize>, f64)> = None;
    let mut proposals = 0usize;
    let mut truncated = false;
    // Proposals already partitioned (TorchRec's proposal cache), by hash.
    let mut seen = std::collections::HashSet::new();
    let mut consider = |proposal: &[usize], base: &Base| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(proposal, &mut h);
        if !seen.insert(std::hash::Hasher::finish(&h)) {
            return;
        }
        proposals += 1;
        if let Some(rating) = part.partition(proposal, base, None) {
            if best.as_ref().is_none_or(|b| rating < b.1) {
                best = Some((proposal.to_vec(), rating));
            }
        }
    };

    // Each table's options by max shard perf (the grid, the depth greedy and the uniform
    // proposers' order).
    let by_depth = sorted_options(options, true);

    // Grid search, only when the whole space is small.
    let space = options
        .iter()
        .try_fold(1u128, |a, os| a.checked_mul(os.len() as u128));
    if space.is_some_and(|s| s <= MAX_GRID_PROPOSALS) {
        let sorted = &by_depth;
        let mut idx = vec![0usize; n];
        'grid: loop {
            if Instant::now() > deadline {
                truncated = true;
                break;
            }
            let p: Vec<usize> = (0..n).map(|t| sorted[t][idx[t]]).collect();
            consider(&p, &part.uniform_base(&p));
            // itertools.product order: the last table varies fastest.
            for t in (0..n).rev() {
                idx[t] += 1;
                if idx[t] < sorted[t].len() {
                    continue 'grid;
                }
                idx[t] = 0;
            }
            break;
        }
    }

    // Greedy, by depth and by sum. The sums are exact (u128) as TorchRec's Python integers
    // are: shard sizes near u64::MAX times many ranks must not wrap.
    let storage_key: Vec<Vec<(u64, u128, u64, u128)>> = options
        .iter()
        .map(|os| {
            os.iter()
                .map(|o| {
                    let it = o.shards.iter();
                    (
                        it.clone().map(|s| s.storage.hbm).max().unwrap_or(0),
                        it.clone().map(|s| u128::from(s.storage.hbm)).sum(),
                        it.clone().map(|s| s.storage.ddr).max().unwrap_or(0),
                        it.map(|s| u128::from(s.storage.ddr)).sum(),
                    )
                })
                .collect()
        })
        .collect();
    for depth in [true, false] {
        if truncated {
            break;
        }
        let by_sum;
        let sorted = if depth {
            &by_depth
        } else {
            by_sum = sorted_options(options, false);
            &by_sum
        };
        let mut idx = vec![0usize; n];
        let mut p: Vec<usize> = (0..n).map(|t| sorted[t][0]).collect();
        let mut base = part.uniform_base(&p);
        loop {
            if Instant::now() > deadline {
                truncated = true;
                break;
            }
            consider(&p, &base);
            let mut largest: Option<(usize, (u64, u128, u64, u128))> = None;
            for t in 0..n {
                if idx[t] + 1 < sorted[t].len() {
                    let k = storage_key[t][sorted[t][idx[t]]];
                    if k > largest.map_or((0, 0, 0, 0), |l| l.1) {
                        largest = Some((t, k));
                    }
                }
            }
            match largest {
                Some((t, _)) => {
                    base.apply(t, &options[t][p[t]], part.totals[t][p[t]], false);
                    idx[t] += 1;
                    p[t] = sorted[t][idx[t]];
                    base.apply(t, &options[t][p[t]], part.totals[t][p[t]], true);
                }
                None => break,
            }
        }
    }

    // Uniform: one proposal per sharding type every table offers, in order of first
    // appearance.
    if !truncated {
        let sorted = &by_depth;
        let mut types: Vec<ShardingType> = Vec::new();
        for os in options {
            for o in os {
                if !types.contains(&o.sharding_type) {
                    types.push(o.sharding_type);
                }
            }
        }
        for st in types {
            let proposal: Option<Vec<usize>> = (0..n)
                .map(|t| {
                    sorted[t]
                        .iter()
                        .copied()
                        .find(|&o| options[t][o].sharding_type == st)
                })
                .collect();
            if let Some(p) = proposal {
                consider(&p, &part.uniform_base(&p));
            }
        }
    }
    let (choice, rating) = best?;
    let mut ranks = vec![Vec::new(); n];
    part.partition(&choice, &part.uniform_base(&choice), Some(&mut ranks))?;
    Some(ReferencePlan {
        choice,
        ranks,
        rating,
        proposals,
        truncated,
    })
}
