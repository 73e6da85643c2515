//! The planner's input file (TOML or JSON) and its resolution into a validated [`Problem`].
//!
//! ```toml
//! batch_size = 16384
//! [topology]
//! preset = "8xH100-80G"
//! [optimizer]
//! kind = "row_wise_adagrad"
//! [[tables]]
//! name = "t0"
//! rows = 40000000
//! dim = 128
//! pooling_factors = [1.0]
//! ```

use crate::error::PlannerError;
use crate::topology::{Topology, MAX_MULTIPLIER};
use crate::types::{ComputeDevice, ComputeKernel, DataType, ShardingType};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::Path;

/// Largest embedding dim accepted (FBGEMM's kernels stop far below; column-wise options are
/// enumerated per `min_partition` columns, so an absurd dim would enumerate without end).
pub const MAX_DIM: u64 = 1 << 16;
/// Largest row count accepted: 2^40 (a trillion rows; rows × dim stays far inside u64).
pub const MAX_ROWS: u64 = 1 << 40;
/// Largest pooling factor (ids per sample and feature) or number of poolings accepted.
pub const MAX_POOLING: f64 = 1e9;
/// The largest configuration file read (bytes): some 500,000 tables.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// Largest `cache_stats.expected_lookups` accepted: distinct ids a batch looks up in one
/// table, which no batch brings past MAX_ROWS (and whose products with row bytes must stay
/// finite).
pub const MAX_EXPECTED_LOOKUPS: f64 = MAX_ROWS as f64;

/// A byte count given either as an integer or as a string with a binary unit (`"80GiB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a whole number of bytes or a size such as \"80GiB\"")
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }

            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| {
                    E::custom(format!("invalid byte size {v}: it must not be negative"))
                })
            }

            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<ByteSize, E> {
                // TOML and JSON write 8.5e10 as a float: taken when it is a whole count.
                if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < u64::MAX as f64 {
                    Ok(ByteSize(v as u64))
                } else {
                    Err(E::custom(format!(
                        "invalid byte size {v}: expected a whole number of bytes ≥ 0"
                    )))
                }
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
                parse_bytes(s).map(ByteSize).map_err(|why| {
                    E::custom(format!(
                        "invalid byte size '{s}': {why} (expected an integer or e.g. \"80GiB\", \
                         \"512MiB\")"
                    ))
                })
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Bytes in `s`, a number and an optional unit. In plain bytes the number must be whole; in a
/// larger unit the amount is floored to whole bytes, but not to 0 from a non-zero amount.
fn parse_bytes(s: &str) -> Result<u64, &'static str> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num.parse().map_err(|_| "no number")?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err("unknown unit"),
    };
    let bytes = v * mult;
    if !(bytes.is_finite() && bytes >= 0.0 && bytes < u64::MAX as f64) {
        return Err("past u64");
    }
    if mult == 1.0 && bytes.fract() != 0.0 {
        return Err("not a whole number of bytes");
    }
    if bytes > 0.0 && bytes < 1.0 {
        return Err("less than one byte");
    }
    Ok(bytes as u64)
}

/// Topology section: a preset and/or explicit fields (explicit fields win). Bandwidths are in
/// bytes per millisecond (TorchRec's unit).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyConfig {
    /// A preset name, see [`Topology::PRESETS`]; default: TorchRec's defaults.
    pub preset: Option<String>,
    /// Number of ranks (default: the preset's; without a preset it must be given).
    pub world_size: Option<usize>,
    /// Ranks per host (default: the preset's host size, capped at world_size).
    pub local_world_size: Option<usize>,
    /// `cuda` or `cpu`.
    pub compute_device: Option<ComputeDevice>,
    /// HBM per rank.
    pub hbm_cap: Option<ByteSize>,
    /// DDR per rank.
    pub ddr_cap: Option<ByteSize>,
    /// HBM bandwidth, bytes/ms.
    pub hbm_mem_bw: Option<f64>,
    /// DDR bandwidth, bytes/ms.
    pub ddr_mem_bw: Option<f64>,
    /// HBM-to-DDR bandwidth, bytes/ms.
    pub hbm_to_ddr_mem_bw: Option<f64>,
    /// Intra-host link bandwidth, bytes/ms.
    pub intra_host_bw: Option<f64>,
    /// Inter-host link bandwidth per NIC, bytes/ms.
    pub inter_host_bw: Option<f64>,
    /// Backward/forward compute ratio.
    pub bwd_compute_multiplier: Option<f64>,
    /// Extra backward multiplier for weighted features.
    pub weighted_feature_bwd_compute_multiplier: Option<f64>,
}

