//! The planner's inputs fuzzed (`tests/support/fuzz.rs`): configs as TOML and as JSON, each
//! parsed, resolved and, when valid, planned (a short search), and plans as `Plan::from_json`
//! reads them. No input may panic, hang or allocate without bound.

#[path = "../../tests/support/fuzz.rs"]
mod fuzz;

use embers_planner::search::SearchSettings;
use embers_planner::{plan_problem_with, Config, CostModel, Plan};
use std::time::Duration;

#[global_allocator]
static ALLOC: fuzz::CountingAlloc = fuzz::CountingAlloc;

fn settings() -> SearchSettings {
    SearchSettings {
        time_limit: Duration::from_millis(50),
        reference_time_limit: Duration::from_millis(200),
        ..SearchSettings::default()
    }
}

fn plan(config: Result<Config, embers_planner::PlannerError>) -> Result<(), String> {
    let problem = config
        .map_err(|e| e.to_string())?
        .resolve()
        .map_err(|e| e.to_string())?;
    plan_problem_with(&problem, CostModel::Torchrec, &settings())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

const SMALL_JSON: &str = r#"{"batch_size": 512,
 "topology": {"world_size": 4, "local_world_size": 2, "hbm_cap": "1GiB"},
 "optimizer": {"kind": "row_wise_adagrad"},
 "tables": [
  {"name": "t0", "rows": 1000, "dim": 64, "pooling_factors": [5.0]},
  {"name": "t1", "rows": 200000, "dim": 128, "data_type": "FP16",
   "constraints": {"sharding_types": ["row_wise", "table_wise"]}},
  {"name": "t2", "rows": 30, "dim": 16, "features": [{"name": "f", "pooling_factor": 2.0}]}]}"#;

#[test]
fn configs() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let toml: Vec<Vec<u8>> = ["small.toml", "criteo_8xh100.toml"]
        .iter()
        .map(|f| std::fs::read(format!("{dir}/{f}")).unwrap())
        .collect();
    fuzz::run("planner-config-toml", &toml, |bytes| {
        let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
        plan(Config::from_toml(text))
    });
    fuzz::run(
        "planner-config-json",
        &[SMALL_JSON.as_bytes().to_vec()],
        |bytes| {
            let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
            plan(Config::from_json(text))
        },
    );
}

#[test]
fn plans() {
    let problem = Config::from_json(SMALL_JSON).unwrap().resolve().unwrap();
    let seed = plan_problem_with(&problem, CostModel::Torchrec, &settings())
        .unwrap()
        .to_json();
    fuzz::run("plan-json", &[seed.into_bytes()], |bytes| {
        let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
        Plan::from_json(text).map(|_| ()).map_err(|e| e.to_string())
    });
}
