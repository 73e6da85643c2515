//! Reordering whole features of feature-major sparse data: `permute_2D_sparse_data` and
//! `expand_into_jagged_permute`.

use crate::tensor::ops::index::checked_index_slice;
use crate::{Error, Result, Tensor};

use super::{expect_int, gather_row_ranges_tensor, int_tensor, read_ints};

/// The result of [`permute_2d_sparse_data`].
#[derive(Clone, Debug)]
pub struct PermutedSparseData {
    /// `[permute.len(), B]` lengths, in the input's dtype.
    pub lengths: Tensor,
    /// The values of the permuted features, feature-major.
    pub values: Tensor,
    /// The weights, permuted the same way, when weights were given.
    pub weights: Option<Tensor>,
}

/// Reorders the features of feature-major sparse data: output feature `i` is input feature
/// `permute[i]` (features may repeat or be dropped). `lengths` is `[T, B]`; `values` (and
/// `weights`) hold `Σ lengths` rows, feature 0's first. Because each feature's values are
/// contiguous, this is one block copy per output feature, done in parallel.
/// `permuted_lengths_sum`, when given, must equal the number of output rows. FBGEMM's CPU
/// kernel requires an i32 `permute`; i64 is accepted here too.
pub fn permute_2d_sparse_data(
    permute: &Tensor,
    lengths: &Tensor,
    values: &Tensor,
    weights: Option<&Tensor>,
    permuted_lengths_sum: Option<usize>,
) -> Result<PermutedSparseData> {
    const OP: &str = "permute_2D_sparse_data";
    expect_int(OP, "lengths", lengths)?;
    if values.rank() == 0 || weights.is_some_and(|w| w.rank() == 0) {
        return Err(Error::invalid(
            OP,
            "values and weights must have at least one dimension",
        ));
    }
    let (num_features, batch) = match lengths.shape() {
        [t, b] => (*t, *b),
        [n] => (*n, 1),
        s => {
            return Err(Error::invalid(
                OP,
                format!("lengths must be [T, B], got shape {s:?}"),
            ))
        }
    };
    let order = checked_index_slice(OP, &read_ints(OP, "permute", permute)?, num_features)?;
    let lens = read_ints(OP, "lengths", lengths)?;
    // Each feature's value range, validated once.
    let mut feature_start = Vec::with_capacity(num_features + 1);
    let mut total = 0usize;
    feature_start.push(0);
    for (t, row) in lens.chunks(batch.max(1)).take(num_features).enumerate() {
        let mut sum = 0i64;
        for (b, &l) in row.iter().enumerate() {
            if l < 0 {
                return Err(Error::invalid(
                    OP,
                    format!("feature {t}, sample {b}: length {l} is negative"),
                ));
            }
            sum = sum.checked_add(l).ok_or_else(|| {
                Error::invalid(OP, format!("feature {t}: the lengths sum past an i64"))
            })?;
        }
        total = total.checked_add(sum as usize).ok_or_else(|| {
            Error::invalid(OP, format!("feature {t}: the lengths sum past a usize"))
        })?;
        feature_start.push(total);
    }
    if num_features > 0 && batch == 0 {
        feature_start = vec![0; num_features + 1];
    }
    let rows = values.shape().first().copied().unwrap_or(0);
    if total != rows {
        return Err(Error::invalid(
            OP,
            format!("lengths add up to {total} but values has {rows} rows"),
        ));
    }
    if let Some(w) = weights {
        if w.shape().first().copied() != Some(rows) {
            return Err(Error::invalid(
                OP,
                format!(
                    "weights have shape {:?} but values have {rows} rows",
                    w.shape()
                ),
            ));
        }
    }
    let value_ranges: Vec<(usize, usize)> = order
        .iter()
        .map(|&t| (feature_start[t], feature_start[t + 1] - feature_start[t]))
        .collect();
    let out_rows: usize = value_ranges.iter().map(|r| r.1).sum();
    if let Some(expected) = permuted_lengths_sum {
        if expected != out_rows {
            return Err(Error::invalid(
                OP,
                format!("permuted_lengths_sum is {expected} but the permuted lengths add up to {out_rows}"),
            ));
        }
    }
    let length_ranges: Vec<(usize, usize)> = order.iter().map(|&t| (t * batch, batch)).collect();
    let flat_lengths = lengths.reshape(&[num_features * batch])?;
    let out_lengths =
        gather_row_ranges_tensor(&flat_lengths, &length_ranges)?.reshape(&[order.len(), batch])?;
    Ok(PermutedSparseData {
        lengths: out_lengths,
        values: gather_row_ranges_tensor(values, &value_ranges)?,
        weights: weights
            .map(|w| gather_row_ranges_tensor(w, &value_ranges))
            .transpose()?,
    })
}

/// For each output segment `i` (`output_offset[i] .. output_offset[i+1]`), the consecutive
/// input positions starting at `input_offset[permute[i]]`: the element-level permutation that
/// applies a segment-level `permute` to jagged data.
pub fn expand_into_jagged_permute(
    permute: &Tensor,
    input_offset: &Tensor,
    output_offset: &Tensor,
    output_size: usize,
) -> Result<Tensor> {
    const OP: &str = "expand_into_jagged_permute";
    let input_offset_v = read_ints(OP, "input_offset", input_offset)?;
    // (Unchecked, a decrease gave negative positions, or overflowed.)
    super::validate_offsets(OP, &input_offset_v, |i| format!("input segment {i}"))?;
    let output_offset_v = read_ints(OP, "output_offset", output_offset)?;
    let order = checked_index_slice(
        OP,
        &read_ints(OP, "permute", permute)?,
        input_offset_v.len().saturating_sub(1),
    )?;
    if output_offset_v.len() != order.len() + 1 {
        return Err(Error::invalid(
            OP,
            format!(
                "{} output offsets for {} segments; expected segments + 1",
                output_offset_v.len(),
                order.len()
            ),
        ));
    }
    super::validate_offsets(OP, &output_offset_v, |i| format!("output segment {i}"))?;
    if output_offset_v[order.len()] as usize != output_size {
        return Err(Error::invalid(
            OP,
            format!(
                "output offsets end at {} but output_size is {output_size}",
                output_offset_v[order.len()]
            ),
        ));
    }
    // Every segment checked before the output (whose size the offsets claim) is allocated.
    for (i, &src) in order.iter().enumerate() {
        let len = output_offset_v[i + 1] - output_offset_v[i];
        let avail = input_offset_v[src + 1] - input_offset_v[src];
        if len != avail {
            return Err(Error::invalid(
                OP,
                format!("output segment {i} has length {len} but input segment {src} has {avail}"),
            ));
        }
    }
    let mut out = crate::tensor::storage::try_with_capacity(OP, output_size)?;
    for (i, &src) in order.iter().enumerate() {
        let len = output_offset_v[i + 1] - output_offset_v[i];
        out.extend(input_offset_v[src]..input_offset_v[src] + len);
    }
    int_tensor(out, &[output_size], permute.dtype())
}
