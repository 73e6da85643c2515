//! Conversions between jagged values and padded dense tensors: `jagged_to_padded_dense` and its
//! inverse `dense_to_jagged` (each the other's backward), plus FBGEMM's 1-D/2-D and stacked
//! variants. The conversion itself ([`Padding`]) has its CPU half in `cpu.rs` and its CUDA half
//! in `cuda.rs` (`kernels/jagged.cu`).

mod cpu;
pub(crate) mod cuda;

use std::sync::Arc;

use super::{expect_int, read_ints, read_offsets};
use crate::cuda::CudaDevice;
use crate::tensor::{record_op, run_on, BackwardOp, DeviceOp, Gradient};
use crate::{Error, Result, Tensor};

/// Validates the offsets of every jagged dimension and, for more than one, returns for every
/// slot of the padded dense layout `[B, max_0, ..., max_{k-1}]`, the jagged row it
/// holds, or -1 for padding. `offsets[l]` indexes into the entries of `offsets[l + 1]` (or into
/// the value rows for the last level); a bag longer than its max length is truncated.
fn padded_slot_map_checked(
    op: &'static str,
    offsets: &[Vec<i64>],
    max_lengths: &[usize],
    value_rows: usize,
) -> Result<Option<Vec<i64>>> {
    if offsets.len() != max_lengths.len() || offsets.is_empty() {
        return Err(Error::invalid(
            op,
            format!(
                "{} offset tensors but {} max lengths; expected one max length per jagged \
                 dimension (at least one)",
                offsets.len(),
                max_lengths.len()
            ),
        ));
    }
    for (level, offs) in offsets.iter().enumerate() {
        let limit = offsets
            .get(level + 1)
            .map_or(value_rows, |next| next.len() - 1);
        let last = *offs.last().expect("validated non-empty");
        if last as usize > limit {
            return Err(Error::invalid(
                op,
                format!(
                    "offsets of jagged dimension {level} end at {last} but the next level has \
                     only {limit} rows"
                ),
            ));
        }
    }
    if offsets.len() == 1 {
        // The single-dimension kernels work bag by bag; no map needed.
        return Ok(None);
    }
    let batch = offsets[0].len() - 1;
    let mut current: Vec<i64> = (0..batch as i64).collect();
    for (offs, &max) in offsets.iter().zip(max_lengths) {
        // The slots of a padded tensor of no elements (a trailing dimension of 0) may be past
        // any memory: an error, where the process aborted (or the count overflowed).
        let slots = current.len().checked_mul(max).ok_or_else(|| {
            Error::invalid(
                op,
                format!("{} slots × max length {max} is past a usize", current.len()),
            )
        })?;
        let mut next = crate::tensor::storage::try_with_capacity(op, slots)?;
        for &bag in &current {
            if bag < 0 {
                next.extend(std::iter::repeat_n(-1, max));
                continue;
            }
            let (start, end) = (offs[bag as usize], offs[bag as usize + 1]);
            let take = ((end - start) as usize).min(max);
            next.extend(start..start + take as i64);
            next.extend(std::iter::repeat_n(-1, max - take));
        }
        current = next;
    }
    Ok(Some(current))
}

/// The inverse of an injective slot map: for each of `rows` targets, the slot that holds it.
fn invert_map(map: &[i64], rows: usize) -> Vec<i64> {
    let mut inverse = vec![-1i64; rows];
    for (slot, &row) in map.iter().enumerate() {
        if row >= 0 {
            inverse[row as usize] = slot as i64;
        }
    }
    inverse
}

