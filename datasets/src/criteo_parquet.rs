//! The Criteo schema read from Parquet, one row group at a time.

use std::fs::File;
use std::path::PathBuf;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, BooleanArray, GenericStringArray, PrimitiveArray, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReader,
    ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;

use crate::criteo::{criteo_schema, parse_hex_id, CRITEO_NUM_CATEGORICAL, CRITEO_NUM_DENSE};
use crate::{
    CriteoConfig, DatasetError, Example, ExampleSource, FeatureSchema, Result, SkippedRecords,
};

/// Rows decoded at a time inside a row group: bounds memory to about this many rows of the
/// projected columns plus one compressed page per column, whatever the file size.
const DEFAULT_ROWS_PER_BATCH: usize = 8192;

/// Names of the Parquet columns holding the Criteo fields.
///
/// Accepted column types: labels — any integer, float or boolean type (values in [0, 1]);
/// dense — any integer or float type (null → 0, then the dense transform); categorical — any
/// integer type (signed values are reinterpreted as unsigned of the same width, so ids that
/// were stored as `int32` from 32-bit hex round-trip), or a UTF-8 string of hex digits as in
/// the TSV files (null or empty → the missing id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CriteoParquetColumns {
    /// Label columns, one per task (default: `label`). One column is the task `click`;
    /// several are tasks named after their columns.
    pub labels: Vec<String>,
    /// The 13 dense columns (default `int_0..int_12`).
    pub dense: Vec<String>,
    /// The 26 categorical columns (default `cat_0..cat_25`).
    pub categorical: Vec<String>,
}

impl Default for CriteoParquetColumns {
    fn default() -> Self {
        let schema = criteo_schema();
        CriteoParquetColumns {
            labels: vec!["label".to_string()],
            dense: schema.dense_names,
            categorical: schema.sparse_keys,
        }
    }
}

/// A column of one decoded batch, resolved once to its concrete type.
enum TypedColumn {
    Bool(BooleanArray),
    I8(PrimitiveArray<Int8Type>),
    I16(PrimitiveArray<Int16Type>),
    I32(PrimitiveArray<Int32Type>),
    I64(PrimitiveArray<Int64Type>),
    U8(PrimitiveArray<UInt8Type>),
    U16(PrimitiveArray<UInt16Type>),
    U32(PrimitiveArray<UInt32Type>),
    U64(PrimitiveArray<UInt64Type>),
    F32(PrimitiveArray<Float32Type>),
    F64(PrimitiveArray<Float64Type>),
    Utf8(GenericStringArray<i32>),
    LargeUtf8(GenericStringArray<i64>),
}

/// Why a column of type `data_type` cannot be read as a number (`wants_id` false: a label or
/// dense feature) or as a categorical id, or `Ok` when it can. Checked on the file's schema
/// when it is opened, so that a mistyped column is named before any of its rows is read.
fn type_fits(data_type: &DataType, wants_id: bool) -> std::result::Result<(), String> {
    use DataType as T;
    let supported = matches!(
        data_type,
        T::Boolean
            | T::Int8
            | T::Int16
            | T::Int32
            | T::Int64
            | T::UInt8
            | T::UInt16
            | T::UInt32
            | T::UInt64
            | T::Float32
            | T::Float64
            | T::Utf8
            | T::LargeUtf8
    );
    if !supported {
        return Err(format!("unsupported column type {data_type}"));
    }
    let fits = if wants_id {
        !matches!(data_type, T::Boolean | T::Float32 | T::Float64)
    } else {
        !matches!(data_type, T::Utf8 | T::LargeUtf8)
    };
    if fits {
        Ok(())
    } else {
        let role = if wants_id {
            "a categorical id (integer or hex string)"
        } else {
            "a number"
        };
        Err(format!("column type {data_type} cannot hold {role}"))
    }
}

