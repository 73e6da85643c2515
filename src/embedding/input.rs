//! TBE inputs (indices, offsets, per-sample weights) and the one validation pass that makes the
//! kernels' accesses safe: offsets shape and monotonicity, weights length, and every id inside
//! its table (or skipped, in [`BoundsCheckMode::WarnAndSkip`]).

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::config::{BoundsCheckMode, PoolingMode};
use crate::{DType, Error, Result, Tensor};

/// Borrowed ids or offsets, as i32 or i64 (FBGEMM accepts both).
#[derive(Clone, Copy, Debug)]
pub enum IndexSlice<'a> {
    /// 32-bit values.
    I32(&'a [i32]),
    /// 64-bit values.
    I64(&'a [i64]),
}

impl<'a> IndexSlice<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            IndexSlice::I32(s) => s.len(),
            IndexSlice::I64(s) => s.len(),
        }
    }

    /// True when there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `i` widened to i64.
    pub fn get(&self, i: usize) -> i64 {
        match self {
            IndexSlice::I32(s) => s[i] as i64,
            IndexSlice::I64(s) => s[i],
        }
    }
}

impl<'a> From<&'a [i64]> for IndexSlice<'a> {
    fn from(s: &'a [i64]) -> Self {
        IndexSlice::I64(s)
    }
}

impl<'a> From<&'a [i32]> for IndexSlice<'a> {
    fn from(s: &'a [i32]) -> Self {
        IndexSlice::I32(s)
    }
}

/// One TBE call's sparse input in FBGEMM's layout: `offsets` has `F·B + 1` entries, feature-major
/// (bag `b` of feature `f` is `indices[offsets[f·B + b] .. offsets[f·B + b + 1]]`); ids are row
/// numbers local to the feature's table.
#[derive(Clone, Copy, Debug)]
pub struct TbeInput<'a> {
    /// Row ids.
    pub indices: IndexSlice<'a>,
    /// Bag boundaries, `F·B + 1` entries.
    pub offsets: IndexSlice<'a>,
    /// One weight per id, or none.
    pub per_sample_weights: Option<&'a [f32]>,
}

impl<'a> TbeInput<'a> {
    /// An unweighted input.
    pub fn new(indices: impl Into<IndexSlice<'a>>, offsets: impl Into<IndexSlice<'a>>) -> Self {
        TbeInput {
            indices: indices.into(),
            offsets: offsets.into(),
            per_sample_weights: None,
        }
    }

    /// The same input with per-sample weights.
    pub fn with_weights(mut self, weights: &'a [f32]) -> Self {
        self.per_sample_weights = Some(weights);
        self
    }
}

/// An id type the kernels read.
pub(crate) trait IndexValue: Copy + Send + Sync + 'static {
    fn to_usize(self) -> usize;
}
impl IndexValue for i32 {
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as u32 as usize
    }
}
impl IndexValue for i64 {
    #[inline(always)]
    fn to_usize(self) -> usize {
        self as u64 as usize
    }
}

/// Ids after validation: borrowed when nothing had to be skipped.
#[derive(Clone, Debug)]
pub(crate) enum Ids<'a> {
    I32(Cow<'a, [i32]>),
    I64(Cow<'a, [i64]>),
}

impl Ids<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Ids::I32(s) => s.len(),
            Ids::I64(s) => s.len(),
        }
    }

    pub(crate) fn get(&self, i: usize) -> usize {
        match self {
            Ids::I32(s) => s[i].to_usize(),
            Ids::I64(s) => s[i].to_usize(),
        }
    }

    pub(crate) fn into_owned(self) -> Ids<'static> {
        match self {
            Ids::I32(s) => Ids::I32(Cow::Owned(s.into_owned())),
            Ids::I64(s) => Ids::I64(Cow::Owned(s.into_owned())),
        }
    }
}

/// A validated batch: every id is inside its table, offsets are monotone and end at the
/// number of ids.
#[derive(Clone, Debug)]
pub(crate) struct Batch<'a> {
    pub ids: Ids<'a>,
    pub offsets: Vec<usize>,
    pub weights: Option<Cow<'a, [f32]>>,
    pub batch_size: usize,
    pub num_features: usize,
    /// When ids were skipped: the original position of every kept id, and how many ids the
    /// caller gave (gradients of per-sample weights are reported in the caller's positions).
    pub kept: Option<(Vec<usize>, usize)>,
}

