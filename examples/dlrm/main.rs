//! Trains a DLRM (or DLRM-DCNv2) click model and reports what the field reports.
//!
//! `cargo run --release --example dlrm` trains on the built-in synthetic Criteo-shaped data
//! (whose best achievable AUC is known), validating as it goes, then writes to `--out`
//! (default `dlrm-out/`): `checkpoint.safetensors` (atomic), `metrics.csv`, `metrics.json`
//! and `curves.png`, and prints a test report with the AUC of quantized copies of the tables.
//! `--help` lists the flags (Criteo TSV/Parquet and MovieLens data, model sizes, optimizers,
//! resume).

mod dist;
// Loss sums kept in checkpoints as their bits.
#[path = "../shared/bits.rs"]
mod bits;
mod plot;

use bits::{bits_of_f64, f64_of_bits};

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use embers::embedding::{CachePolicy, CacheStats, FusedOptimizer, Placement, WeightType};
use embers::metrics::Throughput;
use embers::nn::Module;
use embers::train::{Batch, DenseOptimizer, DlrmConfig, DlrmTrainer, EvalReport};
use embers::{Error, Result};
use embers_datasets::{
    BatchConfig, Batcher, CategoricalMapping, CriteoConfig, CriteoParquetColumns,
    CriteoParquetReader, CriteoTsvReader, ExampleSource, FeatureSchema, MovieLensConfig,
    MovieLensFormat, MovieLensReader, RawBatch, ShuffleConfig, Split, SplitRule, SyntheticCriteo,
    SyntheticCriteoConfig, MOVIELENS_GENRES,
};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DataSource {
    /// Built-in seeded Criteo-shaped data with a planted logistic signal.
    Synthetic,
    /// Criteo Kaggle / 1TB TSV files (`--path`, several allowed).
    CriteoTsv,
    /// Criteo schema in Parquet (`--path`, several allowed).
    CriteoParquet,
    /// MovieLens ratings (`u.data`, `ratings.dat` or RecBole `.inter`), rating >= 4 is a click.
    Movielens,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DenseOpt {
    Sgd,
    Adagrad,
    Adam,
}

/// Where the tables live: the planner's compute kernels, on this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PlacementArg {
    /// In memory.
    Fused,
    /// On a GPU: in managed memory, read and updated in place by the GPU (FBGEMM's
    /// MANAGED); on the host: in files under --cache-dir, read through the smallest cache
    /// (one set per table).
    FusedUvm,
    /// In files under --cache-dir behind a DRAM cache of --cache-load-factor × rows.
    FusedUvmCaching,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CachePolicyArg {
    Lru,
    Lfu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SparseOpt {
    Sgd,
    Adagrad,
    RowwiseAdagrad,
    Adam,
    PartialRowwiseAdam,
    Lamb,
    PartialRowwiseLamb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum QuantType {
    Fp16,
    Int8,
    Int4,
    Fp8,
}

impl QuantType {
    fn weight_type(self) -> WeightType {
        match self {
            QuantType::Fp16 => WeightType::Fp16,
            QuantType::Int8 => WeightType::Int8,
            QuantType::Int4 => WeightType::Int4,
            QuantType::Fp8 => WeightType::Fp8,
        }
    }
}

/// How MovieLens ratings are split into train / validation / test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum MovieLensSplit {
    Hash,
    Time,
}

/// A precision of the sharded tables' communication.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CommPrec {
    Fp32,
    Fp16,
    Bf16,
    Fp8,
    Int8,
}

/// Train a DLRM click model (defaults: synthetic data, a few minutes on 2 cores).
#[derive(Parser, Debug, Clone)]
#[command(version, about)]
struct Args {
    /// Data source.
    #[arg(long, value_enum, default_value_t = DataSource::Synthetic)]
    data: DataSource,
    /// Data files (Criteo TSV/Parquet: one or more; MovieLens: the ratings file), split into
    /// train / validation / test by a seeded hash (`--holdout`).
    #[arg(long, num_args = 1..)]
    path: Vec<PathBuf>,
    /// Criteo files of the training split (an explicit split by time, e.g. days 0-22), with
    /// `--valid` and `--test` instead of `--path`.
    #[arg(long, num_args = 1..)]
    train: Vec<PathBuf>,
    /// Criteo files of the validation split. Given the same files as `--test`, their first
    /// half validates and the second half tests (TorchRec's DLRM reference split of day 23).
    #[arg(long, num_args = 1..)]
    valid: Vec<PathBuf>,
    /// Criteo files of the test split.
    #[arg(long, num_args = 1..)]
    test: Vec<PathBuf>,
    /// Stop when the validation AUC has not improved for this many validations in a row (0:
    /// never); the best checkpoint (`best.safetensors`) is then restored for the final
    /// validation and test report.
    #[arg(long, default_value_t = 0)]
    early_stop_patience: u64,
    /// MovieLens items file (`u.item`, `movies.dat`, `.item`): adds a multi-hot genres feature.
    #[arg(long)]
    items_path: Option<PathBuf>,
    /// Training examples of the synthetic data (fresh examples, so one epoch never repeats
    /// one; 4M reach within 0.005 of the best achievable AUC in under a minute on 2 cores).
    #[arg(long, default_value_t = 4_000_000)]
    synthetic_train: u64,
    /// Rows of every table of the synthetic data (default: the generator's, 1000; ids are
    /// drawn from each table's rows, skewed as the generator draws them).
    #[arg(long)]
    synthetic_rows: Option<u64>,
    /// Validation and test examples (each) of the synthetic data.
    #[arg(long, default_value_t = 100_000)]
    synthetic_eval: u64,
    /// Tasks of the synthetic data (label columns): `click`, then `task1`, `task2`, … with
    /// related planted signals. The model gets one logit per task, the metrics one set each.
    #[arg(long, default_value_t = 1)]
    synthetic_tasks: usize,
    /// Label columns of Criteo Parquet files, one task each (named after its column when
    /// there are several; one column is the task `click`).
    #[arg(long, value_delimiter = ',', default_value = "label")]
    label_columns: Vec<String>,
    /// Fraction of file examples held out for validation and for test (each; within (0, 0.5)).
    #[arg(long, default_value_t = 0.1)]
    holdout: f64,
    /// How MovieLens ratings are split: by a seeded hash, or by time (the latest `--holdout`
    /// of the ratings test, the `--holdout` before them validate, the rest train).
    #[arg(long, value_enum, default_value_t = MovieLensSplit::Hash)]
    movielens_split: MovieLensSplit,
    /// Passes over the training split.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// Stop after this many steps in total (default: run all epochs).
    #[arg(long)]
    steps: Option<u64>,
    /// Samples per batch.
    #[arg(long, default_value_t = 512)]
    batch_size: usize,
    /// Embedding dimension (also the bottom MLP's output width).
    #[arg(long, default_value_t = 16)]
    emb_dim: usize,
    /// Cap on rows per table (ids are reduced modulo the table size).
    #[arg(long, default_value_t = 100_000)]
    table_cap: u64,
    /// Hidden widths of the bottom MLP (the embedding dim is appended).
    #[arg(long, value_delimiter = ',', default_value = "64,32")]
    dense_arch: Vec<usize>,
    /// Hidden widths of the top MLP (the logit layer, one logit per task, is appended).
    #[arg(long, value_delimiter = ',', default_value = "64,32")]
    over_arch: Vec<usize>,
    /// Use DLRM-DCNv2 (a low-rank cross network) instead of the dot interaction.
    #[arg(long)]
    dcn: bool,
    /// Cross layers of DCN.
    #[arg(long, default_value_t = 3, requires = "dcn")]
    dcn_layers: usize,
    /// Rank of DCN's low-rank cross weights.
    #[arg(long, default_value_t = 16, requires = "dcn")]
    dcn_rank: usize,
    /// Optimizer of the dense half.
    #[arg(long, value_enum, default_value_t = DenseOpt::Adagrad)]
    dense_optimizer: DenseOpt,
    /// Learning rate of the dense half.
    #[arg(long, default_value_t = 0.05)]
    dense_lr: f64,
    /// Optimizer fused into the embedding tables' backward.
    #[arg(long, value_enum, default_value_t = SparseOpt::RowwiseAdagrad)]
    sparse_optimizer: SparseOpt,
    /// Learning rate of the tables.
    #[arg(long, default_value_t = 0.05)]
    sparse_lr: f32,
    /// Seed of the model, the data shuffle and the synthetic data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Validate (and checkpoint) every this many steps (0: only at the end).
    #[arg(long, default_value_t = 500)]
    validate_every: u64,
    /// Examples of the validation split used at each validation (0: all).
    #[arg(long, default_value_t = 50_000)]
    validation_examples: u64,
    /// Output directory (checkpoint, metrics CSV/JSON, PNG plot).
    #[arg(long, default_value = "dlrm-out")]
    out: PathBuf,
    /// Resume from this checkpoint (continues bit-identically with the same flags).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Evaluate quantized copies of the tables on the test split (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "fp16,int8,int4,fp8",
        conflicts_with = "no_quantized_eval"
    )]
    quantized_eval: Vec<QuantType>,
    /// Skip the quantized evaluation.
    #[arg(long)]
    no_quantized_eval: bool,
    /// Shuffle buffer size (examples) for file sources.
    #[arg(long, default_value_t = 100_000)]
    shuffle_buffer: usize,
    /// No progress bar (plain log lines instead).
    #[arg(long)]
    no_progress: bool,
    /// Where to train: cpu, cuda or cuda:N (a GPU; `EMBERS_CUDA_SIM=1` makes cuda:0 the
    /// host emulation of one, slow, for checking only).
    #[arg(long, default_value = "cpu")]
    device: embers::Device,
    /// Train across processes (`mpiexec -n W`, built with `--features mpi`), the tables
    /// sharded by this plan: an `embers-plan plan … --format json -o plan.json` file, or
    /// `auto` to plan here for W CPU ranks. `--batch-size` is then per rank.
    #[arg(long)]
    plan: Option<String>,
    /// Write this model's planner config (tables, batch size, `--ranks` ranks of `--device`'s
    /// kind) to this file and exit: the input of `embers-plan plan`.
    #[arg(long, conflicts_with = "plan")]
    write_planner_config: Option<PathBuf>,
    /// With `--write-planner-config` and `--device cuda` (the planner offers `fused_uvm_caching`
    /// on GPU ranks only): measure each table's cache statistics (the planner's
    /// `constraints.cache_stats`, which price that kernel at `--cache-load-factor`) on this
    /// many training batches.
    #[arg(long, default_value_t = 0, requires = "write_planner_config")]
    cache_stats_batches: usize,
    /// Ranks for `--write-planner-config`.
    #[arg(long, default_value_t = 2, requires = "write_planner_config")]
    ranks: usize,
    /// With `--plan`: the precision of the pooled embeddings' all-to-alls, one for both
    /// directions or `forward,backward` (TorchRec's QCommsConfig).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "fp32",
        requires = "plan"
    )]
    comm_precision: Vec<CommPrec>,
    /// With `--plan`: input distribution and training one after the other (no pipeline).
    #[arg(long, requires = "plan")]
    no_pipeline: bool,
    /// Where the tables live (the planner's kernel names): in memory, or in files behind a
    /// DRAM cache, for tables larger than memory. Training is the same, bit for bit.
    #[arg(long, value_enum, default_value_t = PlacementArg::Fused)]
    placement: PlacementArg,
    /// With `--placement fused-uvm-caching`: the cached fraction of each table's rows, in
    /// (0, 1] (with `--plan`, the plan's own sizes the caches).
    #[arg(long, default_value_t = 0.2)]
    cache_load_factor: f64,
    /// With a file placement: the cache's replacement policy.
    #[arg(long, value_enum, default_value_t = CachePolicyArg::Lru)]
    cache_policy: CachePolicyArg,
    /// With a file placement: the directory of the row files (default `<out>/tables`; with
    /// `--device cuda`, host memory unless this is given, as FBGEMM's `MANAGED_CACHING`).
    #[arg(long, conflicts_with = "cache_host_memory")]
    cache_dir: Option<PathBuf>,
    /// With a file placement: keep the rows in host memory instead of files (FBGEMM's
    /// `MANAGED_CACHING` behind a GPU cache: no page-cache write-back of evicted rows).
    #[arg(long)]
    cache_host_memory: bool,
    /// With a file placement, or a plan with cached kernels: bring the next batch's rows into
    /// the cache while a batch trains — on another thread, or with `--plan` in the training
    /// pipeline's communication stage after the batch's input distribution (off by default:
    /// with every core busy training, as on 2 cores, the second admission costs more than the
    /// overlap hides).
    #[arg(long)]
    cache_prefetch: bool,
    /// The flags given on the command line (clap's ids), defaults not included.
    #[arg(skip)]
    given: BTreeSet<String>,
}

