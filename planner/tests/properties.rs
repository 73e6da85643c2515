//! Invariants of every plan on random problems: memory fits on every rank, every row and
//! column of every table is covered exactly once (once per replica for data parallel), and
//! the makespan is at least the lower bound.

use embers_planner::config::{
    Config, FeatureConfig, OptimizerConfig, OptimizerKind, TableConfig, TopologyConfig,
};
use embers_planner::types::ShardingType;
use embers_planner::{plan_problem, CostModel};
use proptest::prelude::*;

fn table_strategy() -> impl Strategy<Value = (u64, u64, f64)> {
    (
        1u64..200_000,
        prop::sample::select(vec![4u64, 8, 16, 32, 64, 96, 128, 256, 512]),
        prop::sample::select(vec![0.5, 1.0, 5.0, 20.0]),
    )
}

fn config(tables: &[(u64, u64, f64)], world: usize, local: usize, hbm_mib: u64) -> Config {
    Config {
        batch_size: 512,
        topology: TopologyConfig {
            world_size: Some(world),
            local_world_size: Some(local),
            hbm_cap: Some(embers_planner::config::ByteSize(hbm_mib << 20)),
            ..Default::default()
        },
        optimizer: OptimizerConfig {
            kind: OptimizerKind::Adam,
            state_multiplier: None,
        },
        storage_reservation: Default::default(),
        tables: tables
            .iter()
            .enumerate()
            .map(|(i, &(rows, dim, pf))| TableConfig {
                name: format!("t{i}"),
                rows,
                dim,
                data_type: embers_planner::types::DataType::Fp32,
                features: vec![FeatureConfig {
                    name: None,
                    pooling_factor: pf,
                    num_poolings: None,
                    batch_size: None,
                }],
                pooling_factors: None,
                weighted: i % 3 == 0,
                pooled: true,
                constraints: Default::default(),
            })
            .collect(),
    }
}

/// Cases of the property test below that must plan (not fail for lack of memory), so that
/// the invariants cannot pass vacuously.
const MIN_PLANNED: usize = 24;