impl Batch<'_> {
    pub(crate) fn into_owned(self) -> Batch<'static> {
        Batch {
            ids: self.ids.into_owned(),
            offsets: self.offsets,
            weights: self.weights.map(|w| Cow::Owned(w.into_owned())),
            batch_size: self.batch_size,
            num_features: self.num_features,
            kept: self.kept,
        }
    }

    /// Range of ids of bag `bag` (`f·B + b`).
    #[inline]
    pub(crate) fn bag(&self, bag: usize) -> std::ops::Range<usize> {
        self.offsets[bag]..self.offsets[bag + 1]
    }

    /// Rows of a lookup's output (and of its gradient): one per sample when pooled, one per
    /// id when not.
    pub(crate) fn output_rows(&self, pooling: PoolingMode) -> usize {
        if pooling == PoolingMode::None {
            self.ids.len()
        } else {
            self.batch_size
        }
    }

    /// Checks a caller's buffer for a pooled lookup of this batch into it (`forward_into`):
    /// the operator must pool and the buffer hold `B × out_stride` values.
    pub(crate) fn check_pooled_buffer(
        &self,
        op: &'static str,
        pooling: PoolingMode,
        out_stride: usize,
        len: usize,
    ) -> Result<()> {
        if pooling == PoolingMode::None || len != self.batch_size * out_stride {
            return Err(Error::invalid(
                op,
                format!(
                    "forward_into needs a pooled operator and {}×{out_stride} outputs, got {len}",
                    self.batch_size
                ),
            ));
        }
        Ok(())
    }
}

/// What the validation pass needs to know about each feature.
pub(crate) struct FeatureBounds<'a> {
    /// Rows of the feature's table.
    pub rows: usize,
    /// Feature name (for messages).
    pub feature: &'a str,
    /// Table name (for messages).
    pub table: &'a str,
}

/// Counts skipped ids and prints the first warning only.
#[derive(Debug, Default)]
pub(crate) struct SkipCounter {
    pub skipped: AtomicU64,
    warned: AtomicBool,
}

