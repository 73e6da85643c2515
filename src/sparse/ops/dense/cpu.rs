//! The padding conversions in host memory: block copies bag by bag for one jagged dimension, a
//! slot map for several.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::super::{
    copy_to_uninit, gather_rows, output_buffer, with_any_dtype, zeroed_buffer,
    PARALLEL_MIN_ELEMENTS,
};
use super::{Padding, SlotLayout};
use crate::tensor::WithDType;
use crate::{Result, Tensor};

/// Bags handled by one task of the single-dimension kernels.
const BAGS_PER_TASK: usize = 256;

/// Jagged rows (`row_len` elements each) → padded `[slots, row_len]` buffer.
pub(super) fn pad<T: Copy + Send + Sync>(
    values: &[T],
    layout: &SlotLayout,
    row_len: usize,
    fill: T,
) -> Vec<T> {
    match layout {
        SlotLayout::Mapped { slot_to_row, .. } => gather_rows(values, row_len, slot_to_row, fill),
        SlotLayout::Single {
            offsets,
            max_length,
        } => {
            let bag_len = max_length * row_len;
            let n = (offsets.len() - 1) * bag_len;
            let mut out: Vec<T> = output_buffer(n);
            if bag_len > 0 {
                let dst = &mut out.spare_capacity_mut()[..n];
                let work = |(task, chunk): (usize, &mut [MaybeUninit<T>])| {
                    for (i, bag_out) in chunk.chunks_exact_mut(bag_len).enumerate() {
                        let b = task * BAGS_PER_TASK + i;
                        let start = offsets[b] as usize;
                        let take = ((offsets[b + 1] - offsets[b]) as usize).min(*max_length);
                        let (data, padding) = bag_out.split_at_mut(take * row_len);
                        copy_to_uninit(data, &values[start * row_len..(start + take) * row_len]);
                        for d in padding {
                            d.write(fill);
                        }
                    }
                };
                if n >= PARALLEL_MIN_ELEMENTS {
                    dst.par_chunks_mut(BAGS_PER_TASK * bag_len)
                        .enumerate()
                        .for_each(work);
                } else {
                    dst.chunks_mut(BAGS_PER_TASK * bag_len)
                        .enumerate()
                        .for_each(work);
                }
            }
            // SAFETY: every bag's `bag_len` elements were written above (data then padding),
            // and the bags tile `[0, n)`.
            unsafe { out.set_len(n) };
            out
        }
    }
}

/// Padded `[slots, row_len]` buffer → `rows` jagged rows (rows no slot holds are zero).
fn unpad<T: Copy + Send + Sync + Default>(
    dense: &[T],
    layout: &SlotLayout,
    row_len: usize,
    rows: usize,
) -> Vec<T> {
    match layout {
        SlotLayout::Mapped { row_to_slot, .. } => {
            gather_rows(dense, row_len, row_to_slot, T::default())
        }
        SlotLayout::Single {
            offsets,
            max_length,
        } => {
            let mut out = zeroed_buffer(rows * row_len);
            let bags = offsets.len() - 1;
            // Each task owns the output rows of its bags: one contiguous range.
            let mut pieces = Vec::with_capacity(bags.div_ceil(BAGS_PER_TASK));
            let mut rest = out.as_mut_slice();
            let mut consumed = 0usize;
            for first in (0..bags).step_by(BAGS_PER_TASK) {
                let last = (first + BAGS_PER_TASK).min(bags);
                let end = offsets[last] as usize * row_len;
                let (head, tail) = rest.split_at_mut(end - consumed);
                pieces.push((first, last, head));
                rest = tail;
                consumed = end;
            }
            let work = |(first, last, chunk): (usize, usize, &mut [T])| {
                let base = offsets[first] as usize;
                for b in first..last {
                    let start = offsets[b] as usize;
                    let take = ((offsets[b + 1] - offsets[b]) as usize).min(*max_length);
                    let src = &dense[b * max_length * row_len..][..take * row_len];
                    chunk[(start - base) * row_len..][..take * row_len].copy_from_slice(src);
                }
            };
            if rows * row_len >= PARALLEL_MIN_ELEMENTS {
                pieces.into_par_iter().for_each(work);
            } else {
                pieces.into_iter().for_each(work);
            }
            out
        }
    }
}

pub(super) fn run(op: &Padding<'_>) -> Result<Tensor> {
    with_any_dtype!(op.input.dtype(), T => {
        let out = if op.to_dense {
            let fill = <T as WithDType>::from_f64(op.fill);
            op.input.with_contiguous(|v: &[T]| pad(v, op.layout, op.row_len, fill))?
        } else {
            op.input.with_contiguous(|v: &[T]| unpad(v, op.layout, op.row_len, op.rows))?
        };
        Tensor::from_vec(out, op.shape)
    })
}
