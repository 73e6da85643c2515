//! # embers-planner
//!
//! Decides how each embedding table is sharded and where each shard lives, from the tables,
//! the batch size and the hardware. The cost model is TorchRec 1.9.2's, reproduced exactly
//! (checked against golden data produced by TorchRec), with an improved model selectable by
//! name; the search starts from TorchRec's own search (reproduced) and from largest-first
//! constructions, then local search over placements and sharding options; the plan reports a
//! lower bound valid for every plan ([`bound`]) next to its makespan.
//!
//! Pipeline, one file per role: [`config`] → [`enumerator`] (with [`shard_sizes`] and the
//! [`estimator`]s) → [`reservation`] → [`search`] (with [`reference`](mod@reference)) → [`plan`] (with
//! [`bound`]) / [`report`].
//!
//! ```
//! use embers_planner::{config::Config, estimator::CostModel, plan_problem};
//! let cfg = Config::from_toml(r#"
//!     batch_size = 512
//!     [topology]
//!     world_size = 2
//!     [[tables]]
//!     name = "t0"
//!     rows = 1000
//!     dim = 64
//! "#).unwrap();
//! let plan = plan_problem(&cfg.resolve().unwrap(), CostModel::Torchrec).unwrap();
//! assert_eq!(plan.tables.len(), 1);
//! assert!(plan.makespan >= plan.lower_bound);
//! ```

pub mod bound;
pub mod config;
pub mod enumerator;
pub mod error;
pub mod estimator;
pub mod plan;
pub mod reference;
pub mod report;
pub mod reservation;
pub mod search;
pub mod shard_sizes;
pub mod topology;
pub mod types;

pub use config::{Config, Problem};
pub use error::PlannerError;
pub use estimator::CostModel;
pub use plan::Plan;

/// Enumerates, reserves memory, searches, and returns the best plan found.
pub fn plan_problem(problem: &Problem, model: CostModel) -> Result<Plan, PlannerError> {
    plan_problem_with(problem, model, &search::SearchSettings::default())
}

/// [`plan_problem`] with explicit search settings.
pub fn plan_problem_with(
    problem: &Problem,
    model: CostModel,
    settings: &search::SearchSettings,
) -> Result<Plan, PlannerError> {
    let options = enumerator::enumerate(problem)?;
    let capacity = reservation::reserve(problem)?;
    let placed = search::search(problem, &options, &capacity, model, settings)?;
    Ok(plan::Plan::build(
        problem, &options, &placed, &capacity, model,
    ))
}
