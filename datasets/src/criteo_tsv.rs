//! Criteo Kaggle / 1TB click logs in their original TSV form.

use std::path::PathBuf;

use crate::criteo::{criteo_schema, parse_hex_id, CRITEO_NUM_CATEGORICAL, CRITEO_NUM_DENSE};
use crate::error::show_field;
use crate::text_lines::{split_fields, LineRecords, TextLines};
use crate::{
    CriteoConfig, DatasetError, Example, ExampleSource, FeatureSchema, Result, SkippedRecords,
};

const MAX_FIELDS: usize = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_CATEGORICAL;

/// Streams examples from Criteo TSV files, one line at a time (memory does not grow with the
/// file size).
///
/// Each line is `label \t int_0 … int_12 \t cat_0 … cat_25` (40 fields; 39 without label).
/// Empty integer fields read as 0 before the [`crate::DenseTransform`]; empty categorical
/// fields become [`CriteoConfig::missing_categorical_id`]. Files are read in the given order;
/// example indices run on across files and count every line, including skipped ones.
pub struct CriteoTsvReader {
    records: LineRecords,
    config: CriteoConfig,
    schema: FeatureSchema,
}

impl CriteoTsvReader {
    /// Opens `paths` (read lazily, in order) with `config`.
    pub fn open<P: Into<PathBuf>>(
        paths: impl IntoIterator<Item = P>,
        config: CriteoConfig,
    ) -> Result<Self> {
        config.validate()?;
        let paths: Vec<PathBuf> = paths.into_iter().map(Into::into).collect();
        if paths.is_empty() {
            return Err(DatasetError::InvalidConfig(
                "no Criteo TSV files given".to_string(),
            ));
        }
        Ok(CriteoTsvReader {
            records: LineRecords::new(TextLines::new(paths), config.bad_records, false),
            config,
            schema: criteo_schema(),
        })
    }

    /// Handle on the count of skipped records (stays live after the reader is moved).
    pub fn skipped(&self) -> SkippedRecords {
        self.records.skipped()
    }
}

/// The example on the current line of `lines` (`config`'s layout and transforms).
fn parse_line(config: &CriteoConfig, lines: &TextLines, index: u64) -> Result<Example> {
    let line = lines.line();
    let malformed = |field: &str, message: String| DatasetError::Malformed {
        path: lines.path().to_path_buf(),
        line: lines.line_number(),
        field: field.to_string(),
        message,
    };
    let expected = MAX_FIELDS - usize::from(!config.has_label);
    let mut fields: [&[u8]; MAX_FIELDS] = [&[]; MAX_FIELDS];
    let count = split_fields(line, b"\t", &mut fields);
    if count != expected {
        return Err(malformed(
            "line",
            format!("expected {expected} tab-separated fields, found {count}"),
        ));
    }
    let (label, rest) = if config.has_label {
        let raw = fields[0];
        let label = match raw {
            b"0" => 0.0,
            b"1" => 1.0,
            _ => {
                return Err(malformed(
                    "label",
                    format!("expected 0 or 1, found `{}`", show_field(raw)),
                ))
            }
        };
        (label, &fields[1..expected])
    } else {
        (0.0, &fields[..expected])
    };

    let mut dense = Vec::with_capacity(CRITEO_NUM_DENSE);
    for (j, raw) in rest[..CRITEO_NUM_DENSE].iter().enumerate() {
        let value = if raw.is_empty() {
            0
        } else {
            parse_i64(raw).ok_or_else(|| {
                malformed(
                    &format!("int_{j}"),
                    format!(
                        "expected a decimal integer within ±2^63, found `{}`",
                        show_field(raw)
                    ),
                )
            })?
        };
        dense.push(config.dense_transform.apply(value as f64));
    }

    let mut ids = Vec::with_capacity(CRITEO_NUM_CATEGORICAL);
    for (f, raw) in rest[CRITEO_NUM_DENSE..].iter().enumerate() {
        let id = if raw.is_empty() {
            config.missing_id()
        } else {
            parse_hex_id(raw)
                .and_then(|value| config.map_categorical(f, value))
                .map_err(|message| malformed(&format!("cat_{f}"), message))?
        };
        ids.push(id);
    }

    Ok(Example {
        index,
        dense,
        ids,
        lengths: vec![1; CRITEO_NUM_CATEGORICAL],
        labels: vec![label],
        true_probability: None,
    })
}

/// Strict decimal integer: optional '-', digits only (no spaces, no '+', no decimals).
pub(crate) fn parse_i64(raw: &[u8]) -> Option<i64> {
    let (negative, digits) = match raw.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, raw),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut value: i64 = 0;
    for &d in digits {
        value = value.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
    }
    Some(if negative { -value } else { value })
}

impl Iterator for CriteoTsvReader {
    type Item = Result<Example>;

    fn next(&mut self) -> Option<Self::Item> {
        let config = &self.config;
        (self.records).next_example(|lines, index| parse_line(config, lines, index))
    }
}

impl ExampleSource for CriteoTsvReader {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    fn indices_ascend(&self) -> bool {
        true
    }
}
