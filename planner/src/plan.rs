//! The plan as a typed value and as JSON in TorchRec's vocabulary.

use crate::config::Problem;
use crate::estimator::CostModel;
use crate::search::Placement;
use crate::types::{ComputeKernel, Perf, ShardingOption, ShardingType, Storage};
use serde::{Deserialize, Serialize};

/// One placed shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlacedShard {
    /// `[rows, cols]`.
    pub size: [u64; 2],
    /// `[row, col]` offset in the table.
    pub offset: [u64; 2],
    /// The rank holding it.
    pub rank: usize,
    /// TorchRec's perf components (ms).
    pub perf: Perf,
    /// TorchRec's total (ms): everything but input distribution.
    pub perf_total: f64,
    /// Cost under the plan's cost model (ms).
    pub cost: f64,
    /// Memory (bytes).
    pub storage: Storage,
}

/// The decision for one table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TablePlan {
    /// Table name.
    pub name: String,
    /// Sharding type.
    pub sharding_type: ShardingType,
    /// Compute kernel.
    pub compute_kernel: ComputeKernel,
    /// Cache load factor from the constraints, if any.
    pub cache_load_factor: Option<f64>,
    /// Rank of each shard, in shard order (TorchRec's `ParameterSharding.ranks`).
    pub ranks: Vec<usize>,
    /// The shards.
    pub shards: Vec<PlacedShard>,
    /// Sum of the shards' costs under the plan's model.
    pub cost: f64,
}

/// Totals of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    /// Rank id.
    pub rank: usize,
    /// Sum of the perf components of its shards.
    pub perf: Perf,
    /// Sum of TorchRec totals.
    pub perf_total: f64,
    /// Sum of costs under the plan's model.
    pub cost: f64,
    /// Memory used.
    pub used: Storage,
    /// Memory available to tables after reservation.
    pub capacity: Storage,
    /// Number of shards.
    pub shards: usize,
}

/// A complete plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Cost model the plan was optimised for.
    pub cost_model: String,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks per host.
    pub local_world_size: usize,
    /// Per table, in config order.
    pub tables: Vec<TablePlan>,
    /// Per rank.
    pub ranks: Vec<RankSummary>,
    /// Max over ranks of the summed cost (the objective).
    pub makespan: f64,
    /// A lower bound on the makespan of every plan of this problem ([`crate::bound`]): the
    /// larger of the largest unavoidable shard and the LP relaxation of the total cost under
    /// the summed memory, over the ranks.
    pub lower_bound: f64,
    /// max(largest shard cost, total cost / ranks) for the chosen options: the best any
    /// placement of this plan's options could reach (no bound on other option choices).
    pub balance_bound: f64,
    /// What TorchRec's own search (reproduced, on the same options) found, when it ran.
    #[serde(default)]
    pub torchrec_search: Option<crate::search::ReferenceSummary>,
    /// Max over ranks of the summed TorchRec perf total (comparable with TorchRec's planner).
    pub max_rank_perf: f64,
    /// makespan / mean rank cost.
    pub imbalance: f64,
}

impl Plan {
    /// Assembles the plan from the chosen options and ranks.
    pub fn build(
        problem: &Problem,
        options: &[Vec<ShardingOption>],
        placement: &Placement,
        capacity: &[Storage],
        model: CostModel,
    ) -> Plan {
        let w = problem.topology.world_size;
        let mut ranks: Vec<RankSummary> = (0..w)
            .map(|r| RankSummary {
                rank: r,
                perf: Perf::default(),
                perf_total: 0.0,
                cost: 0.0,
                used: Storage::default(),
                capacity: capacity[r],
                shards: 0,
            })
            .collect();
        let mut tables = Vec::with_capacity(options.len());
        let mut largest: f64 = 0.0;
        let mut total = 0.0;
        for (t, os) in options.iter().enumerate() {
            let o = &os[placement.choice[t]];
            let mut shards = Vec::with_capacity(o.shards.len());
            for (s, &r) in o.shards.iter().zip(&placement.ranks[t]) {
                let cost = model.shard_cost(&s.perf);
                largest = largest.max(cost);
                total += cost;
                let rs = &mut ranks[r];
                rs.perf.add(&s.perf);
                rs.perf_total += s.perf.total();
                rs.cost += cost;
                rs.used = rs.used.plus(&s.storage);
                rs.shards += 1;
                shards.push(PlacedShard {
                    size: s.size,
                    offset: s.offset,
                    rank: r,
                    perf: s.perf,
                    perf_total: s.perf.total(),
                    cost,
                    storage: s.storage,
                });
            }
            tables.push(TablePlan {
                name: o.name.clone(),
                sharding_type: o.sharding_type,
                compute_kernel: o.compute_kernel,
                cache_load_factor: o.cache_load_factor,
                ranks: placement.ranks[t].clone(),
                cost: shards.iter().map(|s| s.cost).sum(),
                shards,
            });
        }
        let makespan = ranks.iter().map(|r| r.cost).fold(0.0, f64::max);
        let max_rank_perf = ranks.iter().map(|r| r.perf_total).fold(0.0, f64::max);
        let mean = total / w as f64;
        Plan {
            cost_model: model.as_str().to_string(),
            world_size: w,
            local_world_size: problem.topology.local_world_size,
            tables,
            ranks,
            makespan,
            lower_bound: crate::bound::lower_bound(options, capacity, |o, i| {
                model.shard_cost(&o.shards[i].perf)
            }),
            balance_bound: largest.max(mean),
            torchrec_search: placement.reference.clone(),
            max_rank_perf,
            imbalance: if mean > 0.0 { makespan / mean } else { 1.0 },
        }
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Reads a plan from the JSON [`Plan::to_json`] writes (`embers-plan plan --output`).
    pub fn from_json(json: &str) -> Result<Plan, serde_json::Error> {
        serde_json::from_str(json)
    }
}
