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
