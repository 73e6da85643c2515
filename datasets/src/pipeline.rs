//! Split selection, seeded shuffling and batch assembly on top of any [`ExampleSource`].

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::hashing::{hash_words, unit_open, SplitMix64};
use crate::{DatasetError, Example, ExampleSource, FeatureSchema, Prefetcher, RawBatch, Result};

/// Which part of the data a pipeline reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    /// Training examples.
    Train,
    /// Validation examples (model selection, early stopping).
    Validation,
    /// Held-out test examples (the final report).
    Test,
}

/// Deterministic rule assigning each example, by its source index, to a [`Split`].
#[derive(Debug, Clone, PartialEq)]
pub enum SplitRule {
    /// Everything is in every split (use when the files are already split, e.g. one per day).
    All,
    /// Each index goes to validation with probability `validation`, to test with probability
    /// `test`, else to train, decided by a seeded hash of the index: reproducible, streaming,
    /// and independent of file order or skipped records.
    Fractions {
        /// Fraction of examples in the validation split.
        validation: f64,
        /// Fraction of examples in the test split.
        test: f64,
        /// Seed of the assignment hash.
        seed: u64,
    },
    /// Contiguous index ranges (e.g. TorchRec's "last day halves" for val/test). Indices in
    /// none of the ranges are dropped.
    IndexRanges {
        /// Indices of the training split.
        train: Range<u64>,
        /// Indices of the validation split.
        validation: Range<u64>,
        /// Indices of the test split.
        test: Range<u64>,
    },
    /// A split given per index (e.g. computed from timestamps); indices past the end or
    /// mapped to `None` are dropped.
    Assigned(std::sync::Arc<Vec<Option<Split>>>),
}

impl SplitRule {
    /// The split `index` belongs to under this rule (`None`: dropped). For [`SplitRule::All`]
    /// this is `wanted` itself.
    pub fn split_of(&self, index: u64, wanted: Split) -> Option<Split> {
        match self {
            SplitRule::All => Some(wanted),
            SplitRule::Fractions {
                validation,
                test,
                seed,
            } => {
                let u = unit_open(hash_words(&[*seed, 0x5EED_5B11, index]));
                Some(if u < *validation {
                    Split::Validation
                } else if u < validation + test {
                    Split::Test
                } else {
                    Split::Train
                })
            }
            SplitRule::IndexRanges {
                train,
                validation,
                test,
            } => {
                if train.contains(&index) {
                    Some(Split::Train)
                } else if validation.contains(&index) {
                    Some(Split::Validation)
                } else if test.contains(&index) {
                    Some(Split::Test)
                } else {
                    None
                }
            }
            SplitRule::Assigned(splits) => usize::try_from(index)
                .ok()
                .and_then(|i| splits.get(i).copied().flatten()),
        }
    }

    /// An index past every one of split `wanted` (`None`: no such bound), so that reading
    /// an ascending source can stop there.
    pub fn index_bound(&self, wanted: Split) -> Option<u64> {
        match self {
            SplitRule::All => None,
            SplitRule::Fractions {
                validation, test, ..
            } => {
                // A split of no share takes no index: the hash `u` is in the open (0, 1) and
                // compared as `split_of` compares it.
                let empty = match wanted {
                    Split::Validation => *validation <= 0.0,
                    Split::Test => *test <= 0.0,
                    Split::Train => validation + test >= 1.0,
                };
                empty.then_some(0)
            }
            SplitRule::IndexRanges {
                train,
                validation,
                test,
            } => {
                let range = match wanted {
                    Split::Train => train,
                    Split::Validation => validation,
                    Split::Test => test,
                };
                Some(if range.is_empty() { 0 } else { range.end })
            }
            SplitRule::Assigned(splits) => Some(
                (splits.iter().rposition(|s| *s == Some(wanted))).map_or(0, |last| last as u64 + 1),
            ),
        }
    }