#[test]
fn plans_fit_cover_and_respect_the_bound() {
    let strategy = (
        prop::collection::vec(table_strategy(), 1..14),
        1usize..3,
        prop::sample::select(vec![1usize, 2, 4]),
        64u64..4096,
        any::<bool>(),
    );
    let planned = std::sync::atomic::AtomicUsize::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(48));
    let result = runner.run(&strategy, |(tables, hosts, local, hbm_mib, overlap)| {
        let world = hosts * local;
        let problem = config(&tables, world, local, hbm_mib).resolve().unwrap();
        let model = if overlap {
            CostModel::Overlap
        } else {
            CostModel::Torchrec
        };
        let plan = match plan_problem(&problem, model) {
            Ok(p) => p,
            // Too little memory is a legitimate outcome; it must be a typed planning error.
            Err(e) => {
                prop_assert!(e.torchrec_error_type().is_some(), "{e}");
                return Ok(());
            }
        };
        for r in &plan.ranks {
            prop_assert!(
                r.used.fits_in(&r.capacity),
                "rank {} over: {:?} > {:?}",
                r.rank,
                r.used,
                r.capacity
            );
        }
        // Recompute per-rank memory from the shards: the summary must agree.
        let mut used = vec![(0u64, 0u64); world];
        for t in &plan.tables {
            for s in &t.shards {
                prop_assert!(s.rank < world);
                used[s.rank].0 += s.storage.hbm;
                used[s.rank].1 += s.storage.ddr;
            }
        }
        for r in &plan.ranks {
            prop_assert_eq!(used[r.rank], (r.used.hbm, r.used.ddr));
        }
        for (t, cfg) in plan.tables.iter().zip(&problem.tables) {
            let replicas = if t.sharding_type == ShardingType::DataParallel {
                world
            } else {
                1
            };
            let area: u64 = t.shards.iter().map(|s| s.size[0] * s.size[1]).sum();
            prop_assert_eq!(
                area,
                cfg.rows * cfg.dim * replicas as u64,
                "table {}",
                &t.name
            );
            for (i, a) in t.shards.iter().enumerate() {
                prop_assert!(
                    a.offset[0] + a.size[0] <= cfg.rows && a.offset[1] + a.size[1] <= cfg.dim
                );
                if replicas == 1 {
                    for b in &t.shards[i + 1..] {
                        let rows_overlap = a.offset[0] < b.offset[0] + b.size[0]
                            && b.offset[0] < a.offset[0] + a.size[0];
                        let cols_overlap = a.offset[1] < b.offset[1] + b.size[1]
                            && b.offset[1] < a.offset[1] + a.size[1];
                        let empty = a.size[0] * a.size[1] == 0 || b.size[0] * b.size[1] == 0;
                        prop_assert!(
                            empty || !(rows_overlap && cols_overlap),
                            "overlap in {}",
                            &t.name
                        );
                    }
                } else {
                    prop_assert_eq!(a.rank, i);
                }
            }
        }
        prop_assert!(plan.makespan >= plan.lower_bound * (1.0 - 1e-12));
        prop_assert!(plan.balance_bound >= plan.lower_bound * (1.0 - 1e-9));
        // Never worse than TorchRec's own search on the same options (under its model).
        if !overlap {
            let reference = plan
                .torchrec_search
                .as_ref()
                .expect("TorchRec's search ran");
            prop_assert!(
                plan.max_rank_perf <= reference.max_rank_perf * (1.0 + 1e-12),
                "{} > torchrec {}",
                plan.max_rank_perf,
                reference.max_rank_perf
            );
        }
        planned.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let planned = planned.into_inner();
    assert!(
        planned >= MIN_PLANNED,
        "only {planned} of 48 random problems planned"
    );
}

#[test]
fn malformed_config_points_at_line_and_field() {
    let err =
        Config::from_toml("batch_size = 512\n[[tables]]\nname = \"a\"\nrows = \"many\"\ndim = 8\n")
            .unwrap_err()
            .to_string();
    assert!(err.contains("line 4"), "{err}");
    assert!(
        err.contains("column 8") && err.contains("expected u64"),
        "{err}"
    );
    let err = Config::from_toml(
        "batch_size = 512\n[topology]\nworld_size = 2\n[[tables]]\nname = \"a\"\nrows = 10\ndim = 0\n",
    )
    .unwrap()
    .resolve()
    .unwrap_err()
    .to_string();
    assert!(err.contains("tables[0].dim"), "{err}");
    // No preset and no world size: the ranks are not guessed (8 were, a plan for a world the
    // job might not have).
    let err = Config::from_toml("batch_size = 512\n[[tables]]\nname = \"a\"\nrows = 10\ndim = 8\n")
        .unwrap()
        .resolve()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("topology.world_size") && err.contains("torchrec-default"),
        "{err}"
    );
    let err = Config::from_json(
        "{\"batch_size\": 1,\n \"tables\": [{\"name\": \"a\", \"rows\": 1, \"dimm\": 2}]}",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("line 2") && err.contains("dimm"), "{err}");
}

