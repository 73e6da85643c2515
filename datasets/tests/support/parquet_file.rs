//! A small Criteo Parquet file for the tests.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

/// Row r: label r % 2, int_j = r + j (int_3 null on every third row), cat_f = hex of r·31 + f
/// as a string (cat_0 stored as int32, cat_5 null on even rows), and a second label column
/// `like` (float64: 1 on rows divisible by 3, else 0; null on row 41).
pub fn write_file(path: &Path, rows: usize, rows_per_group: usize) {
    let mut fields = vec![
        Field::new("label", DataType::Int32, false),
        Field::new("like", DataType::Float64, true),
    ];
    let like: Vec<Option<f64>> = (0..rows)
        .map(|r| (r != 41).then_some(if r % 3 == 0 { 1.0 } else { 0.0 }))
        .collect();
    let mut columns: Vec<ArrayRef> = vec![
        Arc::new(Int32Array::from(
            (0..rows as i32).map(|r| r % 2).collect::<Vec<_>>(),
        )),
        Arc::new(Float64Array::from(like)),
    ];
    for j in 0..13 {
        fields.push(Field::new(format!("int_{j}"), DataType::Int64, true));
        let values: Vec<Option<i64>> = (0..rows as i64)
            .map(|r| {
                if j == 3 && r % 3 == 0 {
                    None
                } else {
                    Some(r + j)
                }
            })
            .collect();
        columns.push(Arc::new(Int64Array::from(values)));
    }
    for f in 0..26 {
        if f == 0 {
            fields.push(Field::new("cat_0", DataType::Int32, false));
            columns.push(Arc::new(Int32Array::from(
                (0..rows as i32).map(|r| r * 31).collect::<Vec<_>>(),
            )));
            continue;
        }
        fields.push(Field::new(format!("cat_{f}"), DataType::Utf8, true));
        let values: Vec<Option<String>> = (0..rows)
            .map(|r| {
                if f == 5 && r % 2 == 0 {
                    None
                } else {
                    Some(format!("{:x}", r * 31 + f))
                }
            })
            .collect();
        columns.push(Arc::new(StringArray::from(values)));
    }
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(rows_per_group))
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = ArrowWriter::try_new(file, schema, Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}
