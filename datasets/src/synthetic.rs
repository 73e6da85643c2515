//! A seeded, counter-based Criteo-shaped generator with a planted logistic signal.

use std::ops::Range;

use rayon::prelude::*;
use std::sync::Arc;

use crate::hashing::{hash_words, standard_normal, unit_open};
use crate::{
    tie_corrected_auc, DatasetError, DenseTransform, Example, ExampleSource, FeatureSchema, Result,
    Split, ZipfSampler,
};

// Domain-separation salts: each random quantity hashes a different word so they never collide.
const SALT_ID: u64 = 0x1D5;
const SALT_EFFECT: u64 = 0xEFF;
const SALT_DENSE: u64 = 0xDE5;
const SALT_LABEL: u64 = 0x1AB;
const SALT_WEIGHT: u64 = 0x3E1;
const SALT_MEAN: u64 = 0x3EA;

/// √½: a task's effects mix task 0's and its own with equal weight and unit variance.
const HALF_SQRT: f64 = std::f64::consts::FRAC_1_SQRT_2;

/// Parameters of [`SyntheticCriteo`]. Every field has a default; see [`Default`].
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticCriteoConfig {
    /// Seed of everything (ids, dense values, effects, labels).
    pub seed: u64,
    /// Rows of each categorical table; its length is the number of sparse features.
    /// Default: 26 tables of 1000 rows (small enough that a few minutes of training sees
    /// the effects of most ids several times).
    pub table_sizes: Vec<u64>,
    /// Ids drawn per sample for each feature (≥ 1; 1 = one-hot as in Criteo). Same length as
    /// `table_sizes`.
    pub ids_per_feature: Vec<u32>,
    /// Zipf exponent `s` of id frequencies (P(rank k) ∝ k^-s); id 0 is the most frequent.
    /// Default 1.1.
    pub zipf_exponent: f64,
    /// Number of dense features (default 13).
    pub num_dense: usize,
    /// Dense features are `ln(1 + count)` with count geometric of a per-feature mean drawn
    /// log-uniformly from this range (default 1 to 100).
    pub dense_count_mean_range: (f64, f64),
    /// Logit offset (default -1.2: a click rate of about 0.36 with the other defaults).
    pub bias: f64,
    /// Standard deviation of the per-dense-feature weights (default 0.3).
    pub dense_weight_std: f64,
    /// Standard deviation of the per-id effect on the logit (default 0.25; with the other
    /// defaults the best achievable AUC is about 0.83, near what models reach on Criteo).
    pub sparse_effect_std: f64,
    /// Examples in the training split (indices `0..num_train`).
    pub num_train: u64,
    /// Examples in the validation split (the next `num_validation` indices).
    pub num_validation: u64,
    /// Examples in the test split (the next `num_test` indices).
    pub num_test: u64,
    /// Tasks (label columns; default 1). Task 0 is `click`; task `t` ≥ 1 (`task<t>`) has its
    /// own dense weights and id effects, each `√½·(task 0's) + √½·(its own draw)` — related
    /// tasks (correlation ½ of the effects), each with its own labels drawn independently.
    pub num_tasks: usize,
}

impl Default for SyntheticCriteoConfig {
    fn default() -> Self {
        SyntheticCriteoConfig {
            seed: 0,
            table_sizes: vec![1000; 26],
            ids_per_feature: vec![1; 26],
            zipf_exponent: 1.1,
            num_dense: 13,
            dense_count_mean_range: (1.0, 100.0),
            bias: -1.2,
            dense_weight_std: 0.3,
            sparse_effect_std: 0.25,
            num_train: 1_000_000,
            num_validation: 100_000,
            num_test: 100_000,
            num_tasks: 1,
        }
    }
}