/// The optimizer attached to the embedding tables; it sets the optimizer-state memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// No optimizer state (inference or nothing attached).
    #[default]
    None,
    /// SGD: no state.
    Sgd,
    /// Adam: two moments, 2x the weights.
    Adam,
    /// Row-wise Adagrad: one value per row (1/dim of the weights).
    RowWiseAdagrad,
    /// Adagrad: 1x the weights.
    Adagrad,
    /// LAMB: two moments, 2x the weights.
    Lamb,
    /// Partial row-wise Adam: a first moment per element, a second per row (1 + 1/dim).
    PartialRowWiseAdam,
    /// Partial row-wise LAMB: as partial row-wise Adam (1 + 1/dim).
    PartialRowWiseLamb,
    /// Any other optimizer: `state_multiplier` x the weights (default 1).
    Custom,
}

/// Optimizer section.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Which optimizer.
    #[serde(default)]
    pub kind: OptimizerKind,
    /// For `custom`: optimizer state bytes as a multiple of the weight bytes.
    pub state_multiplier: Option<f64>,
}

impl OptimizerConfig {
    /// Optimizer-state bytes per weight byte for a table of width `dim`.
    pub fn multiplier(&self, dim: u64) -> f64 {
        match self.kind {
            OptimizerKind::None | OptimizerKind::Sgd => 0.0,
            OptimizerKind::Adam | OptimizerKind::Lamb => 2.0,
            OptimizerKind::PartialRowWiseAdam | OptimizerKind::PartialRowWiseLamb => {
                1.0 + 1.0 / dim as f64
            }
            OptimizerKind::RowWiseAdagrad => 1.0 / dim as f64,
            OptimizerKind::Adagrad => 1.0,
            OptimizerKind::Custom => self.state_multiplier.unwrap_or(1.0),
        }
    }
}

/// Memory held back from the tables on every rank (TorchRec's heuristical reservation).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReservationConfig {
    /// Fraction of HBM kept free as a margin (default 0.15).
    #[serde(default = "default_percentage")]
    pub percentage: f64,
    /// Bytes of dense model (MLPs, optimizer) per rank (default 0).
    #[serde(default)]
    pub dense_bytes: ByteSize,
    /// Reserve the input KeyedJaggedTensor buffers (default true).
    #[serde(default = "yes")]
    pub kjt: bool,
}

impl Default for ReservationConfig {
    fn default() -> Self {
        ReservationConfig {
            percentage: default_percentage(),
            dense_bytes: ByteSize(0),
            kjt: true,
        }
    }
}

fn default_percentage() -> f64 {
    0.15
}
fn yes() -> bool {
    true
}

/// Cache statistics of a table for cached kernels (TorchRec's `EmbeddingOffloadStats`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheStats {
    /// Expected unique ids per global batch.
    pub expected_lookups: f64,
    /// Histogram of the LRU miss-ratio curve over cache sizes 0..height.
    pub mrc_hist_counts: Vec<f64>,
    /// Rows of the table the histogram was taken on.
    pub height: u64,
    /// Area under the miss-ratio curve (informational).
    #[serde(default)]
    pub cacheability: Option<f64>,
}

