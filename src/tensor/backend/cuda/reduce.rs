//! Reductions on a CUDA device: sums over dimensions (a warp per row along the last one), the
//! maximum along a dimension with its index, and softmax.

use super::super::{Cuda, ReduceOps};
use super::{device_of, empty, float_kernel, float_kernels, zeroed, ELEMENTWISE, THREADS};
use crate::args;
use crate::cuda::LaunchConfig;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::ops::reduce::split_at_dim;
use crate::Tensor;

impl ReduceOps for Cuda {
    /// Sum over `dims` (sorted, distinct), keeping them as size 1: floats with f64 accumulation,
    /// rounded to f32 and then to the dtype of `x`; integers wrapping around, as on the CPU.
    fn sum_dims(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        let kernel = match x.dtype() {
            DType::I64 => ELEMENTWISE.kernel("sum_middle_i64"),
            DType::I32 => ELEMENTWISE.kernel("sum_middle_i32"),
            DType::U8 => ELEMENTWISE.kernel("sum_middle_u8"),
            _ => float_kernel("sum", x, float_kernels!("sum_middle"))?,
        };
        // Float rows along the last dimension: a warp per row.
        let rows_kernel = x
            .dtype()
            .is_float()
            .then(|| float_kernel("sum", x, float_kernels!("sum_rows")))
            .transpose()?;
        let mut cur = x.contiguous_values()?;
        for &d in dims {
            let shape = cur.shape().to_vec();
            let (outer, r, inner) = split_at_dim(&shape, d);
            let dev = device_of(&cur)?;
            let mut out_shape = shape.clone();
            out_shape[d] = 1;
            let out = empty(&dev, x.dtype(), &out_shape)?;
            if let (Some(rows_kernel), 1, true) = (rows_kernel, inner, outer > 0 && r >= 64) {
                // Contiguous [outer, r] input and [outer] output.
                dev.launch(
                    rows_kernel,
                    LaunchConfig::warp_per_item(outer, 4),
                    &args![cur, out, outer as i64, r as i64],
                )?;
            } else if outer * inner > 0 {
                // Contiguous [outer, r, inner] input and [outer, inner] output.
                dev.launch(
                    kernel,
                    LaunchConfig::linear(outer * inner, THREADS),
                    &args![cur, out, outer as i64, r as i64, inner as i64],
                )?;
            }
            cur = out;
        }
        Ok(cur)
    }

    /// softmax (or log_softmax) of `x` along dimension `d`.
    fn softmax(x: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let kernel = float_kernel(op, x, float_kernels!("softmax_middle"))?;
        let rows_kernel = float_kernel(op, x, float_kernels!("softmax_rows"))?;
        let x = x.contiguous_values()?;
        let (outer, r, inner) = split_at_dim(x.shape(), d);
        let dev = device_of(&x)?;
        let out = empty(&dev, x.dtype(), x.shape())?;
        if inner == 1 && outer > 0 && r > 0 {
            // Along the last dimension, a warp per row: contiguous [outer, r] input and output.
            dev.launch(
                rows_kernel,
                LaunchConfig::warp_per_item(outer, 4),
                &args![x, out, outer as i64, r as i64, i32::from(log)],
            )?;
        } else if outer * inner > 0 && r > 0 {
            // Contiguous [outer, r, inner] input and output.
            dev.launch(
                kernel,
                LaunchConfig::linear(outer * inner, THREADS),
                &args![x, out, outer as i64, r as i64, inner as i64, i32::from(log)],
            )?;
        }
        Ok(out)
    }

    /// The maximum of `x` along dimension `d` (not empty) and the index of its first occurrence,
    /// both shaped `[outer, inner]`.
    fn max_dim(x: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
        let kernel = float_kernel("max", x, float_kernels!("max_middle"))?;
        let rows_kernel = float_kernel("max", x, float_kernels!("max_rows"))?;
        let x = x.contiguous_values()?;
        let (outer, r, inner) = split_at_dim(x.shape(), d);
        let dev = device_of(&x)?;
        let values = empty(&dev, x.dtype(), &[outer, inner])?;
        let indices = empty(&dev, DType::I64, &[outer, inner])?;
        if inner == 1 && outer > 0 {
            // Along the last dimension, a warp per row: contiguous [outer, r] input (r ≥ 1,
            // checked by the caller), outputs of `outer` values.
            dev.launch(
                rows_kernel,
                LaunchConfig::warp_per_item(outer, 4),
                &args![x, values, indices, outer as i64, r as i64],
            )?;
        } else if outer * inner > 0 {
            // Contiguous [outer, r, inner] input, [outer, inner] outputs.
            dev.launch(
                kernel,
                LaunchConfig::linear(outer * inner, THREADS),
                &args![x, values, indices, outer as i64, r as i64, inner as i64],
            )?;
        }
        Ok((values, indices))
    }

    /// The gradient of [`max_dim`]: `g` (`[outer, inner]` values in order) placed at the maxima
    /// `indices` of an `input_shape` tensor of zeros.
    fn max_dim_backward(
        g: &Tensor,
        indices: &Tensor,
        input_shape: &[usize],
        d: usize,
    ) -> Result<Tensor> {
        let kernel = float_kernel("max", g, float_kernels!("max_middle_backward"))?;
        let g = g.contiguous_values()?;
        let indices = indices.contiguous_values()?;
        let (outer, r, inner) = split_at_dim(input_shape, d);
        let dev = device_of(&g)?;
        let gx = zeroed(&dev, g.dtype(), input_shape)?;
        if outer * inner > 0 {
            // g and indices hold outer·inner values (indices < r), gx the input's shape.
            dev.launch(
                kernel,
                LaunchConfig::linear(outer * inner, THREADS),
                &args![g, indices, gx, outer as i64, r as i64, inner as i64],
            )?;
        }
        Ok(gx)
    }
}