/// Which padded slot holds which jagged row.
#[derive(Clone, Debug)]
enum SlotLayout {
    /// One jagged dimension: bag `b`'s first `min(len, max_length)` rows fill slots
    /// `b·max_length ..`; handled bag by bag with block copies, no per-slot map.
    Single {
        offsets: Arc<Vec<i64>>,
        max_length: usize,
    },
    /// Several jagged dimensions: an explicit slot → row map (-1 for padding) and its inverse.
    Mapped {
        slot_to_row: Arc<Vec<i64>>,
        row_to_slot: Arc<Vec<i64>>,
    },
}
/// One padding conversion: jagged rows → padded slots (`to_dense`) or back.
struct Padding<'a> {
    input: &'a Tensor,
    layout: &'a SlotLayout,
    /// Elements per row.
    row_len: usize,
    /// The padding value (jagged → dense).
    fill: f64,
    /// Jagged rows of the result (dense → jagged).
    rows: usize,
    to_dense: bool,
    /// The result's shape.
    shape: &'a [usize],
}

impl DeviceOp for Padding<'_> {
    type Output = Tensor;
    fn cpu(&self) -> Result<Tensor> {
        cpu::run(self)
    }
    fn cuda(&self, device: &Arc<CudaDevice>) -> Result<Tensor> {
        cuda::run(self, device)
    }
}

fn pad_tensor(
    values: &Tensor,
    layout: &SlotLayout,
    row_len: usize,
    fill: f64,
    shape: &[usize],
) -> Result<Tensor> {
    let op = Padding {
        input: values,
        layout,
        row_len,
        fill,
        rows: 0,
        to_dense: true,
        shape,
    };
    run_on(values.device(), &op)
}

fn unpad_tensor(
    dense: &Tensor,
    layout: &SlotLayout,
    row_len: usize,
    rows: usize,
    shape: &[usize],
) -> Result<Tensor> {
    let op = Padding {
        input: dense,
        layout,
        row_len,
        fill: 0.0,
        rows,
        to_dense: false,
        shape,
    };
    run_on(dense.device(), &op)
}

/// Backward of the padding conversions: each direction's gradient is the other direction.
struct PaddingBackward {
    name: &'static str,
    layout: SlotLayout,
    row_len: usize,
    input_shape: Vec<usize>,
    /// True when the forward padded (jagged → dense), so the backward unpads.
    forward_padded: bool,
}

impl BackwardOp for PaddingBackward {
    fn name(&self) -> &'static str {
        self.name
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let g = if self.forward_padded {
            unpad_tensor(
                grad_output,
                &self.layout,
                self.row_len,
                self.input_shape[0],
                &self.input_shape,
            )?
        } else {
            pad_tensor(
                grad_output,
                &self.layout,
                self.row_len,
                0.0,
                &self.input_shape,
            )?
        };
        Ok(vec![Some(Gradient::Dense(g))])
    }
}

/// Validates the offsets against the max lengths and the value rows and picks the layout.
fn slot_layout(
    op: &'static str,
    offsets: Vec<Vec<i64>>,
    max_lengths: &[usize],
    value_rows: usize,
) -> Result<SlotLayout> {
    let slot_to_row = padded_slot_map_checked(op, &offsets, max_lengths, value_rows)?;
    match slot_to_row {
        None => {
            let offsets = offsets.into_iter().next().expect("one jagged dimension");
            Ok(SlotLayout::Single {
                offsets: Arc::new(offsets),
                max_length: max_lengths[0],
            })
        }
        Some(slot_to_row) => {
            let row_to_slot = invert_map(&slot_to_row, value_rows);
            Ok(SlotLayout::Mapped {
                slot_to_row: Arc::new(slot_to_row),
                row_to_slot: Arc::new(row_to_slot),
            })
        }
    }
}

fn read_all_offsets(op: &'static str, offsets: &[&Tensor]) -> Result<Vec<Vec<i64>>> {
    if offsets.is_empty() {
        return Err(Error::invalid(
            op,
            "no offsets: one tensor per jagged dimension is needed",
        ));
    }
    offsets.iter().map(|o| read_offsets(op, o)).collect()
}

