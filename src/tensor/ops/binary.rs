//! Broadcasting elementwise binary ops (add, sub, mul, div, maximum, minimum), scalar ops and
//! comparisons.

use crate::tensor::autograd::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::tensor::backend::{with_backend, BinaryOp, CompareOp, ElementwiseOps};
use crate::{Error, Result, Tensor};

fn check_same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    crate::tensor::device::same_device(op, a, b)
}

/// `a op b` after the checks every device shares.
fn binary_values(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_same_dtype(op.name(), a, b)?;
    with_backend!(a.device(), B => B::binary(op, a, b))
}

/// The backward of `a op b`: keeps an operand only when a wanted gradient reads it (a sum
/// keeps none; a product `a·b` whose `b` alone needs a gradient keeps only `a`).
struct BinaryBackward {
    kind: BinaryOp,
    a: SavedTensor,
    b: SavedTensor,
    a_needs: bool,
    b_needs: bool,
}

impl BackwardOp for BinaryBackward {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let op = self.kind.name();
        // Values are read only by the gradients that need them, each checked unchanged since
        // the forward.
        let (a, b) = (|| self.a.get(op), || self.b.get(op));
        // Only the gradients an input needs are computed (a subtraction from a constant does
        // not negate a whole gradient for nothing).
        let (ga, gb) = match self.kind {
            BinaryOp::Add => (
                self.a_needs.then(|| g.clone()),
                self.b_needs.then(|| g.clone()),
            ),
            BinaryOp::Sub => (
                self.a_needs.then(|| g.clone()),
                self.b_needs.then(|| g.neg()).transpose()?,
            ),
            BinaryOp::Mul => (
                self.a_needs.then(|| g.mul(b()?)).transpose()?,
                self.b_needs.then(|| g.mul(a()?)).transpose()?,
            ),
            BinaryOp::Div => (
                self.a_needs.then(|| g.div(b()?)).transpose()?,
                self.b_needs
                    .then(|| g.mul(a()?)?.div(&b()?.mul(b()?)?)?.neg())
                    .transpose()?,
            ),
            BinaryOp::Maximum | BinaryOp::Minimum => {
                // Ties send the gradient to `a`.
                let pick_a = if matches!(self.kind, BinaryOp::Maximum) {
                    a()?.ge(b()?)?
                } else {
                    a()?.le(b()?)?
                };
                let zero = Tensor::try_zeros(&[], g.dtype(), g.device())?;
                (
                    (self.a_needs)
                        .then(|| Tensor::where_cond(&pick_a, g, &zero))
                        .transpose()?,
                    (self.b_needs)
                        .then(|| Tensor::where_cond(&pick_a, &zero, g))
                        .transpose()?,
                )
            }
        };
        let reduce =
            |g: Option<Tensor>, shape: &[usize], needed: bool| -> Result<Option<Gradient>> {
                match g {
                    Some(g) if needed => Ok(Some(Gradient::Dense(g.sum_to_shape(shape)?))),
                    _ => Ok(None),
                }
            };
        Ok(vec![
            reduce(ga, self.a.shape(), self.a_needs)?,
            reduce(gb, self.b.shape(), self.b_needs)?,
        ])
    }
}

fn binary(kind: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = binary_values(kind, a, b)?;
    if out.dtype().is_float() {
        let (a_needs, b_needs) = (a.requires_grad(), b.requires_grad());
        // Which operand each wanted gradient reads: d(a·b)/da = b, d(a/b)/db = −a/b², a
        // maximum compares both.
        let (reads_a, reads_b) = match kind {
            BinaryOp::Add | BinaryOp::Sub => (false, false),
            BinaryOp::Mul => (b_needs, a_needs),
            BinaryOp::Div => (b_needs, a_needs || b_needs),
            BinaryOp::Maximum | BinaryOp::Minimum => (true, true),
        };
        Ok(record_op(
            out,
            &[a, b],
            BinaryBackward {
                kind,
                a: SavedTensor::new_if(reads_a, &a.detach()),
                b: SavedTensor::new_if(reads_b, &b.detach()),
                a_needs,
                b_needs,
            },
        ))
    } else {
        Ok(out)
    }
}

/// `a op b` as a u8 mask (1 = true), broadcasting; no gradient.
fn compare(op: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_same_dtype(op.name(), a, b)?;
    with_backend!(a.device(), B => B::compare(op, a, b))
}

impl Tensor {
    /// `self + rhs`, broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Add, self, rhs)
    }
    /// `self - rhs`, broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Sub, self, rhs)
    }
    /// `self * rhs` elementwise, broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Mul, self, rhs)
    }
    /// `self / rhs` elementwise, broadcasting. Integer division by zero is an error.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Div, self, rhs)
    }
    /// Elementwise maximum, broadcasting (NaN propagates from either side).
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Maximum, self, rhs)
    }
    /// Elementwise minimum, broadcasting.
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryOp::Minimum, self, rhs)
    }

    /// Mask of `self > rhs` (u8, broadcasting).
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(CompareOp::Gt, self, rhs)
    }
    /// Mask of `self >= rhs`.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(CompareOp::Ge, self, rhs)
    }
    /// Mask of `self < rhs`.
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(CompareOp::Lt, self, rhs)
    }
    /// Mask of `self <= rhs`.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(CompareOp::Le, self, rhs)
    }
    /// Mask of `self == rhs`.
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        compare(CompareOp::Eq, self, rhs)
    }

    fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::try_full(v, &[], self.dtype(), self.device())
    }

    /// `self + v`.
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0, v)
    }
    /// `self * v`.
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(v, 0.0)
    }
    /// `self / v`.
    pub fn div_scalar(&self, v: f64) -> Result<Tensor> {
        self.affine(1.0 / v, 0.0)
    }
    /// Mask of `self > v`.
    pub fn gt_scalar(&self, v: f64) -> Result<Tensor> {
        self.gt(&self.scalar_like(v)?)
    }
    /// Mask of `self < v`.
    pub fn lt_scalar(&self, v: f64) -> Result<Tensor> {
        self.lt(&self.scalar_like(v)?)
    }
    /// Mask of `self == v`.
    pub fn eq_scalar(&self, v: f64) -> Result<Tensor> {
        self.eq(&self.scalar_like(v)?)
    }
}
