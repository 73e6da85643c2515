//! For every scenario TorchRec planned, our plan is at least as good (max per-rank perf under
//! TorchRec's own cost model) and fits memory after the same reservation; the failing
//! scenarios fail with the same kind of error.

mod common;

use embers_planner::{enumerator, plan_problem, reference, reservation, CostModel, PlannerError};

#[test]
fn reservation_matches_torchrec() {
    let golden = common::load("planner_plans.json");
    for case in golden["cases"].as_array().unwrap() {
        let problem = common::problem(&case["inputs"]);
        let cap = reservation::reserve(&problem).unwrap();
        let r = &case["reservation"];
        if r.is_null() {
            continue;
        }
        let name = case["name"].as_str().unwrap();
        assert_eq!(
            Some(cap[0].hbm),
            r["reserved_hbm_per_rank"][0].as_u64(),
            "{name}"
        );
        assert_eq!(
            Some(cap[0].ddr),
            r["reserved_ddr_per_rank"][0].as_u64(),
            "{name}"
        );
    }
}

#[test]
fn plans_beat_or_match_torchrec() {
    let golden = common::load("planner_plans.json");
    let mut lines = Vec::new();
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let problem = common::problem(&case["inputs"]);
        let result = plan_problem(&problem, CostModel::Torchrec);
        if let Some(kind) = case["error"]["error_type"].as_str() {
            let err = result.expect_err(name);
            assert_eq!(err.torchrec_error_type(), Some(kind), "{name}: {err}");
            let msg = err.to_string();
            let table = problem.tables[0].name.as_str();
            assert!(
                msg.contains(table),
                "{name}: message names the table: {msg}"
            );
            match &err {
                PlannerError::InsufficientStorage {
                    needed, available, ..
                } => {
                    assert!(needed.hbm + needed.ddr > available.hbm + available.ddr)
                }
                PlannerError::StrictConstraints { tables } => {
                    assert!(tables[0].needed.hbm > tables[0].left.hbm);
                    assert!(tables[0].constraint.contains("table_wise"), "{msg}");
                }
                other => panic!("{name}: unexpected {other}"),
            }
            lines.push(format!("{name}: error {kind} (as TorchRec)"));
            continue;
        }
        let plan = result.unwrap_or_else(|e| panic!("{name}: {e}"));
        let theirs = case["max_rank_perf"].as_f64().unwrap();
        for r in &plan.ranks {
            assert!(
                r.used.fits_in(&r.capacity),
                "{name}: rank {} over memory",
                r.rank
            );
        }
        assert!(
            plan.max_rank_perf <= theirs * (1.0 + 1e-12),
            "{name}: ours {} > torchrec {theirs}",
            plan.max_rank_perf
        );
        assert!(plan.makespan >= plan.lower_bound * (1.0 - 1e-12));
        // The lower bound holds for TorchRec's plan too (it is a bound on every plan).
        assert!(
            theirs >= plan.lower_bound * (1.0 - 1e-12),
            "{name}: bound {} above torchrec {theirs}",
            plan.lower_bound
        );
        let reference = plan
            .torchrec_search
            .as_ref()
            .expect("TorchRec's search ran");
        assert!(
            plan.max_rank_perf <= reference.max_rank_perf * (1.0 + 1e-12),
            "{name}"
        );
        lines.push(format!(
            "{name}: ours {:.9} vs torchrec {theirs:.9} ({:+.2}%), lower bound {:.9}",
            plan.max_rank_perf,
            100.0 * (plan.max_rank_perf / theirs - 1.0),
            plan.lower_bound
        ));
    }
    println!("{}", lines.join("\n"));
}

/// TorchRec's search as reproduced in `embers_planner::reference` makes the same number of
/// distinct proposals, finds the same rating and places every table as TorchRec did.
#[test]
fn torchrec_search_is_reproduced() {
    let golden = common::load("planner_plans.json");
    let mut checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let Some(rating) = case["perf_model_rating"].as_f64() else {
            continue;
        };
        let problem = common::problem(&case["inputs"]);
        let options = enumerator::enumerate(&problem).unwrap();
        let capacity = reservation::reserve(&problem).unwrap();
        let found = reference::torchrec_search(
            &options,
            &capacity,
            problem.topology.local_world_size,
            std::time::Instant::now() + std::time::Duration::from_secs(60),
        )
        .unwrap_or_else(|| panic!("{name}: no plan"));
        assert!(!found.truncated, "{name}");
        assert!(
            (found.rating - rating).abs() <= 1e-9 * rating,
            "{name}: rating {} vs torchrec {rating}",
            found.rating
        );
        let proposals = case["num_proposals"].as_u64().unwrap() as usize;
        assert_eq!(found.proposals, proposals, "{name}: proposals");
        let plan = case["plan"].as_array().unwrap();
        assert_eq!(plan.len(), options.len(), "{name}");
        for entry in plan {
            let table = entry["table"].as_str().unwrap();
            let t = problem
                .tables
                .iter()
                .position(|x| x.name == table)
                .unwrap_or_else(|| panic!("{name}: table {table}"));
            let o = &options[t][found.choice[t]];
            assert_eq!(
                o.sharding_type.as_str(),
                entry["sharding_type"].as_str().unwrap(),
                "{name}: {table}"
            );
            assert_eq!(
                o.compute_kernel.as_str(),
                entry["compute_kernel"].as_str().unwrap(),
                "{name}: {table}"
            );
            let ranks: Vec<usize> = entry["shards"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["rank"].as_u64().unwrap() as usize)
                .collect();
            assert_eq!(found.ranks[t], ranks, "{name}: {table} shard ranks");
        }
        checked += 1;
    }
    assert_eq!(checked, 6, "every planned golden case checked");
}
