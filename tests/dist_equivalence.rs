//! Sharded == unsharded, in one process: each rank is a thread over a `LocalGroup`, for every
//! sharding type and a mixed plan, at 2 and 4 ranks (4 as 2 hosts of 2), 5 steps each (see
//! `support/dist_scenarios.rs`). The same scenarios run across processes under MPI in
//! `dist_mpi.rs`.

#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;

use dist_scenarios::{cases, run_local};

fn check_world(world: usize) {
    let mut failures = Vec::new();
    for case in cases(world) {
        let reports = run_local(&case, 5);
        for (rank, r) in reports.into_iter().enumerate() {
            match r {
                Ok(report) => {
                    assert!(report.table_values > 0, "{report:?}");
                    assert!(world == 1 || report.bytes_checked > 0, "{report:?}");
                    if case.batches[rank] > 0 {
                        assert!(report.predictions > 0, "{report:?}");
                    }
                }
                Err(e) => failures.push(format!("{} rank {rank}: {e}", case.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn sharded_equals_unsharded_on_two_ranks() {
    check_world(2);
}

#[test]
fn sharded_equals_unsharded_on_four_ranks_as_two_hosts() {
    check_world(4);
}

#[test]
fn one_rank_is_the_unsharded_model() {
    check_world(1);
}