/// Per-table constraints on the search.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Constraints {
    /// Allowed sharding types (default: all but grid_shard).
    pub sharding_types: Option<Vec<ShardingType>>,
    /// Allowed kernels (default: dense, fused, fused_uvm, fused_uvm_caching on cuda).
    pub compute_kernels: Option<Vec<ComputeKernel>>,
    /// Smallest column block for column-wise and grid sharding (default 128).
    pub min_partition: Option<u64>,
    /// HBM cache size as a fraction of the table for cached kernels (default 0.2).
    pub cache_load_factor: Option<f64>,
    /// Cache statistics; with them and a `cache_load_factor` (as in TorchRec, the default
    /// factor alone prices no prefetch) cached kernels get a prefetch cost.
    pub cache_stats: Option<CacheStats>,
    /// Element type of the embedding outputs (default: the table's).
    pub output_dtype: Option<DataType>,
}

/// One input feature of a table.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeatureConfig {
    /// Feature name (informational).
    #[serde(default)]
    pub name: Option<String>,
    /// Mean ids per sample (default 1).
    #[serde(default = "one")]
    pub pooling_factor: f64,
    /// Poolings per sample (default 1).
    #[serde(default)]
    pub num_poolings: Option<f64>,
    /// Batch size of this feature (default: the global one).
    #[serde(default)]
    pub batch_size: Option<u64>,
}

fn one() -> f64 {
    1.0
}
fn pooled_default() -> bool {
    true
}

/// One embedding table.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    /// Unique name.
    pub name: String,
    /// Number of rows (embeddings).
    pub rows: u64,
    /// Embedding dimension.
    pub dim: u64,
    /// Element type (default FP32).
    #[serde(default = "fp32")]
    pub data_type: DataType,
    /// Features reading this table, with their pooling factors.
    #[serde(default)]
    pub features: Vec<FeatureConfig>,
    /// Shorthand for features: one pooling factor per feature.
    #[serde(default)]
    pub pooling_factors: Option<Vec<f64>>,
    /// Whether ids carry weights.
    #[serde(default)]
    pub weighted: bool,
    /// Pooled (EmbeddingBag) or sequence (Embedding) output (default pooled).
    #[serde(default = "pooled_default")]
    pub pooled: bool,
    /// Constraints on how this table may be sharded.
    #[serde(default)]
    pub constraints: Constraints,
}

fn fp32() -> DataType {
    DataType::Fp32
}

/// The whole input file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Per-rank batch size.
    pub batch_size: u64,
    /// The hardware.
    #[serde(default)]
    pub topology: TopologyConfig,
    /// The embedding optimizer.
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Memory held back per rank.
    #[serde(default)]
    pub storage_reservation: ReservationConfig,
    /// The tables.
    pub tables: Vec<TableConfig>,
}

/// A table resolved for the estimators: per-feature lists of equal length.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Dimension.
    pub dim: u64,
    /// Element type.
    pub data_type: DataType,
    /// Pooling factor per feature (TorchRec's `input_lengths`).
    pub input_lengths: Vec<f64>,
    /// Poolings per sample per feature.
    pub num_poolings: Vec<f64>,
    /// Batch size per feature.
    pub batch_sizes: Vec<u64>,
    /// Weighted ids.
    pub weighted: bool,
    /// Pooled output.
    pub pooled: bool,
    /// Optimizer-state bytes per weight byte.
    pub optimizer_multiplier: f64,
    /// Constraints.
    pub constraints: Constraints,
}

/// A validated planning problem.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Resolved hardware.
    pub topology: Topology,
    /// Per-rank batch size.
    pub batch_size: u64,
    /// Resolved tables.
    pub tables: Vec<Table>,
    /// Reservation settings.
    pub reservation: ReservationSettings,
}

/// Resolved reservation settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReservationSettings {
    /// Fraction of HBM kept free.
    pub percentage: f64,
    /// Dense model bytes per rank.
    pub dense_bytes: u64,
    /// Whether the KJT input buffers are reserved.
    pub kjt: bool,
}