/// Cache statistics that no trace could give (negative, NaN or infinite counts, a curve
/// whose total overflows f32) are refused naming the field, not planned with.
#[test]
fn impossible_cache_stats_are_refused_naming_the_field() {
    let resolved = |stats: &str| {
        let toml = format!(
            "batch_size = 512\n[topology]\npreset = \"torchrec-default\"\n\
             [[tables]]\nname = \"a\"\nrows = 1000\ndim = 8\n\
             [tables.constraints]\ncompute_kernels = [\"fused_uvm_caching\"]\n\
             cache_load_factor = 0.2\n[tables.constraints.cache_stats]\n{stats}\n"
        );
        Config::from_toml(&toml).unwrap().resolve()
    };
    let curve = "mrc_hist_counts = [5.0, 0.0, 1.0]\nheight = 10";
    resolved(&format!("expected_lookups = 100.0\n{curve}")).unwrap();
    for (stats, field, says) in [
        (
            format!("expected_lookups = -1e12\n{curve}"),
            "expected_lookups",
            "got -1000000000000",
        ),
        (
            format!("expected_lookups = inf\n{curve}"),
            "expected_lookups",
            "got inf",
        ),
        (
            format!("expected_lookups = nan\n{curve}"),
            "expected_lookups",
            "got NaN",
        ),
        (
            "expected_lookups = 10.0\nmrc_hist_counts = [5.0, -5.0, 1.0]\nheight = 10".into(),
            "mrc_hist_counts",
            "count #1 must be a finite count >= 0",
        ),
        (
            "expected_lookups = 10.0\nmrc_hist_counts = [1.0, nan]\nheight = 10".into(),
            "mrc_hist_counts",
            "count #1 must be",
        ),
        (
            "expected_lookups = 10.0\nmrc_hist_counts = [3e38, 3e38]\nheight = 10".into(),
            "mrc_hist_counts",
            "count #1 must be",
        ),
        (
            format!("expected_lookups = 10.0\n{curve}\ncacheability = -inf"),
            "cacheability",
            "got -inf",
        ),
        (
            format!("expected_lookups = 1e308\n{curve}"),
            "expected_lookups",
            "got 1000000000000000000000",
        ),
    ] {
        let err = resolved(&stats).unwrap_err().to_string();
        assert!(
            err.contains(&format!("tables[0].constraints.cache_stats.{field}"))
                && err.contains(says),
            "{stats}: {err}"
        );
    }
}

/// Multipliers no hardware or optimizer has (negative, NaN, infinite, absurd) are refused
/// naming the field, as is a state multiplier given to an optimizer that sets its own: before,
/// they planned to NaN costs (a plan file that could not be read back) or a silently zero
/// optimizer state.
#[test]
fn impossible_multipliers_are_refused_naming_the_field() {
    let resolved = |extra: &str| {
        let extra = match extra.contains("[topology]") {
            true => extra.replace("[topology]", "[topology]\nworld_size = 8"),
            false => format!("[topology]\nworld_size = 8\n{extra}"),
        };
        let toml =
            format!("batch_size = 512\n{extra}\n[[tables]]\nname = \"a\"\nrows = 1000\ndim = 8\n");
        Config::from_toml(&toml).unwrap().resolve()
    };
    resolved("[optimizer]\nkind = \"custom\"\nstate_multiplier = 3.0").unwrap();
    resolved("[topology]\nbwd_compute_multiplier = 0.5").unwrap();
    for (extra, field, says) in [
        (
            "[optimizer]\nkind = \"custom\"\nstate_multiplier = -1.0",
            "optimizer.state_multiplier",
            "got -1",
        ),
        (
            "[optimizer]\nkind = \"custom\"\nstate_multiplier = nan",
            "optimizer.state_multiplier",
            "got NaN",
        ),
        (
            "[optimizer]\nkind = \"custom\"\nstate_multiplier = 1e300",
            "optimizer.state_multiplier",
            "within [0, 1000], got 1000000000000000000000",
        ),
        (
            "[optimizer]\nkind = \"adam\"\nstate_multiplier = 2.0",
            "optimizer.state_multiplier",
            "only a `custom` optimizer",
        ),
        (
            "[topology]\nbwd_compute_multiplier = nan",
            "topology.bwd_compute_multiplier",
            "got NaN",
        ),
        (
            "[topology]\nbwd_compute_multiplier = -5.0",
            "topology.bwd_compute_multiplier",
            "got -5",
        ),
        (
            "[topology]\nweighted_feature_bwd_compute_multiplier = inf",
            "topology.weighted_feature_bwd_compute_multiplier",
            "got inf",
        ),
    ] {
        let err = resolved(extra).unwrap_err().to_string();
        assert!(err.contains(field) && err.contains(says), "{extra}: {err}");
    }
}