impl Args {
    /// Refuses cache flags that no cached table would use: without `--plan`, all of them
    /// with `--placement fused` and the load factor unless `fused-uvm-caching`; with `--plan`,
    /// whose kernels and cache sizes place the tables, the load factor; with
    /// `--write-planner-config`, all but the load factor its cache statistics are priced at.
    fn check_cache_flags(&self) -> Result<()> {
        // (With --write-planner-config it is written to the planner's input, unchecked: NaN
        // became `null`, which the planner read as its default.)
        if !(self.cache_load_factor > 0.0 && self.cache_load_factor <= 1.0) {
            return Err(Error::invalid(
                "dlrm",
                format!(
                    "--cache-load-factor {} is not a fraction within (0, 1]",
                    self.cache_load_factor
                ),
            ));
        }
        let given = [
            "cache_load_factor",
            "cache_policy",
            "cache_dir",
            "cache_host_memory",
            "cache_prefetch",
        ]
        .map(|id| (id, self.given(id)));
        let (unused, why) = match (&self.plan, self.placement) {
            _ if self.write_planner_config.is_some() => (
                &given[(self.cache_stats_batches > 0) as usize..],
                "--write-planner-config writes no cache but the tables' cache statistics and \
                 load factor (with --cache-stats-batches)",
            ),
            (Some(_), _) => (
                &given[..1],
                "with --plan, the plan's cache_load_factor sizes each cached table's cache",
            ),
            (None, PlacementArg::Fused) => (
                &given[..],
                "--placement fused keeps every table in memory, with no cache",
            ),
            (None, PlacementArg::FusedUvm) => (
                &given[..1],
                "--placement fused-uvm caches no fraction of the rows (fused-uvm-caching does)",
            ),
            (None, PlacementArg::FusedUvmCaching) => (&given[..0], ""),
        };
        let unused: Vec<String> = (unused.iter())
            .filter(|(_, set)| *set)
            .map(|(id, _)| flag(id))
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        Err(Error::invalid(
            "dlrm",
            format!("{} would do nothing: {why}", unused.join(", ")),
        ))
    }

    /// `--comm-precision`'s forward and backward precisions.
    fn comm_precisions(&self) -> Result<(CommPrec, CommPrec)> {
        match self.comm_precision[..] {
            [f] => Ok((f, f)),
            [f, b] => Ok((f, b)),
            _ => Err(Error::invalid(
                "dlrm",
                "--comm-precision takes one precision or forward,backward",
            )),
        }
    }

    /// Whether the flag of clap id `id` was given on the command line.
    fn given(&self, id: &str) -> bool {
        self.given.contains(id)
    }

    /// Refuses flags of another data source than `--data`'s: each was ignored.
    fn check_source_flags(&self) -> Result<()> {
        use DataSource::*;
        let files = self.data != Synthetic;
        let split_by_hash = files && self.train.is_empty();
        for (id, applies, to) in [
            ("synthetic_train", !files, "--data synthetic"),
            ("synthetic_eval", !files, "--data synthetic"),
            ("synthetic_rows", !files, "--data synthetic"),
            ("synthetic_tasks", !files, "--data synthetic"),
            (
                "shuffle_buffer",
                files,
                "file data (--data criteo-tsv, criteo-parquet, movielens)",
            ),
            (
                "holdout",
                split_by_hash,
                "file data split by --holdout (not --train/--valid/--test)",
            ),
            (
                "label_columns",
                self.data == CriteoParquet,
                "--data criteo-parquet",
            ),
            (
                "movielens_split",
                self.data == Movielens,
                "--data movielens",
            ),
            ("items_path", self.data == Movielens, "--data movielens"),
        ] {
            if self.given(id) && !applies {
                return Err(Error::invalid(
                    "dlrm",
                    format!(
                        "{} applies to {to}; with --data {} it would do nothing",
                        flag(id),
                        self.data.to_possible_value().expect("a value").get_name()
                    ),
                ));
            }
        }
        if let Some(rows) = self.synthetic_rows.filter(|&r| r > self.table_cap) {
            return Err(Error::invalid(
                "dlrm",
                format!(
                    "--synthetic-rows {rows} is more than --table-cap {} rows a table: raise \
                     --table-cap too",
                    self.table_cap
                ),
            ));
        }
        Ok(())
    }

    /// The tables' placement the flags ask for.
    fn placement(&self) -> Result<Placement> {
        let kernel = match self.placement {
            PlacementArg::Fused => "fused",
            PlacementArg::FusedUvm => "fused_uvm",
            PlacementArg::FusedUvmCaching => "fused_uvm_caching",
        };
        let (dir, policy) = self.cache_files();
        Placement::for_kernel(kernel, Some(self.cache_load_factor), dir, policy)
    }

