//! Criteo from Parquet: written with the parquet crate, read back, and corrupted.

#[path = "support/parquet_file.rs"]
mod parquet_file;

use parquet_file::write_file;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use embers_datasets::{
    BadRecordPolicy, CategoricalMapping, CriteoConfig, CriteoParquetColumns, CriteoParquetReader,
    DatasetError, Example, ExampleSource,
};
use parquet::arrow::ArrowWriter;

fn raw_config() -> CriteoConfig {
    CriteoConfig {
        categorical: CategoricalMapping::Raw,
        missing_categorical_id: 99,
        ..CriteoConfig::default()
    }
}

fn read(path: &PathBuf, config: CriteoConfig) -> Vec<Example> {
    CriteoParquetReader::open([path], config)
        .unwrap()
        .with_rows_per_batch(7)
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

#[test]
fn round_trip_across_row_groups() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("criteo.parquet");
    write_file(&path, 100, 32);
    let examples = read(&path, raw_config());
    assert_eq!(examples.len(), 100);
    for (r, e) in examples.iter().enumerate() {
        assert_eq!(e.index, r as u64);
        assert_eq!(e.labels, vec![(r % 2) as f32]);
        assert!((e.dense[0] - ((r as f32) + 1.0).ln()).abs() < 1e-5);
        let expected_int3 = if r % 3 == 0 {
            0.0
        } else {
            ((r + 3) as f32 + 1.0).ln()
        };
        assert!((e.dense[3] - expected_int3).abs() < 1e-5, "row {r}");
        assert_eq!(e.ids[0], (r * 31) as i64);
        assert_eq!(e.ids[1], (r * 31 + 1) as i64);
        let expected_cat5 = if r % 2 == 0 { 99 } else { (r * 31 + 5) as i64 };
        assert_eq!(e.ids[5], expected_cat5, "row {r}");
        assert_eq!(e.lengths, vec![1; 26]);
    }
    let modulo = CriteoConfig {
        categorical: CategoricalMapping::Modulo(vec![10; 26]),
        ..CriteoConfig::default()
    };
    let reduced = read(&path, modulo);
    assert_eq!(reduced[7].ids[1], ((7 * 31 + 1) % 10) as i64);
}

#[test]
fn column_mapping_and_missing_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.parquet");
    write_file(&path, 10, 10);
    // Map dense features in reverse order.
    let mut columns = CriteoParquetColumns::default();
    columns.dense.reverse();
    let examples: Vec<Example> =
        CriteoParquetReader::open_with_columns([&path], raw_config(), columns)
            .unwrap()
            .map(Result::unwrap)
            .collect();
    assert!((examples[4].dense[0] - ((4 + 12) as f32 + 1.0).ln()).abs() < 1e-5);

    let columns = CriteoParquetColumns {
        labels: vec!["click".to_string()],
        ..CriteoParquetColumns::default()
    };
    let error = CriteoParquetReader::open_with_columns([&path], raw_config(), columns)
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("c.parquet") && text.contains("`click`"),
        "{text}"
    );
}

#[test]
fn several_label_columns_are_tasks_named_after_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tasks.parquet");
    write_file(&path, 60, 16);
    let columns = CriteoParquetColumns {
        labels: vec!["label".to_string(), "like".to_string()],
        ..CriteoParquetColumns::default()
    };
    let reader = CriteoParquetReader::open_with_columns([&path], raw_config(), columns).unwrap();
    assert_eq!(reader.schema().tasks, ["label", "like"]);
    let results: Vec<_> = reader.with_rows_per_batch(7).collect();
    for (r, result) in results.iter().enumerate().take(41) {
        let e = result.as_ref().unwrap();
        let like = if r % 3 == 0 { 1.0 } else { 0.0 };
        assert_eq!(e.labels, vec![(r % 2) as f32, like], "row {r}");
    }
    // Row 41's `like` is null: an error naming the column and the row.
    let text = results[41].as_ref().unwrap_err().to_string();
    assert!(text.contains("`like`") && text.contains("null"), "{text}");
    // One label column is the task `click`, whatever its name.
    let one = CriteoParquetReader::open([&path], raw_config()).unwrap();
    assert_eq!(one.schema().tasks, ["click"]);
    // No label column, or a column named twice, is refused at open.
    for labels in [
        vec![],
        vec!["int_2".to_string()],
        vec!["like".into(), "like".into()],
    ] {
        let columns = CriteoParquetColumns {
            labels: labels.clone(),
            ..CriteoParquetColumns::default()
        };
        let error = CriteoParquetReader::open_with_columns([&path], raw_config(), columns)
            .err()
            .unwrap_or_else(|| panic!("labels {labels:?} were accepted"));
        let text = error.to_string();
        assert!(
            text.contains("label column") || text.contains("named twice"),
            "{text}"
        );
    }
}

