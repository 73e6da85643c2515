//! `embers-plan`: plan embedding-table sharding from a TOML/JSON config.

use clap::{Parser, Subcommand, ValueEnum};
use embers_planner::types::ShardingOption;
use embers_planner::{enumerator, plan_problem, report, Config, CostModel, PlannerError};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "embers-plan",
    version,
    about = "Shard embedding tables across GPUs/CPUs by TorchRec's cost model, with a better search.",
    after_help = "Examples:
  embers-plan plan planner/examples/criteo_8xh100.toml
  embers-plan plan planner/examples/criteo_8xh100.toml --format json -o plan.json
  embers-plan plan planner/examples/small.toml --cost-model overlap
  embers-plan estimate planner/examples/small.toml
  embers-plan estimate planner/examples/small.toml --format json"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// Human-readable tables.
    Table,
    /// JSON in TorchRec's vocabulary.
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Find a plan and print it (human table by default).
    Plan {
        /// Config file (.toml or .json).
        config: PathBuf,
        /// Also write the plan as JSON to this file.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Output format on stdout.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
        /// Cost model the search minimises.
        #[arg(long, value_enum, default_value = "torchrec")]
        cost_model: CostModel,
    },
    /// List every sharding option with its estimated cost, as TorchRec's enumerator would.
    Estimate {
        /// Config file (.toml or .json).
        config: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value = "table")]
        format: Format,
    },
}

#[derive(Serialize)]
struct OptionJson<'a> {
    table: &'a str,
    sharding_type: &'a str,
    compute_kernel: &'a str,
    cache_load_factor: Option<f64>,
    shards: Vec<ShardJson>,
}

#[derive(Serialize)]
struct ShardJson {
    size: [u64; 2],
    offset: [u64; 2],
    perf: embers_planner::types::Perf,
    perf_total: f64,
    storage: embers_planner::types::Storage,
}

fn options_json(options: &[Vec<ShardingOption>]) -> String {
    let list: Vec<OptionJson> = options
        .iter()
        .flatten()
        .map(|o| OptionJson {
            table: &o.name,
            sharding_type: o.sharding_type.as_str(),
            compute_kernel: o.compute_kernel.as_str(),
            cache_load_factor: o.cache_load_factor,
            shards: o
                .shards
                .iter()
                .map(|s| ShardJson {
                    size: s.size,
                    offset: s.offset,
                    perf: s.perf,
                    perf_total: s.perf.total(),
                    storage: s.storage,
                })
                .collect(),
        })
        .collect();
    serde_json::to_string_pretty(&list).unwrap_or_default()
}

fn run(cli: Cli) -> Result<(), PlannerError> {
    match cli.command {
        Command::Plan {
            config,
            output,
            format,
            cost_model,
        } => {
            let problem = Config::from_path(&config)?.resolve()?;
            let plan = plan_problem(&problem, cost_model)?;
            if let Some(path) = output {
                std::fs::write(&path, plan.to_json()).map_err(|source| PlannerError::Io {
                    path: path.display().to_string(),
                    source,
                })?;
            }
            match format {
                Format::Table => print!("{}", report::plan_table(&plan)),
                Format::Json => println!("{}", plan.to_json()),
            }
        }
        Command::Estimate { config, format } => {
            let problem = Config::from_path(&config)?.resolve()?;
            let options = enumerator::enumerate(&problem)?;
            match format {
                Format::Table => print!("{}", report::options_table(&options)),
                Format::Json => println!("{}", options_json(&options)),
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
