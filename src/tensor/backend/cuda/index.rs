//! Indexing on a CUDA device: index_select, take (a gather by flat offsets) and its
//! deterministic adjoint, and the row scatter-add.

use super::super::{Cuda, IndexOps};
use super::{
    by_size, device_of, empty, expect_f32, float_kernel, float_kernels, zeroed, ELEMENTWISE, INDEX,
    THREADS,
};
use crate::args;
use crate::cuda::LaunchConfig;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::device::same_device;
use crate::Tensor;

/// The positions `0..targets.len()` grouped by target (stably, so each group keeps position
/// order): (positions, group starts with a final end, distinct targets).
fn group_by_target(targets: &[usize]) -> (Vec<i64>, Vec<i64>, Vec<i64>) {
    let mut positions: Vec<i64> = (0..targets.len() as i64).collect();
    positions.sort_by_key(|&p| targets[p as usize]);
    let (mut starts, mut distinct) = (Vec::new(), Vec::new());
    for (k, &p) in positions.iter().enumerate() {
        let t = targets[p as usize] as i64;
        if distinct.last() != Some(&t) {
            starts.push(k as i64);
            distinct.push(t);
        }
    }
    starts.push(positions.len() as i64);
    (positions, starts, distinct)
}

impl IndexOps for Cuda {
    /// Rows `rows` (checked by the caller) of a CUDA tensor, any dtype: `[rows.len(), ...]`.
    fn index_select(t: &Tensor, rows: &[usize], shape: &[usize]) -> Result<Tensor> {
        let src = t.contiguous_values()?;
        let dev = device_of(&src)?;
        let out = empty(&dev, t.dtype(), shape)?;
        let row_len: usize = t.shape()[1..].iter().product();
        let n = rows.len() * row_len;
        if n == 0 {
            return Ok(out);
        }
        let rows_i64: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let d_rows = dev.htod(&rows_i64)?;
        let kernel = by_size(
            &INDEX,
            [
                "index_select_b1",
                "index_select_b2",
                "index_select_b4",
                "index_select_b8",
            ],
            t.dtype(),
        );
        // Every row number is below the source's row count (checked by the caller); the output
        // holds rows.len() rows of row_len elements.
        dev.launch(
            kernel,
            LaunchConfig::linear(n, THREADS),
            &args![src, d_rows, rows.len() as i64, row_len as i64, out],
        )?;
        Ok(out)
    }

    /// `out[i] = src[sources[i]]` (flat offsets into `src`'s contiguous values, checked by the
    /// caller), shaped `shape`.
    fn take(src: &Tensor, sources: &[usize], shape: &[usize]) -> Result<Tensor> {
        let src = src.contiguous_values()?;
        let dev = device_of(&src)?;
        let out = empty(&dev, src.dtype(), shape)?;
        let n = sources.len();
        if n == 0 {
            return Ok(out);
        }
        let offsets: Vec<i64> = sources.iter().map(|&s| s as i64).collect();
        let offsets = dev.htod(&offsets)?;
        let kernel = by_size(
            &ELEMENTWISE,
            ["take_b1", "take_b2", "take_b4", "take_b8"],
            src.dtype(),
        );
        // Every offset lies inside `src` (the caller's check); the output holds n values.
        dev.launch(
            kernel,
            LaunchConfig::linear(n, THREADS),
            &args![src, offsets, out, n as i64],
        )?;
        Ok(out)
    }

    /// The adjoint of [`take`]: a zero tensor of `shape` with `g[p]` added at `targets[p]`,
    /// duplicates summed in position order (deterministic; f32, f16 or bf16).
    fn put_add(g: &Tensor, targets: &[usize], shape: &[usize]) -> Result<Tensor> {
        let kernel = float_kernel("gather", g, float_kernels!("put_add_sorted"))?;
        let g = g.contiguous_values()?;
        let dev = device_of(&g)?;
        let out = zeroed(&dev, g.dtype(), shape)?;
        if targets.is_empty() {
            return Ok(out);
        }
        let (positions, starts, distinct) = group_by_target(targets);
        let m = distinct.len();
        let (positions, starts, distinct) = (
            dev.htod(&positions)?,
            dev.htod(&starts)?,
            dev.htod(&distinct)?,
        );
        // Positions index g, targets lie inside the output (the caller's check).
        dev.launch(
            kernel,
            LaunchConfig::linear(m, THREADS),
            &args![g, positions, starts, distinct, out, m as i64],
        )?;
        Ok(out)
    }

    /// `t` with `values[i]` added to row `rows[i]` (rows checked by the caller; repeats summed in
    /// position order, deterministic), f32.
    fn index_add_rows(t: &Tensor, rows: &[usize], values: &Tensor) -> Result<Tensor> {
        const OP: &str = "index_add_rows";
        expect_f32(OP, t)?;
        expect_f32(OP, values)?;
        same_device(OP, t, values)?;
        // A fresh copy of `t` to add into.
        let c = t.contiguous_values()?;
        let dev = device_of(&c)?;
        let out = empty(&dev, DType::F32, t.shape())?;
        super::copy_elements(&c, 0, &out, 0, t.numel())?;
        let row_len: usize = t.shape()[1..].iter().product();
        if rows.is_empty() || row_len == 0 {
            return Ok(out);
        }
        let (order, starts, unique) = group_by_target(rows);
        let values = values.contiguous_values()?;
        let (du, ds, dord) = (dev.htod(&unique)?, dev.htod(&starts)?, dev.htod(&order)?);
        let n = unique.len() * row_len;
        // Unique rows lie inside `out` (checked by the caller), `order` indexes the `values` rows,
        // `starts` has unique.len() + 1 entries ending at order.len().
        dev.launch(
            INDEX.kernel("index_add_rows_f32"),
            LaunchConfig::linear(n, THREADS),
            &args![
                out,
                du,
                ds,
                dord,
                values,
                unique.len() as i64,
                row_len as i64
            ],
        )?;
        Ok(out)
    }
}
