//! Sharded == unsharded, in one process: each rank is a thread over a `LocalGroup`, for every
//! sharding type and a mixed plan, at 2 and 4 ranks (4 as 2 hosts of 2), 5 steps each (see
//! `support/dist_scenarios.rs`). The same scenarios run across processes under MPI in
//! `dist_mpi.rs`.

#[path = "support/cuda_device.rs"]
mod cuda_device;
#[path = "support/dist_scenarios.rs"]
mod dist_scenarios;

use dist_scenarios::{cache_failures, cases, remove_cache_files, run_local};

fn check_world(world: usize) {
    check_cases(cases(world));
}

fn check_cases(cases: Vec<dist_scenarios::Case>) {
    let mut failures = Vec::new();
    for case in cases {
        let world = case.world;
        let reports = run_local(&case, 5);
        let files = remove_cache_files(&case);
        failures.extend(cache_failures(&case, &reports, files));
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

/// The same with every rank's tables on the CUDA device (a GPU, else the host emulation): the
/// device TBEs' lookups and fused backward under each sharding type, at 2 ranks, and the
/// plan's cached kernels with their caches in the GPU's memory (rows in host memory or in
/// files).
#[test]
fn sharded_equals_unsharded_with_tables_on_the_cuda_device() {
    let Some(device) = cuda_device::device() else {
        return;
    };
    let names = [
        "mixed",
        "mixed_adagrad",
        "column_wise",
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

/// A rank whose row files cannot be made (its cache directory under a plain file) fails its
/// build naming the path, and the other rank's build fails at once naming that rank, instead
/// of waiting for it at its first collective until the deadline; no collection is built, and
/// no row file is left behind.
#[test]
fn a_rank_that_cannot_make_its_row_files_fails_every_ranks_build() {
    use embers::distributed::ShardedEmbeddingBagCollection;
    use embers::embedding::WeightDecay;
    let case = dist_scenarios::case(2, "row_wise_cached_files").expect("a cached case");
    let plan = dist_scenarios::plan_of(&case).unwrap();
    let blocker = std::env::temp_dir().join(format!("embers-blocker-{}", std::process::id()));
    std::fs::write(&blocker, b"a file, not a directory").unwrap();
    let started = std::time::Instant::now();
    let deadline = std::time::Duration::from_secs(20);
    let results = dist_scenarios::on_ranks(2, deadline, |comm| {
        let mut caches = case.caches.clone();
        if comm.rank() == 1 {
            caches.dir = blocker.join("tables");
        }
        ShardedEmbeddingBagCollection::with_caches(
            dist_scenarios::tables(),
            &plan,
            case.optimizer,
            WeightDecay::None,
            &caches,
            comm,
            dist_scenarios::SEED,
        )
        .map(drop)
        .map_err(|e| e.to_string())
    });
    assert!(started.elapsed() < deadline / 2, "{:?}", started.elapsed());
    let own = results[1].as_ref().unwrap_err();
    assert!(own.contains("embers-blocker"), "{own}");
    let other = results[0].as_ref().unwrap_err();
    assert!(
        other.contains("build.tables failed on rank 1") && other.contains("no collection"),
        "{other}"
    );
    // Rank 0 made its row files before it heard; they went with its failed build.
    let left: Vec<_> = std::fs::read_dir(&case.caches.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let _ = std::fs::remove_file(&blocker);
    let _ = std::fs::remove_dir_all(&case.caches.dir);
}