#[test]
fn truncated_file_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trunc.parquet");
    write_file(&path, 50, 16);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let error = CriteoParquetReader::open([&path], CriteoConfig::default())
        .unwrap()
        .find_map(Result::err)
        .expect("error");
    match &error {
        DatasetError::Parquet {
            path: p,
            row_group,
            field,
            ..
        } => {
            assert_eq!(p, &path);
            assert_eq!(*row_group, None);
            assert_eq!(field, "footer");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(error.to_string().contains("trunc.parquet"));
}

/// Overwrites the first data page header of the column chunk of `column` in row group 1.
fn corrupt_column_chunk(path: &Path, column: &str) {
    let file = std::fs::File::open(path).unwrap();
    let reader = parquet::file::reader::SerializedFileReader::new(file).unwrap();
    use parquet::file::reader::FileReader;
    let group = reader.metadata().row_group(1);
    let index = (0..group.num_columns())
        .find(|&i| group.column(i).column_path().string() == column)
        .unwrap();
    let (start, _) = group.column(index).byte_range();
    let mut bytes = std::fs::read(path).unwrap();
    for b in &mut bytes[start as usize..start as usize + 12] {
        *b = 0xFF;
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn corrupt_page_names_row_group_and_column_or_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corrupt.parquet");
    write_file(&path, 96, 32);
    corrupt_column_chunk(&path, "int_4");

    let mut reader = CriteoParquetReader::open([&path], CriteoConfig::default()).unwrap();
    let good: Vec<Example> = reader
        .by_ref()
        .take_while(Result::is_ok)
        .map(Result::unwrap)
        .collect();
    assert_eq!(good.len(), 32, "row group 0 is intact");
    let error = CriteoParquetReader::open([&path], CriteoConfig::default())
        .unwrap()
        .find_map(Result::err)
        .unwrap();
    match &error {
        DatasetError::Parquet {
            row_group, field, ..
        } => {
            assert_eq!(*row_group, Some(1));
            assert_eq!(field, "int_4");
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = error.to_string();
    assert!(
        text.contains("corrupt.parquet: row group 1: field `int_4`"),
        "{text}"
    );

    let config = CriteoConfig {
        bad_records: BadRecordPolicy::SkipAndCount,
        ..CriteoConfig::default()
    };
    let reader = CriteoParquetReader::open([&path], config).unwrap();
    let skipped = reader.skipped();
    let examples: Vec<Example> = reader.map(Result::unwrap).collect();
    assert_eq!(examples.len(), 64);
    assert_eq!(skipped.count(), 32);
    // Row group 2's rows keep their indices (64..96): the skipped rows keep theirs, so
    // splits by index do not shift.
    assert_eq!(examples[31].index, 31);
    assert_eq!(examples[32].index, 64, "row group 2 keeps its indices");
}

#[test]
fn wrong_column_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("types.parquet");
    let mut fields = vec![Field::new("label", DataType::Utf8, false)];
    let mut columns: Vec<ArrayRef> = vec![Arc::new(StringArray::from(vec!["yes"]))];
    for j in 0..13 {
        fields.push(Field::new(format!("int_{j}"), DataType::Int64, false));
        columns.push(Arc::new(Int64Array::from(vec![1])));
    }
    for f in 0..26 {
        fields.push(Field::new(format!("cat_{f}"), DataType::Int64, false));
        columns.push(Arc::new(Int64Array::from(vec![-1])));
    }
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let mut writer =
        ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), schema, None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
    let text = CriteoParquetReader::open([&path], CriteoConfig::default())
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("row group 0") && text.contains("`label`"),
        "{text}"
    );
}

/// A file found by fuzzing (`tests/fuzz.rs`): skipping its bad row groups, the reader reaches
/// one on which the parquet crate panics ("Decoder for dict should have been set"); the reader
/// turns that into a skipped row group instead of a crash.
#[test]
fn a_decoder_panic_on_a_corrupt_file_is_an_error() {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/dictionary_page_missing.parquet"
    ));
    let errors: Vec<String> = CriteoParquetReader::open([&path], CriteoConfig::default())
        .unwrap()
        .with_rows_per_batch(4)
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    // Failing on bad records: the first (an ordinary decode error) names the file.
    assert!(
        !errors.is_empty() && errors[0].contains("dictionary_page_missing.parquet"),
        "{errors:?}"
    );
    let config = CriteoConfig {
        bad_records: BadRecordPolicy::SkipAndCount,
        ..CriteoConfig::default()
    };
    let reader = CriteoParquetReader::open([&path], config).unwrap();
    let skipped = reader.skipped();
    let results: Vec<_> = reader.with_rows_per_batch(4).collect();
    assert!(results.iter().all(|r| r.is_ok()));
    assert!(skipped.count() > 0);
}
