//! The training pipeline (`TrainPipeline`) on 2 ranks in process: pipelined == the same steps
//! one after the other, bit for bit (every step's loss, every table, the dense head); uneven
//! data ends every rank on the same step; a batch that fails to load, or a bad batch, on one
//! rank ends the run on every rank with an error naming it.

#[path = "support/dist_pipeline.rs"]
mod dist_pipeline;
#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;

use std::time::Duration;

use dist_pipeline::{raw_step, step, step_of, train, train_case};
use dist_scenarios::{case, on_ranks, sharded_of};
use embers::distributed::LocalGroup;

const DEADLINE: Duration = Duration::from_secs(20);

#[test]
fn pipelined_training_equals_sequential_training_bit_for_bit() {
    let reference = on_ranks(2, DEADLINE, |comm| {
        let rank = comm.rank();
        let data = (0..10).map(|s| step(rank, s)).collect();
        train(comm, false, data).unwrap()
    });
    for pipelined in [false, true] {
        let runs = on_ranks(2, DEADLINE, |comm| {
            let rank = comm.rank();
            let data = (0..10).map(|s| step(rank, s)).collect();
            train(comm, pipelined, data).unwrap()
        });
        for (rank, ((got, report), (want, _))) in runs.iter().zip(&reference).enumerate() {
            assert_eq!(report.steps, 10, "rank {rank}");
            assert_eq!(report.unused_batches, 0, "rank {rank}");
            assert_eq!(got.losses.len(), 10);
            assert!(
                got == want,
                "pipelined={pipelined} rank {rank}: the runs differ"
            );
            if !pipelined {
                assert_eq!(report.hidden_fraction(), 0.0, "one stage after the other");
            }
        }
    }
    // And the pipelined run trained: its tables moved from the first step's.
    let first = on_ranks(2, DEADLINE, |comm| {
        let data = vec![step(comm.rank(), 0)];
        train(comm, true, data).unwrap().0
    });
    let ten = on_ranks(2, DEADLINE, |comm| {
        let data = (0..10).map(|s| step(comm.rank(), s)).collect();
        train(comm, true, data).unwrap().0
    });
    assert_ne!(first[0].tables, ten[0].tables);
    assert_eq!(first[0].losses[..], ten[0].losses[..1]);
}

/// The plan's cached kernels (`mixed_cached`: sharded tables behind caches over rows in host
/// memory) with each batch's rows prefetched into the caches while the batch before trains:
/// the same losses, tables and head, bit for bit, as the steps one after the other without
/// prefetching (and as the same plan all in memory, `tests/dist_equivalence.rs`).
#[test]
fn prefetching_into_the_caches_of_cached_shards_changes_nothing() {
    let reference = on_ranks(2, DEADLINE, |comm| {
        let data = (0..10).map(|s| step(comm.rank(), s)).collect();
        train_case(comm, "mixed_cached", false, false, data).unwrap()
    });
    assert!(
        reference.iter().all(|r| r.2 == 0),
        "no prefetch, none taken"
    );
    for pipelined in [false, true] {
        let runs = on_ranks(2, DEADLINE, |comm| {
            let data = (0..10).map(|s| step(comm.rank(), s)).collect();
            train_case(comm, "mixed_cached", pipelined, true, data).unwrap()
        });
        let mut prefetched = 0;
        for (rank, ((got, report, taken), (want, _, _))) in runs.iter().zip(&reference).enumerate()
        {
            assert_eq!(report.steps, 10, "rank {rank}");
            assert!(
                got == want,
                "pipelined={pipelined} rank {rank}: prefetching changed the run"
            );
            prefetched += taken;
        }
        // Every step's cached lookups took the prefetch's admission, on some rank at least.
        assert!(
            prefetched >= 10,
            "pipelined={pipelined}: {prefetched} prefetched lookups"
        );
    }
}

#[test]
fn uneven_data_ends_every_rank_on_the_same_step() {
    for pipelined in [false, true] {
        let runs = on_ranks(2, DEADLINE, |comm| {
            let rank = comm.rank();
            let n = if rank == 0 { 12 } else { 9 };
            let data = (0..n).map(|s| step(rank, s)).collect();
            train(comm, pipelined, data).unwrap()
        });
        let even = on_ranks(2, DEADLINE, |comm| {
            let rank = comm.rank();
            let data = (0..9).map(|s| step(rank, s)).collect();
            train(comm, pipelined, data).unwrap().0
        });
        for (rank, ((outcome, report), want)) in runs.iter().zip(&even).enumerate() {
            assert_eq!(report.steps, 9, "pipelined={pipelined} rank {rank}");
            assert_eq!(outcome, want, "pipelined={pipelined} rank {rank}");
            if rank == 0 {
                // The batch for step 9 at least was loaded and left.
                assert!(report.unused_batches >= 1, "{report:?}");
            } else {
                assert_eq!(report.unused_batches, 0, "{report:?}");
            }
        }
    }
}

