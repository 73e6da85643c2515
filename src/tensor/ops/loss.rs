//! Losses: BCE-with-logits, MSE and cross-entropy.

use super::{float_compute, with_float};
use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::backend::{with_backend, ElementwiseOps};
use crate::tensor::dtype::FloatElem;
use crate::{DType, Error, Result, Tensor};
use num_traits::One;

/// How per-element losses are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Keep the per-element losses.
    None,
    /// Mean over all elements (PyTorch's default).
    #[default]
    Mean,
    /// Sum over all elements.
    Sum,
}

/// Backward of a loss computed elementwise: the local derivatives were saved by the forward
/// pass; backward scales them by the upstream gradient and the reduction.
struct PointwiseLossBackward {
    name: &'static str,
    d_input: Tensor,
    d_target: Option<Tensor>,
    reduction: Reduction,
}

impl BackwardOp for PointwiseLossBackward {
    fn name(&self) -> &'static str {
        self.name
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let n = self.d_input.numel().max(1) as f64;
        let scale = |d: &Tensor| -> Result<Tensor> {
            let s = d.mul(g)?;
            match self.reduction {
                Reduction::Mean => s.mul_scalar(1.0 / n),
                _ => Ok(s),
            }
        };
        Ok(vec![
            Some(Gradient::Dense(scale(&self.d_input)?)),
            self.d_target
                .as_ref()
                .map(scale)
                .transpose()?
                .map(Gradient::Dense),
        ])
    }
}

fn reduce(op: &'static str, losses: Tensor, reduction: Reduction) -> Result<Tensor> {
    let _ = op;
    crate::no_grad(|| match reduction {
        Reduction::None => Ok(losses),
        Reduction::Mean => losses.mean_all(),
        Reduction::Sum => losses.sum_all(),
    })
}

fn check_pair(op: &'static str, input: &Tensor, target: &Tensor) -> Result<()> {
    if input.shape() != target.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: input.shape().to_vec(),
            rhs: target.shape().to_vec(),
            detail: "input and target must have the same shape".into(),
        });
    }
    if input.dtype() != target.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: input.dtype(),
            rhs: target.dtype(),
        });
    }
    Ok(())
}

/// Per-element `(loss, d loss/d input, d loss/d target)` over contiguous compute-dtype buffers.
fn pointwise<T: FloatElem>(
    x: &[T],
    y: &[T],
    f: impl Fn(T, T) -> (T, T, T),
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut l = Vec::with_capacity(x.len());
    let mut dx = Vec::with_capacity(x.len());
    let mut dy = Vec::with_capacity(x.len());
    for (&a, &b) in x.iter().zip(y) {
        let (v, da, db) = f(a, b);
        l.push(v);
        dx.push(da);
        dy.push(db);
    }
    (l, dx, dy)
}

impl Tensor {
    /// Binary cross-entropy on logits: `max(x,0) − x·y + log(1+e^{−|x|})` per element
    /// (numerically stable), times `weight` if given (broadcast to the input). Targets may be
    /// soft labels in [0, 1]; they are not differentiated.
    pub fn bce_with_logits(
        &self,
        target: &Tensor,
        weight: Option<&Tensor>,
        reduction: Reduction,
    ) -> Result<Tensor> {
        const OP: &str = "bce_with_logits";
        check_pair(OP, self, target)?;
        let (mut losses, mut dx) =
            with_backend!(self.device(), B => B::bce_with_logits(self, target))?;
        if let Some(w) = weight {
            let w = w.detach();
            losses = losses.mul(&w)?;
            dx = dx.mul(&w)?;
            if losses.shape() != self.shape() {
                return Err(Error::shape(OP, self.shape(), w.shape()));
            }
        }
        let out = reduce(OP, losses, reduction)?;
        Ok(record_op(
            out,
            &[self, target],
            PointwiseLossBackward {
                name: OP,
                d_input: dx,
                d_target: None,
                reduction,
            },
        ))
    }

    /// Mean squared error `(x − y)²` per element; differentiable in both arguments.
    pub fn mse_loss(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        const OP: &str = "mse_loss";
        check_pair(OP, self, target)?;
        let (x, storage) = float_compute(OP, self)?;
        let (y, _) = float_compute(OP, target)?;
        let (l, dx, dy) = with_float!(x.dtype(), OP, T => {
            let (l, dx, dy) = x.with_contiguous(|xs: &[T]| {
                y.with_contiguous(|ys: &[T]| {
                    pointwise(xs, ys, |x, y| {
                        let d = x - y;
                        let two = T::one() + T::one();
                        (d * d, two * d, -(two * d))
                    })
                })
            })??;
            let s = x.shape();
            (Tensor::from_vec(l, s)?, Tensor::from_vec(dx, s)?, Tensor::from_vec(dy, s)?)
        });
        let out = reduce(OP, l.cast_values(storage)?, reduction)?;
        Ok(record_op(
            out,
            &[self, target],
            PointwiseLossBackward {
                name: OP,
                d_input: dx.cast_values(storage)?,
                d_target: Some(dy.cast_values(storage)?),
                reduction,
            },
        ))
    }

    /// Cross-entropy of logits `[N, C]` against class indices `[N]` (i64 in `0..C`):
    /// `−log_softmax(x)[target]` per row.
    pub fn cross_entropy(&self, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
        const OP: &str = "cross_entropy";
        if self.rank() != 2 || target.rank() != 1 || target.shape()[0] != self.shape()[0] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: self.shape().to_vec(),
                rhs: target.shape().to_vec(),
                detail: "expected logits [N, C] and targets [N]".into(),
            });
        }
        if !matches!(target.dtype(), DType::I64 | DType::I32) {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype: target.dtype(),
                expected: "i64 or i32 class indices",
            });
        }
        let n = self.shape()[0];
        // Row i picks column target[i]: a dim-0 gather on the transpose, lsmᵀ[target[i], i].
        let picked = self
            .log_softmax(1)?
            .t()?
            .gather(&target.reshape(&[1, n])?)?
            .reshape(&[n])?
            .neg()?;
        match reduction {
            Reduction::None => Ok(picked),
            Reduction::Mean => picked.mean_all(),
            Reduction::Sum => picked.sum_all(),
        }
    }
}
