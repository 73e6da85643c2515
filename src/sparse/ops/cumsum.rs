//! Cumulative sums of lengths: complete (`[0, a0, a0+a1, ...]`, one longer), exclusive and
//! inclusive, on i64/i32 tensors, 1-D or row-wise over a 2-D tensor.

use super::{expect_int, int_tensor, read_ints};
use crate::{Error, Result, Tensor};

#[derive(Clone, Copy)]
enum CumsumKind {
    Complete,
    Exclusive,
    Inclusive,
}

fn cumsum(op: &'static str, input: &Tensor, kind: CumsumKind) -> Result<Tensor> {
    expect_int(op, "input", input)?;
    let (rows, width) = match input.shape() {
        [n] => (1, *n),
        [r, n] => (*r, *n),
        s => {
            return Err(Error::invalid(
                op,
                format!("expected a 1-D or 2-D tensor, got shape {s:?}"),
            ))
        }
    };
    let v = read_ints(op, "input", input)?;
    let out_width = if matches!(kind, CumsumKind::Complete) {
        width + 1
    } else {
        width
    };
    // The output's size comes from the shape, which a tensor of no elements can claim at
    // will ([2^40, 0]): checked and allocated fallibly.
    let size = rows
        .checked_mul(out_width)
        .ok_or_else(|| Error::invalid(op, format!("{rows} rows of {out_width} are past usize")))?;
    let mut out = crate::tensor::storage::try_with_capacity(op, size)?;
    let overflow = |r: usize| {
        Error::invalid(
            op,
            format!("the sum of row {r} overflows i64 (lengths past any tensor)"),
        )
    };
    for (r, row) in v.chunks(width.max(1)).take(rows).enumerate() {
        let mut acc = 0i64;
        if matches!(kind, CumsumKind::Complete) {
            out.push(0);
        }
        for &x in row.iter().take(width) {
            if matches!(kind, CumsumKind::Exclusive) {
                out.push(acc);
                acc = acc.checked_add(x).ok_or_else(|| overflow(r))?;
            } else {
                acc = acc.checked_add(x).ok_or_else(|| overflow(r))?;
                out.push(acc);
            }
        }
    }
    if width == 0 && matches!(kind, CumsumKind::Complete) {
        out = crate::tensor::storage::try_filled(op, 0i64, rows)?;
    }
    let shape: Vec<usize> = if input.rank() == 1 {
        vec![out_width]
    } else {
        vec![rows, out_width]
    };
    int_tensor(out, &shape, input.dtype())
}

/// `[0, x0, x0+x1, ..., Σx]` (one entry longer than the input; row-wise for a 2-D input):
/// lengths → offsets. Keeps the input's integer dtype.
pub fn complete_cumsum(input: &Tensor) -> Result<Tensor> {
    cumsum("asynchronous_complete_cumsum", input, CumsumKind::Complete)
}

/// `[0, x0, x0+x1, ..., x0+...+x_{n-2}]` (same length as the input).
pub fn exclusive_cumsum(input: &Tensor) -> Result<Tensor> {
    cumsum(
        "asynchronous_exclusive_cumsum",
        input,
        CumsumKind::Exclusive,
    )
}

/// `[x0, x0+x1, ..., Σx]` (same length as the input).
pub fn inclusive_cumsum(input: &Tensor) -> Result<Tensor> {
    cumsum(
        "asynchronous_inclusive_cumsum",
        input,
        CumsumKind::Inclusive,
    )
}
