//! Broadcasting elementwise binary ops (add, sub, mul, div, maximum, minimum), scalar ops and
//! comparisons.

use rayon::prelude::*;

use super::{float_compute, par_zip, with_num, PAR_THRESHOLD};
use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::dtype::{NumElem, WithDType};
use crate::tensor::layout::{broadcast_shapes, for_each_row};
use crate::{DType, Error, Result, Tensor};

/// Applies `f` to every broadcast pair of elements of `a` and `b` (which must have dtype `T`),
/// producing a contiguous tensor. Runs on strided views directly, in parallel when large.
pub(crate) fn broadcast_zip<T: WithDType, U: WithDType>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(T, T) -> U + Sync + Send,
) -> Result<Tensor> {
    let shape = broadcast_shapes(op, a.shape(), b.shape())?;
    let out = a.with_strided(|ad: &[T], al| {
        b.with_strided(|bd: &[T], bl| {
            let n: usize = shape.iter().product();
            if al.is_contiguous() && bl.is_contiguous() && al.shape() == bl.shape() {
                let (ao, bo) = (al.offset(), bl.offset());
                return par_zip(&ad[ao..ao + n], &bd[bo..bo + n], &f);
            }
            let sa = al.broadcast_strides(&shape);
            let sb = bl.broadcast_strides(&shape);
            let mut out = vec![U::default(); n];
            let fill = |chunk: &mut [U], shape: &[usize], sa: &[usize], sb: &[usize], ao, bo| {
                let mut pos = 0;
                for_each_row(shape, &[sa, sb], &[ao, bo], |len, base, st| {
                    let dst = &mut chunk[pos..pos + len];
                    let (x, y) = (&ad[base[0]..], &bd[base[1]..]);
                    match (st[0], st[1]) {
                        (1, 1) => dst
                            .iter_mut()
                            .zip(x.iter().zip(y))
                            .for_each(|(d, (&p, &q))| *d = f(p, q)),
                        (1, 0) => dst.iter_mut().zip(x).for_each(|(d, &p)| *d = f(p, y[0])),
                        (0, 1) => dst.iter_mut().zip(y).for_each(|(d, &q)| *d = f(x[0], q)),
                        (s, t) => dst
                            .iter_mut()
                            .enumerate()
                            .for_each(|(i, d)| *d = f(x[i * s], y[i * t])),
                    }
                    pos += len;
                });
            };
            if n >= PAR_THRESHOLD && shape.len() > 1 && shape[0] > 1 {
                let inner = n / shape[0];
                out.par_chunks_mut(inner)
                    .enumerate()
                    .for_each(|(i, chunk)| {
                        fill(
                            chunk,
                            &shape[1..],
                            &sa[1..],
                            &sb[1..],
                            al.offset() + i * sa[0],
                            bl.offset() + i * sb[0],
                        );
                    });
            } else if n > 0 {
                fill(&mut out, &shape, &sa, &sb, al.offset(), bl.offset());
            }
            out
        })
    })??;
    Tensor::from_vec(out, &shape)
}

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

/// The elementwise arithmetic ops.
#[derive(Clone, Copy, Debug)]
enum BinaryKind {
    // The discriminants are the op codes of `binary_strided_f32` in kernels/elementwise.cu.
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

impl BinaryKind {
    fn name(self) -> &'static str {
        match self {
            BinaryKind::Add => "add",
            BinaryKind::Sub => "sub",
            BinaryKind::Mul => "mul",
            BinaryKind::Div => "div",
            BinaryKind::Maximum => "maximum",
            BinaryKind::Minimum => "minimum",
        }
    }

    fn forward(self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let op = self.name();
        check_same_dtype(op, a, b)?;
        if a.device().is_cuda() {
            // Codes of kernels/elementwise.cu.
            return crate::tensor::cuda::binary(op, self as i32, a, b);
        }
        if matches!(a.dtype(), DType::F16 | DType::BF16) {
            let (a32, storage) = float_compute(op, a)?;
            let (b32, _) = float_compute(op, b)?;
            return self.forward(&a32, &b32)?.cast_values(storage);
        }
        with_num!(a.dtype(), op, T => {
            let f = match self {
                BinaryKind::Add => |x: T, y: T| x.add_wrap(y),
                BinaryKind::Sub => |x: T, y: T| x.sub_wrap(y),
                BinaryKind::Mul => |x: T, y: T| x.mul_wrap(y),
                BinaryKind::Div => |x: T, y: T| x.div_wrap(y),
                BinaryKind::Maximum => |x: T, y: T| if x >= y || y.is_nan_value() { x } else { y },
                BinaryKind::Minimum => |x: T, y: T| if x <= y || y.is_nan_value() { x } else { y },
            };
            if matches!(self, BinaryKind::Div) && !a.dtype().is_float() {
                // Integer division by zero must not panic: check first.
                let zero = b.with_contiguous(|v: &[T]| v.iter().position(|&x| x == T::ZERO))?;
                if let Some(p) = zero {
                    return Err(Error::invalid(op, format!("integer division by zero at position {p} of the divisor")));
                }
            }
            broadcast_zip::<T, T>(op, a, b, f)
        })
    }
}