#[derive(Debug)]
struct Generator {
    config: SyntheticCriteoConfig,
    schema: FeatureSchema,
    zipf: Vec<ZipfSampler>,
    /// Dense weights of each task (`[task][feature]`).
    dense_weights: Vec<Vec<f64>>,
    dense_means: Vec<f64>,
    /// E[ln(1 + count)] per dense feature, subtracted so dense weights don't move the click rate.
    dense_centres: Vec<f64>,
}

/// Criteo-shaped synthetic data whose labels follow a known logistic model.
///
/// Example `i` is a pure function of `(seed, i)` ("counter-based"): no state, no stored
/// tables, any index range can be generated on any thread, and splits are disjoint index
/// ranges (train `0..num_train`, then validation, then test).
///
/// For example `i`: feature `f` draws `ids_per_feature[f]` Zipf(s) ranks `k` in
/// `1..=table_sizes[f]` and uses id `k − 1`; dense `j` is `ln(1 + c)` with `c` geometric of
/// mean `m_j`; then
///
/// `logit = bias + Σ_j w_j (dense_j − E[dense_j]) + Σ_f mean over ids of effect_f(id)`,
///
/// with `effect_f(id) = sparse_effect_std · N(0,1)` from a seeded hash of `(f, id)` (so no
/// table-sized storage), and `label ~ Bernoulli(sigmoid(logit))`. The probability is kept
/// with each example, so the best achievable AUC is the AUC of that probability against
/// the drawn labels ([`SyntheticCriteo::best_auc`]).
#[derive(Debug, Clone)]
pub struct SyntheticCriteo {
    inner: Arc<Generator>,
}

