//! Datasets for embers: readers that turn recommendation data into batches shaped for a
//! DLRM-style model (dense features, one key-major jagged id buffer, labels).
//!
//! Sources (each an [`ExampleSource`], an iterator of [`Example`]s plus a [`FeatureSchema`]):
//! - [`CriteoTsvReader`]: Criteo Kaggle / 1TB TSV files (`label`, 13 integers, 26 hex ids).
//! - [`CriteoParquetReader`]: the same schema from Parquet, streamed one row group at a time.
//! - [`MovieLensReader`]: ml-100k `u.data`, ml-1m `ratings.dat`, RecBole `.inter`.
//! - [`SyntheticCriteo`]: a seeded, counter-based Criteo-shaped generator with Zipf ids and a
//!   planted logistic signal whose best achievable AUC is computable ([`SyntheticCriteo::best_auc`]).
//!
//! [`Batcher`] applies the train/validation/test split and seeded shuffling and assembles
//! [`RawBatch`]es (TorchRec's KJT layout, built in one key-major pass); [`Prefetcher`] runs any
//! of this on a background thread behind a bounded queue.
//!
//! Bad data is an [`DatasetError`] naming file, line (or row group) and field, or — with
//! [`BadRecordPolicy::SkipAndCount`] — a skipped record counted in [`SkippedRecords`].
#![warn(missing_docs)]

mod auc;
mod bad_records;
mod batch;
mod criteo;
mod criteo_parquet;
mod criteo_tsv;
mod error;
mod example;
mod hashing;
mod movielens;
mod pipeline;
mod prefetch;
mod synthetic;
mod text_lines;
mod zipf;

pub use auc::tie_corrected_auc;
pub use bad_records::{BadRecordPolicy, SkippedRecords};
pub use batch::RawBatch;
pub use criteo::{
    criteo_schema, CategoricalMapping, CriteoConfig, DenseTransform, CRITEO_DEFAULT_TABLE_SIZE,
    CRITEO_NUM_CATEGORICAL, CRITEO_NUM_DENSE,
};
pub use criteo_parquet::{parquet_rows, CriteoParquetColumns, CriteoParquetReader};
pub use criteo_tsv::CriteoTsvReader;
pub use error::{DatasetError, Result};
pub use example::{Example, ExampleSource, FeatureSchema};
pub use movielens::{MovieLensConfig, MovieLensFormat, MovieLensReader, MOVIELENS_GENRES};
pub use pipeline::{BatchConfig, Batcher, ShuffleConfig, Split, SplitRule};
pub use prefetch::{Prefetcher, PREFETCH_DROP_WAIT};
pub use synthetic::{SyntheticCriteo, SyntheticCriteoConfig, SyntheticExamples};
pub use zipf::ZipfSampler;