impl TypedColumn {
    fn new(array: &ArrayRef) -> Option<TypedColumn> {
        Some(match array.data_type() {
            DataType::Boolean => TypedColumn::Bool(array.as_boolean_opt()?.clone()),
            DataType::Int8 => TypedColumn::I8(array.as_primitive_opt()?.clone()),
            DataType::Int16 => TypedColumn::I16(array.as_primitive_opt()?.clone()),
            DataType::Int32 => TypedColumn::I32(array.as_primitive_opt()?.clone()),
            DataType::Int64 => TypedColumn::I64(array.as_primitive_opt()?.clone()),
            DataType::UInt8 => TypedColumn::U8(array.as_primitive_opt()?.clone()),
            DataType::UInt16 => TypedColumn::U16(array.as_primitive_opt()?.clone()),
            DataType::UInt32 => TypedColumn::U32(array.as_primitive_opt()?.clone()),
            DataType::UInt64 => TypedColumn::U64(array.as_primitive_opt()?.clone()),
            DataType::Float32 => TypedColumn::F32(array.as_primitive_opt()?.clone()),
            DataType::Float64 => TypedColumn::F64(array.as_primitive_opt()?.clone()),
            DataType::Utf8 => TypedColumn::Utf8(array.as_string_opt()?.clone()),
            DataType::LargeUtf8 => TypedColumn::LargeUtf8(array.as_string_opt()?.clone()),
            _ => return None,
        })
    }

    fn is_null(&self, row: usize) -> bool {
        match self {
            TypedColumn::Bool(a) => a.is_null(row),
            TypedColumn::I8(a) => a.is_null(row),
            TypedColumn::I16(a) => a.is_null(row),
            TypedColumn::I32(a) => a.is_null(row),
            TypedColumn::I64(a) => a.is_null(row),
            TypedColumn::U8(a) => a.is_null(row),
            TypedColumn::U16(a) => a.is_null(row),
            TypedColumn::U32(a) => a.is_null(row),
            TypedColumn::U64(a) => a.is_null(row),
            TypedColumn::F32(a) => a.is_null(row),
            TypedColumn::F64(a) => a.is_null(row),
            TypedColumn::Utf8(a) => a.is_null(row),
            TypedColumn::LargeUtf8(a) => a.is_null(row),
        }
    }

    /// Numeric value of a non-null row (`None` for string columns).
    fn number(&self, row: usize) -> Option<f64> {
        Some(match self {
            TypedColumn::Bool(a) => f64::from(u8::from(a.value(row))),
            TypedColumn::I8(a) => f64::from(a.value(row)),
            TypedColumn::I16(a) => f64::from(a.value(row)),
            TypedColumn::I32(a) => f64::from(a.value(row)),
            TypedColumn::I64(a) => a.value(row) as f64,
            TypedColumn::U8(a) => f64::from(a.value(row)),
            TypedColumn::U16(a) => f64::from(a.value(row)),
            TypedColumn::U32(a) => f64::from(a.value(row)),
            TypedColumn::U64(a) => a.value(row) as f64,
            TypedColumn::F32(a) => f64::from(a.value(row)),
            TypedColumn::F64(a) => a.value(row),
            TypedColumn::Utf8(_) | TypedColumn::LargeUtf8(_) => return None,
        })
    }

    /// Raw categorical id of a non-null row; `Ok(None)` for an empty string (missing).
    fn id(&self, row: usize) -> std::result::Result<Option<u64>, String> {
        let hex = |s: &str| {
            if s.is_empty() {
                Ok(None)
            } else {
                parse_hex_id(s.as_bytes()).map(Some)
            }
        };
        Ok(Some(match self {
            TypedColumn::I8(a) => u64::from(a.value(row) as u8),
            TypedColumn::I16(a) => u64::from(a.value(row) as u16),
            TypedColumn::I32(a) => u64::from(a.value(row) as u32),
            TypedColumn::I64(a) => a.value(row) as u64,
            TypedColumn::U8(a) => u64::from(a.value(row)),
            TypedColumn::U16(a) => u64::from(a.value(row)),
            TypedColumn::U32(a) => u64::from(a.value(row)),
            TypedColumn::U64(a) => a.value(row),
            TypedColumn::Utf8(a) => return hex(a.value(row)),
            TypedColumn::LargeUtf8(a) => return hex(a.value(row)),
            TypedColumn::Bool(_) | TypedColumn::F32(_) | TypedColumn::F64(_) => {
                return Err("floating-point or boolean column cannot hold ids".to_string())
            }
        }))
    }
}

/// One decoded record batch with its columns in Criteo order.
struct DecodedBatch {
    labels: Vec<TypedColumn>,
    dense: Vec<TypedColumn>,
    categorical: Vec<TypedColumn>,
    num_rows: usize,
    next_row: usize,
}

