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
        .unwrap()
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
    let results: Vec<_> = reader.with_rows_per_batch(7).unwrap().collect();
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
        text.contains("types.parquet") && text.contains("`label`") && text.contains("Utf8"),
        "{text}"
    );
    // Checked on the schema when the file is opened: a mistyped column in a file of no rows
    // is named (a decoded batch was checked, and a file of no rows has none).
    let empty = dir.path().join("empty.parquet");
    let schema = Arc::new(Schema::new(
        std::iter::once(Field::new("label", DataType::Int64, false))
            .chain((0..13).map(|j| Field::new(format!("int_{j}"), DataType::Int64, false)))
            .chain((0..26).map(|f| {
                let t = if f == 3 {
                    DataType::Float64
                } else {
                    DataType::Int64
                };
                Field::new(format!("cat_{f}"), t, false)
            }))
            .collect::<Vec<_>>(),
    ));
    let writer =
        ArrowWriter::try_new(std::fs::File::create(&empty).unwrap(), schema, None).unwrap();
    writer.close().unwrap();
    let text = CriteoParquetReader::open([&empty], CriteoConfig::default())
        .unwrap()
        .next()
        .expect("an error, not an empty read")
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("`cat_3`") && text.contains("Float64"),
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
        .unwrap()
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
    let results: Vec<_> = reader.with_rows_per_batch(4).unwrap().collect();
    assert!(results.iter().all(|r| r.is_ok()));
    assert!(skipped.count() > 0);
}

/// Rewrites `path`'s footer with row group `g` claiming `group_rows[g]` rows (the pages stay
/// as written; the writer sets the file's count to their sum).
fn rewrite_footer(path: &Path, group_rows: &[i64]) {
    use parquet::file::metadata::{
        ParquetMetaDataBuilder, ParquetMetaDataReader, ParquetMetaDataWriter,
    };
    let bytes = std::fs::read(path).unwrap();
    let footer_len =
        u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let data_end = bytes.len() - 8 - footer_len as usize;
    let file = std::fs::File::open(path).unwrap();
    let metadata = ParquetMetaDataReader::new()
        .parse_and_finish(&file)
        .unwrap();
    let groups = (metadata.row_groups().iter().zip(group_rows))
        .map(|(g, &rows)| g.clone().into_builder().set_num_rows(rows).build().unwrap())
        .collect();
    let rewritten = ParquetMetaDataBuilder::new_from_metadata(metadata)
        .set_row_groups(groups)
        .build();
    let mut out = bytes[..data_end].to_vec();
    ParquetMetaDataWriter::new(&mut out, &rewritten)
        .finish()
        .unwrap();
    std::fs::write(path, out).unwrap();
}

