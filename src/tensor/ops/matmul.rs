//! Matrix products: 2-D, batched with broadcasting, and the fused `linear` (`x·Wᵀ + b`), with
//! their gradients. Transposed operands stay strided views (the backends read them in place).

use crate::tensor::autograd::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::tensor::backend::{with_backend, MatmulOps};
use crate::tensor::layout::broadcast_shapes;
use crate::{Error, Result, Tensor};

thread_local! {
    static ROW_INVARIANT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every [`Tensor::linear`] on this thread *row-invariant* (CPU tensors): each
/// output row is computed in an order that depends only on that input row, so a sample gets
/// bit-identical values alone or inside any batch. The default gemm is faster on large batches
/// but picks its kernel and blocking by shape, so the last bits of a row can depend on the
/// batch it is in. Serving and [`DlrmTrainer::predict`](crate::train::DlrmTrainer::predict)
/// run inside this mode; cuBLAS makes no such promise, so on a CUDA device it changes nothing.
pub fn row_invariant<R>(f: impl FnOnce() -> R) -> R {
    with_row_invariant(true, f)
}

/// Runs `f` with [`row_invariant`] on or off on this thread, restoring the mode after.
pub(crate) fn with_row_invariant<R>(on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ROW_INVARIANT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(ROW_INVARIANT.with(|c| c.replace(on)));
    f()
}

/// Whether [`row_invariant`] is in force on this thread.
pub fn is_row_invariant() -> bool {
    ROW_INVARIANT.with(|c| c.get())
}

fn check_matmul(a: &Tensor, b: &Tensor) -> Result<(usize, usize, usize, Vec<usize>)> {
    if a.rank() < 2 || b.rank() < 2 {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
            detail: "both operands need at least 2 dimensions".into(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op: "matmul",
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let (m, k) = (a.shape()[a.rank() - 2], a.shape()[a.rank() - 1]);
    let (k2, n) = (b.shape()[b.rank() - 2], b.shape()[b.rank() - 1]);
    if k != k2 {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
            detail: format!("inner dimensions differ: {k} vs {k2}"),
        });
    }
    let batch = broadcast_shapes(
        "matmul",
        &a.shape()[..a.rank() - 2],
        &b.shape()[..b.rank() - 2],
    )?;
    Ok((m, k, n, batch))
}

fn matmul_values(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (_, _, _, batch) = check_matmul(a, b)?;
    crate::tensor::device::same_device("matmul", a, b)?;
    with_backend!(a.device(), B => B::matmul(a, b, &batch))
}

struct MatmulBackward {
    a: SavedTensor,
    b: SavedTensor,
    a_needs: bool,
    b_needs: bool,
    /// Whether each operand is a transposed view (its gradient is then produced transposed).
    a_transposed: bool,
    b_transposed: bool,
}

impl BackwardOp for MatmulBackward {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        // dA = G·Bᵀ and dB = Aᵀ·G. When an operand is itself a transposed view (z·zᵀ), its
        // gradient is produced transposed too (dBᵀ = Gᵀ·A), so the transpose's backward hands
        // a contiguous gradient on instead of a strided one.
        let ga = if self.a_needs {
            let b = self.b.get("matmul")?;
            let ga = if self.a_transposed {
                matmul_values(b, &g.t()?)?.t()?
            } else {
                matmul_values(g, &b.t()?)?
            };
            Some(Gradient::Dense(ga.sum_to_shape(self.a.shape())?))
        } else {
            None
        };
        let gb = if self.b_needs {
            let a = self.a.get("matmul")?;
            let gb = if self.b_transposed {
                matmul_values(&g.t()?, a)?.t()?
            } else {
                matmul_values(&a.t()?, g)?
            };
            Some(Gradient::Dense(gb.sum_to_shape(self.b.shape())?))
        } else {
            None
        };
        Ok(vec![ga, gb])
    }
}

/// True when the last two dimensions are laid out column-major (a transposed view).
fn is_transposed(t: &Tensor) -> bool {
    let (s, r) = (t.layout().strides(), t.rank());
    r >= 2 && s[r - 2] == 1 && s[r - 1] != 1 && t.shape()[r - 2] > 1
}