struct RowGroupCursor {
    row_group: usize,
    reader: ParquetRecordBatchReader,
    batch: Option<DecodedBatch>,
    /// Rows of this row group already handed out (or skipped).
    rows_consumed: u64,
}

/// Outcome of one step inside a file.
enum Step {
    Example(Example),
    Continue,
    FileDone,
}

struct OpenFile {
    path: PathBuf,
    file: File,
    metadata: ArrowReaderMetadata,
    projection: ProjectionMask,
    row_group_rows: Vec<u64>,
    next_row_group: usize,
    cursor: Option<RowGroupCursor>,
}

/// Streams Criteo examples from Parquet files, decoding one row group at a time in slices of
/// a few thousand rows, so memory stays bounded for files larger than RAM.
///
/// Example indices run on across files and row groups (skipped rows included). A corrupt
/// page is an error naming the file, the row group and — found by re-decoding the row group
/// column by column — the column; under [`BadRecordPolicy::SkipAndCount`](crate::BadRecordPolicy::SkipAndCount) the rest of that
/// row group is skipped and counted. A corrupt footer or a missing/mistyped column is always
/// an error.
pub struct CriteoParquetReader {
    paths: Vec<PathBuf>,
    next_file: usize,
    config: CriteoConfig,
    columns: CriteoParquetColumns,
    schema: FeatureSchema,
    skipped: SkippedRecords,
    rows_per_batch: usize,
    file: Option<OpenFile>,
    next_index: u64,
    done: bool,
}

impl CriteoParquetReader {
    /// Opens `paths` (read lazily, in order) with the default column names.
    pub fn open<P: Into<PathBuf>>(
        paths: impl IntoIterator<Item = P>,
        config: CriteoConfig,
    ) -> Result<Self> {
        Self::open_with_columns(paths, config, CriteoParquetColumns::default())
    }

    /// Opens `paths` reading the Criteo fields from the named `columns`.
    pub fn open_with_columns<P: Into<PathBuf>>(
        paths: impl IntoIterator<Item = P>,
        config: CriteoConfig,
        columns: CriteoParquetColumns,
    ) -> Result<Self> {
        config.validate()?;
        if !config.has_label {
            // (It was ignored: an unlabeled file failed on its missing `label` column.)
            return Err(DatasetError::InvalidConfig(
                "has_label: false is for TSV files; a Parquet file's labels are its label \
                 columns (CriteoParquetColumns::labels)"
                    .to_string(),
            ));
        }
        if columns.dense.len() != CRITEO_NUM_DENSE
            || columns.categorical.len() != CRITEO_NUM_CATEGORICAL
        {
            return Err(DatasetError::InvalidConfig(format!(
                "column mapping must name {CRITEO_NUM_DENSE} dense and {CRITEO_NUM_CATEGORICAL} categorical columns, got {} and {}",
                columns.dense.len(),
                columns.categorical.len()
            )));
        }
        let labels = &columns.labels;
        if labels.is_empty() {
            return Err(DatasetError::InvalidConfig(
                "column mapping must name at least one label column".to_string(),
            ));
        }
        let all: Vec<&String> = (labels.iter())
            .chain(&columns.dense)
            .chain(&columns.categorical)
            .collect();
        if let Some(name) =
            (all.iter().enumerate()).find_map(|(i, n)| all[..i].contains(n).then_some(n))
        {
            return Err(DatasetError::InvalidConfig(format!(
                "column `{name}` is named twice in the column mapping"
            )));
        }
        let mut schema = criteo_schema();
        if labels.len() > 1 {
            schema.tasks = labels.clone();
        }
        let paths: Vec<PathBuf> = paths.into_iter().map(Into::into).collect();
        if paths.is_empty() {
            return Err(DatasetError::InvalidConfig(
                "no Parquet files given".to_string(),
            ));
        }
        Ok(CriteoParquetReader {
            paths,
            next_file: 0,
            config,
            columns,
            schema,
            skipped: SkippedRecords::default(),
            rows_per_batch: DEFAULT_ROWS_PER_BATCH,
            file: None,
            next_index: 0,
            done: false,
        })
    }

