//! The padding conversions on a CUDA device (`kernels/jagged.cu`, f32): one thread per output
//! element bag by bag for one jagged dimension, through the host-built slot maps for several.

use std::sync::Arc;

use super::{Padding, SlotLayout};
use crate::args;
use crate::cuda::{CudaDevice, LaunchConfig};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::backend::cuda::empty;
use crate::Tensor;

crate::kernel_source!(
    pub(crate) static JAGGED = "jagged.cu",
    ["jagged_to_padded_dense_f32", "dense_to_jagged_f32", "gather_rows_or_fill_f32"];
);

/// Threads per block.
const THREADS: u32 = 256;

pub(super) fn run(op: &Padding<'_>, device: &Arc<CudaDevice>) -> Result<Tensor> {
    let name = if op.to_dense {
        "jagged_to_padded_dense"
    } else {
        "dense_to_jagged"
    };
    if op.input.dtype() != DType::F32 {
        return Err(Error::UnsupportedDType {
            op: name,
            dtype: op.input.dtype(),
            expected: "f32 on CUDA devices (other dtypes: move to the CPU)",
        });
    }
    let out = match (op.layout, op.to_dense) {
        (
            SlotLayout::Single {
                offsets,
                max_length,
            },
            to_dense,
        ) => jagged_dense(device, op.input, offsets, *max_length, op, to_dense)?,
        (SlotLayout::Mapped { slot_to_row, .. }, true) => {
            gather_rows_or_fill(device, op.input, slot_to_row, op.row_len, op.fill)?
        }
        (SlotLayout::Mapped { row_to_slot, .. }, false) => {
            gather_rows_or_fill(device, op.input, row_to_slot, op.row_len, 0.0)?
        }
    };
    out.reshape(op.shape)
}

/// Jagged `[N, D]` f32 values with `offsets` (`[B + 1]`, checked) padded to `[B, max_len, D]`,
/// or the reverse (`to_dense` false: `dense [B, max_len, D]` → `[rows, D]`, positions past
/// `max_len` zero).
fn jagged_dense(
    device: &Arc<CudaDevice>,
    src: &Tensor,
    offsets: &[i64],
    max_len: usize,
    op: &Padding<'_>,
    to_dense: bool,
) -> Result<Tensor> {
    let src = src.contiguous_values()?;
    let (b, d) = (offsets.len() - 1, op.row_len);
    let d_offsets = device.htod(offsets)?;
    // Offsets are validated (start at 0, never decrease, end ≤ the jagged rows); shapes as in
    // kernels/jagged.cu. The kernels take no grid-stride loop: `covering`.
    if to_dense {
        let out = empty(device, DType::F32, &[b, max_len, d])?;
        let n = b * max_len * d;
        if n > 0 {
            device.launch(
                JAGGED.kernel("jagged_to_padded_dense_f32"),
                LaunchConfig::covering(n, THREADS),
                &args![
                    src,
                    d_offsets,
                    b as i32,
                    max_len as i32,
                    d as i32,
                    op.fill as f32,
                    out
                ],
            )?;
        }
        Ok(out)
    } else {
        let out = empty(device, DType::F32, &[op.rows, d])?;
        let n = op.rows * d;
        if n > 0 {
            device.launch(
                JAGGED.kernel("dense_to_jagged_f32"),
                LaunchConfig::covering(n, THREADS),
                &args![
                    src,
                    d_offsets,
                    b as i32,
                    max_len as i32,
                    d as i32,
                    op.rows as i64,
                    out
                ],
            )?;
        }
        Ok(out)
    }
}

/// `[map.len(), row_len]` f32 rows: row `r` is row `map[r]` of `src` (`[*, row_len]`, rows
/// checked by the caller's layout), or `fill` where `map[r] < 0`.
fn gather_rows_or_fill(
    device: &Arc<CudaDevice>,
    src: &Tensor,
    map: &[i64],
    row_len: usize,
    fill: f64,
) -> Result<Tensor> {
    let src = src.contiguous_values()?;
    let out = empty(device, DType::F32, &[map.len(), row_len])?;
    let n = map.len() * row_len;
    if n == 0 {
        return Ok(out);
    }
    let d_map = device.htod(map)?;
    // Every non-negative map entry is a row of `src`; the output holds map.len() rows of
    // row_len values.
    device.launch(
        JAGGED.kernel("gather_rows_or_fill_f32"),
        LaunchConfig::linear(n, THREADS),
        &args![
            src,
            d_map,
            map.len() as i64,
            row_len as i64,
            fill as f32,
            out
        ],
    )?;
    Ok(out)
}