/// Checks `input` against the features' tables; in [`BoundsCheckMode::WarnAndSkip`] returns a
/// copy without the out-of-range ids, unless `sequence` (pooling NONE: every id keeps its
/// output row, so skipping one would shift the rows after it) makes them errors too.
pub(crate) fn validate<'a>(
    op: &'static str,
    input: TbeInput<'a>,
    features: &[FeatureBounds<'_>],
    mode: BoundsCheckMode,
    sequence: bool,
    counter: &SkipCounter,
) -> Result<Batch<'a>> {
    let num_features = features.len();
    if num_features == 0 {
        return Err(Error::invalid(op, "the operator has no features"));
    }
    let n_off = input.offsets.len();
    if n_off == 0 || (n_off - 1) % num_features != 0 {
        return Err(Error::invalid(
            op,
            format!(
                "offsets has {n_off} entries; expected F·B + 1 with F = {num_features} features \
                 (FBGEMM layout, feature-major)"
            ),
        ));
    }
    let batch_size = (n_off - 1) / num_features;
    let offsets = match input.offsets {
        IndexSlice::I32(s) => monotone_offsets(s),
        IndexSlice::I64(s) => monotone_offsets(s),
    };
    let offsets = offsets.map_err(|i| {
        let (o, prev) = (
            input.offsets.get(i),
            if i > 0 { input.offsets.get(i - 1) } else { 0 },
        );
        Error::invalid(
            op,
            format!(
                "offsets must be non-negative and non-decreasing: offsets[{i}] = {o} after \
                 {prev} (feature {}, bag {})",
                i.saturating_sub(1) / batch_size.max(1),
                i.saturating_sub(1) % batch_size.max(1)
            ),
        )
    })?;
    let n_ids = input.indices.len();
    if offsets[0] != 0 || offsets[n_off - 1] != n_ids {
        return Err(Error::invalid(
            op,
            format!(
                "offsets must start at 0 and end at the number of indices: they run {}..{} but \
                 there are {n_ids} indices",
                offsets[0],
                offsets[n_off - 1]
            ),
        ));
    }
    if let Some(w) = input.per_sample_weights {
        if w.len() != n_ids {
            return Err(Error::invalid(
                op,
                format!(
                    "per_sample_weights has {} entries but there are {n_ids} indices",
                    w.len()
                ),
            ));
        }
        // A NaN or infinite weight would poison the pooled rows and, in training, the table
        // rows its gradient reaches; name the first one.
        if let Some(at) = w.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                op,
                format!(
                    "per_sample_weights[{at}] is {}: weights must be finite",
                    w[at]
                ),
            ));
        }
    }
    // The fast pass: one branch-free scan per feature over its (contiguous) ids, features in
    // parallel when the batch is large. Only features with an id out of range are walked again
    // bag by bag, to name the first one or collect the positions to skip.
    let feature_ids = |f: usize| offsets[f * batch_size]..offsets[(f + 1) * batch_size];
    let feature_bad = |f: usize| match input.indices {
        IndexSlice::I32(s) => any_out_of_range(&s[feature_ids(f)], features[f].rows),
        IndexSlice::I64(s) => any_out_of_range(&s[feature_ids(f)], features[f].rows),
    };
    let bad_features: Vec<bool> = if n_ids >= PARALLEL_VALIDATION_IDS {
        use rayon::prelude::*;
        (0..num_features).into_par_iter().map(feature_bad).collect()
    } else {
        (0..num_features).map(feature_bad).collect()
    };
    let mut bad: Vec<usize> = Vec::new();
    for (f, feat) in features.iter().enumerate() {
        if !bad_features[f] {
            continue;
        }
        for b in 0..batch_size {
            let bag = f * batch_size + b;
            for p in offsets[bag]..offsets[bag + 1] {
                let id = input.indices.get(p);
                if out_of_range(id, feat.rows) {
                    if mode == BoundsCheckMode::Error || sequence {
                        return Err(Error::invalid(
                            op,
                            format!(
                                "feature `{}` (table `{}`), bag {b}: id {id} at position {p} is \
                                 out of range for a table of {} rows{}",
                                feat.feature,
                                feat.table,
                                feat.rows,
                                if sequence && mode == BoundsCheckMode::WarnAndSkip {
                                    " (with pooling NONE each id has its output row: skipping \
                                     it would shift the rows after it, so it is not skipped)"
                                } else {
                                    ""
                                }
                            ),
                        ));
                    }
                    if !counter.warned.swap(true, Ordering::Relaxed) {
                        eprintln!(
                            "warning: {op}: feature `{}` (table `{}`), bag {b}: id {id} at \
                             position {p} is out of range for {} rows; skipping it (further \
                             skips are only counted)",
                            feat.feature, feat.table, feat.rows
                        );
                    }
                    bad.push(p);
                }
            }
        }
    }
    if bad.is_empty() {
        let ids = match input.indices {
            IndexSlice::I32(s) => Ids::I32(Cow::Borrowed(s)),
            IndexSlice::I64(s) => Ids::I64(Cow::Borrowed(s)),
        };
        return Ok(Batch {
            ids,
            offsets,
            weights: input.per_sample_weights.map(Cow::Borrowed),
            batch_size,
            num_features,
            kept: None,
        });
    }
    counter
        .skipped
        .fetch_add(bad.len() as u64, Ordering::Relaxed);
    // Rebuild the batch without the skipped ids (rare path, one copy).
    let mut keep = vec![true; n_ids];
    for &p in &bad {
        keep[p] = false;
    }
    let mut new_offsets = Vec::with_capacity(n_off);
    let mut new_ids: Vec<i64> = Vec::with_capacity(n_ids - bad.len());
    let mut new_weights: Option<Vec<f32>> = input.per_sample_weights.map(|_| Vec::new());
    let mut kept = Vec::with_capacity(n_ids - bad.len());
    new_offsets.push(0);
    for bag in 0..n_off - 1 {
        for p in offsets[bag]..offsets[bag + 1] {
            if keep[p] {
                kept.push(p);
                new_ids.push(input.indices.get(p));
                if let (Some(nw), Some(w)) = (new_weights.as_mut(), input.per_sample_weights) {
                    nw.push(w[p]);
                }
            }
        }
        new_offsets.push(new_ids.len());
    }
    Ok(Batch {
        ids: Ids::I64(Cow::Owned(new_ids)),
        offsets: new_offsets,
        weights: new_weights.map(Cow::Owned),
        batch_size,
        num_features,
        kept: Some((kept, n_ids)),
    })
}

/// Batches of at least this many ids check their features in parallel (below it, the rayon
/// round trip costs more than the scan).
const PARALLEL_VALIDATION_IDS: usize = 1 << 15;

/// The offsets as `usize`, or the position of the first one that is negative or below its
/// predecessor.
fn monotone_offsets<I: Copy + Into<i64>>(s: &[I]) -> std::result::Result<Vec<usize>, usize> {
    let mut prev = 0i64;
    let mut out = Vec::with_capacity(s.len());
    for (i, &o) in s.iter().enumerate() {
        let o: i64 = o.into();
        if o < prev {
            return Err(i);
        }
        prev = o;
        out.push(o as usize);
    }
    Ok(out)
}