struct BinaryBackward {
    kind: BinaryKind,
    a: Tensor,
    b: Tensor,
    a_needs: bool,
    b_needs: bool,
}

impl BackwardOp for BinaryBackward {
    fn name(&self) -> &'static str {
        self.kind.name()
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let (a, b) = (&self.a, &self.b);
        let (ga, gb) = match self.kind {
            BinaryKind::Add => (Some(g.clone()), Some(g.clone())),
            BinaryKind::Sub => (Some(g.clone()), Some(g.neg()?)),
            BinaryKind::Mul => (
                self.a_needs.then(|| g.mul(b)).transpose()?,
                self.b_needs.then(|| g.mul(a)).transpose()?,
            ),
            BinaryKind::Div => (
                self.a_needs.then(|| g.div(b)).transpose()?,
                self.b_needs
                    .then(|| g.mul(a)?.div(&b.mul(b)?)?.neg())
                    .transpose()?,
            ),
            BinaryKind::Maximum | BinaryKind::Minimum => {
                // Ties send the gradient to `a`.
                let pick_a = if matches!(self.kind, BinaryKind::Maximum) {
                    a.ge(b)?
                } else {
                    a.le(b)?
                };
                let zero = Tensor::zeros(&[], g.dtype(), g.device());
                (
                    Some(Tensor::where_cond(&pick_a, g, &zero)?),
                    Some(Tensor::where_cond(&pick_a, &zero, g)?),
                )
            }
        };
        let reduce = |g: Option<Tensor>, t: &Tensor, needed: bool| -> Result<Option<Gradient>> {
            match g {
                Some(g) if needed => Ok(Some(Gradient::Dense(g.sum_to_shape(t.shape())?))),
                _ => Ok(None),
            }
        };
        Ok(vec![
            reduce(ga, a, self.a_needs)?,
            reduce(gb, b, self.b_needs)?,
        ])
    }
}

fn binary(kind: BinaryKind, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = kind.forward(a, b)?;
    if out.dtype().is_float() {
        Ok(record_op(
            out,
            &[a, b],
            BinaryBackward {
                kind,
                a: a.detach(),
                b: b.detach(),
                a_needs: a.requires_grad(),
                b_needs: b.requires_grad(),
            },
        ))
    } else {
        Ok(out)
    }
}

/// Comparison predicates, producing u8 masks (1 = true).
/// `code` names the predicate for the CUDA kernel (`compare_strided`: 0 ==, 1 <, 2 <=, 3 >,
/// 4 >=).
fn compare(
    op: &'static str,
    code: i32,
    a: &Tensor,
    b: &Tensor,
    pred: fn(f64, f64) -> bool,
) -> Result<Tensor> {
    check_same_dtype(op, a, b)?;
    if a.device().is_cuda() {
        return crate::tensor::cuda::compare(op, code, a, b);
    }
    let (a, b) = if matches!(a.dtype(), DType::F16 | DType::BF16) {
        (a.cast_values(DType::F32)?, b.cast_values(DType::F32)?)
    } else {
        (a.clone(), b.clone())
    };
    with_num!(a.dtype(), op, T => broadcast_zip::<T, u8>(op, &a, &b, |x, y| pred(x.to_f64(), y.to_f64()) as u8))
}

impl Tensor {
    /// `self + rhs`, broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Add, self, rhs)
    }
    /// `self - rhs`, broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Sub, self, rhs)
    }
    /// `self * rhs` elementwise, broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Mul, self, rhs)
    }
    /// `self / rhs` elementwise, broadcasting. Integer division by zero is an error.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Div, self, rhs)
    }
    /// Elementwise maximum, broadcasting (NaN propagates from either side).
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Maximum, self, rhs)
    }
    /// Elementwise minimum, broadcasting.
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        binary(BinaryKind::Minimum, self, rhs)
    }

    /// Mask of `self > rhs` (u8, broadcasting).
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        compare("gt", 3, self, rhs, |x, y| x > y)
    }
    /// Mask of `self >= rhs`.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        compare("ge", 4, self, rhs, |x, y| x >= y)
    }
    /// Mask of `self < rhs`.
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        compare("lt", 1, self, rhs, |x, y| x < y)
    }
    /// Mask of `self <= rhs`.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        compare("le", 2, self, rhs, |x, y| x <= y)
    }
    /// Mask of `self == rhs`.
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        compare("eq", 0, self, rhs, |x, y| x == y)
    }

    fn scalar_like(&self, v: f64) -> Tensor {
        Tensor::full(v, &[], self.dtype(), self.device())
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
        self.gt(&self.scalar_like(v))
    }
    /// Mask of `self < v`.
    pub fn lt_scalar(&self, v: f64) -> Result<Tensor> {
        self.lt(&self.scalar_like(v))
    }
    /// Mask of `self == v`.
    pub fn eq_scalar(&self, v: f64) -> Result<Tensor> {
        self.eq(&self.scalar_like(v))
    }
}
