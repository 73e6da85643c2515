//! softmax and log_softmax along a dimension, computed stably (max subtracted).

use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::backend::{with_backend, ReduceOps};
use crate::tensor::layout::resolve_dim;
use crate::{Result, Tensor};

struct SoftmaxBackward {
    y: Tensor,
    dim: usize,
    log: bool,
}

impl BackwardOp for SoftmaxBackward {
    fn name(&self) -> &'static str {
        if self.log {
            "log_softmax"
        } else {
            "softmax"
        }
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        if let Some(gx) = last_dim_cpu_f32(&self.y, g, self.dim, self.log)? {
            return Ok(vec![Some(Gradient::Dense(gx))]);
        }
        let d = self.dim as isize;
        let gx = if self.log {
            // g − softmax · Σg
            g.sub(&self.y.exp()?.mul(&g.sum(&[d], true)?)?)?
        } else {
            // y ⊙ (g − Σ(g ⊙ y))
            self.y.mul(&g.sub(&g.mul(&self.y)?.sum(&[d], true)?)?)?
        };
        Ok(vec![Some(Gradient::Dense(gx))])
    }
}

/// The backward along the last dimension of f32 CPU tensors in one pass per row (in parallel
/// over rows): the same formulas as the general path, without its intermediate tensors.
/// `None` for anything else.
fn last_dim_cpu_f32(y: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Option<Tensor>> {
    use rayon::prelude::*;
    let cpu_f32 = |t: &Tensor| t.device() == crate::Device::Cpu && t.dtype() == crate::DType::F32;
    if !(cpu_f32(y) && cpu_f32(g)) || dim + 1 != y.rank() || g.shape() != y.shape() {
        return Ok(None);
    }
    let n = y.shape()[dim].max(1);
    let mut out = vec![0f32; y.numel()];
    y.with_contiguous(|ys: &[f32]| {
        g.with_contiguous(|gs: &[f32]| {
            let row = |((yr, gr), or): ((&[f32], &[f32]), &mut [f32])| {
                if log {
                    // g − softmax · Σg
                    let sg: f32 = gr.iter().sum();
                    for ((o, &yv), &gv) in or.iter_mut().zip(yr).zip(gr) {
                        *o = gv - yv.exp() * sg;
                    }
                } else {
                    // y ⊙ (g − Σ(g ⊙ y))
                    let sgy: f32 = gr.iter().zip(yr).map(|(a, b)| a * b).sum();
                    for ((o, &yv), &gv) in or.iter_mut().zip(yr).zip(gr) {
                        *o = yv * (gv - sgy);
                    }
                }
            };
            if ys.len() >= crate::tensor::ops::PAR_THRESHOLD && ys.len() > n {
                (ys.par_chunks(n).zip(gs.par_chunks(n)))
                    .zip(out.par_chunks_mut(n))
                    .with_min_len((crate::tensor::ops::PAR_THRESHOLD / n).max(1))
                    .for_each(row);
            } else {
                (ys.chunks(n).zip(gs.chunks(n)))
                    .zip(out.chunks_mut(n))
                    .for_each(row);
            }
        })
    })??;
    Ok(Some(Tensor::from_vec(out, y.shape())?))
}

fn softmax_impl(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let d = resolve_dim(op, dim, x.rank())?;
    let y = with_backend!(x.device(), B => B::softmax(x, d, log))?;
    Ok(record_op(
        y.clone(),
        &[x],
        SoftmaxBackward { y, dim: d, log },
    ))
}

impl Tensor {
    /// `exp(x) / Σ exp(x)` along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        softmax_impl(self, dim, false)
    }

    /// `x − log Σ exp(x)` along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        softmax_impl(self, dim, true)
    }
}
