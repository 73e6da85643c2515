//! The Criteo schema and the per-value transforms shared by the TSV and Parquet readers.

use crate::hashing::hash_words;
use crate::{BadRecordPolicy, DatasetError, FeatureSchema, Result};

/// Integer ("dense") features per Criteo record.
pub const CRITEO_NUM_DENSE: usize = 13;
/// Categorical features per Criteo record.
pub const CRITEO_NUM_CATEGORICAL: usize = 26;
/// Default rows per categorical table (TorchRec's DLRM example default, `--num_embeddings`).
pub const CRITEO_DEFAULT_TABLE_SIZE: u64 = 100_000;

/// The Criteo schema with TorchRec's names: dense `int_0..int_12`, keys `cat_0..cat_25`, one task.
pub fn criteo_schema() -> FeatureSchema {
    FeatureSchema {
        dense_names: (0..CRITEO_NUM_DENSE).map(|i| format!("int_{i}")).collect(),
        sparse_keys: (0..CRITEO_NUM_CATEGORICAL)
            .map(|i| format!("cat_{i}"))
            .collect(),
        tasks: vec!["click".to_string()],
    }
}

/// How a raw integer feature becomes a model input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseTransform {
    /// The raw value as `f32`.
    Identity,
    /// `ln(max(x, 0) + 1)`. Criteo's integer features are counts, but a few columns contain
    /// small negatives (e.g. -1, -2 in `int_1`); they are clamped to 0 so the log is finite.
    #[default]
    Log1p,
    /// TorchRec's preprocessing: `ln(x + 3)`, which keeps the known negatives (≥ -2) distinct.
    /// Values below -2 would make the log undefined, so they are clamped to -2 (result 0).
    TorchRecLogPlus3,
}

impl DenseTransform {
    /// Applies the transform to one raw value (missing values arrive here as 0).
    pub fn apply(self, raw: f64) -> f32 {
        match self {
            DenseTransform::Identity => raw as f32,
            DenseTransform::Log1p => raw.max(0.0).ln_1p() as f32,
            DenseTransform::TorchRecLogPlus3 => (raw.max(-2.0) + 3.0).ln() as f32,
        }
    }
}

/// How a raw categorical id (a 32-bit hex value in Criteo) is reduced to a table row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CategoricalMapping {
    /// Keep the raw id (must fit in `i64`). Only sensible with a downstream hash.
    Raw,
    /// `id % table_sizes[f]`, as TorchRec does with its `hashes` argument.
    Modulo(Vec<u64>),
    /// `hash(f, id) % table_sizes[f]`: breaks up any structure in the raw ids (e.g. sequential
    /// ids that modulo would spread too evenly or collide in patterns).
    Hash(Vec<u64>),
}

/// Options of the Criteo readers (TSV and Parquet).
#[derive(Debug, Clone, PartialEq)]
pub struct CriteoConfig {
    /// Transform applied to the 13 integer features.
    pub dense_transform: DenseTransform,
    /// Reduction of categorical ids to table rows.
    pub categorical: CategoricalMapping,
    /// Row used for a missing (empty/null) categorical value, *after* mapping (so it must be a
    /// valid row). Default 0, as TorchRec (which parses a missing id as hex "0").
    pub missing_categorical_id: u64,
    /// Whether records start with a label (false for Criteo Kaggle's `test.txt`, 39 fields);
    /// without one every label is 0.
    pub has_label: bool,
    /// What to do with malformed records.
    pub bad_records: BadRecordPolicy,
}

impl Default for CriteoConfig {
    fn default() -> Self {
        CriteoConfig {
            dense_transform: DenseTransform::Log1p,
            categorical: CategoricalMapping::Modulo(vec![
                CRITEO_DEFAULT_TABLE_SIZE;
                CRITEO_NUM_CATEGORICAL
            ]),
            missing_categorical_id: 0,
            has_label: true,
            bad_records: BadRecordPolicy::Fail,
        }
    }
}

impl CriteoConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        let sizes = match &self.categorical {
            CategoricalMapping::Raw => {
                if self.missing_categorical_id > i64::MAX as u64 {
                    return Err(DatasetError::InvalidConfig(
                        "missing_categorical_id does not fit in i64".to_string(),
                    ));
                }
                return Ok(());
            }
            CategoricalMapping::Modulo(sizes) | CategoricalMapping::Hash(sizes) => sizes,
        };
        if sizes.len() != CRITEO_NUM_CATEGORICAL {
            return Err(DatasetError::InvalidConfig(format!(
                "{} categorical table sizes given, Criteo has {CRITEO_NUM_CATEGORICAL}",
                sizes.len()
            )));
        }
        for (feature, &size) in sizes.iter().enumerate() {
            if size == 0 || size > i64::MAX as u64 {
                return Err(DatasetError::InvalidConfig(format!(
                    "table size of cat_{feature} must be in 1..=i64::MAX, got {size}"
                )));
            }
            if self.missing_categorical_id >= size {
                return Err(DatasetError::InvalidConfig(format!(
                    "missing_categorical_id {} is not a row of cat_{feature} (size {size})",
                    self.missing_categorical_id
                )));
            }
        }
        Ok(())
    }

    /// Maps a raw id of categorical feature `feature`. `Err` holds a message when a raw id does
    /// not fit (only possible with [`CategoricalMapping::Raw`]).
    pub(crate) fn map_categorical(
        &self,
        feature: usize,
        raw: u64,
    ) -> std::result::Result<i64, String> {
        match &self.categorical {
            CategoricalMapping::Raw => i64::try_from(raw)
                .map_err(|_| format!("id {raw:#x} does not fit in i64 (use Modulo or Hash)")),
            CategoricalMapping::Modulo(sizes) => Ok((raw % sizes[feature]) as i64),
            CategoricalMapping::Hash(sizes) => {
                Ok((hash_words(&[feature as u64, raw]) % sizes[feature]) as i64)
            }
        }
    }

    pub(crate) fn missing_id(&self) -> i64 {
        // validate() guarantees this fits.
        self.missing_categorical_id as i64
    }
}

/// Parses a hex categorical id: 1 to 16 hex digits, nothing else (no sign, no `0x`).
pub(crate) fn parse_hex_id(raw: &[u8]) -> std::result::Result<u64, String> {
    if raw.is_empty() || raw.len() > 16 || !raw.iter().all(u8::is_ascii_hexdigit) {
        return Err(format!(
            "expected a hexadecimal id of 1 to 16 digits, found `{}`",
            crate::error::show_field(raw)
        ));
    }
    let mut value = 0u64;
    for &b in raw {
        // is_ascii_hexdigit above makes to_digit infallible here.
        value = (value << 4) | u64::from((b as char).to_digit(16).unwrap_or(0));
    }
    Ok(value)
}
