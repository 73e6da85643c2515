//! `KeyedJaggedTensor`: several sparse features in one values buffer and one lengths buffer,
//! key-major (TorchRec's KJT), with variable batch per key.

use std::sync::Arc;

use super::ops::{
    expect_int, expect_total, gather_row_ranges_tensor, int_tensor, lengths_from_offsets,
    read_ints, validate_offsets,
};
use super::JaggedTensor;
use crate::{DType, Error, Result, Tensor};

/// Sparse features of a batch: `keys`, one `values` buffer (key 0's ids for every sample, then
/// key 1's, ...), optional per-id `weights`, and `lengths` (ids per (key, sample), key-major)
/// with their `offsets`.
///
/// Every key has `stride` samples, or, for a variable-batch KJT, its own count given per rank
/// by `stride_per_key_per_rank` (`stride()` is then the largest per-key count). The per-key
/// bookkeeping (`length_per_key`, `offset_per_key`, where each key's lengths start) is computed
/// once at construction, so `get`, `split` and `permute` never rescan the lengths. Cloning is
/// cheap (tensors are shared).
#[derive(Clone, Debug)]
pub struct KeyedJaggedTensor {
    keys: Arc<Vec<String>>,
    values: Tensor,
    weights: Option<Tensor>,
    lengths: Tensor,
    offsets: Tensor,
    stride: usize,
    stride_per_key_per_rank: Option<Arc<Vec<Vec<usize>>>>,
    meta: Arc<KeyMeta>,
}

/// Per-key bookkeeping derived once from the lengths.
#[derive(Debug)]
struct KeyMeta {
    stride_per_key: Vec<usize>,
    /// Where each key's lengths start (`keys + 1` entries).
    lengths_offset_per_key: Vec<usize>,
    /// Values per key.
    length_per_key: Vec<usize>,
    /// Where each key's values start (`keys + 1` entries).
    offset_per_key: Vec<usize>,
    /// Complete cumsum of all lengths.
    bag_offsets: Vec<i64>,
}

impl KeyMeta {
    fn build(stride_per_key: Vec<usize>, bag_offsets: Vec<i64>) -> Self {
        let mut lengths_offset_per_key = vec![0usize];
        // (Saturating and wrapping: checked by the caller, which refuses what does not add up.)
        for &s in &stride_per_key {
            lengths_offset_per_key.push(lengths_offset_per_key.last().unwrap().saturating_add(s));
        }
        let offset_per_key: Vec<usize> = lengths_offset_per_key
            .iter()
            .map(|&i| bag_offsets.get(i).copied().unwrap_or(0) as usize)
            .collect();
        let length_per_key = (offset_per_key.windows(2))
            .map(|w| w[1].wrapping_sub(w[0]))
            .collect();
        KeyMeta {
            stride_per_key,
            lengths_offset_per_key,
            length_per_key,
            offset_per_key,
            bag_offsets,
        }
    }
}

/// How the batch of each key is given.
enum Strides {
    /// Every key has the same number of samples (inferred from the lengths when `None`).
    Uniform(Option<usize>),
    /// Variable batch: per key, the sample count contributed by each rank.
    PerKeyPerRank(Vec<Vec<usize>>),
}

/// `[0, l0, l0 + l1, ...]` without validation (the caller checks the lengths), saturating:
/// lengths that sum past an `i64` then disagree with these offsets and are refused.
fn running_sum(lengths: &[i64]) -> Vec<i64> {
    let mut out = Vec::with_capacity(lengths.len() + 1);
    let mut total = 0i64;
    out.push(0);
    for &l in lengths {
        total = total.saturating_add(l);
        out.push(total);
    }
    out
}

fn key_at(keys: &[String], lengths_offset_per_key: &[usize], position: usize) -> String {
    let k = lengths_offset_per_key
        .partition_point(|&s| s <= position)
        .saturating_sub(1);
    match keys.get(k) {
        Some(key) => format!(
            "key `{key}`, sample {}",
            position - lengths_offset_per_key[k]
        ),
        None => format!("position {position}"),
    }
}

