//! Configs at the edges of what the planner takes: each is refused with an error naming the
//! field, or planned, never a panic, a wrapped sum, a NaN cost or a silently changed value.

use embers_planner::search::SearchSettings;
use embers_planner::{plan_problem_with, Config, CostModel, PlannerError};
use std::time::Duration;

fn settings() -> SearchSettings {
    SearchSettings {
        time_limit: Duration::from_millis(50),
        reference_time_limit: Duration::from_millis(200),
        ..SearchSettings::default()
    }
}

/// A JSON config of `tables` (JSON objects) on `topology`, batch `batch`, with `extra`
/// top-level fields.
fn config(batch: &str, topology: &str, tables: &str, extra: &str) -> String {
    format!(
        r#"{{"batch_size": {batch}, "topology": {topology}, {extra}
             "optimizer": {{"kind": "sgd"}}, "tables": [{tables}]}}"#
    )
}

const TOPOLOGY: &str = r#"{"world_size": 2, "local_world_size": 2, "hbm_cap": "1GiB"}"#;
const TABLE: &str = r#"{"name": "t", "rows": 1000, "dim": 16}"#;

/// Parses, resolves and plans `json`.
fn plan(json: &str) -> Result<embers_planner::Plan, PlannerError> {
    let problem = Config::from_json(json)?.resolve()?;
    plan_problem_with(&problem, CostModel::Torchrec, &settings())
}

fn field_error(json: &str) -> (String, String) {
    match plan(json) {
        Err(PlannerError::Config { field, message }) => (field, message),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn huge_shards_on_many_ranks_do_not_wrap_the_reference_search_sums() {
    // 64 data-parallel copies of a 2^58-byte table: the copies' sum is past u64.
    let json = config(
        "512",
        r#"{"world_size": 64, "local_world_size": 8, "hbm_cap": "80GiB"}"#,
        r#"{"name": "huge", "rows": 1099511627776, "dim": 65536}"#,
        "",
    );
    assert!(matches!(
        plan(&json),
        Err(PlannerError::InsufficientStorage { .. } | PlannerError::StrictConstraints { .. })
    ));
    // Output buffers of 10^15 samples on 8 ranks, with the KJT reservation off (so the
    // search runs): no sum may wrap, whatever the search decides.
    let json = config(
        "1000000000000000",
        r#"{"world_size": 8, "local_world_size": 8, "hbm_cap": "80GiB"}"#,
        TABLE,
        r#""storage_reservation": {"kjt": false},"#,
    );
    let _ = plan(&json);
}

#[test]
fn a_capacity_of_u64_max_does_not_hold_sizes_past_u64() {
    // Each shard's DDR saturates to u64::MAX (1000 × state on 2^40 × 2^16 FP32), which stands
    // for "past u64": no capacity may reach it (a row-wise shard of it was
    // planned into a rank of u64::MAX), and none fits the largest capacity accepted, under any
    // sharding.
    let json = |cap: &str, sharding: &str| {
        let table = |name: &str| {
            format!(
                r#"{{"name": "{name}", "rows": 1099511627776, "dim": 65536,
                    "constraints": {{"compute_kernels": ["fused_uvm"], "sharding_types": ["{sharding}"]}}}}"#
            )
        };
        format!(
            r#"{{"batch_size": 512,
                 "topology": {{"world_size": 1, "local_world_size": 1, "ddr_cap": {cap}}},
                 "optimizer": {{"kind": "custom", "state_multiplier": 1000}},
                 "tables": [{}, {}]}}"#,
            table("a"),
            table("b")
        )
    };
    for sharding in ["table_wise", "row_wise", "column_wise", "table_row_wise"] {
        let (field, message) = field_error(&json("18446744073709551615", sharding));
        assert_eq!(field, "topology.ddr_cap", "{sharding}");
        assert!(message.contains("at most 2^60 bytes"), "{message}");
        let got = plan(&json("1152921504606846976", sharding));
        assert!(
            matches!(
                got,
                Err(PlannerError::InsufficientStorage { .. }
                    | PlannerError::StrictConstraints { .. })
            ),
            "{sharding}: {got:?}"
        );
    }
}

#[test]
fn a_reservation_past_the_device_names_what_reserves_it() {
    let json = config(
        "512",
        TOPOLOGY,
        TABLE,
        r#""storage_reservation": {"dense_bytes": "1TiB"},"#,
    );
    let (field, message) = field_error(&json);
    assert_eq!(field, "storage_reservation.dense_bytes");
    assert!(
        message.contains("1.00 TiB") && message.contains("HBM"),
        "{message}"
    );
    // The KJT buffers of a batch too large for the device.
    let json = config("100000000000", TOPOLOGY, TABLE, "");
    let (field, message) = field_error(&json);
    assert_eq!(field, "batch_size");
    assert!(message.contains("KJT"), "{message}");
    // The same on CPUs, where the reservation comes out of DDR.
    let json = config(
        "512",
        r#"{"world_size": 2, "local_world_size": 2, "compute_device": "cpu", "ddr_cap": "1GiB"}"#,
        TABLE,
        r#""storage_reservation": {"dense_bytes": "2GiB"},"#,
    );
    let (field, message) = field_error(&json);
    assert_eq!(field, "storage_reservation.dense_bytes");
    assert!(message.contains("DDR"), "{message}");
    // Within the device it plans.
    let json = config(
        "512",
        TOPOLOGY,
        TABLE,
        r#""storage_reservation": {"dense_bytes": "100MiB"},"#,
    );
    plan(&json).unwrap();
}