    /// Where cached tables keep their rows (an empty directory: host memory) and the caches'
    /// policy.
    fn cache_files(&self) -> (PathBuf, CachePolicy) {
        let policy = match self.cache_policy {
            CachePolicyArg::Lru => CachePolicy::Lru,
            CachePolicyArg::Lfu => CachePolicy::Lfu,
        };
        let dir = match (&self.cache_dir, self.cache_host_memory) {
            (_, true) => PathBuf::new(),
            (Some(dir), false) => dir.clone(),
            (None, false) if self.device != embers::Device::Cpu => PathBuf::new(),
            (None, false) => self.out.join("tables"),
        };
        (dir, policy)
    }
}

/// The error of a validation at `step` that found no example in the validation split.
fn empty_validation(step: u64) -> Error {
    Error::invalid(
        "dlrm",
        format!(
            "the validation split holds no example (step {step}): --validate-every has \
             nothing to validate; give data with validation examples, or --validate-every 0"
        ),
    )
}

/// Refuses a final report of no example (it reported AUC 0.5 and NE NaN of none): the
/// validation and the test split must each hold some; the checkpoint at `checkpoint` is
/// written.
fn empty_reports(validation: u64, test: u64, checkpoint: &Path) -> Result<()> {
    let empty: Vec<&str> = [("validation", validation), ("test", test)]
        .iter()
        .filter(|(_, n)| *n == 0)
        .map(|(s, _)| *s)
        .collect();
    if empty.is_empty() {
        return Ok(());
    }
    Err(Error::invalid(
        "dlrm",
        format!(
            "the {} split holds no example: nothing to report (the trained model is in {})",
            empty.join(" and the "),
            checkpoint.display()
        ),
    ))
}

/// Batches of `batch_size` examples on each of `world` ranks a validation reads:
/// `--validation-examples` rounded up to whole batches, `None` (all) for 0.
fn validation_batches(args: &Args, world: usize) -> Option<usize> {
    (args.validation_examples > 0).then(|| {
        (args.validation_examples as usize).div_ceil(args.batch_size.saturating_mul(world))
    })
}

/// The command-line spelling of clap id `id` (`cache_dir` → `--cache-dir`).
fn flag(id: &str) -> String {
    format!("--{}", id.replace('_', "-"))
}

/// The dataset chosen on the command line, able to produce batches of any split.
enum Data {
    Synthetic(SyntheticCriteo),
    Files {
        args: Box<Args>,
        schema: FeatureSchema,
        /// With explicit splits whose validation and test files are the same: their example
        /// count (the first half validates, the rest tests).
        halves: Option<u64>,
        /// MovieLens split by time: each example's split, by index.
        by_time: Option<std::sync::Arc<Vec<Option<Split>>>>,
    },
}

/// Splits MovieLens ratings by time: sorted by timestamp, the latest `holdout` fraction tests,
/// the `holdout` before it validates, the rest trains (ratings at a cut go to the later split).
fn split_by_time(args: &Args) -> Result<std::sync::Arc<Vec<Option<Split>>>> {
    let mut reader = MovieLensReader::open(movielens_config(args)?)?;
    let mut stamps: Vec<(u64, f64)> = Vec::new();
    // Not a `for` loop: the timestamp is read from the reader between items.
    while let Some(example) = reader.next() {
        let index = example?.index;
        let Some(t) = reader.last_timestamp() else {
            return Err(Error::invalid(
                "dlrm",
                format!(
                    "--movielens-split time: {} has no timestamp column",
                    args.path[0].display()
                ),
            ));
        };
        stamps.push((index, t));
    }
    let mut sorted: Vec<f64> = stamps.iter().map(|s| s.1).collect();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let cut = |fraction: f64| sorted.get((n as f64 * fraction) as usize).copied();
    let (valid_from, test_from) = (cut(1.0 - 2.0 * args.holdout), cut(1.0 - args.holdout));
    let len = stamps.iter().map(|s| s.0 + 1).max().unwrap_or(0) as usize;
    let mut splits = vec![None; len];
    for (index, t) in stamps {
        splits[index as usize] = Some(if test_from.is_some_and(|c| t >= c) {
            Split::Test
        } else if valid_from.is_some_and(|c| t >= c) {
            Split::Validation
        } else {
            Split::Train
        });
    }
    Ok(std::sync::Arc::new(splits))
}

/// Examples (lines, including any the reader will skip) in Criteo TSV files.
fn count_lines(paths: &[PathBuf]) -> Result<u64> {
    use std::io::Read;
    let mut total = 0u64;
    for path in paths {
        let io = |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut last = b'\n';
        loop {
            let n = file.read(&mut buf).map_err(io)?;
            if n == 0 {
                break;
            }
            total += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
            last = buf[n - 1];
        }
        if last != b'\n' {
            total += 1;
        }
    }
    Ok(total)
}

/// Checks the explicit-split flags: all three or none, not with `--path`, Criteo files only.
fn explicit_splits(args: &Args) -> Result<bool> {
    let given = [&args.train, &args.valid, &args.test].map(|v| !v.is_empty());
    if given.iter().all(|g| !g) {
        return Ok(false);
    }
    let bad = |msg: String| Err(Error::invalid("dlrm", msg));
    if given.iter().any(|g| !g) {
        return bad("explicit splits need all of --train, --valid and --test".into());
    }
    if !args.path.is_empty() {
        return bad("give either --path (a hashed hold-out) or --train/--valid/--test".into());
    }
    if !matches!(args.data, DataSource::CriteoTsv | DataSource::CriteoParquet) {
        return bad(format!(
            "--train/--valid/--test are for Criteo files, not --data {:?}",
            args.data
        ));
    }
    Ok(true)
}

/// Where a run stands, kept in every checkpoint's user metadata and read back by `--resume`.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    /// The epoch being trained.
    epoch: u64,
    /// Batches of it already trained on.
    batch_in_epoch: u64,
    /// Early stopping: the best validation AUC so far and its step.
    best: Option<(f64, u64)>,
    /// Validations since the best.
    since_best: u64,
    /// The training losses summed since the last log line, and their count (the next line
    /// averages them).
    loss_sum: f64,
    loss_count: u64,
    /// Seconds the run trained before this process (its earlier processes').
    seconds: f64,
}

impl Progress {
    /// The metadata entries of a checkpoint.
    fn to_user(self) -> BTreeMap<String, String> {
        let mut user = BTreeMap::from([
            ("epoch".to_string(), self.epoch.to_string()),
            (
                "batch_in_epoch".to_string(),
                self.batch_in_epoch.to_string(),
            ),
            ("since_best".to_string(), self.since_best.to_string()),
            ("loss_sum".to_string(), bits_of_f64(self.loss_sum)),
            ("loss_count".to_string(), self.loss_count.to_string()),
            ("seconds".to_string(), format!("{:e}", self.seconds)),
        ]);
        if let Some((auc, step)) = self.best {
            user.insert("best_auc".to_string(), format!("{auc:e}"));
            user.insert("best_step".to_string(), step.to_string());
        }
        user
    }

    /// Read back from the metadata of the checkpoint `path`, which must hold every entry.
    fn from_user(user: &BTreeMap<String, String>, path: &Path) -> Result<Progress> {
        let bad = |what: String| {
            Error::invalid(
                "dlrm",
                format!(
                    "--resume {}: {what} (a checkpoint of this example is needed)",
                    path.display()
                ),
            )
        };
        let get = |k: &str| -> Result<u64> {
            let v = user
                .get(k)
                .ok_or_else(|| bad(format!("no `{k}` in its metadata")))?;
            v.parse()
                .map_err(|_| bad(format!("its `{k}` is {v:?}, not a count")))
        };
        let best = match user.get("best_auc") {
            None => None,
            Some(a) => {
                let auc = (a.parse::<f64>().ok().filter(|a| a.is_finite()))
                    .ok_or_else(|| bad(format!("its `best_auc` is {a:?}, not an AUC")))?;
                Some((auc, get("best_step")?))
            }
        };
        // (Checkpoints written before these were kept have none: counted from 0.)
        let loss_sum = match user.get("loss_sum") {
            None => 0.0,
            Some(v) => f64_of_bits(v)
                .ok_or_else(|| bad(format!("its `loss_sum` is {v:?}, not a finite f64's bits")))?,
        };
        let seconds = match user.get("seconds") {
            None => 0.0,
            Some(v) => (v.parse::<f64>().ok())
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(format!("its `seconds` is {v:?}, not a duration")))?,
        };
        Ok(Progress {
            epoch: get("epoch")?,
            batch_in_epoch: get("batch_in_epoch")?,
            best,
            since_best: get("since_best")?,
            loss_sum,
            loss_count: user
                .get("loss_count")
                .map_or(Ok(0), |_| get("loss_count"))?,
            seconds,
        })
    }
}

/// The flags that decide which examples each step trains on, as a checkpoint records them
/// (`run.<flag>` metadata): a resume must give them as the run it continues did, or it would
/// skip or repeat other examples than those trained on (another `--seed` moves examples
/// between the splits, another `--batch-size` skips another number of them).
fn run_flags(args: &Args) -> Vec<(&'static str, String)> {
    (run_flag_values(args).into_iter())
        .map(|(flag, text, _)| (flag, text))
        .collect()
}