impl SyntheticCriteo {
    /// Validates `config` and prepares the (tiny) per-feature parameters.
    pub fn new(config: SyntheticCriteoConfig) -> Result<Self> {
        let invalid = |m: String| Err(DatasetError::InvalidConfig(m));
        if config.table_sizes.is_empty() {
            return invalid("at least one table is needed".to_string());
        }
        if config.ids_per_feature.len() != config.table_sizes.len() {
            return invalid(format!(
                "ids_per_feature has {} entries, table_sizes has {}",
                config.ids_per_feature.len(),
                config.table_sizes.len()
            ));
        }
        if let Some(f) = config.ids_per_feature.iter().position(|&n| n == 0) {
            return invalid(format!("ids_per_feature[{f}] must be at least 1"));
        }
        // Each example holds all its ids at once: bounded, as a record is.
        let total_ids: u64 = config.ids_per_feature.iter().map(|&n| u64::from(n)).sum();
        if total_ids > MAX_IDS_PER_EXAMPLE {
            return invalid(format!(
                "ids_per_feature sums to {total_ids} ids per example, past {MAX_IDS_PER_EXAMPLE}"
            ));
        }
        if config.num_dense > MAX_DENSE {
            return invalid(format!(
                "num_dense {} is past {MAX_DENSE}",
                config.num_dense
            ));
        }
        if let Some(f) = config
            .table_sizes
            .iter()
            .position(|&n| n == 0 || n > i64::MAX as u64)
        {
            return invalid(format!("table_sizes[{f}] must be in 1..=i64::MAX"));
        }
        let (low, high) = config.dense_count_mean_range;
        // Above MAX_DENSE_MEAN the count's law loses precision (m / (m + 1) rounds toward 1)
        // and the centring series is cut short.
        if !(low.is_finite() && high.is_finite() && low > 0.0 && low <= high)
            || high > MAX_DENSE_MEAN
        {
            return invalid(format!(
                "dense_count_mean_range must satisfy 0 < low <= high <= {MAX_DENSE_MEAN:e}, got \
                 ({low}, {high})"
            ));
        }
        for (name, value) in [
            ("bias", config.bias),
            ("dense_weight_std", config.dense_weight_std),
            ("sparse_effect_std", config.sparse_effect_std),
        ] {
            if !value.is_finite() {
                return invalid(format!("{name} must be finite, got {value}"));
            }
        }
        if config.num_tasks == 0 || config.num_tasks > 1024 {
            return invalid(format!(
                "num_tasks must be in 1..=1024, got {}",
                config.num_tasks
            ));
        }
        if config
            .num_train
            .checked_add(config.num_validation)
            .and_then(|n| n.checked_add(config.num_test))
            .is_none()
        {
            return invalid("split sizes overflow u64".to_string());
        }
        let zipf = config
            .table_sizes
            .iter()
            .map(|&n| ZipfSampler::new(n, config.zipf_exponent))
            .collect::<Result<Vec<_>>>()?;
        let seed = config.seed;
        let std = config.dense_weight_std;
        let first: Vec<f64> = (0..config.num_dense as u64)
            .map(|j| std * standard_normal(hash_words(&[seed, SALT_WEIGHT, j])))
            .collect();
        let dense_weights: Vec<Vec<f64>> = (0..config.num_tasks as u64)
            .map(|t| match t {
                0 => first.clone(),
                _ => (first.iter().enumerate())
                    .map(|(j, w0)| {
                        let own =
                            std * standard_normal(hash_words(&[seed, SALT_WEIGHT, j as u64, t]));
                        HALF_SQRT * (w0 + own)
                    })
                    .collect(),
            })
            .collect();
        let dense_means: Vec<f64> = (0..config.num_dense as u64)
            .map(|j| {
                let u = unit_open(hash_words(&[seed, SALT_MEAN, j]));
                (low.ln() + u * (high.ln() - low.ln())).exp()
            })
            .collect();
        let dense_centres = dense_means
            .iter()
            .map(|&m| expected_log1p_geometric(m))
            .collect();
        let schema = FeatureSchema {
            dense_names: (0..config.num_dense).map(|j| format!("int_{j}")).collect(),
            sparse_keys: (0..config.table_sizes.len())
                .map(|f| format!("cat_{f}"))
                .collect(),
            tasks: (0..config.num_tasks)
                .map(|t| match t {
                    0 => "click".to_string(),
                    _ => format!("task{t}"),
                })
                .collect(),
        };
        Ok(SyntheticCriteo {
            inner: Arc::new(Generator {
                config,
                schema,
                zipf,
                dense_weights,
                dense_means,
                dense_centres,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SyntheticCriteoConfig {
        &self.inner.config
    }

    /// The schema (`int_j` dense names, `cat_f` keys, one task).
    pub fn schema(&self) -> &FeatureSchema {
        &self.inner.schema
    }

    /// Index range of a split: train, validation and test are consecutive, disjoint ranges.
    pub fn split_range(&self, split: Split) -> Range<u64> {
        let c = &self.inner.config;
        let validation_start = c.num_train;
        let test_start = validation_start + c.num_validation;
        match split {
            Split::Train => 0..c.num_train,
            Split::Validation => validation_start..test_start,
            Split::Test => test_start..test_start + c.num_test,
        }
    }

    /// The effect of id `id` of feature `feature` on the logit (0 outside the table).
    pub fn sparse_effect(&self, feature: usize, id: i64) -> f64 {
        self.task_sparse_effect(0, feature, id)
    }

    /// The planted logit effect of id `id` of sparse feature `feature` on task `task` (0 for an
    /// id outside the table or a task the data does not have).
    pub fn task_sparse_effect(&self, task: usize, feature: usize, id: i64) -> f64 {
        let c = &self.inner.config;
        match c.table_sizes.get(feature) {
            Some(&size) if id >= 0 && (id as u64) < size && task < c.num_tasks => {
                let (f, i) = (feature as u64, id as u64);
                let draw = |words: &[u64]| c.sparse_effect_std * standard_normal(hash_words(words));
                let first = draw(&[c.seed, SALT_EFFECT, f, i]);
                match task {
                    0 => first,
                    t => HALF_SQRT * (first + draw(&[c.seed, SALT_EFFECT, f, i, t as u64])),
                }
            }
            _ => 0.0,
        }
    }

    /// Example `index`, a pure function of the seed and `index`.
    pub fn example(&self, index: u64) -> Example {
        self.example_with_probabilities(index).0
    }

    /// Example `index` and the probability each task's label was drawn with.
    pub fn example_with_probabilities(&self, index: u64) -> (Example, Vec<f64>) {
        let g = &*self.inner;
        let c = &g.config;
        let seed = c.seed;
        let tasks = c.num_tasks;
        let mut logits = vec![c.bias; tasks];
        let mut dense = Vec::with_capacity(c.num_dense);
        for j in 0..c.num_dense {
            let u = unit_open(hash_words(&[seed, SALT_DENSE, index, j as u64]));
            // Geometric count on {0, 1, …} with mean m: floor(ln u / ln(m / (m + 1))).
            let m = g.dense_means[j];
            let count = (u.ln() / (m / (m + 1.0)).ln()).floor();
            let value = DenseTransform::Log1p.apply(count);
            for (logit, weights) in logits.iter_mut().zip(&g.dense_weights) {
                *logit += weights[j] * (f64::from(value) - g.dense_centres[j]);
            }
            dense.push(value);
        }
        let total_ids: usize = c.ids_per_feature.iter().map(|&n| n as usize).sum();
        let mut ids = Vec::with_capacity(total_ids);
        let mut lengths = Vec::with_capacity(c.table_sizes.len());
        let mut effects = vec![0.0; tasks];
        for (f, sampler) in g.zipf.iter().enumerate() {
            let count = c.ids_per_feature[f];
            effects.iter_mut().for_each(|e| *e = 0.0);
            for slot in 0..u64::from(count) {
                let mut attempt = 0u64;
                let rank = sampler.sample(|| {
                    attempt += 1;
                    unit_open(hash_words(&[seed, SALT_ID, index, f as u64, slot, attempt]))
                });
                let id = (rank - 1) as i64;
                for (t, effect) in effects.iter_mut().enumerate() {
                    *effect += self.task_sparse_effect(t, f, id);
                }
                ids.push(id);
            }
            for (logit, effect) in logits.iter_mut().zip(&effects) {
                *logit += effect / f64::from(count);
            }
            lengths.push(count as i32);
        }
        let probabilities: Vec<f64> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
        let labels = (probabilities.iter().enumerate())
            .map(|(t, &p)| {
                let u = match t {
                    0 => unit_open(hash_words(&[seed, SALT_LABEL, index])),
                    _ => unit_open(hash_words(&[seed, SALT_LABEL, index, t as u64])),
                };
                if u < p {
                    1.0
                } else {
                    0.0
                }
            })
            .collect();
        let example = Example {
            index,
            dense,
            ids,
            lengths,
            labels,
            true_probability: Some(probabilities[0] as f32),
        };
        (example, probabilities)
    }

    /// A source yielding examples `range` in order.
    pub fn examples(&self, range: Range<u64>) -> SyntheticExamples {
        SyntheticExamples {
            generator: self.clone(),
            range,
            ready: std::collections::VecDeque::new(),
        }
    }

    /// A source yielding the examples of `split`.
    pub fn split(&self, split: Split) -> SyntheticExamples {
        self.examples(self.split_range(split))
    }

    /// The best achievable AUC on `split`: the tie-correct AUC of the true probability against
    /// the drawn labels, over the split's first `max_examples` examples (all when `None`).
    /// `None` when the split is empty or has a single class. The first task's; see
    /// [`best_task_auc`](Self::best_task_auc) for the others.
    pub fn best_auc(&self, split: Split, max_examples: Option<u64>) -> Option<f64> {
        self.best_task_auc(split, 0, max_examples)
    }

    /// [`best_auc`](Self::best_auc) of task `task` (`None` also for a task the data lacks).
    pub fn best_task_auc(
        &self,
        split: Split,
        task: usize,
        max_examples: Option<u64>,
    ) -> Option<f64> {
        if task >= self.inner.config.num_tasks {
            return None;
        }
        let range = self.split_range(split);
        let end = match max_examples {
            Some(n) => range.start + n.min(range.end - range.start),
            None => range.end,
        };
        // Reserved up to a bound, grown past it: a split past any memory is computed as far
        // as memory goes rather than aborting on the reservation.
        let reserve = (end - range.start).min(1 << 20) as usize;
        let mut probabilities = Vec::with_capacity(reserve);
        let mut labels = Vec::with_capacity(reserve);
        for index in range.start..end {
            let (example, p) = self.example_with_probabilities(index);
            probabilities.push(p[task] as f32);
            labels.push(example.labels[task]);
        }
        tie_corrected_auc(&probabilities, &labels)
    }
}

/// The most ids one synthetic example holds, over all its features.
pub(crate) const MAX_IDS_PER_EXAMPLE: u64 = 1 << 20;
/// The most dense features a synthetic example holds.
pub(crate) const MAX_DENSE: usize = 1 << 16;
/// The largest mean count of a synthetic dense feature.
pub(crate) const MAX_DENSE_MEAN: f64 = 1e4;

/// E[ln(1 + C)] for C geometric on {0, 1, …} with mean m, summed until the tail is negligible.
fn expected_log1p_geometric(m: f64) -> f64 {
    let q = m / (m + 1.0);
    let mut probability = 1.0 - q;
    let mut expectation = 0.0;
    let mut k = 0.0f64;
    while probability > 1e-12 || k < 10.0 {
        expectation += probability * k.ln_1p();
        probability *= q;
        k += 1.0;
        if k > 1e6 {
            break;
        }
    }
    expectation
}

/// Examples generated at once, in parallel, by [`SyntheticExamples`].
const CHUNK: u64 = 1024;

/// The generator's own threads: a quarter of the machine's (none below 8 cores, where the
/// caller's thread generates alone). Not rayon's global pool, which training uses: generation
/// jobs queued there would stall the training step's parallel ops.
fn generator_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = cores / 4;
        if threads < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("embers-synthetic-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// An index range of a [`SyntheticCriteo`], as an [`ExampleSource`]. On machines of 8 cores or
/// more, examples are generated 1024 at a time on a pool of a quarter of the cores (each
/// is a pure function of its index, so the sequence is the same as one at a time): a GPU
/// trains faster than one core generates.
#[derive(Debug, Clone)]
pub struct SyntheticExamples {
    generator: SyntheticCriteo,
    /// Indices not generated yet.
    range: Range<u64>,
    /// Generated examples not yet returned, in index order (before `range`).
    ready: std::collections::VecDeque<Example>,
}

impl Iterator for SyntheticExamples {
    type Item = Result<Example>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.ready.is_empty() {
            let start = self.range.start;
            let end = self.range.end.min(start.saturating_add(CHUNK));
            if start >= end {
                return None;
            }
            self.range.start = end;
            let generator = &self.generator;
            match generator_pool() {
                Some(pool) => {
                    let chunk: Vec<Example> = pool.install(|| {
                        (start..end)
                            .into_par_iter()
                            .map(|i| generator.example(i))
                            .collect()
                    });
                    self.ready.extend(chunk);
                }
                None => self
                    .ready
                    .extend((start..end).map(|i| generator.example(i))),
            }
        }
        self.ready.pop_front().map(Ok)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let (low, high) = self.range.size_hint();
        let ready = self.ready.len();
        (
            low.saturating_add(ready),
            high.and_then(|h| h.checked_add(ready)),
        )
    }
}

impl ExampleSource for SyntheticExamples {
    fn schema(&self) -> &FeatureSchema {
        self.generator.schema()
    }

    fn indices_ascend(&self) -> bool {
        true
    }
}