    fn validate(&self) -> Result<()> {
        match self {
            SplitRule::All => Ok(()),
            SplitRule::Fractions {
                validation, test, ..
            } => {
                let ok = |f: f64| f.is_finite() && (0.0..=1.0).contains(&f);
                if ok(*validation) && ok(*test) && validation + test <= 1.0 {
                    Ok(())
                } else {
                    Err(DatasetError::InvalidConfig(format!(
                        "split fractions must be in [0, 1] and sum to at most 1, got validation={validation} test={test}"
                    )))
                }
            }
            SplitRule::IndexRanges {
                train,
                validation,
                test,
            } => {
                for (name, r) in [("train", train), ("validation", validation), ("test", test)] {
                    if r.start > r.end {
                        return Err(DatasetError::InvalidConfig(format!(
                            "split index range {name} {r:?} runs backwards (start after end)"
                        )));
                    }
                }
                let overlap = |a: &Range<u64>, b: &Range<u64>| {
                    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
                };
                if overlap(train, validation) || overlap(train, test) || overlap(validation, test) {
                    Err(DatasetError::InvalidConfig(format!(
                        "split index ranges overlap: train {train:?}, validation {validation:?}, test {test:?}"
                    )))
                } else {
                    Ok(())
                }
            }
            SplitRule::Assigned(_) => Ok(()),
        }
    }
}

/// Seeded shuffling through a bounded buffer.
///
/// "Shuffle" here means: examples enter a buffer of `buffer_size`; each output is a uniformly
/// chosen buffered example, replaced by the next input. For data larger than RAM this is a
/// *local* shuffle (an example moves at most about `buffer_size` places on average), memory
/// is `buffer_size` examples, and the order is a pure function of `seed` and the input order.
/// Use a different seed per epoch (e.g. `seed + epoch`) for a different order each epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShuffleConfig {
    /// Examples held in the shuffle buffer (≥ 1; 1 means no shuffling).
    pub buffer_size: usize,
    /// Seed of the shuffle.
    pub seed: u64,
}

/// How a [`Batcher`] selects, orders and groups examples.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchConfig {
    /// Samples per batch (≥ 1).
    pub batch_size: usize,
    /// Drop a final batch smaller than `batch_size` (keeps shapes static for compiled steps).
    pub drop_last: bool,
    /// Shuffling, or `None` to keep source order.
    pub shuffle: Option<ShuffleConfig>,
    /// How examples are assigned to splits.
    pub split_rule: SplitRule,
    /// The split this batcher yields.
    pub split: Split,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            batch_size: 512,
            drop_last: false,
            shuffle: None,
            split_rule: SplitRule::All,
            split: Split::Train,
        }
    }
}

/// Turns an [`ExampleSource`] into an iterator of [`RawBatch`]es of one split.
///
/// After an error the batcher yields that error once and then ends.
pub struct Batcher<S: ExampleSource> {
    source: S,
    schema: FeatureSchema,
    config: BatchConfig,
    rng: SplitMix64,
    buffer: Vec<Example>,
    source_done: bool,
    finished: bool,
    /// Set when the [`Prefetcher`] running this batcher is dropped.
    stop: Option<Arc<AtomicBool>>,
    /// The wanted split's index bound ([`SplitRule::index_bound`]), found once: an assigned
    /// split's is a scan of every index, which each example repeated (a time split of a
    /// million ratings in time order took some 10^11 steps an epoch).
    bound: Option<u64>,
}

/// The most examples a batcher reserves room for ahead of reading them.
const MAX_RESERVED: usize = 1 << 16;