/// Refuses an output of `shape` and `dtype` that no memory holds (before it is laid out).
fn check_output_size(op: &'static str, shape: &[usize], dtype: crate::DType) -> Result<()> {
    if crate::tensor::addressable_bytes(shape, dtype.size_in_bytes()).is_none() {
        return Err(Error::invalid(
            op,
            format!("the output's shape {shape:?} is past any memory"),
        ));
    }
    Ok(())
}

/// Pads jagged `values` (`[total, D...]`, or 1-D) with `offsets` (one tensor per jagged
/// dimension, outermost first, each `[n + 1]` starting at 0) into a dense
/// `[B, max_lengths[0], ..., max_lengths[k-1], D...]` tensor. Bags longer than their max length
/// are truncated; missing positions hold `padding_value`. Differentiable in `values` (the
/// gradient is [`dense_to_jagged`] of the output gradient; truncated rows get zero).
pub fn jagged_to_padded_dense(
    values: &Tensor,
    offsets: &[&Tensor],
    max_lengths: &[usize],
    padding_value: f64,
) -> Result<Tensor> {
    const OP: &str = "jagged_to_padded_dense";
    if values.rank() == 0 {
        return Err(Error::invalid(
            OP,
            "values must have at least one dimension",
        ));
    }
    let offs = read_all_offsets(OP, offsets)?;
    let rows = values.shape()[0];
    let batch = offs[0].len() - 1;
    let mut shape = vec![batch];
    shape.extend_from_slice(max_lengths);
    shape.extend_from_slice(&values.shape()[1..]);
    check_output_size(OP, &shape, values.dtype())?;
    let layout = slot_layout(OP, offs, max_lengths, rows)?;
    let row_len = values.shape()[1..].iter().product();
    let out = pad_tensor(values, &layout, row_len, padding_value, &shape)?;
    if !values.dtype().is_float() {
        return Ok(out);
    }
    Ok(record_op(
        out,
        &[values],
        PaddingBackward {
            name: OP,
            layout,
            row_len,
            input_shape: values.shape().to_vec(),
            forward_padded: true,
        },
    ))
}

/// Extracts the jagged rows of `dense` (`[B, max_0, ..., max_{k-1}, D...]`) at the positions
/// given by `offsets` (as in [`jagged_to_padded_dense`]): the result is `[total_l, D...]`,
/// where `total_l` defaults to the last offset of the innermost dimension. Jagged positions
/// beyond the dense tensor's max lengths come out as zeros. Differentiable in `dense`.
pub fn dense_to_jagged(
    dense: &Tensor,
    offsets: &[&Tensor],
    total_l: Option<usize>,
) -> Result<Tensor> {
    const OP: &str = "dense_to_jagged";
    let k = offsets.len();
    if dense.rank() < k + 1 {
        return Err(Error::invalid(
            OP,
            format!(
                "dense has shape {:?}; expected [B, one max length per jagged dimension ({k}), ...]",
                dense.shape()
            ),
        ));
    }
    let offs = read_all_offsets(OP, offsets)?;
    if offs[0].len() - 1 != dense.shape()[0] {
        return Err(Error::invalid(
            OP,
            format!(
                "offsets describe {} bags but dense has batch size {}",
                offs[0].len() - 1,
                dense.shape()[0]
            ),
        ));
    }
    let innermost_total = *offs[k - 1].last().expect("validated non-empty") as usize;
    let rows = total_l.unwrap_or(innermost_total);
    if rows < innermost_total {
        return Err(Error::invalid(
            OP,
            format!("total_L = {rows} is smaller than the last offset {innermost_total}"),
        ));
    }
    let max_lengths = dense.shape()[1..=k].to_vec();
    let mut shape = vec![rows];
    shape.extend_from_slice(&dense.shape()[k + 1..]);
    check_output_size(OP, &shape, dense.dtype())?;
    let layout = slot_layout(OP, offs, &max_lengths, rows)?;
    let row_len = dense.shape()[k + 1..].iter().product();
    let out = unpad_tensor(dense, &layout, row_len, rows, &shape)?;
    if !dense.dtype().is_float() {
        return Ok(out);
    }
    Ok(record_op(
        out,
        &[dense],
        PaddingBackward {
            name: OP,
            layout,
            row_len,
            input_shape: dense.shape().to_vec(),
            forward_padded: false,
        },
    ))
}

