//! `embers-plan`: plan embedding-table sharding from a TOML/JSON config.

use clap::{Parser, Subcommand, ValueEnum};
use embers_planner::types::ShardingOption;
use embers_planner::{enumerator, plan_problem, report, Config, CostModel, PlannerError};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
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
  embers-plan estimate planner/examples/small.toml --format json

Exit status: 0 planned; 1 a bad input (the config, a file); 3 no plan exists for a valid
config (the error names TorchRec's PlannerErrorType: INSUFFICIENT_STORAGE or
STRICT_CONSTRAINTS)."
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
                write_atomically(&path, plan.to_json().as_bytes()).map_err(|source| {
                    PlannerError::Io {
                        path: path.display().to_string(),
                        source,
                    }
                })?;
            }
            match format {
                Format::Table => say(&report::plan_table(&plan)),
                Format::Json => say(&format!("{}\n", plan.to_json())),
            }
        }
        Command::Estimate { config, format } => {
            let problem = Config::from_path(&config)?.resolve()?;
            let options = enumerator::enumerate(&problem)?;
            match format {
                Format::Table => say(&report::options_table(&options)),
                Format::Json => say(&format!("{}\n", options_json(&options))),
            }
        }
    }
    Ok(())
}

/// Prints `text` to stdout; a reader that went away (`| head`) ends the output quietly (it
/// panicked in `print!`).
fn say(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("error: writing the output: {e}");
            std::process::exit(1);
        }
    }
}

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one, never a part:
/// a temporary file beside it, flushed to disk, renamed over it, the directory synced.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename on disk (best effort where a directory cannot be opened).
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        // A config that cannot be planned is told apart from a bad one, by its TorchRec error
        // type and its exit status.
        Err(e) => match e.torchrec_error_type() {
            Some(kind) => {
                eprintln!("error [{kind}]: {e}");
                ExitCode::from(3)
            }
            None => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