/// Whether `id` lies outside `0..rows` (a negative id widens to a huge `u64`).
#[inline(always)]
fn out_of_range(id: i64, rows: usize) -> bool {
    id as u64 >= rows as u64
}

/// Whether any id lies outside `0..rows`. Branch-free inside blocks of 1024 ids, so the
/// compiler vectorises it.
fn any_out_of_range<I: Copy + Into<i64>>(ids: &[I], rows: usize) -> bool {
    ids.chunks(1024).any(|block| {
        block
            .iter()
            .fold(false, |bad, &id| bad | out_of_range(id.into(), rows))
    })
}

/// Calls `f` with a [`TbeInput`] borrowed from tensors (i32/i64 indices and offsets, f32
/// weights).
pub(crate) fn with_tensor_input<R>(
    op: &'static str,
    indices: &Tensor,
    offsets: &Tensor,
    per_sample_weights: Option<&Tensor>,
    f: impl FnOnce(TbeInput<'_>) -> Result<R>,
) -> Result<R> {
    for (what, t) in [("indices", indices), ("offsets", offsets)] {
        if t.rank() != 1 {
            return Err(Error::invalid(
                op,
                format!("{what} must be 1-D, got shape {:?}", t.shape()),
            ));
        }
        if !matches!(t.dtype(), DType::I32 | DType::I64) {
            return Err(Error::UnsupportedDType {
                op,
                dtype: t.dtype(),
                expected: "i32 or i64 indices and offsets",
            });
        }
    }
    if let Some(w) = per_sample_weights {
        if w.dtype() != DType::F32 || w.rank() != 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "per_sample_weights must be a 1-D f32 tensor, got {:?} {:?}",
                    w.dtype(),
                    w.shape()
                ),
            ));
        }
    }
    let ids: Ids<'static> = match indices.dtype() {
        DType::I32 => Ids::I32(Cow::Owned(indices.to_vec::<i32>()?)),
        _ => Ids::I64(Cow::Owned(indices.to_vec::<i64>()?)),
    };
    let offs: Ids<'static> = match offsets.dtype() {
        DType::I32 => Ids::I32(Cow::Owned(offsets.to_vec::<i32>()?)),
        _ => Ids::I64(Cow::Owned(offsets.to_vec::<i64>()?)),
    };
    let weights = per_sample_weights.map(|w| w.to_vec::<f32>()).transpose()?;
    fn as_slice<'b>(x: &'b Ids<'static>) -> IndexSlice<'b> {
        match x {
            Ids::I32(v) => IndexSlice::I32(v),
            Ids::I64(v) => IndexSlice::I64(v),
        }
    }
    f(TbeInput {
        indices: as_slice(&ids),
        offsets: as_slice(&offs),
        per_sample_weights: weights.as_deref(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch of `features` features × `batch` bags of random lengths 0..8 over tables of
    /// `rows[f]` rows, every id in range; returns (ids, offsets).
    fn random_batch(rows: &[usize], batch: usize, seed: u64) -> (Vec<i64>, Vec<i64>) {
        use rand::Rng as _;
        let mut rng = crate::tensor::rng::seeded(seed);
        let (mut ids, mut offsets) = (Vec::new(), vec![0i64]);
        for &r in rows {
            for _ in 0..batch {
                for _ in 0..rng.random_range(0..8) {
                    ids.push(rng.random_range(0..r as i64));
                }
                offsets.push(ids.len() as i64);
            }
        }
        (ids, offsets)
    }

    /// Validates `ids` / `offsets` against `features` in `mode`.
    fn check<'a, I: ?Sized>(
        ids: &'a I,
        offsets: &'a I,
        features: &[FeatureBounds<'_>],
        mode: BoundsCheckMode,
    ) -> Result<Batch<'a>>
    where
        &'a I: Into<IndexSlice<'a>>,
    {
        validate(
            "test",
            TbeInput::new(ids, offsets),
            features,
            mode,
            false,
            &SkipCounter::default(),
        )
    }

    fn bounds<'a>(rows: &[usize], names: &'a [String]) -> Vec<FeatureBounds<'a>> {
        rows.iter()
            .zip(names)
            .map(|(&rows, name)| FeatureBounds {
                rows,
                feature: name,
                table: name,
            })
            .collect()
    }

    /// The positions a naive walk finds out of range, in order.
    fn naive_bad(ids: &[i64], offsets: &[i64], rows: &[usize], batch: usize) -> Vec<usize> {
        let mut bad = Vec::new();
        for (f, &r) in rows.iter().enumerate() {
            let (s, e) = (
                offsets[f * batch] as usize,
                offsets[(f + 1) * batch] as usize,
            );
            bad.extend((s..e).filter(|&p| ids[p] < 0 || ids[p] as u64 >= r as u64));
        }
        bad
    }

    /// Small batches (serial scan) and large ones (features in parallel), i64 and i32 ids,
    /// with bad ids planted anywhere (negative, equal to the row count, huge): the error
    /// names the first bad id in feature order, and skipping drops exactly the bad ones.
    #[test]
    fn validation_finds_every_bad_id_small_and_large_batches() {
        let rows = [5usize, 1000, 1 << 20, 7];
        let names: Vec<String> = (0..rows.len()).map(|f| format!("f{f}")).collect();
        let features = bounds(&rows, &names);
        for (batch, seed) in [(3usize, 1u64), (40, 2), (4096, 3), (6000, 4)] {
            let (clean, offsets) = random_batch(&rows, batch, seed);
            let large = clean.len() >= PARALLEL_VALIDATION_IDS;
            assert_eq!(large, batch >= 4096, "batch {batch}: {} ids", clean.len());
            let ok = check(&clean[..], &offsets[..], &features, BoundsCheckMode::Error).unwrap();
            assert!(matches!(ok.ids, Ids::I64(Cow::Borrowed(_))) && ok.kept.is_none());
            for (k, bad_value) in [-1i64, 5, 1000, 1 << 20, 7, i64::MAX, i64::MIN]
                .into_iter()
                .enumerate()
            {
                let mut ids = clean.clone();
                // Plant the bad value in a feature whose table it overflows, plus a second
                // one later, and compare against the naive walk.
                let f = match bad_value {
                    5 => 0,
                    1000 => 1,
                    0x10_0000 => 2,
                    7 => 3,
                    _ => k % rows.len(),
                };
                let (s, e) = (
                    offsets[f * batch] as usize,
                    offsets[(f + 1) * batch] as usize,
                );
                if s == e {
                    continue;
                }
                let p = s + (seed as usize * 31 + k * 17) % (e - s);
                ids[p] = bad_value;
                let last = ids.len() - 1;
                if p != last {
                    ids[last] = -5;
                }
                let expected = naive_bad(&ids, &offsets, &rows, batch);
                assert_eq!(expected[0], p);
                let err = check(&ids[..], &offsets[..], &features, BoundsCheckMode::Error)
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains(&format!("feature `f{f}`"))
                        && err.contains(&format!("id {bad_value} at position {p}")),
                    "batch {batch}: {err}"
                );
                // The same through i32 ids where the value fits (every other id does).
                if i32::try_from(bad_value).is_ok() {
                    let ids32: Vec<i32> = ids.iter().map(|&x| x as i32).collect();
                    let offs32: Vec<i32> = offsets.iter().map(|&o| o as i32).collect();
                    let err32 = check(&ids32[..], &offs32[..], &features, BoundsCheckMode::Error)
                        .unwrap_err()
                        .to_string();
                    assert!(err32.contains(&format!("at position {p}")), "{err32}");
                }
                let skipped = check(
                    &ids[..],
                    &offsets[..],
                    &features,
                    BoundsCheckMode::WarnAndSkip,
                )
                .unwrap();
                let (kept, n) = skipped.kept.clone().unwrap();
                assert_eq!(n, ids.len());
                let kept_expected: Vec<usize> =
                    (0..ids.len()).filter(|p| !expected.contains(p)).collect();
                assert_eq!(kept, kept_expected, "batch {batch} value {bad_value}");
            }
        }
    }

    #[test]
    fn validation_names_the_first_bad_offset() {
        let rows = [10usize, 10];
        let names: Vec<String> = vec!["a".into(), "b".into()];
        let features = bounds(&rows, &names);
        let ids = [1i64, 2, 3, 4];
        for (offsets, needle) in [
            ([-1i64, 1, 2, 3, 4], "offsets[0] = -1 after 0"),
            ([0, 3, 2, 3, 4], "offsets[2] = 2 after 3 (feature 0, bag 1)"),
            ([0, 1, 2, 4, 3], "offsets[4] = 3 after 4 (feature 1, bag 1)"),
        ] {
            let err = check(&ids[..], &offsets[..], &features, BoundsCheckMode::Error)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
