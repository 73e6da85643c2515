//! The sharded `EmbeddingCollection` (unpooled lookups) in one process, each rank a thread
//! over a `LocalGroup`: sharded == unsharded for every sharding type and the mixed plans at 1,
//! 2 and 4 ranks (see `support/dist_sequence.rs`), on the CUDA device too; checkpoints across
//! world sizes and into an unsharded collection; bad input. The same scenarios run across
//! processes in `dist_mpi.rs`.

#[path = "support/cuda_device.rs"]
mod cuda_device;
#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;
#[path = "support/dist_sequence.rs"]
mod dist_sequence;

use std::time::Duration;

use dist_scenarios::{
    cache_failures, case, cases, compare, kjt_of, plan_of, rank_batch, remove_cache_files, Case,
    SEED,
};
use dist_sequence::{ec_tables, run_ec_local, train_ec};
use embers::distributed::{load_into_unsharded, Comm, ShardedEmbeddingCollection};
use embers::embedding::{EmbeddingCollection, EmbeddingConfig};
use embers::sparse::KeyedJaggedTensor;
use embers::tensor::rng::seeded;
use embers::Tensor;

fn check_cases(cases: Vec<Case>) {
    let mut failures = Vec::new();
    for case in cases {
        let reports = run_ec_local(&case, 5);
        let files = remove_cache_files(&case);
        failures.extend(cache_failures(&case, &reports, files));
        for (rank, r) in reports.into_iter().enumerate() {
            match r {
                Ok(report) => {
                    assert!(report.table_values > 0, "{report:?}");
                    assert!(case.world == 1 || report.bytes_checked > 0, "{report:?}");
                }
                Err(e) => failures.push(format!("{} rank {rank}: {e}", case.name)),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn sharded_ec_equals_unsharded_on_two_ranks() {
    check_cases(cases(2));
}

#[test]
fn sharded_ec_equals_unsharded_on_four_ranks_as_two_hosts() {
    check_cases(cases(4));
}

#[test]
fn one_rank_ec_is_the_unsharded_model() {
    check_cases(cases(1));
}

#[test]
fn sharded_ec_equals_unsharded_with_tables_on_the_cuda_device() {
    let Some(device) = cuda_device::device() else {
        return;
    };
    // With the plan's cached kernels too: their caches in the GPU's memory.
    let names = [
        "mixed",
        "mixed_adagrad",
        "row_wise",
        "mixed_cached",
        "row_wise_cached_files",
    ];
    let cases = (cases(2).into_iter())
        .filter(|c| names.contains(&c.name.as_str()))
        .map(|mut c| {
            c.device = device;
            if c.name == "mixed_cached" {
                // Its `fused_uvm` shards in managed memory (its `fused_uvm_caching` ones
                // behind HBM caches); the other cached case moves its smallest caches there.
                c.caches.device = device;
            }
            c
        })
        .collect::<Vec<_>>();
    assert_eq!(cases.len(), names.len());
    check_cases(cases);
}

/// Runs `f` on every rank of a `LocalGroup` of `world` (deadline 5 s).
fn on_ranks<T: Send>(world: usize, f: impl Fn(Comm) -> T + Sync) -> Vec<T> {
    dist_scenarios::on_ranks(world, Duration::from_secs(5), f)
}

#[test]
fn an_ec_trained_on_four_ranks_loads_on_two_and_unsharded() {
    let dir = std::env::temp_dir().join(format!("embers-ec-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let four = case(4, "mixed_adagrad").unwrap();
    let references = on_ranks(4, |comm| {
        let trained = train_ec(comm, &four, 3).unwrap();
        trained.sharded.save(&dir).unwrap();
        (trained.rank, trained.reference)
    });
    let reference = &references[0].1;
    // Unsharded: every table and its optimizer state.
    let whole = EmbeddingCollection::new(ec_tables(), four.optimizer, &mut seeded(9)).unwrap();
    load_into_unsharded(&whole, &dir).unwrap();
    for c in ec_tables() {
        compare(
            &format!("unsharded {}", c.name),
            &whole.table_weights(&c.name).unwrap(),
            &reference.table_weights(&c.name).unwrap(),
        )
        .unwrap();
        for (tw, tr) in whole.tbes().iter().zip(reference.tbes()) {
            if let Some(t) = tw.config().tables.iter().position(|s| s.name == c.name) {
                for k in 0..tw.optimizer_state_names().len() {
                    compare(
                        &format!("unsharded {} state {k}", c.name),
                        &tw.optimizer_state(k, t).unwrap(),
                        &tr.optimizer_state(k, t).unwrap(),
                    )
                    .unwrap();
                }
            }
        }
    }
    // Two ranks under another plan (every table row-wise).
    let two = case(2, "row_wise_adagrad").unwrap();
    let gathered = on_ranks(2, |comm| {
        let ec = ShardedEmbeddingCollection::new(
            ec_tables(),
            &plan_of(&two).unwrap(),
            two.optimizer,
            comm,
            SEED + 5,
        )
        .unwrap();
        ec.load(&dir).unwrap();
        (ec_tables().iter())
            .map(|c| ec.table_weights(&c.name).unwrap())
            .collect::<Vec<_>>()
    });
    for tables in gathered {
        for (c, got) in ec_tables().iter().zip(tables) {
            compare(
                &format!("resharded {}", c.name),
                &got,
                &reference.table_weights(&c.name).unwrap(),
            )
            .unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every rank's forward result on a 2-rank mixed plan when rank 1's batch is `bad`.
fn forward_with(bad: impl Fn() -> KeyedJaggedTensor + Sync) -> Vec<Result<(), String>> {
    let mixed = case(2, "mixed").unwrap();
    on_ranks(2, |comm| {
        let rank = comm.rank();
        let ec = ShardedEmbeddingCollection::new(
            ec_tables(),
            &plan_of(&mixed).unwrap(),
            mixed.optimizer,
            comm,
            SEED,
        )
        .map_err(|e| e.to_string())?;
        let kjt = if rank == 1 {
            bad()
        } else {
            kjt_of(&[&rank_batch(0, 0, 3)], false)
        };
        ec.forward(&kjt).map(|_| ()).map_err(|e| e.to_string())
    })
}

#[test]
fn an_id_outside_its_table_on_one_rank_fails_every_rank_naming_it() {
    let results = forward_with(|| {
        let mut batch = rank_batch(1, 0, 3);
        batch.ids[3][1] = vec![2, 30]; // feature f2 reads t2: 30 rows
        kjt_of(&[&batch], false)
    });
    let e1 = results[1].as_ref().unwrap_err();
    assert!(
        e1.contains("`f2`") && e1.contains("30") && e1.contains("`t2`"),
        "{e1}"
    );
    let e0 = results[0].as_ref().unwrap_err();
    assert!(e0.contains("rank(s) [1] rejected"), "{e0}");
}

#[test]
fn a_missing_feature_on_one_rank_fails_every_rank() {
    let results = forward_with(|| {
        KeyedJaggedTensor::from_lengths(
            vec!["f0".into()],
            Tensor::from_vec(vec![1i64], &[1]).unwrap(),
            Tensor::from_vec(vec![1i64], &[1]).unwrap(),
            None,
            Some(1),
        )
        .unwrap()
    });
    let e1 = results[1].as_ref().unwrap_err();
    assert!(e1.contains("feature `f0b` is missing"), "{e1}");
    assert!(results[0].as_ref().unwrap_err().contains("rejected"));
}

/// Every rank's construction error when rank `r`'s tables are `tables(r)` (2 ranks, the mixed
/// plan).
fn build_errors(tables: impl Fn(usize) -> Vec<EmbeddingConfig> + Sync) -> Vec<String> {
    let mixed = case(2, "mixed").unwrap();
    on_ranks(2, |comm| {
        let plan = plan_of(&mixed).unwrap();
        let built = ShardedEmbeddingCollection::new(
            tables(comm.rank()),
            &plan,
            mixed.optimizer,
            comm,
            SEED,
        );
        built.map(|_| ()).unwrap_err().to_string()
    })
}

#[test]
fn ranks_with_different_tables_fail_naming_the_table() {
    let errors = build_errors(|rank| {
        let mut tables = ec_tables();
        if rank == 1 {
            tables[2] = EmbeddingConfig::new("t2", 30, 32, &["f2", "extra"]);
        }
        tables
    });
    for e in errors {
        assert!(e.contains("first difference: table `t2`"), "{e}");
    }
}

#[test]
fn bad_configs_are_refused_on_every_rank() {
    let errors = build_errors(|_| {
        let mut tables = ec_tables();
        tables[1].feature_names = vec!["f0".into()]; // read by t0 too
        tables
    });
    for e in errors {
        assert!(
            e.contains("feature `f0` is listed by more than one table"),
            "{e}"
        );
    }
}
