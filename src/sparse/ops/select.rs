//! Selections on jagged data: whole bags by index (`jagged_index_select`,
//! `keyed_jagged_index_select_dim1`), rows by index (`index_select_dim0`), and per-bag
//! sub-ranges (`jagged_slice`, `jagged_1d_to_truncated_values`, `masked_select_jagged_1d`).
//! Each builds the list of source rows and hands it to the tensor core's differentiable
//! `index_select`, so float values get gradients (row-sparse) for free.

use crate::tensor::ops::index::checked_index_slice;
use crate::{DType, Error, Result, Tensor};

use super::{expect_int, expect_total, int_tensor, read_ints, read_lengths};

/// Rows of `values` listed in `rows`, through the differentiable `index_select`.
fn select_rows(values: &Tensor, rows: Vec<i64>) -> Result<Tensor> {
    let n = rows.len();
    values.index_select(&Tensor::from_vec(rows, &[n])?)
}

/// Bags `indices[k]` of the jagged `values` (lengths `lengths`), concatenated: returns the new
/// values and lengths (lengths keep their dtype). Works on 1-D and 2-D values (FBGEMM's CPU
/// kernel only takes 2-D). Differentiable in float `values`.
pub fn jagged_index_select(
    values: &Tensor,
    lengths: &Tensor,
    indices: &Tensor,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "jagged_index_select";
    let (lens, offsets) = read_lengths(OP, lengths)?;
    expect_total(
        OP,
        "lengths",
        offsets[lens.len()],
        values.shape().first().copied().unwrap_or(0),
    )?;
    let picks = checked_index_slice(OP, &read_ints(OP, "indices", indices)?, lens.len())?;
    let mut rows = Vec::new();
    let mut out_lengths = Vec::with_capacity(picks.len());
    for &b in &picks {
        rows.extend(offsets[b]..offsets[b + 1]);
        out_lengths.push(lens[b]);
    }
    let n = out_lengths.len();
    Ok((
        select_rows(values, rows)?,
        int_tensor(out_lengths, &[n], lengths.dtype())?,
    ))
}

/// The result of [`keyed_jagged_index_select_dim1`].
#[derive(Clone, Debug)]
pub struct KeyedJaggedSelection {
    /// Selected values, key-major.
    pub values: Tensor,
    /// `[num_keys · indices.len()]` lengths.
    pub lengths: Tensor,
    /// Selected weights, when weights were given.
    pub weights: Option<Tensor>,
}

/// Selects samples `indices` (along the batch dimension) of every key of a keyed jagged tensor
/// given as `values`, `lengths` (key-major, `num_keys · batch_size` entries) and `offsets`
/// (their complete cumsum). Samples may repeat. Differentiable in float values and weights.
/// FBGEMM has no CPU kernel for this op; it is tested against a naïve reference.
pub fn keyed_jagged_index_select_dim1(
    values: &Tensor,
    lengths: &Tensor,
    offsets: &Tensor,
    indices: &Tensor,
    batch_size: usize,
    weights: Option<&Tensor>,
) -> Result<KeyedJaggedSelection> {
    const OP: &str = "keyed_jagged_index_select_dim1";
    let (lens, expected_offsets) = read_lengths(OP, lengths)?;
    let given_offsets = read_ints(OP, "offsets", offsets)?;
    if given_offsets != expected_offsets {
        return Err(Error::invalid(
            OP,
            format!(
                "offsets {given_offsets:?} are not the complete cumsum of the lengths \
                 ({expected_offsets:?})"
            ),
        ));
    }
    let rows_total = values.shape().first().copied().unwrap_or(0);
    expect_total(OP, "lengths", expected_offsets[lens.len()], rows_total)?;
    if batch_size == 0 || lens.len() % batch_size != 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "{} lengths are not a whole number of samples of batch size {batch_size}",
                lens.len()
            ),
        ));
    }
    if let Some(w) = weights {
        if w.shape().first().copied() != Some(rows_total) {
            return Err(Error::invalid(
                OP,
                format!(
                    "weights have shape {:?} but values have {rows_total} rows",
                    w.shape()
                ),
            ));
        }
    }
    let picks = checked_index_slice(OP, &read_ints(OP, "indices", indices)?, batch_size)?;
    let num_keys = lens.len() / batch_size;
    let mut rows = Vec::new();
    let mut out_lengths = Vec::with_capacity(num_keys * picks.len());
    for key in 0..num_keys {
        for &b in &picks {
            let bag = key * batch_size + b;
            rows.extend(expected_offsets[bag]..expected_offsets[bag + 1]);
            out_lengths.push(lens[bag]);
        }
    }
    let n = out_lengths.len();
    let weights = weights.map(|w| select_rows(w, rows.clone())).transpose()?;
    Ok(KeyedJaggedSelection {
        values: select_rows(values, rows)?,
        lengths: int_tensor(out_lengths, &[n], lengths.dtype())?,
        weights,
    })
}