#[test]
fn a_batch_that_fails_to_load_ends_the_run_on_every_rank() {
    for pipelined in [false, true] {
        let errors = on_ranks(2, DEADLINE, |comm| {
            let rank = comm.rank();
            let data = (0..8)
                .map(|s| {
                    if rank == 1 && s == 4 {
                        Err(embers::Error::Distributed("truncated record 17".into()))
                    } else {
                        step(rank, s)
                    }
                })
                .collect();
            train(comm, pipelined, data).unwrap_err().to_string()
        });
        assert!(errors[1].contains("truncated record 17"), "{}", errors[1]);
        assert!(
            errors[0].contains("rank(s) [1] could not load their batch for step 4"),
            "{}",
            errors[0]
        );
    }
}

#[test]
fn a_bad_batch_on_one_rank_ends_the_run_on_every_rank() {
    for pipelined in [false, true] {
        let errors = on_ranks(2, DEADLINE, |comm| {
            let rank = comm.rank();
            let data = (0..6)
                .map(|s| {
                    if rank == 0 && s == 3 {
                        let mut batch = raw_step(rank, s);
                        batch.ids[0][0] = vec![999];
                        Ok(step_of(batch))
                    } else {
                        step(rank, s)
                    }
                })
                .collect();
            train(comm, pipelined, data).unwrap_err().to_string()
        });
        assert!(
            errors[0].contains("feature `f0`") && errors[0].contains("id 999"),
            "{}",
            errors[0]
        );
        assert!(
            errors[1].contains("rank(s) [0] rejected their input batch"),
            "{}",
            errors[1]
        );
    }
}

#[test]
fn the_input_distribution_refuses_a_communicator_of_another_group() {
    let errors = on_ranks(2, DEADLINE, |comm| {
        let c = case(2, "mixed_adagrad").unwrap();
        let sharded = sharded_of(comm, &c).unwrap();
        let alone = LocalGroup::comms(1).unwrap().pop().unwrap();
        let batch = step(sharded.comm().rank(), 0).unwrap();
        sharded
            .distribute_input(&batch.kjt, &alone)
            .unwrap_err()
            .to_string()
    });
    for e in errors {
        assert!(
            e.contains("rank 0 of 1") && e.contains("a duplicate of it"),
            "{e}"
        );
    }
}

/// Two pipelines' input distributions at once (validation inside a training step while the
/// training pipeline distributes the next batch), reaching the collection in another order on
/// each rank: each communicator counts its own batches (one count per collection made the
/// ranks disagree on the batch number and fail "a rank skipped or repeated a batch").
#[test]
fn two_communicators_distribute_inputs_at_once_in_any_order() {
    let errors = on_ranks(2, DEADLINE, |comm| {
        let c = case(2, "mixed_adagrad").unwrap();
        let sharded = sharded_of(comm, &c).unwrap();
        let rank = sharded.comm().rank();
        let (a, b) = (sharded.comm().split(0)?, sharded.comm().split(0)?);
        let batch = step(rank, 0)?;
        let order = if rank == 0 { [&a, &b] } else { [&b, &a] };
        std::thread::scope(|s| {
            let threads: Vec<_> = (order.iter().enumerate())
                .map(|(i, &comm)| {
                    let (sharded, batch) = (&sharded, &batch);
                    s.spawn(move || {
                        // The second starts well after the first has taken its number.
                        std::thread::sleep(Duration::from_millis(300 * i as u64));
                        sharded.distribute_input(&batch.kjt, comm).map(|_| ())
                    })
                })
                .collect();
            threads
                .into_iter()
                .try_for_each(|t| t.join().expect("no panic"))
        })
    });
    for e in errors {
        e.unwrap();
    }
}

/// A plan of data-parallel tables only sends no bags, yet a batch one rank rejects still ends
/// every rank at its input distribution (the others went on to the backward's all-gather and
/// waited there until the deadline).
#[test]
fn a_bad_batch_under_a_data_parallel_plan_is_refused_on_every_rank() {
    let errors = on_ranks(2, DEADLINE, |comm| {
        let c = case(2, "data_parallel").unwrap();
        let sharded = sharded_of(comm, &c).unwrap();
        let rank = sharded.comm().rank();
        let mut batch = raw_step(rank, 0);
        if rank == 0 {
            batch.ids[0][0] = vec![999];
        }
        let batch = step_of(batch);
        let comm = sharded.comm();
        let refused = sharded.distribute_input(&batch.kjt, comm).err();
        // The next batch goes through on every rank.
        let next = step(rank, 1).unwrap();
        sharded.distribute_input(&next.kjt, comm).unwrap();
        refused.map(|e| e.to_string())
    });
    let [e0, e1] = [&errors[0], &errors[1]].map(|e| e.clone().expect("refused"));
    assert!(e0.contains("feature `f0`") && e0.contains("id 999"), "{e0}");
    assert!(
        e1.contains("rank(s) [0] rejected their input batch"),
        "{e1}"
    );
}