struct LinearBackward {
    x: SavedTensor,
    w: SavedTensor,
    x_needs: bool,
    w_needs: bool,
    has_bias: bool,
}

impl BackwardOp for LinearBackward {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let out_features = self.w.shape()[0];
        let rows = g.numel() / out_features.max(1);
        let g2 = g.reshape(&[rows, out_features])?;
        let gx = self
            .x_needs
            .then(|| matmul_values(&g2, self.w.get("linear")?)?.reshape(self.x.shape()))
            .transpose()?;
        let gw = self
            .w_needs
            .then(|| {
                let x2 = self.x.get("linear")?.reshape(&[rows, self.w.shape()[1]])?;
                matmul_values(&g2.t()?, &x2)
            })
            .transpose()?;
        let mut grads = vec![gx.map(Gradient::Dense), gw.map(Gradient::Dense)];
        if self.has_bias {
            grads.push(Some(Gradient::Dense(g2.sum(&[0], false)?)));
        }
        Ok(grads)
    }
}

impl Tensor {
    /// Matrix product over the last two dimensions; leading (batch) dimensions broadcast.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let out = matmul_values(self, rhs)?;
        Ok(record_op(
            out,
            &[self, rhs],
            MatmulBackward {
                // dA reads B, dB reads A: each kept only when the other's gradient is wanted.
                a: SavedTensor::new_if(rhs.requires_grad(), &self.detach()),
                b: SavedTensor::new_if(self.requires_grad(), &rhs.detach()),
                a_needs: self.requires_grad(),
                b_needs: rhs.requires_grad(),
                a_transposed: is_transposed(self),
                b_transposed: is_transposed(rhs),
            },
        ))
    }

    /// `x·Wᵀ + b` for `x` of shape `[..., in]`, `weight` `[out, in]`, `bias` `[out]`: one
    /// gemm that accumulates onto the broadcast bias (inside [`row_invariant`], a kernel whose
    /// every row's values are independent of the other rows).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if weight.rank() != 2
            || self.rank() == 0
            || self.shape()[self.rank() - 1] != weight.shape()[1]
        {
            return Err(Error::ShapeMismatch {
                op: "linear",
                lhs: self.shape().to_vec(),
                rhs: weight.shape().to_vec(),
                detail: "expected input [..., in] and weight [out, in]".into(),
            });
        }
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        if let Some(b) = bias {
            if b.shape() != [out_f] {
                return Err(Error::ShapeMismatch {
                    op: "linear",
                    lhs: b.shape().to_vec(),
                    rhs: vec![out_f],
                    detail: "bias must be [out]".into(),
                });
            }
        }
        for t in [Some(weight), bias].into_iter().flatten() {
            if t.dtype() != self.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "linear",
                    lhs: self.dtype(),
                    rhs: t.dtype(),
                });
            }
        }
        for t in [Some(weight), bias].into_iter().flatten() {
            crate::tensor::device::same_device("linear", self, t)?;
        }
        // The rows from the shape (not numel / in_features, which is 0 rows for 0 features).
        let rows: usize = self.shape()[..self.rank() - 1].iter().product();
        let x2 = self.reshape(&[rows, in_f])?.detach();
        let (w, b) = (weight.detach(), bias.map(Tensor::detach));
        let out = if is_row_invariant() {
            with_backend!(self.device(), B => B::linear_row_invariant(&x2, &w, b.as_ref()))?
        } else {
            with_backend!(self.device(), B => B::linear(&x2, &w, b.as_ref()))?
        };
        let mut shape = self.shape().to_vec();
        *shape.last_mut().expect("rank >= 1") = out_f;
        let out = out.reshape(&shape)?;
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        Ok(record_op(
            out,
            &inputs,
            LinearBackward {
                // Without their history: saved operands do not keep the graph alive twice.
                // dx reads W, dW reads x: each kept only when the other's gradient is wanted
                // (a first layer on data keeps its input, not its weights).
                x: SavedTensor::new_if(weight.requires_grad(), &self.detach()),
                w: SavedTensor::new_if(self.requires_grad(), &weight.detach()),
                x_needs: self.requires_grad(),
                w_needs: weight.requires_grad(),
                has_bias: bias.is_some(),
            },
        ))
    }
}