#[test]
fn cache_histograms_that_are_no_curve_are_refused() {
    let table = |counts: &str| {
        format!(
            r#"{{"name": "c", "rows": 1000, "dim": 16,
                 "constraints": {{"cache_load_factor": 1.0, "compute_kernels": ["fused_uvm_caching"],
                   "cache_stats": {{"expected_lookups": 1000, "height": 4,
                                    "mrc_hist_counts": {counts}}}}}}}"#
        )
    };
    // Within f64's sum of f32::MAX, past it in f32 (as the counts are summed to price).
    let overflow = "[3.4028230607370965e38, 1.0141214473232392e31, 1.0141214473232392e31, \
                    1.0141214473232392e31]";
    for counts in [overflow, "[0, 0]", "[1e-50]"] {
        let (field, message) = field_error(&config("512", TOPOLOGY, &table(counts), ""));
        assert_eq!(
            field, "tables[0].constraints.cache_stats.mrc_hist_counts",
            "{counts}: {message}"
        );
    }
    // A proper curve plans, and every cost in the plan is finite.
    let plan = plan(&config("512", TOPOLOGY, &table("[10, 5, 3, 1]"), "")).unwrap();
    let json = plan.to_json();
    assert!(!json.contains("null"), "{json}");
}

#[test]
fn pooling_errors_name_their_field() {
    let cases = [
        (
            r#""pooling_factors": [1.0, -1.0]"#,
            "tables[0].pooling_factors[1]",
        ),
        (
            r#""features": [{"pooling_factor": 1.0}, {"pooling_factor": 2.0, "num_poolings": -3}]"#,
            "tables[0].features[1].num_poolings",
        ),
        (
            r#""features": [{"pooling_factor": 1.0}, {"pooling_factor": -2.0}]"#,
            "tables[0].features[1].pooling_factor",
        ),
    ];
    for (features, expected) in cases {
        let table = format!(r#"{{"name": "t", "rows": 10, "dim": 4, {features}}}"#);
        let (field, message) = field_error(&config("512", TOPOLOGY, &table, ""));
        assert_eq!(field, expected, "{message}");
    }
}

#[test]
fn byte_sizes_are_whole_bytes_or_refused_by_name() {
    let with_hbm = |hbm: &str| {
        config(
            "512",
            &format!(r#"{{"world_size": 2, "local_world_size": 2, "hbm_cap": {hbm}}}"#),
            TABLE,
            "",
        )
    };
    for (hbm, why) in [
        ("-1", "must not be negative"),
        ("8.5", "whole number of bytes"),
        (r#""1.5B""#, "not a whole number of bytes"),
        (r#""0.0001KiB""#, "less than one byte"),
        (r#""12 parsecs""#, "unknown unit"),
    ] {
        let msg = Config::from_json(&with_hbm(hbm)).unwrap_err().to_string();
        assert!(
            msg.contains("invalid byte size") && msg.contains(why),
            "{hbm}: {msg}"
        );
    }
    // A whole count written as a float (TOML's 8.5e10), and a fractional amount of a unit.
    for (hbm, bytes) in [("8.5e10", 85_000_000_000u64), (r#""1.5GiB""#, 3 << 29)] {
        let problem = Config::from_json(&with_hbm(hbm))
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(problem.topology.hbm_cap, bytes, "{hbm}");
    }
}

/// Table names that are empty or hold control characters (they broke or forged the lines of
/// the plan's tables) are refused, naming the table.
#[test]
fn table_names_are_printable() {
    for name in ["", "a\\nb", "t\\u0000"] {
        let table = format!(r#"{{"name": "{name}", "rows": 1000, "dim": 16}}"#);
        let (field, message) = field_error(&config("512", TOPOLOGY, &table, ""));
        assert_eq!(field, "tables[0].name", "{name:?}");
        assert!(message.contains("not a table name"), "{message}");
    }
}

/// A reservation that leaves no memory at all names what left none (the percentage, the
/// capacity), not the batch size whose input buffers then did not fit.
#[test]
fn a_reservation_of_everything_names_the_margin_or_the_capacity() {
    let (field, message) = field_error(&config(
        "512",
        TOPOLOGY,
        TABLE,
        r#""storage_reservation": {"percentage": 1.0},"#,
    ));
    assert_eq!(field, "storage_reservation.percentage", "{message}");
    let topology = r#"{"world_size": 2, "local_world_size": 2, "hbm_cap": 0}"#;
    let (field, message) = field_error(&config("512", topology, TABLE, ""));
    assert_eq!(field, "topology.hbm_cap", "{message}");
}

/// A configuration file past the limit (`/dev/zero`, or a huge file) is refused after reading
/// no more than the limit, naming the file (memory grew until the process was killed).
#[cfg(unix)]
#[test]
fn a_config_file_past_the_limit_is_refused() {
    let err = Config::from_path(std::path::Path::new("/dev/zero")).unwrap_err();
    assert!(
        matches!(&err, PlannerError::Config { field, message }
            if field == "/dev/zero" && message.contains("not a planner configuration")),
        "{err:?}"
    );
}