impl Config {
    /// Reads a config file; `.json` files are JSON, everything else TOML.
    pub fn from_path(path: &Path) -> Result<Config, PlannerError> {
        use std::io::Read;
        let io = |source| PlannerError::Io {
            path: path.display().to_string(),
            source,
        };
        // Read no further than the limit (`/dev/zero` or a huge file grew memory until the
        // process was killed).
        let mut text = String::new();
        (std::fs::File::open(path).map_err(io)?)
            .take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(PlannerError::Config {
                field: path.display().to_string(),
                message: format!(
                    "is more than {} MiB: not a planner configuration",
                    MAX_CONFIG_BYTES >> 20
                ),
            });
        }
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"))
        {
            Config::from_json(&text)
        } else {
            Config::from_toml(&text)
        }
    }

    /// Parses TOML; errors carry the line and column and the offending key.
    pub fn from_toml(text: &str) -> Result<Config, PlannerError> {
        toml::from_str(text).map_err(|e: toml::de::Error| {
            let location = match e.span() {
                Some(span) => {
                    let (line, col) = line_col(text, span.start);
                    format!("line {line}, column {col}")
                }
                None => "unknown position".to_string(),
            };
            PlannerError::Parse {
                location,
                message: e.message().trim().to_string(),
            }
        })
    }

    /// Parses JSON; errors carry the line and column.
    pub fn from_json(text: &str) -> Result<Config, PlannerError> {
        serde_json::from_str(text).map_err(|e| PlannerError::Parse {
            location: format!("line {}, column {}", e.line(), e.column()),
            message: e.to_string(),
        })
    }

    /// Validates every field and resolves presets and defaults.
    pub fn resolve(&self) -> Result<Problem, PlannerError> {
        let topology = self.resolve_topology()?;
        if self.batch_size == 0 {
            return Err(cfg("batch_size", "must be at least 1".into()));
        }
        let r = &self.storage_reservation;
        if !(0.0..=1.0).contains(&r.percentage) {
            return Err(cfg(
                "storage_reservation.percentage",
                format!("must be within [0, 1], got {}", r.percentage),
            ));
        }
        if let Some(m) = self.optimizer.state_multiplier {
            if self.optimizer.kind != OptimizerKind::Custom {
                return Err(cfg(
                    "optimizer.state_multiplier",
                    format!(
                        "only a `custom` optimizer takes one ({:?} sets its own state)",
                        self.optimizer.kind
                    ),
                ));
            }
            if !(m.is_finite() && (0.0..=MAX_MULTIPLIER).contains(&m)) {
                return Err(cfg(
                    "optimizer.state_multiplier",
                    format!("must be a number within [0, {MAX_MULTIPLIER}], got {m}"),
                ));
            }
        }
        if self.tables.is_empty() {
            return Err(cfg("tables", "at least one table is needed".into()));
        }
        let mut names = HashSet::new();
        let mut tables = Vec::with_capacity(self.tables.len());
        for (i, t) in self.tables.iter().enumerate() {
            // A name is printed in the plan's tables and keyed in its JSON: one that is empty
            // or holds control characters (a newline) broke or forged their lines.
            if t.name.is_empty() || t.name.chars().any(char::is_control) {
                return Err(cfg(
                    &format!("tables[{i}].name"),
                    format!(
                        "{:?} is not a table name (one or more characters, none of them \
                         control characters)",
                        t.name
                    ),
                ));
            }
            if !names.insert(t.name.as_str()) {
                return Err(cfg(
                    &format!("tables[{i}].name"),
                    format!("duplicate table name '{}'", t.name),
                ));
            }
            tables.push(self.resolve_table(i, t)?);
        }
        Ok(Problem {
            topology,
            batch_size: self.batch_size,
            tables,
            reservation: ReservationSettings {
                percentage: r.percentage,
                dense_bytes: r.dense_bytes.0,
                kjt: r.kjt,
            },
        })
    }

    fn resolve_topology(&self) -> Result<Topology, PlannerError> {
        let c = &self.topology;
        let device = c.compute_device.unwrap_or_default();
        let mut t = match &c.preset {
            Some(p) => Topology::preset(p).ok_or_else(|| {
                cfg(
                    "topology.preset",
                    format!(
                        "unknown preset '{p}'; known: {}",
                        Topology::PRESETS.join(", ")
                    ),
                )
            })?,
            // No preset: the ranks must be given (a quiet 8 planned for a world the job does
            // not have, found only when the plan was loaded).
            None => Topology::torchrec_default(
                c.world_size.ok_or_else(|| {
                    cfg(
                        "topology.world_size",
                        "give the number of ranks, or a preset (`torchrec-default` is \
                         TorchRec's defaults: one host of 8)"
                            .into(),
                    )
                })?,
                device,
            ),
        };
        let host = t.local_world_size;
        t.compute_device = device;
        if let Some(w) = c.world_size {
            t.world_size = w;
        }
        t.local_world_size = c.local_world_size.unwrap_or(if c.preset.is_some() {
            host.min(t.world_size)
        } else {
            t.world_size
        });
        if device == ComputeDevice::Cpu {
            t.hbm_cap = 0;
        }
        if let Some(v) = c.hbm_cap {
            if device == ComputeDevice::Cpu && v.0 > 0 {
                return Err(cfg(
                    "topology.hbm_cap",
                    "CPU ranks have no HBM: give ddr_cap, or compute_device = \"cuda\"".into(),
                ));
            }
            t.hbm_cap = v.0;
        }
        if let Some(v) = c.ddr_cap {
            t.ddr_cap = v.0;
        }
        let set = |slot: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut t.hbm_mem_bw, c.hbm_mem_bw);
        set(&mut t.ddr_mem_bw, c.ddr_mem_bw);
        set(&mut t.hbm_to_ddr_mem_bw, c.hbm_to_ddr_mem_bw);
        set(&mut t.intra_host_bw, c.intra_host_bw);
        set(&mut t.inter_host_bw, c.inter_host_bw);
        set(&mut t.bwd_compute_multiplier, c.bwd_compute_multiplier);
        set(
            &mut t.weighted_feature_bwd_compute_multiplier,
            c.weighted_feature_bwd_compute_multiplier,
        );
        t.validate()?;
        Ok(t)
    }

    fn resolve_table(&self, i: usize, t: &TableConfig) -> Result<Table, PlannerError> {
        let f = |field: &str| format!("tables[{i}].{field}");
        if t.rows == 0 {
            return Err(cfg(
                &f("rows"),
                format!("table '{}' needs rows >= 1", t.name),
            ));
        }
        if t.dim == 0 || t.dim > MAX_DIM {
            return Err(cfg(
                &f("dim"),
                format!(
                    "table '{}' needs 1 <= dim <= {MAX_DIM}, got {}",
                    t.name, t.dim
                ),
            ));
        }
        if t.rows > MAX_ROWS {
            return Err(cfg(
                &f("rows"),
                format!(
                    "table '{}' has {} rows, more than the {MAX_ROWS} any plan can hold",
                    t.name, t.rows
                ),
            ));
        }
        let (input_lengths, num_poolings, batch_sizes) = if !t.features.is_empty() {
            if t.pooling_factors.is_some() {
                return Err(cfg(
                    &f("pooling_factors"),
                    "give either `features` or `pooling_factors`, not both".into(),
                ));
            }
            (
                t.features.iter().map(|x| x.pooling_factor).collect(),
                t.features
                    .iter()
                    .map(|x| x.num_poolings.unwrap_or(1.0))
                    .collect(),
                t.features
                    .iter()
                    .map(|x| x.batch_size.unwrap_or(self.batch_size))
                    .collect(),
            )
        } else {
            let pf = t.pooling_factors.clone().unwrap_or_else(|| vec![1.0]);
            let n = pf.len();
            (pf, vec![1.0; n], vec![self.batch_size; n])
        };
        if input_lengths.is_empty() {
            return Err(cfg(&f("pooling_factors"), "must not be empty".into()));
        }
        if let Some(k) = batch_sizes.iter().position(|&b| b == 0) {
            return Err(cfg(
                &f(&format!("features[{k}].batch_size")),
                "must be at least 1".into(),
            ));
        }
        // Each value named by the field it came from.
        let by_features = !t.features.is_empty();
        let named = (input_lengths.iter().enumerate())
            .map(|(k, v)| {
                let field = if by_features {
                    format!("features[{k}].pooling_factor")
                } else {
                    format!("pooling_factors[{k}]")
                };
                (field, v)
            })
            .chain(
                (num_poolings.iter().enumerate())
                    .filter(|_| by_features)
                    .map(|(k, v)| (format!("features[{k}].num_poolings"), v)),
            );
        for (field, v) in named {
            if !(v.is_finite() && *v >= 0.0 && *v <= MAX_POOLING) {
                return Err(cfg(
                    &f(&field),
                    format!("must be within [0, {MAX_POOLING:e}], got {v}"),
                ));
            }
        }
        let c = &t.constraints;
        if let Some(clf) = c.cache_load_factor {
            if !(clf > 0.0 && clf <= 1.0) {
                return Err(cfg(
                    &f("constraints.cache_load_factor"),
                    format!("must be within (0, 1], got {clf}"),
                ));
            }
        }
        if c.min_partition == Some(0) {
            return Err(cfg(&f("constraints.min_partition"), "must be >= 1".into()));
        }
        if let Some(s) = &c.cache_stats {
            if s.mrc_hist_counts.is_empty() || s.height == 0 {
                return Err(cfg(
                    &f("constraints.cache_stats"),
                    "mrc_hist_counts must be non-empty and height >= 1".into(),
                ));
            }
            if !(s.expected_lookups.is_finite()
                && (0.0..=MAX_EXPECTED_LOOKUPS).contains(&s.expected_lookups))
            {
                return Err(cfg(
                    &f("constraints.cache_stats.expected_lookups"),
                    format!(
                        "must be a count within [0, {MAX_EXPECTED_LOOKUPS:e}], got {}",
                        s.expected_lookups
                    ),
                ));
            }
            // Summed in f32, as TorchRec sums them (and `expected_miss_rate` does, in the same
            // order): a running total past f32's range is no curve, it would price NaN.
            let mut total = 0.0f32;
            for (k, &v) in s.mrc_hist_counts.iter().enumerate() {
                total += v as f32;
                if !(v.is_finite() && v >= 0.0 && total.is_finite()) {
                    return Err(cfg(
                        &f("constraints.cache_stats.mrc_hist_counts"),
                        format!(
                            "count #{k} must be a finite count >= 0 (the counts summing \
                             within {:e}), got {v}",
                            f32::MAX
                        ),
                    ));
                }
            }
            if total == 0.0 {
                return Err(cfg(
                    &f("constraints.cache_stats.mrc_hist_counts"),
                    "the counts sum to 0 (in f32): an empty histogram is no miss-ratio curve"
                        .into(),
                ));
            }
            if let Some(a) = s.cacheability.filter(|a| !a.is_finite()) {
                return Err(cfg(
                    &f("constraints.cache_stats.cacheability"),
                    format!("must be finite, got {a}"),
                ));
            }
        }
        if let Some(st) = &c.sharding_types {
            if st.is_empty() {
                return Err(cfg(
                    &f("constraints.sharding_types"),
                    "must not be empty".into(),
                ));
            }
        }
        if let Some(k) = &c.compute_kernels {
            if k.is_empty() {
                return Err(cfg(
                    &f("constraints.compute_kernels"),
                    "must not be empty".into(),
                ));
            }
        }
        Ok(Table {
            name: t.name.clone(),
            rows: t.rows,
            dim: t.dim,
            data_type: t.data_type,
            input_lengths,
            num_poolings,
            batch_sizes,
            weighted: t.weighted,
            pooled: t.pooled,
            optimizer_multiplier: self.optimizer.multiplier(t.dim),
            constraints: c.clone(),
        })
    }
}

fn cfg(field: &str, message: String) -> PlannerError {
    PlannerError::Config {
        field: field.to_string(),
        message,
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rfind('\n')
        .map_or(before.len(), |p| before.len() - p - 1)
        + 1;
    (line, col)
}