    /// Sets how many rows are decoded at once (≥ 1; default 8192). Lower it for very wide
    /// rows or tight memory. 0 is refused.
    pub fn with_rows_per_batch(mut self, rows: usize) -> Result<Self> {
        if rows == 0 {
            return Err(DatasetError::InvalidConfig(
                "Parquet rows_per_batch must be at least 1".to_string(),
            ));
        }
        self.rows_per_batch = rows;
        Ok(self)
    }

    /// Handle on the count of skipped records (stays live after the reader is moved).
    pub fn skipped(&self) -> SkippedRecords {
        self.skipped.clone()
    }

    fn all_column_names(&self) -> impl Iterator<Item = &String> {
        (self.columns.labels.iter())
            .chain(&self.columns.dense)
            .chain(&self.columns.categorical)
    }

    fn open_file(&self, path: PathBuf) -> Result<OpenFile> {
        let (file, metadata) = open_footer(&path)?;
        let arrow_schema = metadata.schema().clone();
        let mut roots = Vec::with_capacity(1 + CRITEO_NUM_DENSE + CRITEO_NUM_CATEGORICAL);
        for name in self.all_column_names() {
            let index = arrow_schema
                .index_of(name)
                .map_err(|_| DatasetError::Parquet {
                    path: path.clone(),
                    row_group: None,
                    row: None,
                    field: name.clone(),
                    message: format!(
                        "column not found; the file has columns [{}]",
                        arrow_schema
                            .fields()
                            .iter()
                            .map(|f| f.name().as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })?;
            roots.push(index);
        }
        // Each column's type against its role, from the schema: a mistyped column is named
        // now, not after every row before its first batch was handed out (or never, in a
        // file of no rows).
        let roles = (self.columns.labels.iter().map(|n| (n, false)))
            .chain(self.columns.dense.iter().map(|n| (n, false)))
            .chain(self.columns.categorical.iter().map(|n| (n, true)));
        for ((name, wants_id), &index) in roles.zip(&roots) {
            type_fits(arrow_schema.field(index).data_type(), wants_id).map_err(|message| {
                DatasetError::Parquet {
                    path: path.clone(),
                    row_group: None,
                    row: None,
                    field: name.clone(),
                    message,
                }
            })?;
        }
        let projection = ProjectionMask::roots(metadata.parquet_schema(), roots);
        let (rows, row_group_rows) = footer_rows(&path, &metadata)?;
        if self.next_index.checked_add(rows).is_none() {
            return Err(footer_error(
                &path,
                format!("{rows} rows after {} overflow u64", self.next_index),
            ));
        }
        Ok(OpenFile {
            path,
            file,
            metadata,
            projection,
            row_group_rows,
            next_row_group: 0,
            cursor: None,
        })
    }

    fn row_group_reader(
        file: &OpenFile,
        row_group: usize,
        projection: ProjectionMask,
        rows_per_batch: usize,
    ) -> std::result::Result<ParquetRecordBatchReader, String> {
        let handle = file.file.try_clone().map_err(|e| e.to_string())?;
        guarded(|| {
            ParquetRecordBatchReaderBuilder::new_with_metadata(handle, file.metadata.clone())
                .with_row_groups(vec![row_group])
                .with_projection(projection)
                .with_batch_size(rows_per_batch)
                .build()
                .map_err(|e| e.to_string())
        })
    }

    /// Re-decodes `row_group` one column at a time to name the column a decode error came from.
    /// A column whose reader cannot even be built is named only if some other column's can
    /// be (a failure of every one is the row group's, not the first column's).
    fn locate_corrupt_column(&self, file: &OpenFile, row_group: usize) -> String {
        let arrow_schema = file.metadata.schema().clone();
        let mut unbuilt = Vec::new();
        let mut built = 0;
        for name in self.all_column_names() {
            let Ok(index) = arrow_schema.index_of(name) else {
                continue;
            };
            let mask = ProjectionMask::roots(file.metadata.parquet_schema(), [index]);
            match Self::row_group_reader(file, row_group, mask, self.rows_per_batch) {
                Err(_) => unbuilt.push(name.clone()),
                Ok(mut reader) => loop {
                    match next_batch(&mut reader) {
                        Ok(None) => {
                            built += 1;
                            break;
                        }
                        Ok(Some(_)) => {}
                        Err(_) => return name.clone(),
                    }
                },
            }
        }
        match unbuilt.first() {
            Some(name) if built > 0 => name.clone(),
            _ => "unknown column".to_string(),
        }
    }

    fn decode_batch(
        &self,
        path: &std::path::Path,
        row_group: usize,
        batch: &RecordBatch,
    ) -> Result<DecodedBatch> {
        let column = |name: &String, wants_id: bool| -> Result<TypedColumn> {
            let fail = |message: String| DatasetError::Parquet {
                path: path.to_path_buf(),
                row_group: Some(row_group),
                row: None,
                field: name.clone(),
                message,
            };
            let array = batch
                .column_by_name(name)
                .ok_or_else(|| fail("column missing from decoded batch".to_string()))?;
            type_fits(array.data_type(), wants_id).map_err(fail)?;
            TypedColumn::new(array)
                .ok_or_else(|| fail(format!("unsupported column type {}", array.data_type())))
        };
        Ok(DecodedBatch {
            labels: (self.columns.labels.iter())
                .map(|name| column(name, false))
                .collect::<Result<_>>()?,
            dense: self
                .columns
                .dense
                .iter()
                .map(|name| column(name, false))
                .collect::<Result<_>>()?,
            categorical: self
                .columns
                .categorical
                .iter()
                .map(|name| column(name, true))
                .collect::<Result<_>>()?,
            num_rows: batch.num_rows(),
            next_row: 0,
        })
    }

    fn convert_row(
        &self,
        decoded: &DecodedBatch,
        row: usize,
        index: u64,
        location: (&std::path::Path, usize, u64),
    ) -> Result<Example> {
        let (path, row_group, row_in_group) = location;
        let fail = |field: &String, message: String| DatasetError::Parquet {
            path: path.to_path_buf(),
            row_group: Some(row_group),
            row: Some(row_in_group),
            field: field.clone(),
            message,
        };
        let mut labels = Vec::with_capacity(decoded.labels.len());
        for (column, name) in decoded.labels.iter().zip(&self.columns.labels) {
            if column.is_null(row) {
                return Err(fail(name, "label is null".to_string()));
            }
            let value = column.number(row).unwrap_or(f64::NAN);
            if !(0.0..=1.0).contains(&value) {
                return Err(fail(
                    name,
                    format!("label must be in [0, 1], found {value}"),
                ));
            }
            labels.push(value as f32);
        }
        let mut dense = Vec::with_capacity(CRITEO_NUM_DENSE);
        for (column, name) in decoded.dense.iter().zip(&self.columns.dense) {
            let raw = if column.is_null(row) {
                0.0
            } else {
                column.number(row).unwrap_or(f64::NAN)
            };
            // Finite before and after the transform (a float64 past f32's range would be inf
            // under Identity).
            let value = self.config.dense_transform.apply(raw);
            if !raw.is_finite() || !value.is_finite() {
                return Err(fail(
                    name,
                    format!(
                        "dense value must be finite (as an f32 after the {:?} transform), \
                         found {raw:e}",
                        self.config.dense_transform
                    ),
                ));
            }
            dense.push(value);
        }
        let mut ids = Vec::with_capacity(CRITEO_NUM_CATEGORICAL);
        for (feature, (column, name)) in decoded
            .categorical
            .iter()
            .zip(&self.columns.categorical)
            .enumerate()
        {
            let id = if column.is_null(row) {
                self.config.missing_id()
            } else {
                match column.id(row).map_err(|m| fail(name, m))? {
                    None => self.config.missing_id(),
                    Some(raw) => self
                        .config
                        .map_categorical(feature, raw)
                        .map_err(|m| fail(name, m))?,
                }
            };
            ids.push(id);
        }
        Ok(Example {
            index,
            dense,
            ids,
            lengths: vec![1; CRITEO_NUM_CATEGORICAL],
            labels,
            true_probability: None,
        })
    }

    /// One step of the state machine: `Ok(Some)` an example, `Ok(None)` nothing yet (call
    /// again), `Err` an error (already filtered by the bad-record policy by the caller).
    fn step(&mut self) -> Result<Option<Example>> {
        let Some(mut file) = self.file.take() else {
            let Some(path) = self.paths.get(self.next_file).cloned() else {
                self.done = true;
                return Ok(None);
            };
            self.next_file += 1;
            self.file = Some(self.open_file(path)?);
            return Ok(None);
        };
        match self.step_in_file(&mut file)? {
            Step::Example(example) => {
                self.file = Some(file);
                Ok(Some(example))
            }
            Step::Continue => {
                self.file = Some(file);
                Ok(None)
            }
            // Leaving `self.file` empty moves on to the next path.
            Step::FileDone => Ok(None),
        }
    }

    fn step_in_file(&mut self, file: &mut OpenFile) -> Result<Step> {
        let Some(cursor) = file.cursor.as_mut() else {
            if file.next_row_group >= file.row_group_rows.len() {
                return Ok(Step::FileDone);
            }
            let row_group = file.next_row_group;
            file.next_row_group += 1;
            let reader = Self::row_group_reader(
                file,
                row_group,
                file.projection.clone(),
                self.rows_per_batch,
            )
            .map_err(|message| DatasetError::Parquet {
                path: file.path.clone(),
                row_group: Some(row_group),
                row: None,
                field: "unknown column".to_string(),
                message,
            });
            match reader {
                Ok(reader) => {
                    file.cursor = Some(RowGroupCursor {
                        row_group,
                        reader,
                        batch: None,
                        rows_consumed: 0,
                    })
                }
                Err(error) => {
                    let rows = file.row_group_rows[row_group];
                    return self.skip_rows(rows, error).map(|_| Step::Continue);
                }
            }
            return Ok(Step::Continue);
        };
        let row_group = cursor.row_group;
        let needs_batch = cursor
            .batch
            .as_ref()
            .is_none_or(|batch| batch.next_row >= batch.num_rows);
        if needs_batch {
            match next_batch(&mut cursor.reader) {
                Ok(None) => {
                    let claimed = file.row_group_rows[row_group];
                    let read = cursor.rows_consumed;
                    file.cursor = None;
                    if read < claimed {
                        // Rows the footer promised and the pages do not hold: bad records
                        // (they keep their indices, as an undecodable row group's do).
                        let error = DatasetError::Parquet {
                            path: file.path.clone(),
                            row_group: Some(row_group),
                            row: None,
                            field: "footer".to_string(),
                            message: format!(
                                "the footer says {claimed} rows but the pages hold {read}"
                            ),
                        };
                        return self
                            .skip_rows(claimed - read, error)
                            .map(|_| Step::Continue);
                    }
                }
                Ok(Some(record_batch)) => {
                    let decoded = self.decode_batch(&file.path, row_group, &record_batch)?;
                    cursor.batch = Some(decoded);
                }
                Err(error) => {
                    let remaining =
                        file.row_group_rows[row_group].saturating_sub(cursor.rows_consumed);
                    file.cursor = None;
                    let field = self.locate_corrupt_column(file, row_group);
                    let error = DatasetError::Parquet {
                        path: file.path.clone(),
                        row_group: Some(row_group),
                        row: None,
                        field,
                        message: format!("cannot decode: {error}"),
                    };
                    return self.skip_rows(remaining, error).map(|_| Step::Continue);
                }
            }
            return Ok(Step::Continue);
        }
        let Some(decoded) = cursor.batch.as_mut() else {
            return Ok(Step::Continue);
        };
        let row_in_group = cursor.rows_consumed;
        if row_in_group >= file.row_group_rows[row_group] {
            // More rows than the footer says would shift every later index (and split): the
            // file is not what its footer describes, whatever the policy.
            return Err(DatasetError::Parquet {
                path: file.path.clone(),
                row_group: Some(row_group),
                row: Some(row_in_group),
                field: "footer".to_string(),
                message: format!(
                    "the pages hold more rows than the footer's {}",
                    file.row_group_rows[row_group]
                ),
            });
        }
        let row = decoded.next_row;
        decoded.next_row += 1;
        cursor.rows_consumed += 1;
        let index = self.next_index;
        self.next_index += 1;
        let Some(decoded) = cursor.batch.as_ref() else {
            return Ok(Step::Continue);
        };
        match self.convert_row(decoded, row, index, (&file.path, row_group, row_in_group)) {
            Ok(example) => Ok(Step::Example(example)),
            Err(error) => self.bad_rows(1, error).map(|_| Step::Continue),
        }
    }

    /// Applies the bad-record policy to `rows` rows that failed with `error`.
    fn bad_rows(&mut self, rows: u64, error: DatasetError) -> Result<()> {
        self.config.bad_records.apply(rows, error, &self.skipped)
    }

    /// [`bad_rows`](Self::bad_rows) for `rows` rows not yet given an index (the rest of a row
    /// group that cannot be decoded): skipped, they keep theirs, so the rows after them have
    /// the indices they would have had (and the splits by index stay where they were).
    fn skip_rows(&mut self, rows: u64, error: DatasetError) -> Result<()> {
        self.bad_rows(rows, error)?;
        // Within u64: each file's rows were added to the index before it, checked, and the
        // indices never pass them.
        self.next_index += rows;
        Ok(())
    }
}

/// An error of `path`'s footer (the file as a whole: no row group or row).
fn footer_error(path: &std::path::Path, message: String) -> DatasetError {
    DatasetError::Parquet {
        path: path.to_path_buf(),
        row_group: None,
        row: None,
        field: "footer".to_string(),
        message,
    }
}

/// Opens `path` and reads its footer (errors, and decoder panics, name the file).
fn open_footer(path: &std::path::Path) -> Result<(File, ArrowReaderMetadata)> {
    let file = File::open(path).map_err(|source| DatasetError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let metadata = guarded(|| {
        ArrowReaderMetadata::load(&file, ArrowReaderOptions::default()).map_err(|e| e.to_string())
    })
    .map_err(|message| footer_error(path, message))?;
    Ok((file, metadata))
}

/// The file's rows and each row group's, from its footer, checked: counts not negative, the
/// file's count the sum of its row groups' (the decoder sizes its batches by the file's count:
/// a 0 there ends every row group at once, silently), no sum past u64.
fn footer_rows(path: &std::path::Path, metadata: &ArrowReaderMetadata) -> Result<(u64, Vec<u64>)> {
    let footer = |message: String| footer_error(path, message);
    let meta = metadata.metadata();
    let mut total = 0u64;
    let mut groups = Vec::with_capacity(meta.row_groups().len());
    for (g, group) in meta.row_groups().iter().enumerate() {
        let rows = u64::try_from(group.num_rows())
            .map_err(|_| footer(format!("row group {g} has {} rows", group.num_rows())))?;
        total = total
            .checked_add(rows)
            .ok_or_else(|| footer(format!("the row groups' rows overflow at row group {g}")))?;
        groups.push(rows);
    }
    let file_rows = meta.file_metadata().num_rows();
    if u64::try_from(file_rows) != Ok(total) {
        return Err(footer(format!(
            "the file has {file_rows} rows but its row groups hold {total}"
        )));
    }
    Ok((total, groups))
}

/// Rows in Parquet files, from their footers (nothing else is read), checked as the reader
/// checks them.
pub fn parquet_rows(paths: &[PathBuf]) -> Result<u64> {
    let mut total = 0u64;
    for path in paths {
        let (_, metadata) = open_footer(path)?;
        let rows = footer_rows(path, &metadata)?.0;
        total = total
            .checked_add(rows)
            .ok_or_else(|| footer_error(path, "the files' rows overflow u64".to_string()))?;
    }
    Ok(total)
}

/// Runs a call into the parquet crate, turning a panic into an error: on some corrupt files
/// (found by fuzzing: a dictionary page missing where the column chunk says one is) it panics
/// instead of returning an error. Needs `panic = "unwind"` (Rust's default); the panic message
/// is still printed by the panic hook.
fn guarded<T>(
    f: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "no message".to_string());
        Err(format!(
            "the Parquet decoder failed on corrupt data ({what})"
        ))
    })
}

/// The next record batch of `reader`: `Ok(None)` at the end, `Err` for a decode error or a
/// decoder panic (see [`guarded`]).
fn next_batch(
    reader: &mut ParquetRecordBatchReader,
) -> std::result::Result<Option<arrow_array::RecordBatch>, String> {
    guarded(|| reader.next().transpose().map_err(|e| e.to_string()))
}

impl Iterator for CriteoParquetReader {
    type Item = Result<Example>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            match self.step() {
                Ok(Some(example)) => return Some(Ok(example)),
                Ok(None) => {}
                Err(error) => {
                    self.done = true;
                    return Some(Err(error));
                }
            }
        }
        None
    }
}

impl ExampleSource for CriteoParquetReader {
    fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    fn indices_ascend(&self) -> bool {
        true
    }
}