/// [`run_flags`], each path flag with its paths (see [`same_files`]).
fn run_flag_values(args: &Args) -> Vec<(&'static str, String, Option<Vec<PathBuf>>)> {
    // Paths as given (a run moved with its data still matches).
    let paths = |flag, p: &[PathBuf], text| (flag, text, Some(p.to_vec()));
    let plain = |flag, text| (flag, text, None);
    vec![
        plain("--data", format!("{:?}", args.data)),
        paths("--path", &args.path, format!("{:?}", args.path)),
        paths("--train", &args.train, format!("{:?}", args.train)),
        paths("--valid", &args.valid, format!("{:?}", args.valid)),
        paths("--test", &args.test, format!("{:?}", args.test)),
        paths(
            "--items-path",
            args.items_path.as_slice(),
            format!("{:?}", args.items_path),
        ),
        plain("--synthetic-train", args.synthetic_train.to_string()),
        plain("--synthetic-rows", format!("{:?}", args.synthetic_rows)),
        plain("--synthetic-eval", args.synthetic_eval.to_string()),
        plain("--synthetic-tasks", args.synthetic_tasks.to_string()),
        plain("--label-columns", format!("{:?}", args.label_columns)),
        plain("--holdout", args.holdout.to_string()),
        plain("--movielens-split", format!("{:?}", args.movielens_split)),
        plain("--batch-size", args.batch_size.to_string()),
        plain("--table-cap", args.table_cap.to_string()),
        plain("--shuffle-buffer", args.shuffle_buffer.to_string()),
        plain("--seed", args.seed.to_string()),
    ]
}

