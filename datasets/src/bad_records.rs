//! What to do with a record that cannot be parsed, and the counter of skipped ones.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::DatasetError;

/// Policy for malformed records (bad field count, unparsable value, corrupt Parquet page).
/// I/O errors (missing file, unreadable disk) are always returned, whatever the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadRecordPolicy {
    /// Stop and return the error (the default: bad data should be seen, not trained on).
    #[default]
    Fail,
    /// Skip the record, count it in [`SkippedRecords`], and keep going. For a corrupt Parquet
    /// page the rest of that row group is skipped and its remaining rows are counted.
    SkipAndCount,
}

impl BadRecordPolicy {
    /// Handles `records` records that failed with `error`: the error back ([`Fail`](Self::Fail)),
    /// or counted in `skipped` and `Ok` ([`SkipAndCount`](Self::SkipAndCount)).
    pub(crate) fn apply(
        self,
        records: u64,
        error: DatasetError,
        skipped: &SkippedRecords,
    ) -> crate::Result<()> {
        match self {
            BadRecordPolicy::Fail => Err(error),
            BadRecordPolicy::SkipAndCount => {
                skipped.record(records, &error);
                Ok(())
            }
        }
    }
}

#[derive(Debug, Default)]
struct SkippedInner {
    count: AtomicU64,
    first_error: Mutex<Option<String>>,
}

/// Shared counter of skipped records. Clones share the count, so a handle taken before the
/// reader moves to a [`crate::Prefetcher`] thread still sees the live value.
#[derive(Debug, Clone, Default)]
pub struct SkippedRecords(Arc<SkippedInner>);

impl SkippedRecords {
    /// Number of records skipped so far.
    pub fn count(&self) -> u64 {
        self.0.count.load(Ordering::Relaxed)
    }

    /// The message of the first skipped record's error, to show why records are being dropped.
    pub fn first_error(&self) -> Option<String> {
        self.0
            .first_error
            .lock()
            .ok()
            .and_then(|guard| guard.clone())
    }

    pub(crate) fn record(&self, records: u64, error: &DatasetError) {
        self.0.count.fetch_add(records, Ordering::Relaxed);
        if let Ok(mut first) = self.0.first_error.lock() {
            if first.is_none() {
                *first = Some(error.to_string());
            }
        }
    }
}
