//! The crate's error type: every failure names where it happened.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, DatasetError>;

/// What went wrong while reading or batching data. Each variant carries enough location
/// (file, line or row group/row, field) to find the offending record by hand.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file could not be opened or read.
    #[error("{path}: I/O error: {source}")]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A line of a text file (TSV, `.dat`, `.inter`) does not match the expected format.
    #[error("{path}:{line}: field `{field}`: {message}")]
    Malformed {
        /// The file being read.
        path: PathBuf,
        /// 1-based line number within `path` (0: the file as a whole, e.g. an empty one).
        line: u64,
        /// Name of the offending field (e.g. `int_3`, `cat_7`, `label`, `user_id`), or
        /// `line` when the line as a whole is wrong (e.g. its field count).
        field: String,
        /// What was expected and what was found.
        message: String,
    },

    /// A Parquet file is corrupt, has the wrong schema, or holds an invalid value.
    #[error("{path}: {}: field `{field}`: {message}", parquet_location(*.row_group, *.row))]
    Parquet {
        /// The file being read.
        path: PathBuf,
        /// The row group (0-based), when the problem is inside one; `None` for the footer/schema.
        row_group: Option<usize>,
        /// The row within the row group (0-based), when a single value is at fault.
        row: Option<u64>,
        /// The column at fault (`footer` for footer/metadata problems, `unknown column` when
        /// the decoder could not tell).
        field: String,
        /// What went wrong.
        message: String,
    },

    /// A configuration value is out of range or inconsistent.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// An example does not match the schema of the batch it is being put into.
    #[error("example {index}: {message}")]
    InconsistentExample {
        /// The example's index in its source.
        index: u64,
        /// What did not match.
        message: String,
    },

    /// The background reading thread panicked (a bug, reported as a value rather than hanging).
    #[error("background reader thread panicked: {0}")]
    WorkerPanicked(String),
}

fn parquet_location(row_group: Option<usize>, row: Option<u64>) -> String {
    match (row_group, row) {
        (Some(group), Some(row)) => format!("row group {group}, row {row}"),
        (Some(group), None) => format!("row group {group}"),
        (None, _) => "file metadata".to_string(),
    }
}

/// Shortens a raw field for an error message: long garbage would drown the location.
pub(crate) fn show_field(raw: &[u8]) -> String {
    const MAX: usize = 40;
    let text = String::from_utf8_lossy(raw);
    if text.chars().count() > MAX {
        let head: String = text.chars().take(MAX).collect();
        format!("{head}…")
    } else {
        text.into_owned()
    }
}

impl From<DatasetError> for embers::Error {
    /// Data errors surface in training loops as embers errors naming the dataset problem
    /// (file, line or row group, field).
    fn from(e: DatasetError) -> Self {
        embers::Error::invalid("dataset", e.to_string())
    }
}
