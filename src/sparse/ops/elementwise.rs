//! Elementwise arithmetic between a jagged tensor and a dense one. Each op is a composition of
//! the differentiable [`jagged_to_padded_dense`]/[`dense_to_jagged`] with the tensor core's
//! `add`/`mul`, so the gradients follow from theirs.

use super::dense::{dense_to_jagged, jagged_to_padded_dense};
use super::read_offsets;
use crate::{Error, Result, Tensor};

/// `dense` must be `[B, max_length, D...]` for the offsets' `B` and the jagged values'
/// `[total, D...]` (other trailing dimensions broadcast: a `[B, N]` dense against `[L, D]`
/// values gave `x·y` across columns, silently).
fn check_batch(op: &'static str, values: &Tensor, offsets: &Tensor, dense: &Tensor) -> Result<()> {
    let batch = read_offsets(op, offsets)?.len() - 1;
    let trailing = &values.shape()[values.rank().min(1)..];
    if dense.rank() < 2 || dense.shape()[0] != batch || &dense.shape()[2..] != trailing {
        return Err(Error::invalid(
            op,
            format!(
                "dense has shape {:?}; expected [B = {batch}, max_length, {trailing:?}...] to \
                 match the offsets and the jagged values' {:?}",
                dense.shape(),
                values.shape()
            ),
        ));
    }
    Ok(())
}

/// `y + x` as a dense tensor of `y`'s shape (`[B, max_length, D...]`): `x` is jagged
/// (`x_values`, `x_offsets`), padded with zeros and truncated to `y`'s max length.
/// Differentiable in both.
pub fn jagged_dense_elementwise_add(
    x_values: &Tensor,
    x_offsets: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    check_batch("jagged_dense_elementwise_add", x_values, x_offsets, y)?;
    let padded = jagged_to_padded_dense(x_values, &[x_offsets], &[y.shape()[1]], 0.0)?;
    y.add(&padded)
}

/// `x + y` at the jagged positions of `x` (a jagged result with `x`'s offsets): positions
/// beyond `y`'s max length add zero. Differentiable in both.
pub fn jagged_dense_elementwise_add_jagged_output(
    x_values: &Tensor,
    x_offsets: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    check_batch(
        "jagged_dense_elementwise_add_jagged_output",
        x_values,
        x_offsets,
        y,
    )?;
    let y_jagged = dense_to_jagged(y, &[x_offsets], Some(x_values.shape()[0]))?;
    x_values.add(&y_jagged)
}

/// `x + y_0 + y_1` at the jagged positions of `x`. Differentiable in all three.
pub fn jagged_dense_dense_elementwise_add_jagged_output(
    x_values: &Tensor,
    x_offsets: &Tensor,
    y_0: &Tensor,
    y_1: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "jagged_dense_dense_elementwise_add_jagged_output";
    check_batch(OP, x_values, x_offsets, y_0)?;
    check_batch(OP, x_values, x_offsets, y_1)?;
    let rows = Some(x_values.shape()[0]);
    let a = dense_to_jagged(y_0, &[x_offsets], rows)?;
    let b = dense_to_jagged(y_1, &[x_offsets], rows)?;
    x_values.add(&a)?.add(&b)
}

/// `x * y` at the jagged positions of `x` (positions beyond `y`'s max length give zero).
/// Differentiable in both.
pub fn jagged_dense_elementwise_mul(
    x_values: &Tensor,
    x_offsets: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    check_batch("jagged_dense_elementwise_mul", x_values, x_offsets, y)?;
    let y_jagged = dense_to_jagged(y, &[x_offsets], Some(x_values.shape()[0]))?;
    x_values.mul(&y_jagged)
}
