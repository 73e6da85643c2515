//! `RawBatch`: a batch in TorchRec's layout, built from examples in one key-major pass.

use crate::{DatasetError, Example, FeatureSchema, Result};

/// A batch ready to be turned into a dense tensor, one `KeyedJaggedTensor` and labels.
///
/// All sparse features share one `values` and one `lengths` buffer, **key-major** (every sample
/// of key 0, then every sample of key 1, …), which is TorchRec's KJT layout: the whole sparse
/// input is two host→device copies, not two per feature.
#[derive(Debug, Clone, PartialEq)]
pub struct RawBatch {
    /// Dense features, `[batch_size × num_dense]`, row-major.
    pub dense: Vec<f32>,
    /// Number of dense features per sample.
    pub num_dense: usize,
    /// Sparse feature names (the KJT keys), in `values`/`lengths` order.
    pub keys: Vec<String>,
    /// All ids, key-major: for key k, sample b, the ids are a contiguous run.
    pub values: Vec<i64>,
    /// Ids per (key, sample), key-major: `keys.len() × batch_size` entries.
    pub lengths: Vec<i32>,
    /// Labels, `[batch_size × num_tasks]`, row-major.
    pub labels: Vec<f32>,
    /// Number of label columns.
    pub num_tasks: usize,
    /// The probability each label was drawn with (synthetic data only), `batch_size` entries.
    pub true_probability: Option<Vec<f32>>,
    /// Index of each sample in its source (for reproducibility checks and debugging).
    pub example_indices: Vec<u64>,
    /// Number of samples.
    pub batch_size: usize,
}

impl RawBatch {
    /// Assembles a batch. Every example is checked against `schema` first (an error names the
    /// example), then values/lengths are written key-major in a single pass over the ids.
    pub fn from_examples(schema: &FeatureSchema, examples: &[Example]) -> Result<RawBatch> {
        let num_dense = schema.num_dense();
        let num_keys = schema.num_keys();
        let num_tasks = schema.num_tasks();
        let batch_size = examples.len();
        let with_probability = examples
            .first()
            .is_some_and(|e| e.true_probability.is_some());
        let mut total_ids = 0usize;
        for example in examples {
            let inconsistent = |message: String| DatasetError::InconsistentExample {
                index: example.index,
                message,
            };
            if example.dense.len() != num_dense {
                return Err(inconsistent(format!(
                    "{} dense values, schema has {num_dense}",
                    example.dense.len()
                )));
            }
            if example.lengths.len() != num_keys {
                return Err(inconsistent(format!(
                    "{} lengths, schema has {num_keys} keys",
                    example.lengths.len()
                )));
            }
            if example.labels.len() != num_tasks {
                return Err(inconsistent(format!(
                    "{} labels, schema has {num_tasks} tasks",
                    example.labels.len()
                )));
            }
            let mut sum = 0usize;
            for (key, &length) in example.lengths.iter().enumerate() {
                if length < 0 {
                    return Err(inconsistent(format!(
                        "negative length {length} for key `{}`",
                        schema.sparse_keys[key]
                    )));
                }
                sum += length as usize;
            }
            if sum != example.ids.len() {
                return Err(inconsistent(format!(
                    "lengths sum to {sum} but there are {} ids",
                    example.ids.len()
                )));
            }
            if example.true_probability.is_some() != with_probability {
                return Err(inconsistent(
                    "true_probability present on some examples of the batch but not others"
                        .to_string(),
                ));
            }
            total_ids += sum;
        }

        let mut dense = Vec::with_capacity(batch_size * num_dense);
        let mut labels = Vec::with_capacity(batch_size * num_tasks);
        let mut example_indices = Vec::with_capacity(batch_size);
        for example in examples {
            dense.extend_from_slice(&example.dense);
            labels.extend_from_slice(&example.labels);
            example_indices.push(example.index);
        }
        let true_probability = with_probability.then(|| {
            examples
                .iter()
                .map(|e| e.true_probability.unwrap_or(f32::NAN))
                .collect()
        });

        // Key-major transpose: `cursor[b]` is where key k's ids start inside example b, so each
        // id is read exactly once and written directly into its final place.
        let mut values = Vec::with_capacity(total_ids);
        let mut lengths = Vec::with_capacity(num_keys * batch_size);
        let mut cursor = vec![0usize; batch_size];
        for key in 0..num_keys {
            for (example, start) in examples.iter().zip(cursor.iter_mut()) {
                let length = example.lengths[key];
                let end = *start + length as usize;
                values.extend_from_slice(&example.ids[*start..end]);
                lengths.push(length);
                *start = end;
            }
        }

        Ok(RawBatch {
            dense,
            num_dense,
            keys: schema.sparse_keys.clone(),
            values,
            lengths,
            labels,
            num_tasks,
            true_probability,
            example_indices,
            batch_size,
        })
    }

    /// Total number of ids of each key (TorchRec's `length_per_key`).
    pub fn length_per_key(&self) -> Vec<usize> {
        if self.batch_size == 0 {
            return vec![0; self.keys.len()];
        }
        self.lengths
            .chunks(self.batch_size)
            .map(|chunk| chunk.iter().map(|&l| l as usize).sum())
            .collect()
    }

    /// Exclusive prefix sum of `lengths` (`keys × batch_size + 1` entries, KJT offsets).
    pub fn offsets(&self) -> Vec<i64> {
        let mut offsets = Vec::with_capacity(self.lengths.len() + 1);
        let mut total = 0i64;
        offsets.push(0);
        for &length in &self.lengths {
            total += i64::from(length);
            offsets.push(total);
        }
        offsets
    }

    /// The ids of `key` (index into `keys`) for sample `sample`, or `None` if out of range.
    /// Computes offsets on the fly: meant for tests and inspection, not hot loops.
    pub fn ids(&self, key: usize, sample: usize) -> Option<&[i64]> {
        if key >= self.keys.len() || sample >= self.batch_size {
            return None;
        }
        let position = key * self.batch_size + sample;
        let start: usize = self.lengths[..position].iter().map(|&l| l as usize).sum();
        let end = start + self.lengths[position] as usize;
        self.values.get(start..end)
    }

    /// Turns the batch into embers tensors and one `KeyedJaggedTensor` (moving the buffers,
    /// no per-feature copies); the labels become `[batch_size, num_tasks]`.
    pub fn into_batch(self) -> embers::Result<embers::train::Batch> {
        embers::train::Batch::from_parts(
            self.dense,
            self.num_dense,
            self.keys,
            self.values,
            self.lengths,
            self.labels,
            self.num_tasks,
        )
    }
}