#[test]
fn examples_parse_and_plan() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let problem = Config::from_path(&path).unwrap().resolve().unwrap();
            let plan = plan_problem(&problem, CostModel::Torchrec).unwrap();
            assert_eq!(plan.tables.len(), problem.tables.len());
            assert!(plan.makespan >= plan.lower_bound * (1.0 - 1e-12));
            n += 1;
        }
    }
    assert!(n >= 2);
}

#[test]
fn optimizer_kinds_parse_and_size_their_state() {
    let cases = [
        ("adam", 2.0),
        ("lamb", 2.0),
        ("partial_row_wise_adam", 1.0 + 1.0 / 128.0),
        ("partial_row_wise_lamb", 1.0 + 1.0 / 128.0),
        ("row_wise_adagrad", 1.0 / 128.0),
    ];
    for (name, expected) in cases {
        let cfg: OptimizerConfig = toml::from_str(&format!("kind = \"{name}\"")).unwrap();
        assert_eq!(cfg.multiplier(128), expected, "{name}");
    }
}

/// Values that were quietly replaced or planned into a plan no one could read are refused
/// naming the field: an HBM cap on CPU ranks (zeroed), a feature batch of 0 (a feature that
/// cost nothing), a bandwidth below a byte per millisecond (infinite costs, a NaN imbalance
/// written as `null`).
#[test]
fn values_that_were_replaced_or_unplannable_are_refused_naming_the_field() {
    let resolved = |topology: &str, feature: &str| {
        let toml = format!(
            "batch_size = 512\n[topology]\nworld_size = 2\n{topology}\n[[tables]]\nname = \"a\"\n\
             rows = 1000\ndim = 8\n[[tables.features]]\nname = \"f\"\npooling_factor = 1.0\n\
             {feature}\n"
        );
        Config::from_toml(&toml).unwrap().resolve()
    };
    resolved("compute_device = \"cpu\"\nhbm_cap = 0", "batch_size = 3").unwrap();
    resolved("hbm_to_ddr_mem_bw = 1.0", "").unwrap();
    for (topology, feature, field, says) in [
        (
            "compute_device = \"cpu\"\nhbm_cap = \"80GiB\"",
            "",
            "topology.hbm_cap",
            "CPU ranks have no HBM",
        ),
        (
            "",
            "batch_size = 0",
            "tables[0].features[0].batch_size",
            "at least 1",
        ),
        (
            "hbm_to_ddr_mem_bw = 1e-310",
            "",
            "hbm_to_ddr_mem_bw",
            "at least 1 byte/ms",
        ),
    ] {
        let e = resolved(topology, feature).unwrap_err().to_string();
        assert!(
            e.contains(field) && e.contains(says),
            "{topology} {feature}: {e}"
        );
    }
}

/// A search past any memory is refused before any shard is made, naming what to constrain:
/// a thousand tables on 65536 ranks (7 × 65536 shards each), or one wide table grid-sharded
/// into 2^30 shards, used to allocate until the process aborted.
#[test]
fn searches_past_any_memory_are_refused_before_they_start() {
    let tables = |n: usize, extra: &str| {
        (0..n)
            .map(|i| format!("[[tables]]\nname = \"t{i}\"\nrows = 100000\ndim = 65536\n{extra}\n"))
            .collect::<String>()
    };
    for body in [
        tables(1000, ""),
        tables(
            1,
            "[tables.constraints]\nsharding_types = [\"grid_shard\"]\nmin_partition = 4",
        ),
    ] {
        let toml = format!("batch_size = 512\n[topology]\nworld_size = 65536\n{body}");
        let started = std::time::Instant::now();
        let problem = Config::from_toml(&toml).unwrap().resolve().unwrap();
        let e = embers_planner::plan_problem(&problem, Default::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the search would weigh") && e.contains("constrain sharding_types"),
            "{e}"
        );
        assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
    }
}
