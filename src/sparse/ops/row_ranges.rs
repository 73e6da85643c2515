//! Concatenated row ranges of a tensor (the KJT's per-key slices, permute's reordering), on the
//! tensor's device: the CPU copies in parallel, a CUDA device copies each range on the device.

use std::sync::Arc;

use super::{gather_ranges, row_len, with_any_dtype};
use crate::cuda::CudaDevice;
use crate::tensor::backend::cuda::{copy_elements, empty};
use crate::tensor::{run_on, DeviceOp};
use crate::{Result, Tensor};

/// Rows `start .. start + len` of each range of `src`, back to back, shaped `shape`.
struct RowRanges<'a> {
    src: &'a Tensor,
    /// `(start_row, num_rows)`, checked by the caller to lie inside `src`.
    ranges: &'a [(usize, usize)],
    shape: &'a [usize],
}

impl DeviceOp for RowRanges<'_> {
    type Output = Tensor;

    fn cpu(&self) -> Result<Tensor> {
        let rl = row_len(self.src);
        let element_ranges: Vec<(usize, usize)> =
            self.ranges.iter().map(|&(s, n)| (s * rl, n * rl)).collect();
        with_any_dtype!(self.src.dtype(), T => {
            let out = self.src.with_contiguous(|v: &[T]| gather_ranges(v, &element_ranges))?;
            Tensor::from_vec(out, self.shape)
        })
    }

    fn cuda(&self, device: &Arc<CudaDevice>) -> Result<Tensor> {
        let src = self.src.contiguous_values()?;
        let out = empty(device, src.dtype(), self.shape)?;
        let rl = row_len(&src);
        let mut at = 0;
        for &(start, len) in self.ranges {
            copy_elements(&src, start * rl, &out, at * rl, len * rl)?;
            at += len;
        }
        Ok(out)
    }
}

/// A tensor holding the concatenated row ranges `(start_row, num_rows)` of `src`.
/// A range past `src`'s rows is an error (a KJT built unchecked can hold per-key offsets
/// that its values do not: permuting it panicked on a slice, or on a wrapped length).
pub(crate) fn gather_row_ranges_tensor(src: &Tensor, ranges: &[(usize, usize)]) -> Result<Tensor> {
    let have = src.shape().first().copied().unwrap_or(0);
    let mut rows = 0usize;
    for (i, &(start, len)) in ranges.iter().enumerate() {
        match (start.checked_add(len), rows.checked_add(len)) {
            (Some(end), Some(total)) if end <= have => rows = total,
            _ => {
                return Err(crate::Error::invalid(
                    "gather_row_ranges",
                    format!(
                        "range {i} (rows {start}.. of {len}) is past the tensor's {have} rows \
                         (a KJT whose offsets disagree with its values?)"
                    ),
                ))
            }
        }
    }
    let mut shape = src.shape().to_vec();
    shape[0] = rows;
    run_on(
        src.device(),
        &RowRanges {
            src,
            ranges,
            shape: &shape,
        },
    )
}
