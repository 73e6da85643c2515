//! softmax and log_softmax along a dimension, computed stably (max subtracted).

use super::reduce::split_at_dim;
use super::{float_compute, with_float};
use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::dtype::FloatElem;
use crate::tensor::layout::resolve_dim;
use crate::{Result, Tensor};

fn softmax_kernel<T: FloatElem>(
    x: &[T],
    outer: usize,
    n: usize,
    inner: usize,
    log: bool,
) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * n + k) * inner + i;
            let mut m = T::neg_infinity();
            for k in 0..n {
                m = m.max(x[at(k)]);
            }
            let mut s = T::zero();
            for k in 0..n {
                s += (x[at(k)] - m).exp();
            }
            let ls = s.ln();
            for k in 0..n {
                let z = x[at(k)] - m;
                out[at(k)] = if log { z - ls } else { z.exp() / s };
            }
        }
    }
    out
}

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
    let y = if x.device().is_cuda() {
        crate::tensor::cuda::softmax(x, d, log)?
    } else {
        let (xc, storage) = float_compute(op, x)?;
        let (outer, n, inner) = split_at_dim(x.shape(), d);
        with_float!(xc.dtype(), op, T => {
            let v = xc.with_contiguous(|s: &[T]| softmax_kernel(s, outer, n, inner, log))?;
            Tensor::from_vec(v, x.shape())?
        })
        .cast_values(storage)?
    };
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
