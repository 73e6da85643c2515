//! softmax and log_softmax along a dimension, computed stably (max subtracted).

use crate::tensor::autograd::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::tensor::backend::{with_backend, ReduceOps};
use crate::tensor::layout::resolve_dim;
use crate::{Result, Tensor};

struct SoftmaxBackward {
    y: SavedTensor,
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
        let y = self.y.get(self.name())?;
        let gx = with_backend!(g.device(), B => B::softmax_backward(y, g, self.dim, self.log))?;
        Ok(vec![Some(Gradient::Dense(gx))])
    }
}

/// softmax's gradient from its output `y` and the output gradient `g` along `dim`, composed of
/// tensor ops: `y ⊙ (g − Σ(g ⊙ y))`, or for log_softmax `g − exp(y) · Σg`. The backends' default
/// ([`ReduceOps::softmax_backward`]).
pub(crate) fn softmax_backward_composed(
    y: &Tensor,
    g: &Tensor,
    dim: usize,
    log: bool,
) -> Result<Tensor> {
    let d = dim as isize;
    if log {
        g.sub(&y.exp()?.mul(&g.sum(&[d], true)?)?)
    } else {
        y.mul(&g.sub(&g.mul(y)?.sum(&[d], true)?)?)
    }
}

fn softmax_impl(x: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
    let op = if log { "log_softmax" } else { "softmax" };
    let d = resolve_dim(op, dim, x.rank())?;
    let y = with_backend!(x.device(), B => B::softmax(x, d, log))?;
    let saved = SavedTensor::new(&y);
    Ok(record_op(
        y,
        &[x],
        SoftmaxBackward {
            y: saved,
            dim: d,
            log,
        },
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
