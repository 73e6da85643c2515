//! Errors are values: every failure names the table or field and the numbers involved.

use crate::types::Storage;
use std::fmt;

/// A table that could not be placed: what it needs, what was left, and why the alternatives
/// were not available.
#[derive(Debug, Clone, PartialEq)]
pub struct Shortfall {
    /// Table name.
    pub table: String,
    /// The smallest per-rank memory any of its allowed options needs on a single rank.
    pub needed: Storage,
    /// The most memory left on any single rank when it was placed.
    pub left: Storage,
    /// The constraint that limited the alternatives (or "none").
    pub constraint: String,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "table '{}' needs {} HBM + {} DDR on one rank, at most {} HBM + {} DDR left (constraint: {})",
            self.table,
            human_bytes(self.needed.hbm),
            human_bytes(self.needed.ddr),
            human_bytes(self.left.hbm),
            human_bytes(self.left.ddr),
            self.constraint
        )
    }
}

fn list(s: &[Shortfall]) -> String {
    s.iter()
        .map(|x| format!("\n  - {x}"))
        .collect::<Vec<_>>()
        .join("")
}

/// Everything that can go wrong while reading a config or planning.
#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    /// The config file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config text is malformed (syntax or types); `location` points at line/column or
    /// the field path.
    #[error("malformed config at {location}: {message}")]
    Parse {
        /// `line L, column C` or a field path such as `tables[3].rows`.
        location: String,
        /// What was wrong.
        message: String,
    },
    /// A field has an invalid value.
    #[error("invalid config field `{field}`: {message}")]
    Config {
        /// Field path, e.g. `tables[2].dim`.
        field: String,
        /// What was wrong and what was expected.
        message: String,
    },
    /// The constraints leave a table with no sharding option at all.
    #[error("no sharding option left for table '{table}': {reason}")]
    NoOptions {
        /// Table name.
        table: String,
        /// Which constraint removed which options.
        reason: String,
    },
    /// The model does not fit in the cluster's memory under any allowed choice
    /// (TorchRec's INSUFFICIENT_STORAGE).
    #[error(
        "insufficient storage: the smallest allowed plan needs {} HBM + {} DDR in total, the cluster has {} HBM + {} DDR after reservation{}",
        human_bytes(.needed.hbm), human_bytes(.needed.ddr), human_bytes(.available.hbm), human_bytes(.available.ddr), list(.tables)
    )]
    InsufficientStorage {
        /// Total memory of the smallest choice over all tables.
        needed: Storage,
        /// Total memory of all ranks after reservation.
        available: Storage,
        /// Tables that could not be placed.
        tables: Vec<Shortfall>,
    },
    /// The model would fit in total, but the allowed options cannot be packed onto the ranks
    /// (TorchRec's STRICT_CONSTRAINTS).
    #[error("no plan satisfies the constraints:{}", list(.tables))]
    StrictConstraints {
        /// Tables that could not be placed.
        tables: Vec<Shortfall>,
    },
}

impl PlannerError {
    /// TorchRec's `PlannerErrorType` name for plan failures, `None` for config errors.
    pub fn torchrec_error_type(&self) -> Option<&'static str> {
        match self {
            PlannerError::InsufficientStorage { .. } => Some("INSUFFICIENT_STORAGE"),
            PlannerError::StrictConstraints { .. } | PlannerError::NoOptions { .. } => {
                Some("STRICT_CONSTRAINTS")
            }
            _ => None,
        }
    }
}

/// Bytes in binary units with two decimals.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