/// Sets the file-level row count of `path` (written with 30 rows) to 0, in the footer's
/// Thrift bytes: field 3 (`0x16`, an i64) holding zigzag(30) = 60, before field 4's list
/// header (`0x19`).
fn zero_file_rows(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let footer_len =
        u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let start = bytes.len() - 8 - footer_len as usize;
    let at = (start..bytes.len() - 2)
        .filter(|&i| bytes[i..i + 3] == [0x16, 60, 0x19])
        .collect::<Vec<_>>();
    assert_eq!(at.len(), 1, "the file's row count in the footer");
    bytes[at[0] + 1] = 0;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn footers_whose_row_counts_disagree_with_the_pages_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("counts.parquet");
    let paths = [path.clone()];
    let open =
        || CriteoParquetReader::open([&path], raw_config()).and_then(|r| r.with_rows_per_batch(7));
    let skipping = CriteoConfig {
        bad_records: BadRecordPolicy::SkipAndCount,
        ..raw_config()
    };
    // The footer rewritten as it was reads back: 3 row groups of 10.
    write_file(&path, 30, 10);
    rewrite_footer(&path, &[10, 10, 10]);
    assert_eq!(open().unwrap().count(), 30);
    assert_eq!(embers_datasets::parquet_rows(&paths).unwrap(), 30);
    // A file count of 0 over row groups that hold rows (the decoder then ended every group at
    // once: 0 examples, no error), and a negative row group count.
    let second = path.clone();
    for (setup, needle) in [
        (
            Box::new(|| {
                write_file(&second, 30, 10);
                zero_file_rows(&second)
            }) as Box<dyn Fn()>,
            "the file has 0 rows but its row groups hold 30",
        ),
        (
            Box::new(|| {
                write_file(&second, 30, 10);
                rewrite_footer(&second, &[10, -1, 21])
            }),
            "row group 1 has -1 rows",
        ),
    ] {
        setup();
        let first = open()
            .and_then(|mut r| r.next().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            first.contains(needle) && first.contains("footer"),
            "{first}"
        );
        let rows = embers_datasets::parquet_rows(&paths)
            .unwrap_err()
            .to_string();
        assert!(rows.contains(needle), "{rows}");
    }
    // A row group claiming more rows than its pages hold: the missing ones are bad records
    // (counted under SkipAndCount, keeping the indices after them).
    write_file(&path, 30, 10);
    rewrite_footer(&path, &[10, 12, 10]);
    let err = open().unwrap().find_map(Result::err).unwrap().to_string();
    assert!(
        err.contains("row group 1") && err.contains("footer says 12"),
        "{err}"
    );
    let reader = CriteoParquetReader::open([&path], skipping.clone()).unwrap();
    let skipped = reader.skipped();
    let examples: Vec<Example> = reader.collect::<Result<_, _>>().unwrap();
    assert_eq!(examples.len(), 30);
    assert_eq!(skipped.count(), 2);
    assert_eq!(
        examples[20].index, 22,
        "row group 2 starts after the 12 claimed"
    );
    // Fewer claimed than held: an error whatever the policy (the indices would shift).
    write_file(&path, 30, 10);
    rewrite_footer(&path, &[10, 8, 10]);
    let err = CriteoParquetReader::open([&path], skipping.clone())
        .unwrap()
        .find_map(Result::err)
        .unwrap()
        .to_string();
    assert!(err.contains("more rows than the footer's 8"), "{err}");
    // Files each claiming i64::MAX rows: their sum is past u64, for the row count and for
    // the indices of a reader skipping the missing rows.
    let huge: Vec<PathBuf> = (0..3)
        .map(|i| {
            let p = dir.path().join(format!("huge{i}.parquet"));
            write_file(&p, 10, 10);
            rewrite_footer(&p, &[i64::MAX]);
            p
        })
        .collect();
    let err = embers_datasets::parquet_rows(&huge)
        .unwrap_err()
        .to_string();
    assert!(err.contains("huge2") && err.contains("overflow"), "{err}");
    let reader = CriteoParquetReader::open(&huge, skipping).unwrap();
    let err = reader.filter_map(Result::err).next().unwrap().to_string();
    assert!(
        err.contains("huge2") && err.contains("overflow u64"),
        "{err}"
    );
}

#[test]
fn a_dense_value_past_f32_and_zero_rows_per_batch_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.parquet");
    let mut fields = vec![Field::new("label", DataType::Int64, false)];
    let mut columns: Vec<ArrayRef> = vec![Arc::new(Int64Array::from(vec![1]))];
    for j in 0..13 {
        fields.push(Field::new(format!("int_{j}"), DataType::Float64, false));
        let v = if j == 4 { 1e300 } else { 1.0 };
        columns.push(Arc::new(arrow_array::Float64Array::from(vec![v])));
    }
    for f in 0..26 {
        fields.push(Field::new(format!("cat_{f}"), DataType::Int64, false));
        columns.push(Arc::new(Int64Array::from(vec![1])));
    }
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let mut writer =
        ArrowWriter::try_new(std::fs::File::create(&path).unwrap(), schema, None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
    let config = CriteoConfig {
        dense_transform: embers_datasets::DenseTransform::Identity,
        ..raw_config()
    };
    let err = CriteoParquetReader::open([&path], config)
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`int_4`") && err.contains("1e300") && err.contains("Identity"),
        "{err}"
    );
    // Under the log transform the same value is finite, and read.
    let e = CriteoParquetReader::open([&path], raw_config())
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    assert!(e.dense[4].is_finite());
    let err = CriteoParquetReader::open([&path], raw_config())
        .unwrap()
        .with_rows_per_batch(0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("rows_per_batch"), "{err}");
}

/// `has_label: false` (the TSV reader's unlabeled files) is refused by name for Parquet, whose
/// labels are its label columns (it was ignored: an unlabeled file failed on `label`).
#[test]
fn has_label_false_is_refused_for_parquet() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("criteo.parquet");
    write_file(&path, 10, 10);
    let config = CriteoConfig {
        has_label: false,
        ..raw_config()
    };
    match CriteoParquetReader::open([&path], config) {
        Err(DatasetError::InvalidConfig(m)) => assert!(m.contains("has_label"), "{m}"),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("accepted"),
    }
}