/// Refuses to resume from the checkpoint `path`, whose `run.<flag>` metadata `recorded` gives,
/// when its run gave other [`run_flags`] than `args` do, naming the first that differs. Flags
/// it does not record (it was written before they were recorded) are not checked: a warning
/// names them.
fn check_run_flags(
    args: &Args,
    recorded: impl Fn(&str) -> Option<String>,
    path: &Path,
) -> Result<()> {
    let mut unchecked = Vec::new();
    for (flag, mine, paths) in run_flag_values(args) {
        match recorded(&format!("run.{flag}")) {
            None => unchecked.push(flag),
            Some(theirs) if theirs != mine && !paths.is_some_and(|p| same_files(&p, &theirs)) => {
                return Err(Error::invalid(
                    "dlrm",
                    format!(
                        "--resume {}: its run had {flag} {theirs}; this run has {flag} {mine}: \
                         resume with the flags that choose the data as the checkpoint's run \
                         gave them",
                        path.display()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    if !unchecked.is_empty() {
        eprintln!(
            "warning: --resume {}: the checkpoint does not record {} (written before they \
             were recorded), so they are not checked: give them as its run did",
            path.display(),
            unchecked.join(", ")
        );
    }
    Ok(())
}

/// Whether two path lists name the same files (resolved on this machine; a path that does not
/// resolve stands for itself).
fn same_paths(a: &[PathBuf], b: &[PathBuf]) -> bool {
    let resolved = |p: &[PathBuf]| -> Vec<PathBuf> {
        p.iter()
            .map(|x| std::fs::canonicalize(x).unwrap_or_else(|_| x.clone()))
            .collect()
    };
    resolved(a) == resolved(b)
}

/// Whether a path flag's paths `mine` are the files it names as recorded (`theirs`, its
/// [`run_flags`] text), spelled otherwise (`./data/x` and `data/x`): both sides resolved on
/// this machine. False where a side does not resolve.
fn same_files(mine: &[PathBuf], theirs: &str) -> bool {
    // `["a", "b"]`, `Some("a")` or `None`: JSON once the option is a list.
    let listed = match theirs
        .strip_prefix("Some(")
        .and_then(|t| t.strip_suffix(')'))
    {
        Some(one) => format!("[{one}]"),
        None if theirs == "None" => "[]".to_string(),
        None => theirs.to_string(),
    };
    let Ok(theirs) = serde_json::from_str::<Vec<PathBuf>>(&listed) else {
        return false;
    };
    let resolved = |p: &PathBuf| std::fs::canonicalize(p).ok();
    theirs.len() == mine.len()
        && (theirs.iter().zip(mine))
            .all(|(a, b)| resolved(a).is_some_and(|a| Some(a) == resolved(b)))
}

/// The step recorded in the trainer checkpoint at `path`, if it is one.
fn checkpoint_step(path: &Path) -> Option<u64> {
    let r = embers::checkpoint::CheckpointReader::open(path).ok()?;
    r.metadata("step")?.parse().ok()
}

type Batches = Box<dyn Iterator<Item = Result<Batch>> + Send>;

fn to_batches<S: ExampleSource + 'static>(source: S, config: BatchConfig) -> Result<Batches> {
    let prefetched = Batcher::new(source, config)?.prefetch(4)?;
    Ok(Box::new(prefetched.map(|raw| {
        raw.map_err(Error::from).and_then(RawBatch::into_batch)
    })))
}

impl Data {
    fn open(args: &Args) -> Result<(Data, Vec<(String, usize)>)> {
        let need_path = || -> Result<()> {
            if args.path.is_empty() {
                return Err(Error::invalid(
                    "dlrm",
                    format!("--data {:?} needs --path", args.data),
                ));
            }
            Ok(())
        };
        match args.data {
            DataSource::Synthetic => {
                // The default source reads no files: files given without `--data` are a
                // mistake, not something to train past on other data.
                explicit_splits(args)?;
                if !args.path.is_empty() || args.items_path.is_some() {
                    return Err(Error::invalid(
                        "dlrm",
                        "--path/--items-path given, but --data is synthetic (the default), \
                         which reads no files: add --data criteo-tsv, criteo-parquet or \
                         movielens",
                    ));
                }
                let defaults = SyntheticCriteoConfig::default();
                let config = SyntheticCriteoConfig {
                    seed: args.seed,
                    table_sizes: defaults
                        .table_sizes
                        .iter()
                        .map(|&s| args.synthetic_rows.unwrap_or(s.min(args.table_cap)))
                        .collect(),
                    num_train: args.synthetic_train,
                    num_validation: args.synthetic_eval,
                    num_test: args.synthetic_eval,
                    num_tasks: args.synthetic_tasks,
                    ..defaults
                };
                let features = (config.table_sizes.iter().enumerate())
                    .map(|(f, &rows)| (format!("cat_{f}"), rows as usize))
                    .collect::<Vec<_>>();
                let generator = SyntheticCriteo::new(config)?;
                let keys = &generator.schema().sparse_keys;
                let features = keys.iter().cloned().zip(features.into_iter().map(|f| f.1));
                Ok((Data::Synthetic(generator.clone()), features.collect()))
            }
            DataSource::CriteoTsv | DataSource::CriteoParquet => {
                let explicit = explicit_splits(args)?;
                if !explicit {
                    need_path()?;
                }
                let halves = if explicit && same_paths(&args.valid, &args.test) {
                    Some(match args.data {
                        DataSource::CriteoTsv => count_lines(&args.test)?,
                        _ => embers_datasets::parquet_rows(&args.test)?,
                    })
                } else {
                    None
                };
                let mut schema = embers_datasets::criteo_schema();
                if args.data == DataSource::CriteoParquet && args.label_columns.len() > 1 {
                    schema.tasks = args.label_columns.clone();
                }
                let features = (schema.sparse_keys.iter())
                    .map(|k| (k.clone(), args.table_cap as usize))
                    .collect();
                let data = Data::Files {
                    args: Box::new(args.clone()),
                    schema,
                    halves,
                    by_time: None,
                };
                Ok((data, features))
            }
            DataSource::Movielens => {
                explicit_splits(args)?;
                need_path()?;
                let reader = MovieLensReader::open(movielens_config(args)?)?;
                let schema = reader.schema().clone();
                let features = (schema.sparse_keys.iter())
                    .map(|k| {
                        let rows = if k == "genres" {
                            MOVIELENS_GENRES.len()
                        } else {
                            args.table_cap as usize
                        };
                        (k.clone(), rows)
                    })
                    .collect();
                let by_time = match args.movielens_split {
                    MovieLensSplit::Hash => None,
                    MovieLensSplit::Time => Some(split_by_time(args)?),
                };
                let data = Data::Files {
                    args: Box::new(args.clone()),
                    schema,
                    halves: None,
                    by_time,
                };
                Ok((data, features))
            }
        }
    }

    /// The tasks (label columns), in order.
    fn tasks(&self) -> Vec<String> {
        match self {
            Data::Synthetic(g) => g.schema().tasks.clone(),
            Data::Files { schema, .. } => schema.tasks.clone(),
        }
    }

    fn num_dense(&self) -> usize {
        match self {
            Data::Synthetic(g) => g.schema().num_dense(),
            Data::Files { schema, .. } => schema.num_dense(),
        }
    }

    /// Batches of `split`; training batches are shuffled with a per-epoch seed.
    fn batches(&self, split: Split, epoch: u64, batch_size: usize, seed: u64) -> Result<Batches> {
        self.batches_of_part(split, epoch, batch_size, seed, (0, 1))
    }

    /// Part `part.0` of `part.1` of [`batches`](Self::batches): for the synthetic data, a
    /// contiguous slice of the split's examples (each part generates only its own); for files,
    /// every `part.1`-th batch (each part still reads the whole file).
    fn batches_of_part(
        &self,
        split: Split,
        epoch: u64,
        batch_size: usize,
        seed: u64,
        part: (usize, usize),
    ) -> Result<Batches> {
        let shuffle_seed = seed.wrapping_mul(1_000_003).wrapping_add(epoch);
        let (index, parts) = (part.0 as u64, part.1 as u64);
        match self {
            Data::Synthetic(g) => {
                let config = BatchConfig {
                    batch_size,
                    drop_last: split == Split::Train,
                    shuffle: (split == Split::Train).then_some(ShuffleConfig {
                        buffer_size: 4096,
                        seed: shuffle_seed,
                    }),
                    split_rule: SplitRule::All,
                    split,
                };
                let all = g.split_range(split);
                let len = all.end - all.start;
                // In u128: `len × (index + 1)` passes a u64 for splits past 2^64 / parts.
                let at = |i: u64| all.start + (len as u128 * i as u128 / parts as u128) as u64;
                let mine = at(index)..at(index + 1);
                to_batches(g.examples(mine), config)
            }
            Data::Files {
                args,
                halves,
                by_time,
                ..
            } => {
                // Explicit splits read each split's own files (whole, or a half of the shared
                // validation/test files); otherwise every split reads --path by hash.
                let (paths, split_rule) = if args.train.is_empty() {
                    let rule = match by_time {
                        Some(splits) => SplitRule::Assigned(splits.clone()),
                        None => SplitRule::Fractions {
                            validation: args.holdout,
                            test: args.holdout,
                            seed,
                        },
                    };
                    (&args.path, rule)
                } else {
                    match (split, halves) {
                        (Split::Train, _) => (&args.train, SplitRule::All),
                        (_, Some(n)) => (
                            &args.valid,
                            SplitRule::IndexRanges {
                                train: 0..0,
                                validation: 0..n / 2,
                                test: n / 2..*n,
                            },
                        ),
                        (Split::Validation, None) => (&args.valid, SplitRule::All),
                        (Split::Test, None) => (&args.test, SplitRule::All),
                    }
                };
                let config = BatchConfig {
                    batch_size,
                    drop_last: split == Split::Train,
                    shuffle: (split == Split::Train).then_some(ShuffleConfig {
                        buffer_size: args.shuffle_buffer,
                        seed: shuffle_seed,
                    }),
                    split_rule,
                    split,
                };
                let all = match args.data {
                    DataSource::CriteoTsv => {
                        to_batches(CriteoTsvReader::open(paths, criteo_config(args))?, config)
                    }
                    DataSource::CriteoParquet => to_batches(
                        CriteoParquetReader::open_with_columns(
                            paths,
                            criteo_config(args),
                            CriteoParquetColumns {
                                labels: args.label_columns.clone(),
                                ..Default::default()
                            },
                        )?,
                        config,
                    ),
                    _ => to_batches(MovieLensReader::open(movielens_config(args)?)?, config),
                }?;
                if parts == 1 {
                    return Ok(all);
                }
                Ok(Box::new(
                    all.enumerate()
                        .filter(move |(i, _)| *i as u64 % parts == index)
                        .map(|(_, b)| b),
                ))
            }
        }
    }

    fn best_auc(&self, split: Split, max_examples: Option<u64>) -> Option<f64> {
        self.best_task_auc(split, 0, max_examples)
    }

    /// The best achievable AUC of task `task` (synthetic data only).
    fn best_task_auc(&self, split: Split, task: usize, max_examples: Option<u64>) -> Option<f64> {
        match self {
            Data::Synthetic(g) => g.best_task_auc(split, task, max_examples),
            Data::Files { .. } => None,
        }
    }
}

fn criteo_config(args: &Args) -> CriteoConfig {
    CriteoConfig {
        categorical: CategoricalMapping::Modulo(vec![args.table_cap; 26]),
        ..CriteoConfig::default()
    }
}

fn movielens_config(args: &Args) -> Result<MovieLensConfig> {
    let [path] = &args.path[..] else {
        return Err(Error::invalid(
            "dlrm",
            format!(
                "--data movielens reads one ratings file, --path gives {}",
                args.path.len()
            ),
        ));
    };
    let name = path.file_name().map(|n| n.to_string_lossy().to_string());
    let format = match name.as_deref() {
        Some(n) if n.ends_with(".inter") => MovieLensFormat::RecBoleInter,
        Some(n) if n.ends_with(".dat") => MovieLensFormat::Ml1m,
        Some(_) => MovieLensFormat::Ml100k,
        None => {
            return Err(Error::invalid(
                "dlrm",
                format!("{} is not a file", path.display()),
            ))
        }
    };
    let mut config = MovieLensConfig::new(format, path);
    config.items_path = args.items_path.clone();
    config.user_table_size = Some(args.table_cap);
    config.item_table_size = Some(args.table_cap);
    Ok(config)
}

fn model_config(
    args: &Args,
    num_dense: usize,
    features: Vec<(String, usize)>,
    tasks: Vec<String>,
) -> DlrmConfig {
    let lr = args.sparse_lr;
    DlrmConfig {
        num_dense,
        sparse_features: features,
        embedding_dim: args.emb_dim,
        dense_arch: args.dense_arch.clone(),
        over_arch: args.over_arch.clone(),
        tasks,
        dcn: args.dcn.then_some((args.dcn_layers, args.dcn_rank)),
        dense_optimizer: match args.dense_optimizer {
            DenseOpt::Sgd => DenseOptimizer::Sgd { lr: args.dense_lr },
            DenseOpt::Adagrad => DenseOptimizer::Adagrad { lr: args.dense_lr },
            DenseOpt::Adam => DenseOptimizer::Adam { lr: args.dense_lr },
        },
        sparse_optimizer: match args.sparse_optimizer {
            SparseOpt::Sgd => FusedOptimizer::Sgd { lr },
            SparseOpt::Adagrad => FusedOptimizer::Adagrad { lr, eps: 1e-8 },
            SparseOpt::RowwiseAdagrad => FusedOptimizer::RowWiseAdagrad { lr, eps: 1e-8 },
            SparseOpt::Adam => FusedOptimizer::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            SparseOpt::PartialRowwiseAdam => FusedOptimizer::PartialRowWiseAdam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            SparseOpt::Lamb => FusedOptimizer::Lamb {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
            },
            SparseOpt::PartialRowwiseLamb => FusedOptimizer::PartialRowWiseLamb {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
            },
        },
        seed: args.seed,
        metrics_window: args.batch_size.saturating_mul(100),
        device: args.device,
    }
}

/// One row of the training history.
#[derive(Clone, Debug)]
struct Record {
    step: u64,
    examples: u64,
    seconds: f64,
    train_loss: f64,
    train_window_ne: f64,
    train_window_auc: f64,
    examples_per_second: f64,
    validation: Option<EvalReport>,
}

/// The checkpoint metadata entry (`user.history`) holding the run's history so far, as the
/// JSON array `metrics.json` writes.
const HISTORY_KEY: &str = "history";

impl Record {
    /// As `metrics.json` lists it (non-numbers as `null`).
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "step": self.step, "examples": self.examples, "seconds": self.seconds,
            "train_loss": json_num(self.train_loss),
            "train_window_ne": json_num(self.train_window_ne),
            "train_window_auc": json_num(self.train_window_auc),
            "examples_per_second": json_num(self.examples_per_second),
            "validation": self.validation.as_ref().map(|v| json_metrics(&v.metrics)),
        })
    }

    /// Read back from [`to_json`](Self::to_json)'s form; `None` for anything else.
    fn from_json(v: &serde_json::Value) -> Option<Record> {
        let num = |k: &str| match &v[k] {
            serde_json::Value::Null => Some(f64::NAN),
            x => x.as_f64(),
        };
        let validation = match &v["validation"] {
            serde_json::Value::Null => None,
            serde_json::Value::Object(m) => Some(EvalReport {
                metrics: (m.iter())
                    .map(|(k, x)| {
                        Some((k.clone(), if x.is_null() { f64::NAN } else { x.as_f64()? }))
                    })
                    .collect::<Option<_>>()?,
                examples: 0,
            }),
            _ => return None,
        };
        Some(Record {
            step: v["step"].as_u64()?,
            examples: v["examples"].as_u64()?,
            seconds: num("seconds")?,
            train_loss: num("train_loss")?,
            train_window_ne: num("train_window_ne")?,
            train_window_auc: num("train_window_auc")?,
            examples_per_second: num("examples_per_second")?,
            validation,
        })
    }
}

/// The history a checkpoint's metadata holds (none in checkpoints written before it was
/// kept), or an error naming `path`.
fn history_of(user: &BTreeMap<String, String>, path: &Path) -> Result<Vec<Record>> {
    let Some(text) = user.get(HISTORY_KEY) else {
        return Ok(Vec::new());
    };
    (serde_json::from_str::<Vec<serde_json::Value>>(text).ok())
        .and_then(|v| v.iter().map(Record::from_json).collect::<Option<Vec<_>>>())
        .ok_or_else(|| {
            Error::invalid(
                "dlrm",
                format!(
                    "--resume {}: its `history` metadata is not a run's history",
                    path.display()
                ),
            )
        })
}

fn fmt(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.6}")
    } else {
        String::new()
    }
}