/// FBGEMM's `jagged_1d_to_dense`: 1-D `values` with `offsets` padded to
/// `[B, max_sequence_length]` with `padding_value`.
pub fn jagged_1d_to_dense(
    values: &Tensor,
    offsets: &Tensor,
    max_sequence_length: usize,
    padding_value: f64,
) -> Result<Tensor> {
    if values.rank() != 1 {
        return Err(Error::invalid(
            "jagged_1d_to_dense",
            format!("values must be 1-D, got shape {:?}", values.shape()),
        ));
    }
    jagged_to_padded_dense(values, &[offsets], &[max_sequence_length], padding_value)
}

/// FBGEMM's `jagged_2d_to_dense`: `[total, D]` values padded with zeros to
/// `[B, max_sequence_length, D]`. Differentiable in `values`.
pub fn jagged_2d_to_dense(
    values: &Tensor,
    offsets: &Tensor,
    max_sequence_length: usize,
) -> Result<Tensor> {
    if values.rank() != 2 {
        return Err(Error::invalid(
            "jagged_2d_to_dense",
            format!("values must be 2-D, got shape {:?}", values.shape()),
        ));
    }
    jagged_to_padded_dense(values, &[offsets], &[max_sequence_length], 0.0)
}

/// FBGEMM's `stacked_jagged_1d_to_dense`: `values` of several keys stacked key-major, `lengths`
/// `[T, B]`, the start of each key's values in `offset_per_key` (`T + 1` entries); returns one
/// `[B, max_lengths_per_key[t]]` tensor per key, padded with `padding_value`.
pub fn stacked_jagged_1d_to_dense(
    values: &Tensor,
    lengths: &Tensor,
    offset_per_key: &[usize],
    max_lengths_per_key: &[usize],
    padding_value: f64,
) -> Result<Vec<Tensor>> {
    const OP: &str = "stacked_jagged_1d_to_dense";
    expect_int(OP, "lengths", lengths)?;
    if lengths.rank() != 2 || values.rank() != 1 {
        return Err(Error::invalid(
            OP,
            format!(
                "expected 1-D values and [T, B] lengths, got {:?} and {:?}",
                values.shape(),
                lengths.shape()
            ),
        ));
    }
    let (num_keys, batch) = (lengths.shape()[0], lengths.shape()[1]);
    if offset_per_key.len() != num_keys + 1 || max_lengths_per_key.len() != num_keys {
        return Err(Error::invalid(
            OP,
            format!(
                "{num_keys} keys need {} offset_per_key entries and {num_keys} max lengths, got \
                 {} and {}",
                num_keys + 1,
                offset_per_key.len(),
                max_lengths_per_key.len()
            ),
        ));
    }
    let all_lengths = read_ints(OP, "lengths", lengths)?;
    (0..num_keys)
        .map(|t| {
            let (start, end) = (offset_per_key[t], offset_per_key[t + 1]);
            if end < start || end > values.shape()[0] {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "key {t}: offset_per_key range {start}..{end} is outside values of \
                         length {}",
                        values.shape()[0]
                    ),
                ));
            }
            let key_lengths = &all_lengths[t * batch..(t + 1) * batch];
            let offsets =
                super::offsets_from_lengths(OP, key_lengths, |b| format!("key {t}, sample {b}"))?;
            super::expect_total(
                OP,
                &format!("key {t}: lengths"),
                offsets[batch],
                end - start,
            )?;
            let offsets = Tensor::from_vec(offsets, &[batch + 1])?;
            let key_values = values.narrow(0, start, end - start)?;
            jagged_to_padded_dense(
                &key_values,
                &[&offsets],
                &[max_lengths_per_key[t]],
                padding_value,
            )
        })
        .collect()
}
