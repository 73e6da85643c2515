//! Human-readable tables of a plan and of the enumerated options.

use crate::error::human_bytes;
use crate::plan::Plan;
use crate::types::ShardingOption;
use std::fmt::Write;

fn pct(used: u64, cap: u64) -> String {
    if cap == 0 {
        "-".to_string()
    } else {
        format!("{:.1}%", 100.0 * used as f64 / cap as f64)
    }
}

/// Per-rank and per-table summary of a plan.
pub fn plan_table(plan: &Plan) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "plan: {} ranks ({} per host), cost model '{}'",
        plan.world_size, plan.local_world_size, plan.cost_model
    );
    let _ = writeln!(
        s,
        "makespan {:.6} ms   lower bound {:.6} ms   gap {:.2}%   imbalance {:.3}   max rank perf (torchrec) {:.6} ms",
        plan.makespan,
        plan.lower_bound,
        if plan.lower_bound > 0.0 { 100.0 * (plan.makespan / plan.lower_bound - 1.0) } else { 0.0 },
        plan.imbalance,
        plan.max_rank_perf
    );
    let _ = writeln!(
        s,
        "lower bound: over every plan (largest unavoidable shard, LP relaxation of the total under \
         the summed memory); balance bound of this plan's options {:.6} ms",
        plan.balance_bound
    );
    if let Some(r) = &plan.torchrec_search {
        let _ = writeln!(
            s,
            "TorchRec's search on the same options: max rank perf {:.6} ms ({} proposals{})",
            r.max_rank_perf,
            r.proposals,
            if r.truncated {
                ", cut short by its time limit"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(s, "\nper rank:");
    let _ = writeln!(
        s,
        "{:>4} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>12} {:>7} {:>12} {:>7} {:>6}",
        "rank",
        "cost ms",
        "fwd_comp",
        "fwd_comms",
        "bwd_comp",
        "bwd_comms",
        "prefetch",
        "HBM",
        "HBM%",
        "DDR",
        "DDR%",
        "shards"
    );
    for r in &plan.ranks {
        let _ = writeln!(
            s,
            "{:>4} {:>11.6} {:>11.6} {:>11.6} {:>11.6} {:>11.6} {:>11.6} {:>12} {:>7} {:>12} {:>7} {:>6}",
            r.rank,
            r.cost,
            r.perf.fwd_compute,
            r.perf.fwd_comms,
            r.perf.bwd_compute,
            r.perf.bwd_comms,
            r.perf.prefetch_compute,
            human_bytes(r.used.hbm),
            pct(r.used.hbm, r.capacity.hbm),
            human_bytes(r.used.ddr),
            pct(r.used.ddr, r.capacity.ddr),
            r.shards
        );
    }
    let _ = writeln!(s, "\nper table:");
    let _ = writeln!(
        s,
        "{:<24} {:<18} {:<18} {:>11}  ranks",
        "table", "sharding_type", "compute_kernel", "cost ms"
    );
    for t in &plan.tables {
        let mut ranks: Vec<String> = t.ranks.iter().map(|r| r.to_string()).collect();
        if ranks.len() > 12 {
            let n = ranks.len();
            ranks.truncate(12);
            ranks.push(format!("... ({n} shards)"));
        }
        let _ = writeln!(
            s,
            "{:<24} {:<18} {:<18} {:>11.6}  [{}]",
            t.name,
            t.sharding_type.as_str(),
            t.compute_kernel.as_str(),
            t.cost,
            ranks.join(", ")
        );
    }
    s
}

/// Every option with its per-shard cost, as TorchRec's enumerator lists them.
pub fn options_table(options: &[Vec<ShardingOption>]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<20} {:<18} {:<18} {:>6} {:>13} {:>13} {:>12} {:>12}",
        "table",
        "sharding_type",
        "compute_kernel",
        "shards",
        "max shard ms",
        "total ms",
        "max HBM",
        "max DDR"
    );
    for o in options.iter().flatten() {
        let max_perf = o.shards.iter().map(|x| x.perf.total()).fold(0.0, f64::max);
        let hbm = o.shards.iter().map(|x| x.storage.hbm).max().unwrap_or(0);
        let ddr = o.shards.iter().map(|x| x.storage.ddr).max().unwrap_or(0);
        let _ = writeln!(
            s,
            "{:<20} {:<18} {:<18} {:>6} {:>13.6} {:>13.6} {:>12} {:>12}",
            o.name,
            o.sharding_type.as_str(),
            o.compute_kernel.as_str(),
            o.shards.len(),
            max_perf,
            o.total_perf(),
            human_bytes(hbm),
            human_bytes(ddr)
        );
    }
    s
}