/// Rows `indices` of `input` (duplicates allowed); the gradient scatters back (row-sparse).
pub fn index_select_dim0(input: &Tensor, indices: &Tensor) -> Result<Tensor> {
    expect_int("index_select_dim0", "indices", indices)?;
    input.index_select(indices)
}

/// Picks, per bag, the positions `keep(bag, position)` accepts, returning the selected rows
/// and the per-bag counts.
fn select_within_bags(
    lens: &[i64],
    offsets: &[i64],
    mut keep: impl FnMut(usize, usize) -> bool,
) -> (Vec<i64>, Vec<i64>) {
    let mut rows = Vec::new();
    let mut counts = Vec::with_capacity(lens.len());
    for (b, &len) in lens.iter().enumerate() {
        let before = rows.len();
        for p in 0..len as usize {
            if keep(b, p) {
                rows.push(offsets[b] + p as i64);
            }
        }
        counts.push((rows.len() - before) as i64);
    }
    (rows, counts)
}

/// Per bag `b`, the positions `start[b] .. start[b] + slice_length` (clipped to the bag):
/// returns the new values and lengths. Differentiable in float values.
pub fn jagged_slice(
    x_values: &Tensor,
    x_lengths: &Tensor,
    start: &Tensor,
    slice_length: usize,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "jagged_slice";
    let (lens, offsets) = read_lengths(OP, x_lengths)?;
    expect_total(
        OP,
        "x_lengths",
        offsets[lens.len()],
        x_values.shape().first().copied().unwrap_or(0),
    )?;
    let starts = read_ints(OP, "start", start)?;
    if starts.len() != lens.len() {
        return Err(Error::invalid(
            OP,
            format!("{} start positions for {} bags", starts.len(), lens.len()),
        ));
    }
    if let Some(position) = starts.iter().position(|&s| s < 0) {
        return Err(Error::IndexOutOfRange {
            op: OP,
            index: starts[position],
            position,
            size: lens[position] as usize,
        });
    }
    let (rows, counts) = select_within_bags(&lens, &offsets, |b, p| {
        let s = starts[b] as usize;
        p >= s && p - s < slice_length
    });
    let n = counts.len();
    Ok((
        select_rows(x_values, rows)?,
        int_tensor(counts, &[n], x_lengths.dtype())?,
    ))
}

/// The first `min(length, max_truncated_length)` values of every bag, concatenated.
/// Differentiable in float values.
pub fn jagged_1d_to_truncated_values(
    values: &Tensor,
    lengths: &Tensor,
    max_truncated_length: usize,
) -> Result<Tensor> {
    const OP: &str = "jagged_1d_to_truncated_values";
    let (lens, offsets) = read_lengths(OP, lengths)?;
    expect_total(
        OP,
        "lengths",
        offsets[lens.len()],
        values.shape().first().copied().unwrap_or(0),
    )?;
    let (rows, _) = select_within_bags(&lens, &offsets, |_, p| p < max_truncated_length);
    select_rows(values, rows)
}

/// The values where `mask` (u8, one entry per value) is nonzero, with the per-bag counts as
/// the new lengths. Differentiable in float values.
pub fn masked_select_jagged_1d(
    values: &Tensor,
    lengths: &Tensor,
    mask: &Tensor,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "masked_select_jagged_1d";
    let (lens, offsets) = read_lengths(OP, lengths)?;
    let rows_total = values.shape().first().copied().unwrap_or(0);
    expect_total(OP, "lengths", offsets[lens.len()], rows_total)?;
    if mask.dtype() != DType::U8 || mask.numel() != rows_total {
        return Err(Error::invalid(
            OP,
            format!(
                "mask must be u8 with one entry per value ({rows_total}), got {:?} {:?}",
                mask.dtype(),
                mask.shape()
            ),
        ));
    }
    let m = mask.to_vec::<u8>()?;
    let (rows, counts) =
        select_within_bags(&lens, &offsets, |b, p| m[offsets[b] as usize + p] != 0);
    let n = counts.len();
    Ok((
        select_rows(values, rows)?,
        int_tensor(counts, &[n], lengths.dtype())?,
    ))
}