impl KeyedJaggedTensor {
    #[allow(clippy::too_many_arguments)]
    fn build(
        op: &'static str,
        keys: Vec<String>,
        values: Tensor,
        weights: Option<Tensor>,
        lengths: Option<Tensor>,
        offsets: Option<Tensor>,
        strides: Strides,
        check: bool,
    ) -> Result<Self> {
        if values.rank() == 0 {
            return Err(Error::invalid(
                op,
                "values must have at least one dimension",
            ));
        }
        let offsets_given = lengths.is_none();
        let (lengths, offsets, lens, offs) = match (lengths, offsets) {
            (Some(l), offsets) => {
                expect_int(op, "lengths", &l)?;
                if l.rank() != 1 {
                    return Err(Error::invalid(
                        op,
                        format!("lengths must be 1-D, got shape {:?}", l.shape()),
                    ));
                }
                let lens = read_ints(op, "lengths", &l)?;
                // Negative lengths are reported below with their key and sample.
                let offs = match &offsets {
                    Some(o) => read_ints(op, "offsets", o)?,
                    None => running_sum(&lens),
                };
                let offsets = match offsets {
                    Some(o) => o,
                    None => int_tensor(offs.clone(), &[offs.len()], l.dtype())?,
                };
                (l, offsets, lens, offs)
            }
            (None, Some(o)) => {
                expect_int(op, "offsets", &o)?;
                let offs = read_ints(op, "offsets", &o)?;
                if offs.is_empty() {
                    return Err(Error::invalid(
                        op,
                        "offsets are empty; expected at least one entry (0)",
                    ));
                }
                let lens = lengths_from_offsets(&offs);
                let l = match int_tensor(lens.clone(), &[lens.len()], o.dtype()) {
                    Ok(l) => l,
                    // Lengths past the dtype: decreasing offsets, reported as such.
                    Err(e) => {
                        validate_offsets(op, &offs, |i| format!("position {i}"))?;
                        return Err(e);
                    }
                };
                (l, o, lens, offs)
            }
            (None, None) => {
                return Err(Error::invalid(
                    op,
                    "either lengths or offsets must be given",
                ))
            }
        };
        let (stride, stride_per_key, stride_per_key_per_rank) = match strides {
            Strides::Uniform(given) => {
                let stride = match given {
                    Some(s) => s,
                    None if keys.is_empty() => 0,
                    None => lens.len() / keys.len(),
                };
                // The O(keys) checks run unchecked too: safe methods slice by them.
                if stride.checked_mul(keys.len()) != Some(lens.len()) {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "{} lengths are inconsistent with {} keys × stride {stride}",
                            lens.len(),
                            keys.len(),
                        ),
                    ));
                }
                (stride, vec![stride; keys.len()], None)
            }
            Strides::PerKeyPerRank(per_rank) => {
                if per_rank.len() != keys.len() {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "stride_per_key_per_rank has {} entries for {} keys",
                            per_rank.len(),
                            keys.len()
                        ),
                    ));
                }
                if let Some(k) = per_rank.iter().position(|r| r.len() != per_rank[0].len()) {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "key `{}` has strides for {} ranks but key `{}` for {}",
                            keys[k],
                            per_rank[k].len(),
                            keys[0],
                            per_rank[0].len()
                        ),
                    ));
                }
                // (Saturating: a sum past a usize cannot match the lengths' count.)
                let sum = |v: &[usize]| v.iter().fold(0usize, |n, &s| n.saturating_add(s));
                let per_key: Vec<usize> = per_rank.iter().map(|r| sum(r)).collect();
                let total = sum(&per_key);
                if total != lens.len() {
                    return Err(Error::invalid(
                        op,
                        format!("the per-key strides add up to {total} samples but there are {} lengths", lens.len()),
                    ));
                }
                (
                    per_key.iter().copied().max().unwrap_or(0),
                    per_key,
                    Some(Arc::new(per_rank)),
                )
            }
        };
        let meta = KeyMeta::build(stride_per_key, offs);
        // Checked unchecked too (O(1)): the counts safe methods slice by, and the weights'.
        if meta.bag_offsets.len() != lens.len() + 1 {
            return Err(Error::invalid(
                op,
                format!(
                    "{} offsets for {} lengths; expected lengths + 1",
                    meta.bag_offsets.len(),
                    lens.len()
                ),
            ));
        }
        let last = meta.bag_offsets[lens.len()];
        if !check && usize::try_from(last).is_ok_and(|n| n > values.shape()[0]) {
            return Err(Error::invalid(
                op,
                format!(
                    "the offsets end at {last}, past the {} values",
                    values.shape()[0]
                ),
            ));
        }
        if let Some(w) = &weights {
            // One weight per value, 1-D (`[N, 2]` weights were taken, and `get` handed out
            // a jagged tensor its own constructor refuses).
            if w.shape() != [values.shape()[0]] {
                return Err(Error::invalid(
                    op,
                    format!(
                        "weights have shape {:?}; expected one weight per value ([{}])",
                        w.shape(),
                        values.shape()[0]
                    ),
                ));
            }
        }
        if check {
            let name = |i: usize| key_at(&keys, &meta.lengths_offset_per_key, i);
            // Offsets given directly are checked as offsets (a decrease past i64 wrapped the
            // length it gave to a positive one); lengths as lengths.
            let given = if offsets_given {
                &meta.bag_offsets[..]
            } else {
                &meta.bag_offsets[..1]
            };
            validate_offsets(op, given, name)?;
            if let Some(i) = lens.iter().position(|&l| l < 0) {
                return Err(Error::invalid(
                    op,
                    format!("{}: length {} is negative", name(i), lens[i]),
                ));
            }
            if let Some(i) = lens
                .iter()
                .zip(meta.bag_offsets.windows(2))
                .position(|(&l, w)| w[1].checked_sub(w[0]) != Some(l))
            {
                return Err(Error::invalid(
                    op,
                    format!("{}: offsets disagree with length {}", name(i), lens[i]),
                ));
            }
            expect_total(
                op,
                "lengths",
                meta.bag_offsets[lens.len()],
                values.shape()[0],
            )?;
        }
        Ok(KeyedJaggedTensor {
            keys: Arc::new(keys),
            values,
            weights,
            lengths,
            offsets,
            stride,
            stride_per_key_per_rank,
            meta: Arc::new(meta),
        })
    }

    /// Builds from key-major `lengths` (`keys × stride` entries; `stride` inferred when
    /// `None`). Errors name the key and sample of a negative length, and report lengths that
    /// don't add up to the values, weights of the wrong length, or an inconsistent stride.
    pub fn from_lengths(
        keys: Vec<String>,
        values: Tensor,
        lengths: Tensor,
        weights: Option<Tensor>,
        stride: Option<usize>,
    ) -> Result<Self> {
        Self::build(
            "KeyedJaggedTensor::from_lengths",
            keys,
            values,
            weights,
            Some(lengths),
            None,
            Strides::Uniform(stride),
            true,
        )
    }

    /// One key with exactly one id per sample (a user id, an item id): `ids.len()` bags of one.
    pub fn one_hot(key: impl Into<String>, ids: &[i64]) -> Result<Self> {
        let n = ids.len();
        Self::from_lengths(
            vec![key.into()],
            Tensor::from_vec(ids.to_vec(), &[n])?,
            Tensor::from_vec(vec![1i32; n], &[n])?,
            None,
            Some(n),
        )
    }

    /// Builds from key-major `offsets` (`keys × stride + 1` entries, starting at 0,
    /// non-decreasing, ending at the number of values).
    pub fn from_offsets(
        keys: Vec<String>,
        values: Tensor,
        offsets: Tensor,
        weights: Option<Tensor>,
        stride: Option<usize>,
    ) -> Result<Self> {
        Self::build(
            "KeyedJaggedTensor::from_offsets",
            keys,
            values,
            weights,
            None,
            Some(offsets),
            Strides::Uniform(stride),
            true,
        )
    }

    /// Builds a variable-batch KJT: key `k` has `Σ_r stride_per_key_per_rank[k][r]` samples.
    pub fn from_lengths_variable_batch(
        keys: Vec<String>,
        values: Tensor,
        lengths: Tensor,
        weights: Option<Tensor>,
        stride_per_key_per_rank: Vec<Vec<usize>>,
    ) -> Result<Self> {
        Self::build(
            "KeyedJaggedTensor::from_lengths_variable_batch",
            keys,
            values,
            weights,
            Some(lengths),
            None,
            Strides::PerKeyPerRank(stride_per_key_per_rank),
            true,
        )
    }

    /// Builds without the validation pass over the lengths, for hot paths whose inputs were
    /// validated upstream. `offsets`, when given, must be the complete cumsum of `lengths`.
    /// The counts are still checked (keys × strides against the lengths, the offsets' count
    /// and end within the values, one weight per value: what safe methods slice by); lengths
    /// that disagree with the offsets give wrong results or an error later, never a panic or
    /// undefined behaviour.
    pub fn from_lengths_unchecked(
        keys: Vec<String>,
        values: Tensor,
        lengths: Tensor,
        offsets: Option<Tensor>,
        weights: Option<Tensor>,
        stride: usize,
        stride_per_key_per_rank: Option<Vec<Vec<usize>>>,
    ) -> Result<Self> {
        let strides = match stride_per_key_per_rank {
            Some(s) => Strides::PerKeyPerRank(s),
            None => Strides::Uniform(Some(stride)),
        };
        Self::build(
            "KeyedJaggedTensor::from_lengths_unchecked",
            keys,
            values,
            weights,
            Some(lengths),
            offsets,
            strides,
            false,
        )
    }

    /// A KJT with no keys and no values.
    pub fn empty() -> Self {
        Self::build(
            "KeyedJaggedTensor::empty",
            Vec::new(),
            Tensor::zeros(&[0], DType::F32, crate::Device::Cpu),
            None,
            Some(Tensor::zeros(&[0], DType::I64, crate::Device::Cpu)),
            None,
            Strides::Uniform(Some(0)),
            true,
        )
        .expect("an empty KJT is valid")
    }

    /// Builds from one [`JaggedTensor`] per key (all weighted or all unweighted). Keys whose
    /// sample counts differ give a variable-batch KJT (one rank).
    pub fn from_jagged_tensors(keys: Vec<String>, tensors: &[JaggedTensor]) -> Result<Self> {
        const OP: &str = "KeyedJaggedTensor::from_jagged_tensors";
        if keys.len() != tensors.len() {
            return Err(Error::invalid(
                OP,
                format!("{} keys for {} jagged tensors", keys.len(), tensors.len()),
            ));
        }
        if tensors.is_empty() {
            return Ok(Self::empty());
        }
        let weighted = tensors[0].weights().is_some();
        if let Some(i) = tensors
            .iter()
            .position(|t| t.weights().is_some() != weighted)
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "key `{}` weighted differently from key `{}`",
                    keys[i], keys[0]
                ),
            ));
        }
        let values: Vec<&Tensor> = tensors.iter().map(|t| t.values()).collect();
        let lengths: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.lengths().to_dtype(DType::I64))
            .collect::<Result<_>>()?;
        let lref: Vec<&Tensor> = lengths.iter().collect();
        let weights = if weighted {
            let w: Vec<&Tensor> = tensors
                .iter()
                .map(|t| t.weights().expect("checked weighted"))
                .collect();
            Some(Tensor::cat(&w, 0)?)
        } else {
            None
        };
        let strides: Vec<usize> = tensors.iter().map(|t| t.num_samples()).collect();
        let strides = if strides.iter().all(|&s| s == strides[0]) {
            Strides::Uniform(Some(strides[0]))
        } else {
            Strides::PerKeyPerRank(strides.into_iter().map(|s| vec![s]).collect())
        };
        Self::build(
            OP,
            keys,
            Tensor::cat(&values, 0)?,
            weights,
            Some(Tensor::cat(&lref, 0)?),
            None,
            strides,
            true,
        )
    }

    /// The keys, in order (may repeat after a [`permute`](Self::permute)).
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// All values, key-major.
    pub fn values(&self) -> &Tensor {
        &self.values
    }

    /// Per-value weights, if any.
    pub fn weights(&self) -> Option<&Tensor> {
        self.weights.as_ref()
    }

    /// Values per (key, sample), key-major.
    pub fn lengths(&self) -> &Tensor {
        &self.lengths
    }

    /// Complete cumsum of the lengths (empty for the key-less halves of a split).
    pub fn offsets(&self) -> &Tensor {
        &self.offsets
    }

    /// The batch size (the largest per-key sample count for a variable-batch KJT).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Samples per key.
    pub fn stride_per_key(&self) -> &[usize] {
        &self.meta.stride_per_key
    }

    /// True for a variable-batch KJT.
    pub fn variable_stride_per_key(&self) -> bool {
        self.stride_per_key_per_rank.is_some()
    }

    /// Per key, the samples contributed by each rank (variable-batch KJTs only).
    pub fn stride_per_key_per_rank(&self) -> Option<&[Vec<usize>]> {
        self.stride_per_key_per_rank
            .as_deref()
            .map(|v| v.as_slice())
    }

    /// Values per key.
    pub fn length_per_key(&self) -> &[usize] {
        &self.meta.length_per_key
    }

    /// Where each key's values start (`keys + 1` entries, from 0).
    pub fn offset_per_key(&self) -> &[usize] {
        &self.meta.offset_per_key
    }

    /// Where each key's lengths start (`keys + 1` entries, from 0).
    pub fn lengths_offset_per_key(&self) -> &[usize] {
        &self.meta.lengths_offset_per_key
    }

    fn key_index(&self, op: &'static str, key: &str) -> Result<usize> {
        // The last occurrence of a repeated key, as TorchRec's `_key_indices` dict (and
        // `to_dict`) take it.
        self.keys.iter().rposition(|k| k == key).ok_or_else(|| {
            Error::invalid(
                op,
                format!("unknown key `{key}`; the keys are {:?}", self.keys),
            )
        })
    }

    /// The jagged tensor of key index `k` (views, no copy of values).
    fn jagged_at(&self, k: usize) -> Result<JaggedTensor> {
        let m = &self.meta;
        let (ls, le) = (m.lengths_offset_per_key[k], m.lengths_offset_per_key[k + 1]);
        let (vs, vn) = (m.offset_per_key[k], m.length_per_key[k]);
        let base = m.bag_offsets[ls];
        let offsets: Vec<i64> = m.bag_offsets[ls..=le].iter().map(|&o| o - base).collect();
        Ok(JaggedTensor::new_unchecked(
            self.values.narrow(0, vs, vn)?,
            self.lengths.narrow(0, ls, le - ls)?,
            int_tensor(offsets, &[le - ls + 1], self.lengths.dtype())?,
            self.weights
                .as_ref()
                .map(|w| w.narrow(0, vs, vn))
                .transpose()?,
        ))
    }

    /// The jagged tensor of `key` (its last occurrence, as TorchRec's `kjt[key]` and
    /// [`to_dict`](Self::to_dict)); an unknown key is an error listing the keys.
    pub fn get(&self, key: &str) -> Result<JaggedTensor> {
        self.jagged_at(self.key_index("KeyedJaggedTensor::get", key)?)
    }

    /// Every key's jagged tensor, in key order; a repeated key appears once, at its first
    /// position, holding its last occurrence's data (as a Python dict would).
    pub fn to_dict(&self) -> Result<Vec<(String, JaggedTensor)>> {
        let mut out: Vec<(String, JaggedTensor)> = Vec::new();
        for k in 0..self.keys.len() {
            let jt = self.jagged_at(k)?;
            match out.iter_mut().find(|(name, _)| *name == self.keys[k]) {
                Some(slot) => slot.1 = jt,
                None => out.push((self.keys[k].clone(), jt)),
            }
        }
        Ok(out)
    }

    /// Splits into consecutive groups of `segments[i]` keys (which must add up to the number
    /// of keys). Values, weights and lengths are views; empty segments give key-less KJTs that
    /// keep the stride.
    pub fn split(&self, segments: &[usize]) -> Result<Vec<KeyedJaggedTensor>> {
        const OP: &str = "KeyedJaggedTensor::split";
        let total = crate::tensor::checked_sum(segments);
        if total != Some(self.keys.len()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "segments {segments:?} add up to {}, not to the {} keys",
                    total.map_or("more than a usize holds".to_string(), |t| t.to_string()),
                    self.keys.len()
                ),
            ));
        }
        let m = &self.meta;
        let mut out = Vec::with_capacity(segments.len());
        let mut start = 0;
        for &len in segments {
            let end = start + len;
            let (ls, le) = (
                m.lengths_offset_per_key[start],
                m.lengths_offset_per_key[end],
            );
            let (vs, ve) = (m.offset_per_key[start], m.offset_per_key[end]);
            let base = m.bag_offsets[ls];
            let bag_offsets: Vec<i64> = m.bag_offsets[ls..=le].iter().map(|&o| o - base).collect();
            // TorchRec gives key-less segments an empty offsets tensor.
            let offsets = if len == 0 {
                int_tensor(Vec::new(), &[0], self.lengths.dtype())?
            } else {
                int_tensor(
                    bag_offsets.clone(),
                    &[bag_offsets.len()],
                    self.lengths.dtype(),
                )?
            };
            out.push(KeyedJaggedTensor {
                keys: Arc::new(self.keys[start..end].to_vec()),
                values: self.values.narrow(0, vs, ve - vs)?,
                weights: self
                    .weights
                    .as_ref()
                    .map(|w| w.narrow(0, vs, ve - vs))
                    .transpose()?,
                lengths: self.lengths.narrow(0, ls, le - ls)?,
                offsets,
                stride: self.stride,
                stride_per_key_per_rank: self
                    .stride_per_key_per_rank
                    .as_ref()
                    .map(|s| Arc::new(s[start..end].to_vec())),
                meta: Arc::new(KeyMeta::build(
                    m.stride_per_key[start..end].to_vec(),
                    bag_offsets,
                )),
            });
            start = end;
        }
        Ok(out)
    }

    /// Reorders the keys: output key `i` is input key `indices[i]`. Indices may repeat (the
    /// key's data is copied again) or leave keys out. One block copy per output key.
    pub fn permute(&self, indices: &[usize]) -> Result<KeyedJaggedTensor> {
        const OP: &str = "KeyedJaggedTensor::permute";
        if let Some(position) = indices.iter().position(|&i| i >= self.keys.len()) {
            return Err(Error::IndexOutOfRange {
                op: OP,
                index: indices[position] as i64,
                position,
                size: self.keys.len(),
            });
        }
        let m = &self.meta;
        let value_ranges: Vec<(usize, usize)> = indices
            .iter()
            .map(|&k| (m.offset_per_key[k], m.length_per_key[k]))
            .collect();
        let length_ranges: Vec<(usize, usize)> = indices
            .iter()
            .map(|&k| (m.lengths_offset_per_key[k], m.stride_per_key[k]))
            .collect();
        let lengths = gather_row_ranges_tensor(&self.lengths, &length_ranges)?;
        let strides = match &self.stride_per_key_per_rank {
            Some(s) => Strides::PerKeyPerRank(indices.iter().map(|&k| s[k].clone()).collect()),
            None => Strides::Uniform(Some(self.stride)),
        };
        let mut out = Self::build(
            OP,
            indices.iter().map(|&k| self.keys[k].clone()).collect(),
            gather_row_ranges_tensor(&self.values, &value_ranges)?,
            self.weights
                .as_ref()
                .map(|w| gather_row_ranges_tensor(w, &value_ranges))
                .transpose()?,
            Some(lengths),
            None,
            strides,
            false,
        )?;
        out.stride = self.stride;
        Ok(out)
    }

    /// Concatenates the keys of several KJTs (all weighted or all unweighted). Equal strides
    /// give a regular KJT; otherwise (or if any input has a variable batch) the result is a
    /// variable-batch KJT, which requires every input to have the same number of ranks.
    pub fn concat(kjts: &[KeyedJaggedTensor]) -> Result<KeyedJaggedTensor> {
        const OP: &str = "KeyedJaggedTensor::concat";
        if kjts.is_empty() {
            return Ok(Self::empty());
        }
        // A KJT of no keys holds no values: it neither fixes the weighting nor the stride
        // (its stride of 0 made every concat with one variable-batch).
        let keyed: Vec<usize> = (0..kjts.len())
            .filter(|&i| !kjts[i].keys.is_empty())
            .collect();
        let first = keyed.first().copied().unwrap_or(0);
        let weighted = kjts[first].weights.is_some();
        if let Some(&i) = keyed
            .iter()
            .find(|&&i| kjts[i].weights.is_some() != weighted)
        {
            return Err(Error::invalid(
                OP,
                format!("KJT {i} is weighted differently from KJT {first}"),
            ));
        }
        let kjts: Vec<&KeyedJaggedTensor> = match keyed.is_empty() {
            true => vec![&kjts[0]],
            false => keyed.iter().map(|&i| &kjts[i]).collect(),
        };
        let keys: Vec<String> = kjts.iter().flat_map(|k| k.keys.iter().cloned()).collect();
        let values: Vec<&Tensor> = kjts.iter().map(|k| &k.values).collect();
        let lengths: Vec<Tensor> = kjts
            .iter()
            .map(|k| k.lengths.to_dtype(kjts[0].lengths.dtype()))
            .collect::<Result<_>>()?;
        let lref: Vec<&Tensor> = lengths.iter().collect();
        let weights = if weighted {
            let w: Vec<&Tensor> = kjts
                .iter()
                .map(|k| k.weights.as_ref().expect("checked weighted"))
                .collect();
            Some(Tensor::cat(&w, 0)?)
        } else {
            None
        };
        let uniform = kjts
            .iter()
            .all(|k| !k.variable_stride_per_key() && k.stride == kjts[0].stride);
        let strides = if uniform {
            Strides::Uniform(Some(kjts[0].stride))
        } else {
            let mut per_rank = Vec::new();
            for k in &kjts {
                match &k.stride_per_key_per_rank {
                    Some(s) => per_rank.extend(s.iter().cloned()),
                    None => per_rank.extend(std::iter::repeat_n(vec![k.stride], k.keys.len())),
                }
            }
            Strides::PerKeyPerRank(per_rank)
        };
        Self::build(
            OP,
            keys,
            Tensor::cat(&values, 0)?,
            weights,
            Some(Tensor::cat(&lref, 0)?),
            None,
            strides,
            true,
        )
    }
}
