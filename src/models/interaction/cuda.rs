//! The dot interaction on a CUDA device (`kernels/interaction.cu`, f32): a block per sample.

use std::sync::Arc;

use super::OP;
use crate::args;
use crate::cuda::{CudaDevice, DeviceBuffer, LaunchConfig};
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::backend::cuda::{empty, expect_f32};
use crate::tensor::device::same_device;
use crate::Tensor;

crate::kernel_source!(
    pub(crate) static INTERACTION = "interaction.cu",
    ["dot_interaction_f32", "dot_interaction_backward_f32"];
);

/// Threads per sample's block.
const THREADS: u32 = 128;

/// The strict upper triangle's pairs `(i, j)` of `n` rows, row-major, as two device arrays.
fn pairs(device: &Arc<CudaDevice>, n: usize) -> Result<(DeviceBuffer<i32>, DeviceBuffer<i32>)> {
    let (mut pi, mut pj) = (Vec::new(), Vec::new());
    for i in 0..n {
        for j in i + 1..n {
            pi.push(i as i32);
            pj.push(j as i32);
        }
    }
    Ok((device.htod(&pi)?, device.htod(&pj)?))
}

/// `dense [B, D]`, `sparse [B, F, D]` → `[B, D + F(F+1)/2]`.
pub(super) fn forward(device: &Arc<CudaDevice>, dense: &Tensor, sparse: &Tensor) -> Result<Tensor> {
    expect_f32(OP, dense)?;
    expect_f32(OP, sparse)?;
    let (b, d, f) = (dense.shape()[0], dense.shape()[1], sparse.shape()[1]);
    let p = (f + 1) * f / 2;
    let (dense, sparse) = (dense.contiguous_values()?, sparse.contiguous_values()?);
    let out = empty(device, DType::F32, &[b, d + p])?;
    if b == 0 {
        return Ok(out);
    }
    let (pair_i, pair_j) = pairs(device, f + 1)?;
    // Contiguous [B, D] and [B, F, D] inputs, [B, D + P] output, P pairs.
    device.launch(
        INTERACTION.kernel("dot_interaction_f32"),
        LaunchConfig::blocks(b, THREADS),
        &args![dense, sparse, f as i32, d as i32, pair_i, pair_j, p as i32, out],
    )?;
    Ok(out)
}

/// Gradients of [`forward`] in `dense` and `sparse` from the output's gradient.
pub(super) fn backward(
    device: &Arc<CudaDevice>,
    dense: &Tensor,
    sparse: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    expect_f32(OP, grad)?;
    same_device(OP, dense, grad)?;
    let (b, d, f) = (dense.shape()[0], dense.shape()[1], sparse.shape()[1]);
    let (dense, sparse, grad) = (
        dense.contiguous_values()?,
        sparse.contiguous_values()?,
        grad.contiguous_values()?,
    );
    let gd = empty(device, DType::F32, &[b, d])?;
    let gs = empty(device, DType::F32, &[b, f, d])?;
    if b == 0 {
        return Ok((gd, gs));
    }
    // Contiguous inputs as in the forward, gradient [B, D + P], outputs [B, D] and [B, F, D].
    device.launch(
        INTERACTION.kernel("dot_interaction_backward_f32"),
        LaunchConfig::blocks(b, THREADS),
        &args![dense, sparse, f as i32, d as i32, grad, gd, gs],
    )?;
    Ok((gd, gs))
}
