//! For every scenario TorchRec planned, our plan is at least as good (max per-rank perf under
//! TorchRec's own cost model) and fits memory after the same reservation; the failing
//! scenarios fail with the same kind of error.

mod common;

use embers_planner::{plan_problem, reservation, CostModel, PlannerError};

#[test]
fn reservation_matches_torchrec() {
    let golden = common::load("planner_plans.json");
    for case in golden["cases"].as_array().unwrap() {
        let problem = common::problem(&case["inputs"]);
        let cap = reservation::reserve(&problem);
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
        lines.push(format!(
            "{name}: ours {:.9} vs torchrec {theirs:.9} ({:+.2}%), lower bound {:.9}",
            plan.max_rank_perf,
            100.0 * (plan.max_rank_perf / theirs - 1.0),
            plan.lower_bound
        ));
    }
    println!("{}", lines.join("\n"));
}