fn write_csv(path: &Path, history: &[Record]) -> Result<()> {
    let mut s = String::from(
        "step,examples,seconds,train_loss,train_window_ne,train_window_auc,examples_per_second,val_auc,val_ne,val_logloss,val_calibration\n",
    );
    for r in history {
        let v = |k: &str| r.validation.as_ref().map_or(f64::NAN, |e| e.get(k));
        s.push_str(&format!(
            "{},{},{:.3},{},{},{},{:.1},{},{},{},{}\n",
            r.step,
            r.examples,
            r.seconds,
            fmt(r.train_loss),
            fmt(r.train_window_ne),
            fmt(r.train_window_auc),
            r.examples_per_second,
            fmt(v("auc")),
            fmt(v("ne")),
            fmt(v("logloss")),
            fmt(v("calibration")),
        ));
    }
    embers::checkpoint::write_atomically(path, s.as_bytes())
}

fn json_num(x: f64) -> serde_json::Value {
    serde_json::Number::from_f64(x).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

fn json_metrics(m: &BTreeMap<String, f64>) -> serde_json::Value {
    serde_json::Value::Object(m.iter().map(|(k, v)| (k.clone(), json_num(*v))).collect())
}

fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn main() {
    // Under an MPI launcher every rank meets the others before it checks its flags, so that
    // a rank refusing them ends all (see `dist::main_launched`).
    if let Some(ranks) = dist::launched_ranks() {
        std::process::exit(dist::main_launched(ranks));
    }
    let args = parse_args().unwrap_or_else(|e| e.exit());
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The command line's flags, with the ones given on it recorded.
fn parse_args() -> std::result::Result<Args, clap::Error> {
    let matches = Args::command().try_get_matches()?;
    let mut args = Args::from_arg_matches(&matches)?;
    args.given = (matches.ids())
        .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect();
    Ok(args)
}

/// Each table's cache statistics on the first `--cache-stats-batches` training batches (none
/// when 0), by table name.
fn measured_cache_stats(
    args: &Args,
    data: &Data,
    config: &DlrmConfig,
) -> Result<BTreeMap<String, embers_planner::config::CacheStats>> {
    let mut ids: BTreeMap<String, Vec<Vec<i64>>> = BTreeMap::new();
    let batches = data.batches(Split::Train, 0, args.batch_size, args.seed)?;
    for batch in batches.take(args.cache_stats_batches) {
        let batch = batch?;
        for (f, _) in &config.sparse_features {
            let values = batch.sparse.get(f)?.values().to_dtype(embers::DType::I64)?;
            ids.entry(format!("t_{f}"))
                .or_default()
                .push(values.to_vec::<i64>()?);
        }
    }
    let mut out = BTreeMap::new();
    for (f, rows) in &config.sparse_features {
        let name = format!("t_{f}");
        if let Some(trace) = ids.get(&name) {
            let stats =
                embers::embedding::planner_cache_stats(*rows as u64, trace, 100).map_err(|e| {
                    Error::invalid("dlrm", format!("the cache statistics of table {name}: {e}"))
                })?;
            out.insert(name, stats);
        }
    }
    Ok(out)
}

/// The data and the model of a run whose flags pass every check ([`check_args`], then
/// [`open_data`]).
fn prepare(args: &Args) -> Result<(Data, DlrmConfig)> {
    check_args(args)?;
    open_data(args)
}

/// The checks of the flags that need no data.
fn check_args(args: &Args) -> Result<()> {
    if args.batch_size == 0 || args.emb_dim == 0 {
        return Err(Error::invalid(
            "dlrm",
            "--batch-size and --emb-dim must be at least 1",
        ));
    }
    if !(args.holdout > 0.0 && args.holdout < 0.5) {
        return Err(Error::invalid(
            "dlrm",
            format!(
                "--holdout {} is not a fraction within (0, 0.5) (held out for validation and \
                 for test, each: 0 leaves no example to validate or test on, and the run \
                 reported NaN metrics; 0.5 leaves none to train on)",
                args.holdout
            ),
        ));
    }
    // Flags that would do nothing, refused rather than ignored.
    if args.shuffle_buffer == 0 {
        return Err(Error::invalid(
            "dlrm",
            "--shuffle-buffer 0 holds no example: give at least 1 (1 reads the files in order)",
        ));
    }
    args.check_cache_flags()?;
    args.check_source_flags()?;
    if args.plan.is_some() {
        if args.device != embers::Device::Cpu {
            return Err(Error::invalid(
                "dlrm",
                format!(
                    "--plan runs the sharded model on the host: --device {} is for runs \
                     without --plan (a plan's ranks on GPUs need NCCL, not built yet)",
                    args.device
                ),
            ));
        }
        if args.early_stop_patience > 0 {
            return Err(Error::invalid(
                "dlrm",
                "--early-stop-patience is not supported with --plan yet",
            ));
        }
        if args.placement != PlacementArg::Fused {
            return Err(Error::invalid(
                "dlrm",
                "with --plan the plan's compute kernels place the tables (its fused_uvm and \
                 fused_uvm_caching tables behind caches over rows in --cache-dir); --placement \
                 is for runs without --plan",
            ));
        }
        args.comm_precisions()?;
    }
    Ok(())
}

/// `--out` made, the data opened, the model's configuration for it.
fn open_data(args: &Args) -> Result<(Data, DlrmConfig)> {
    let io = |p: &Path, e: std::io::Error| Error::Io {
        path: p.display().to_string(),
        source: e,
    };
    std::fs::create_dir_all(&args.out).map_err(|e| io(&args.out, e))?;
    let (data, features) = Data::open(args)?;
    let config = model_config(args, data.num_dense(), features, data.tasks());
    Ok((data, config))
}

/// A fresh run (not a resume) removes the report files an earlier run left in `--out`: they
/// are written at the end, so an error part way left the earlier run's report beside this
/// run's checkpoint, reading as this run's.
fn remove_earlier_reports(args: &Args) -> Result<()> {
    if args.resume.is_some() {
        return Ok(());
    }
    for name in ["metrics.csv", "metrics.json", "curves.png"] {
        let path = args.out.join(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::Io {
                    path: path.display().to_string(),
                    source: e,
                })
            }
            _ => {}
        }
    }
    Ok(())
}