impl<S: ExampleSource> Batcher<S> {
    /// Wraps `source`; fails on an invalid configuration.
    pub fn new(source: S, config: BatchConfig) -> Result<Self> {
        if config.batch_size == 0 {
            return Err(DatasetError::InvalidConfig(
                "batch_size must be at least 1".to_string(),
            ));
        }
        if let Some(shuffle) = &config.shuffle {
            if shuffle.buffer_size == 0 {
                return Err(DatasetError::InvalidConfig(
                    "shuffle buffer_size must be at least 1".to_string(),
                ));
            }
        }
        config.split_rule.validate()?;
        let bound = config.split_rule.index_bound(config.split);
        let schema = source.schema().clone();
        let seed = config.shuffle.map_or(0, |s| s.seed);
        // Reserved up to a bound, grown past it as examples arrive: a buffer or batch bigger
        // than the data is allowed, and must not allocate for examples that never come.
        let capacity = config
            .shuffle
            .map_or(0, |s| s.buffer_size.min(MAX_RESERVED));
        Ok(Batcher {
            source,
            schema,
            rng: SplitMix64::new(seed),
            buffer: Vec::with_capacity(capacity),
            config,
            source_done: false,
            finished: false,
            stop: None,
            bound,
        })
    }

    /// The schema of the batches.
    pub fn schema(&self) -> &FeatureSchema {
        &self.schema
    }

    /// Moves this batcher to a background thread that keeps up to `depth` batches ready.
    pub fn prefetch(self, depth: usize) -> Result<Prefetcher<RawBatch>>
    where
        S: 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let mut batcher = self;
        batcher.stop = Some(Arc::clone(&stop));
        Prefetcher::spawn_with_stop(batcher, depth, stop)
    }

    /// Next example of the wanted split from the source, `Ok(None)` at the end.
    fn next_selected(&mut self) -> Result<Option<Example>> {
        if self.source_done {
            return Ok(None);
        }
        let bound = self.bound;
        // No example can be selected: nothing to read (any source). An ascending source also
        // stops at the first index past the split's last.
        if bound == Some(0) {
            self.source_done = true;
            return Ok(None);
        }
        let ascend = self.source.indices_ascend();
        for item in self.source.by_ref() {
            // A dropped prefetcher stops a long scan between two examples.
            if self
                .stop
                .as_ref()
                .is_some_and(|s| s.load(Ordering::Relaxed))
            {
                break;
            }
            let example = item?;
            if ascend && bound.is_some_and(|b| example.index >= b) {
                break;
            }
            if self
                .config
                .split_rule
                .split_of(example.index, self.config.split)
                == Some(self.config.split)
            {
                return Ok(Some(example));
            }
        }
        self.source_done = true;
        Ok(None)
    }

    fn next_batch(&mut self) -> Result<Option<RawBatch>> {
        let batch_size = self.config.batch_size;
        let mut examples = Vec::with_capacity(batch_size.min(MAX_RESERVED));
        match self.config.shuffle {
            None => {
                while examples.len() < batch_size {
                    match self.next_selected()? {
                        Some(example) => examples.push(example),
                        None => break,
                    }
                }
            }
            Some(shuffle) => {
                while examples.len() < batch_size {
                    if !self.source_done && self.buffer.len() < shuffle.buffer_size {
                        if let Some(example) = self.next_selected()? {
                            self.buffer.push(example);
                        }
                        continue;
                    }
                    if self.buffer.is_empty() {
                        break;
                    }
                    let pick = self.rng.below(self.buffer.len());
                    examples.push(self.buffer.swap_remove(pick));
                }
            }
        }
        if examples.is_empty() || (self.config.drop_last && examples.len() < batch_size) {
            return Ok(None);
        }
        RawBatch::from_examples(&self.schema, &examples).map(Some)
    }
}

impl<S: ExampleSource> Iterator for Batcher<S> {
    type Item = Result<RawBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.finished {
            return None;
        }
        match self.next_batch() {
            Ok(Some(batch)) => Some(Ok(batch)),
            Ok(None) => {
                self.finished = true;
                None
            }
            Err(error) => {
                self.finished = true;
                Some(Err(error))
            }
        }
    }
}
