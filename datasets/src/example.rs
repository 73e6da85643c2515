//! One training example and the schema that describes it.

use crate::Result;

/// Names and counts of a source's features.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeatureSchema {
    /// Names of the dense features, in order (their count is the dense width).
    pub dense_names: Vec<String>,
    /// Names of the sparse features, i.e. the KJT keys, in order.
    pub sparse_keys: Vec<String>,
    /// Names of the tasks, one label column each, in label order (`["click"]` for
    /// single-task click prediction).
    pub tasks: Vec<String>,
}

impl FeatureSchema {
    /// Number of dense features per example.
    pub fn num_dense(&self) -> usize {
        self.dense_names.len()
    }

    /// Number of sparse features (KJT keys).
    pub fn num_keys(&self) -> usize {
        self.sparse_keys.len()
    }

    /// Number of tasks (label columns).
    pub fn num_tasks(&self) -> usize {
        self.tasks.len()
    }
}

/// One example, owned, as produced by a source (and held by the shuffle buffer).
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// Position of the record in its source (0-based; counts malformed/skipped records too, so
    /// skipping one never moves another across a split boundary).
    pub index: u64,
    /// Dense features, `num_dense` values.
    pub dense: Vec<f32>,
    /// Sparse ids of all features concatenated, feature by feature.
    pub ids: Vec<i64>,
    /// Number of ids of each feature (`num_keys` entries, summing to `ids.len()`).
    pub lengths: Vec<i32>,
    /// Labels, one per task.
    pub labels: Vec<f32>,
    /// The probability the first task's label was drawn with (synthetic data only).
    pub true_probability: Option<f32>,
}

/// A stream of examples with a fixed schema. Sources are `Send` so they can be moved to a
/// [`crate::Prefetcher`] thread.
pub trait ExampleSource: Iterator<Item = Result<Example>> + Send {
    /// The schema every example of this source follows.
    fn schema(&self) -> &FeatureSchema;

    /// Whether the examples' indices strictly increase (every reader here: records in file
    /// order). A [`crate::Batcher`] of such a source stops reading once no later index can
    /// belong to its split, rather than scanning the rest of the source; the default, `false`,
    /// makes it read to the end.
    fn indices_ascend(&self) -> bool {
        false
    }
}