fn run(args: Args) -> Result<()> {
    if args.plan.is_some() {
        // Started without a launcher: a world of one rank.
        return dist::run_alone(&args);
    }
    let (data, config) = prepare(&args)?;
    if let Some(path) = &args.write_planner_config {
        if args.ranks == 0 {
            return Err(Error::invalid(
                "dlrm",
                "--ranks 0: a planner configuration is for at least 1 rank",
            ));
        }
        if args.cache_stats_batches > 0 && args.device == embers::Device::Cpu {
            return Err(Error::invalid(
                "dlrm",
                "--cache-stats-batches: the planner offers CPU ranks no cached kernel \
                 (TorchRec's: fused and quant), so the statistics would change nothing; \
                 with --device cuda the config is for GPU ranks, where they price \
                 fused_uvm_caching",
            ));
        }
        let stats = measured_cache_stats(&args, &data, &config)?;
        return dist::write_planner_config(&args, &config, &stats, path);
    }
    if args.early_stop_patience > 0 && args.validate_every == 0 {
        return Err(Error::invalid(
            "dlrm",
            "--early-stop-patience counts validations during training, and --validate-every 0 \
             runs none",
        ));
    }
    remove_earlier_reports(&args)?;
    let mut trainer = config.build_with(&args.placement()?)?;
    let checkpoint = args.out.join("checkpoint.safetensors");

    let best_checkpoint = args.out.join("best.safetensors");
    let mut progress = Progress::default();
    let mut resumed_history = Vec::new();
    if let Some(path) = &args.resume {
        // The run's flags first: the trainer changes nothing unless they match.
        let reader = embers::checkpoint::CheckpointReader::open(path)?;
        let recorded = |key: &str| Some(reader.metadata(&format!("user.{key}"))?.to_string());
        check_run_flags(&args, recorded, path)?;
        drop(reader);
        let user = trainer.load_checkpoint(path)?;
        progress = Progress::from_user(&user, path)?;
        resumed_history = history_of(&user, path)?;
        println!(
            "resumed from {} at step {} (epoch {}, batch {})",
            path.display(),
            trainer.step(),
            progress.epoch,
            progress.batch_in_epoch
        );
        // Early stopping restores the best model from best.safetensors, written only by runs
        // that stopped early: a best this run cannot restore is tracked afresh.
        if let Some((_, at)) = progress.best {
            if args.early_stop_patience > 0 && checkpoint_step(&best_checkpoint) != Some(at) {
                println!(
                    "{} holds no checkpoint of the best step {at}: the best is tracked afresh",
                    best_checkpoint.display()
                );
                progress.best = None;
                progress.since_best = 0;
            }
        }
    }
    let params = trainer.model().dense.num_parameters();
    println!(
        "DLRM{}: {} dense + {} sparse features, D={}, bottom {:?}, top {:?}, {} dense parameters, {} table rows",
        if args.dcn { "-DCNv2" } else { "" },
        config.num_dense,
        config.sparse_features.len(),
        config.embedding_dim,
        config.dense_arch,
        config.over_arch,
        params,
        config.sparse_features.iter().map(|f| f.1).sum::<usize>()
    );
    // Over the examples validation reads: whole batches, all of them for 0.
    let best_val = data.best_auc(
        Split::Validation,
        validation_batches(&args, 1).map(|b| b.saturating_mul(args.batch_size) as u64),
    );
    let best_test = data.best_auc(Split::Test, None);
    if let Some(b) = best_test {
        println!(
            "synthetic data: best achievable test AUC (the generator's own probabilities) {b:.4}"
        );
    }

    let steps_per_epoch = match &data {
        Data::Synthetic(_) => Some(args.synthetic_train / args.batch_size as u64),
        Data::Files { .. } => None,
    };
    let total_steps = match (args.steps, steps_per_epoch) {
        (Some(s), _) => Some(s),
        (None, Some(per)) => Some(per.saturating_mul(args.epochs)),
        (None, None) => None,
    };
    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        let bar = total_steps.map_or_else(ProgressBar::new_spinner, ProgressBar::new);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_position(trainer.step());
        bar
    };

    let validate = |trainer: &DlrmTrainer| -> Result<EvalReport> {
        let limit = validation_batches(&args, 1).unwrap_or(usize::MAX);
        let batches = data.batches(Split::Validation, 0, args.batch_size, args.seed)?;
        trainer.evaluate(batches.take(limit), None)
    };

    let mut history: Vec<Record> = resumed_history;
    let mut throughput = Throughput::new(5, 50)?;
    let started = Instant::now();
    // The run's seconds, its earlier processes' included.
    let seconds = |progress: &Progress| progress.seconds + started.elapsed().as_secs_f64();
    let log_every = 50u64;
    // A resumed run that had stopped early (killed after its last checkpoint, before its
    // final report) trains no further under the same patience.
    let stopped_early =
        args.early_stop_patience > 0 && progress.since_best >= args.early_stop_patience;
    if stopped_early {
        println!(
            "the run stopped early at step {} ({} validations without improvement): nothing \
             more to train",
            trainer.step(),
            progress.since_best
        );
    }
    let save = |trainer: &DlrmTrainer,
                path: &Path,
                progress: &Progress,
                history: &[Record]|
     -> Result<()> {
        let progress = Progress {
            seconds: seconds(progress),
            ..*progress
        };
        let mut user = progress.to_user();
        user.insert("args".to_string(), format!("{args:?}"));
        let records: Vec<serde_json::Value> = history.iter().map(Record::to_json).collect();
        user.insert(
            HISTORY_KEY.to_string(),
            serde_json::Value::from(records).to_string(),
        );
        for (flag, v) in run_flags(&args) {
            user.insert(format!("run.{flag}"), v);
        }
        trainer.save_checkpoint(path, &user)
    };
    // Training batches the data yielded in this run (skipped ones included): none at all
    // means an empty training set, an error rather than a model trained on nothing.
    let mut yielded = 0u64;
    let tables = trainer.model().sparse_arch.clone();
    let prefetching = args.placement != PlacementArg::Fused && args.cache_prefetch;
    let on_gpu = trainer.model().device() != embers::Device::Cpu;
    'epochs: while progress.epoch < args.epochs && !stopped_early {
        let mut batches = data.batches(Split::Train, progress.epoch, args.batch_size, args.seed)?;
        // Resuming: skip the batches of this epoch that were already trained on.
        for _ in 0..progress.batch_in_epoch {
            match batches.next() {
                Some(b) => {
                    drop(b?);
                    yielded += 1;
                }
                None => break,
            }
        }
        let mut batches = batches.peekable();
        while let Some(batch) = batches.next() {
            if total_steps.is_some_and(|t| trainer.step() >= t) {
                break 'epochs;
            }
            let batch = batch?;
            yielded += 1;
            // Tables behind a cache: the next batch is admitted (its rows read in) while this
            // one trains — on the host, on another thread; on a GPU, once this batch's
            // backward is queued, on the device's prefetch stream beside it.
            let next = batches.peek().and_then(|b| b.as_ref().ok());
            let out = match next.filter(|_| prefetching) {
                Some(next) if on_gpu => {
                    trainer.train_step_then(&batch, || tables.prefetch(&next.sparse))?
                }
                Some(next) => std::thread::scope(|s| {
                    let prefetch = s.spawn(|| tables.prefetch(&next.sparse));
                    let out = trainer.train_step(&batch);
                    prefetch.join().expect("the prefetch thread panicked")?;
                    out
                })?,
                None => trainer.train_step(&batch)?,
            };
            throughput.step(out.batch_size as u64);
            let step_done = Instant::now();
            progress.batch_in_epoch += 1;
            progress.loss_sum += out.loss;
            progress.loss_count += 1;
            let step = trainer.step();
            bar.set_position(step);
            let validating = args.validate_every > 0 && step % args.validate_every == 0;
            if step % log_every == 0 || validating {
                let m = trainer.train_metrics();
                let mut stop = false;
                let mut new_best = false;
                let validation = if validating {
                    let report = validate(&trainer)?;
                    if report.examples == 0 {
                        // It reported AUC 0.5 and NE NaN of no example, and early stopping
                        // stopped on them.
                        return Err(empty_validation(step));
                    }
                    let auc = report.get("auc");
                    if progress.best.is_none_or(|(b, _)| auc > b) {
                        progress.best = Some((auc, step));
                        progress.since_best = 0;
                        new_best = true;
                    } else {
                        progress.since_best += 1;
                        stop = args.early_stop_patience > 0
                            && progress.since_best >= args.early_stop_patience;
                    }
                    Some(report)
                } else {
                    None
                };
                let record = Record {
                    step,
                    examples: trainer.examples_seen(),
                    seconds: seconds(&progress),
                    train_loss: progress.loss_sum / progress.loss_count.max(1) as f64,
                    train_window_ne: m.get("window_ne").copied().unwrap_or(f64::NAN),
                    train_window_auc: m.get("window_auc").copied().unwrap_or(f64::NAN),
                    examples_per_second: throughput.window(),
                    validation,
                };
                // The checkpoints of a validation hold the history up to it, this record
                // included: a resumed run's metrics.csv and curves go back to step 0.
                history.push(record.clone());
                if validating {
                    if new_best && args.early_stop_patience > 0 {
                        save(&trainer, &best_checkpoint, &progress, &history)?;
                    }
                    save(&trainer, &checkpoint, &progress, &history)?;
                }
                // The validation, the metrics and the checkpoints are no training: the rates
                // leave them out (the first rate after each validation read low).
                throughput.exclude(step_done.elapsed());
                progress.loss_sum = 0.0;
                progress.loss_count = 0;
                bar.set_message(format!(
                    "loss {:.4} NE {:.4} AUC {:.4} {:.0} ex/s",
                    record.train_loss,
                    record.train_window_ne,
                    record.train_window_auc,
                    record.examples_per_second
                ));
                if let Some(v) = &record.validation {
                    let say = |line: String| {
                        if bar.is_hidden() {
                            println!("{line}");
                        } else {
                            bar.println(line);
                        }
                    };
                    say(format!(
                        "step {step}: validation AUC {:.4} NE {:.4} logloss {:.4}{}",
                        v.get("auc"),
                        v.get("ne"),
                        v.get("logloss"),
                        best_val.map_or(String::new(), |b| format!(" (best achievable {b:.4})"))
                    ));
                } else if args.no_progress {
                    println!(
                        "step {step}: loss {:.4} window NE {:.4} AUC {:.4} {:.0} ex/s",
                        record.train_loss,
                        record.train_window_ne,
                        record.train_window_auc,
                        record.examples_per_second
                    );
                }
                if stop {
                    let (b, at) = progress.best.expect("a best validation precedes a stop");
                    let line = format!(
                        "early stop at step {step}: validation AUC has not improved for {} \
                         validations (best {b:.4} at step {at})",
                        args.early_stop_patience
                    );
                    if bar.is_hidden() {
                        println!("{line}");
                    } else {
                        bar.println(line);
                    }
                    break 'epochs;
                }
            }
        }
        if yielded == 0 {
            // The data has no complete batch: every epoch would read it all again to find
            // none (reported below).
            break;
        }
        progress.epoch += 1;
        progress.batch_in_epoch = 0;
    }
    bar.finish_and_clear();
    // `--epochs 0` or `--steps 0` asks for no training: nothing to find empty.
    let asked_to_train = args.epochs > 0 && args.steps != Some(0);
    if yielded == 0 && trainer.step() == 0 && asked_to_train {
        return Err(Error::invalid(
            "dlrm",
            match &data {
                Data::Synthetic(_) => format!(
                    "the training set is empty: --synthetic-train {} is less than one batch of {}",
                    args.synthetic_train, args.batch_size
                ),
                Data::Files { .. } => {
                    format!(
                    "the training split of {} holds no complete batch of {} (the files are empty, \
                     too short, or every line was skipped as malformed); nothing was trained or \
                     written",
                    (if args.train.is_empty() { &args.path } else { &args.train })
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    args.batch_size
                )
                }
            },
        ));
    }
    let train_seconds = seconds(&progress);
    save(&trainer, &checkpoint, &progress, &history)?;
    let (trained_steps, trained_examples) = (trainer.step(), trainer.examples_seen());
    // The step whose model the final report is of.
    let mut reported_step = trained_steps;
    if args.early_stop_patience > 0 {
        if let Some((b, at)) = progress.best {
            if at != trainer.step() {
                if checkpoint_step(&best_checkpoint) != Some(at) {
                    return Err(Error::invalid(
                        "dlrm",
                        format!(
                            "{} is not the best checkpoint (step {at}) any more: was it \
                             replaced while this run trained?",
                            best_checkpoint.display()
                        ),
                    ));
                }
                trainer.load_checkpoint(&best_checkpoint)?;
                reported_step = at;
                println!(
                    "restored the best checkpoint (step {at}, validation AUC {b:.4}) for the \
                     final report"
                );
            }
        }
    }

    // Final reports.
    let validation = validate(&trainer)?;
    let test = trainer.evaluate(
        data.batches(Split::Test, 0, args.batch_size, args.seed)?,
        None,
    )?;
    empty_reports(validation.examples, test.examples, &checkpoint)?;
    println!(
        "trained {} steps ({} examples) in {train_seconds:.1} s: {:.0} examples/s",
        trained_steps,
        trained_examples,
        throughput.lifetime()
    );
    println!(
        "validation: AUC {:.4} NE {:.4}",
        validation.get("auc"),
        validation.get("ne")
    );
    println!(
        "test ({} examples): AUC {:.4}  NE {:.4}  logloss {:.4}  calibration {:.4}  CTR {:.4}",
        test.examples,
        test.get("auc"),
        test.get("ne"),
        test.get("logloss"),
        test.get("calibration"),
        test.get("ctr")
    );
    if let Some(b) = best_test {
        println!(
            "          best achievable AUC {b:.4}: the model is {:.4} below it",
            b - test.get("auc")
        );
    }
    for (t, task) in config.tasks.iter().enumerate().skip(1) {
        let of = |name: &str| test.get(&format!("{name}/{task}"));
        let best = data.best_task_auc(Split::Test, t, None);
        println!(
            "  task {task}: test AUC {:.4}  NE {:.4}  logloss {:.4}  CTR {:.4}{}",
            of("auc"),
            of("ne"),
            of("logloss"),
            of("ctr"),
            best.map_or(String::new(), |b| format!("  (best achievable AUC {b:.4})"))
        );
    }
    let mut quantized = Vec::new();
    if !args.no_quantized_eval {
        for q in &args.quantized_eval {
            let tables = trainer.model().sparse_arch.quantize(q.weight_type())?;
            let report = trainer.evaluate(
                data.batches(Split::Test, 0, args.batch_size, args.seed)?,
                Some(&tables),
            )?;
            println!(
                "  tables as {:<5} ({:>7.2} MiB): test AUC {:.4} ({:+.5} vs FP32), NE {:.4}",
                q.weight_type().fbgemm_name(),
                tables.allocated_bytes() as f64 / (1 << 20) as f64,
                report.get("auc"),
                report.get("auc") - test.get("auc"),
                report.get("ne")
            );
            quantized.push((q.weight_type().fbgemm_name().to_string(), report));
        }
    }
    let rss = peak_rss_mib();
    if let Some(r) = rss {
        println!("peak RSS {r:.0} MiB");
    }
    let cache: Vec<CacheStats> = (trainer.model().sparse_arch.tbes().iter())
        .filter_map(|t| t.cache_stats())
        .flatten()
        .collect();
    if !cache.is_empty() {
        let (ids, misses, conflicts, read, written, slots, rows) =
            cache.iter().fold((0, 0, 0, 0, 0, 0, 0usize), |a, s| {
                let rows = (config.sparse_features.iter())
                    .find(|(f, _)| format!("t_{f}") == s.table)
                    .map_or(0, |f| f.1);
                (
                    a.0 + s.unique_ids,
                    a.1 + s.unique_misses,
                    a.2 + s.conflict_misses,
                    a.3 + s.rows_read,
                    a.4 + s.rows_written,
                    a.5 + s.slots,
                    a.6 + rows,
                )
            });
        println!(
            "table cache: {slots} slots for {rows} rows, miss rate {:.4} of {ids} unique ids \
             ({conflicts} conflict misses), {read} rows read and {written} written back",
            misses as f64 / ids.max(1) as f64
        );
    }

    let csv = args.out.join("metrics.csv");
    write_csv(&csv, &history)?;
    let json = serde_json::json!({
        "args": format!("{args:?}"),
        "steps": trained_steps,
        "examples": trained_examples,
        "reported_step": reported_step,
        "train_seconds": train_seconds,
        "examples_per_second": throughput.lifetime(),
        "peak_rss_mib": rss,
        "table_cache": cache.iter().map(|s| serde_json::json!({
            "table": s.table, "slots": s.slots, "calls": s.calls,
            "requested_ids": s.requested_ids, "unique_ids": s.unique_ids,
            "unique_misses": s.unique_misses, "conflict_misses": s.conflict_misses,
            "evictions": s.evictions, "rows_read": s.rows_read, "rows_written": s.rows_written,
        })).collect::<Vec<_>>(),
        "best_achievable_test_auc": best_test,
        "validation": json_metrics(&validation.metrics),
        "test": json_metrics(&test.metrics),
        "quantized_test": quantized.iter().map(|(k, r)| (k.clone(), json_metrics(&r.metrics))).collect::<serde_json::Map<_, _>>(),
        "history": history.iter().map(Record::to_json).collect::<Vec<_>>(),
    });
    let json_path = args.out.join("metrics.json");
    let text = serde_json::to_string_pretty(&json).expect("JSON of plain values");
    embers::checkpoint::write_atomically(&json_path, text.as_bytes())?;
    let png = args.out.join("curves.png");
    plot::training_curves(&png, &history_series(&history), best_val)?;
    println!(
        "wrote {}, {}, {}, {}",
        checkpoint.display(),
        csv.display(),
        json_path.display(),
        png.display()
    );
    // Tables cached in files are checkpointed beside the file (its parts directory).
    let prefix = format!(
        "{}.parts-",
        checkpoint.file_name().unwrap().to_string_lossy()
    );
    let parts = (std::fs::read_dir(&args.out).into_iter().flatten().flatten())
        .find(|e| e.file_name().to_string_lossy().starts_with(&prefix));
    if let Some(parts) = parts {
        println!(
            "  the checkpoint's cached tables are in {} (copy it with the file)",
            parts.path().display()
        );
    }
    Ok(())
}

fn history_series(history: &[Record]) -> plot::Series {
    let pick = |f: &dyn Fn(&Record) -> Option<f64>| {
        history
            .iter()
            .filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (r.step as f64, v)))
            .collect()
    };
    plot::Series {
        train_loss: pick(&|r| Some(r.train_loss)),
        train_ne: pick(&|r| Some(r.train_window_ne)),
        train_auc: pick(&|r| Some(r.train_window_auc)),
        val_ne: pick(&|r| r.validation.as_ref().map(|v| v.get("ne"))),
        val_auc: pick(&|r| r.validation.as_ref().map(|v| v.get("auc"))),
    }
}
