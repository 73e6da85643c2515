//! Elementwise kernels in host memory: broadcasting binary ops and comparisons, `where`, the
//! float functions of `ops/unary.rs` and their derivatives, and BCE with logits.

use rayon::prelude::*;

use super::super::{BinaryOp, CompareOp, Cpu, ElementwiseOps};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::dtype::{FloatElem, NumElem, WithDType};
use crate::tensor::layout::{broadcast_shapes, for_each_row};
use crate::tensor::ops::unary::UnaryFn;
use crate::tensor::ops::{float_compute, par_map, par_zip, with_float, with_num, PAR_THRESHOLD};
use crate::tensor::storage::{match_storage, CpuStorage};
use crate::Tensor;

/// Applies `f` to every broadcast pair of elements of `a` and `b` (which must have dtype `T`),
/// producing a contiguous tensor. Runs on strided views directly, in parallel when large.
fn broadcast_zip<T: WithDType, U: WithDType>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(T, T) -> U + Sync + Send,
) -> Result<Tensor> {
    let shape = broadcast_shapes(op, a.shape(), b.shape())?;
    // A broadcast's output can be far larger than its inputs ([N, 1] + [1, N]).
    crate::tensor::storage::ensure_allocatable(op, &shape, std::mem::size_of::<U>())?;
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

fn bce_values<T: FloatElem>(xs: &[T], ys: &[T]) -> (Vec<T>, Vec<T>) {
    let (zero, one) = (T::zero(), T::one());
    xs.iter()
        .zip(ys)
        .map(|(&x, &y)| {
            let loss = x.max(zero) - x * y + (-x.abs()).exp().ln_1p();
            let sig = if x >= zero {
                one / (one + (-x).exp())
            } else {
                x.exp() / (one + x.exp())
            };
            (loss, sig - y)
        })
        .unzip()
}

impl ElementwiseOps for Cpu {
    fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let name = op.name();
        if matches!(a.dtype(), DType::F16 | DType::BF16) {
            let (a32, storage) = float_compute(name, a)?;
            let (b32, _) = float_compute(name, b)?;
            return Self::binary(op, &a32, &b32)?.cast_values(storage);
        }
        with_num!(a.dtype(), name, T => {
            let f = match op {
                BinaryOp::Add => |x: T, y: T| x.add_wrap(y),
                BinaryOp::Sub => |x: T, y: T| x.sub_wrap(y),
                BinaryOp::Mul => |x: T, y: T| x.mul_wrap(y),
                BinaryOp::Div => |x: T, y: T| x.div_wrap(y),
                BinaryOp::Maximum => |x: T, y: T| if x >= y || y.is_nan_value() { x } else { y },
                BinaryOp::Minimum => |x: T, y: T| if x <= y || y.is_nan_value() { x } else { y },
            };
            if op == BinaryOp::Div && !a.dtype().is_float() {
                // Integer division by zero must not panic: check first.
                let zero = b.with_contiguous(|v: &[T]| v.iter().position(|&x| x == T::ZERO))?;
                if let Some(p) = zero {
                    return Err(Error::invalid(name, format!("integer division by zero at position {p} of the divisor")));
                }
            }
            broadcast_zip::<T, T>(name, a, b, f)
        })
    }

    fn compare(op: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = if matches!(a.dtype(), DType::F16 | DType::BF16) {
            (a.cast_values(DType::F32)?, b.cast_values(DType::F32)?)
        } else {
            (a.clone(), b.clone())
        };
        let name = op.name();
        with_num!(a.dtype(), name, T => broadcast_zip::<T, u8>(name, &a, &b, |x, y| op.holds(x.to_f64(), y.to_f64()) as u8))
    }

    fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
        let c = cond.detach().expand(shape)?.to_vec::<u8>()?;
        let av = a.detach().expand(shape)?.contiguous_values()?;
        let bv = b.detach().expand(shape)?.contiguous_values()?;
        let ga = av.storage_read();
        let gb = bv.storage_read();
        let (x, y) = (ga.cpu("where")?, gb.cpu("where")?);
        let storage = {
            match_storage!(x, xs => {
                fn pick<T: WithDType>(c: &[u8], xs: &[T], ys: &CpuStorage) -> CpuStorage {
                    let ys = T::slice(ys).expect("same dtype checked by the caller");
                    T::into_storage(c.iter().zip(xs.iter().zip(ys)).map(|(&m, (&x, &y))| if m != 0 { x } else { y }).collect())
                }
                pick(&c, xs, y)
            })
        };
        drop((ga, gb));
        Tensor::from_storage(storage, shape)
    }

    fn unary<F: UnaryFn>(f: &F, x: &Tensor) -> Result<Tensor> {
        let (xc, storage) = float_compute(F::NAME, x)?;
        with_float!(xc.dtype(), F::NAME, T => {
            let v = xc.with_contiguous(|s: &[T]| par_map(s, |v| f.f(v)))?;
            Tensor::from_vec(v, x.shape())?
        })
        .cast_values(storage)
    }

    fn unary_backward<F: UnaryFn>(f: &F, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (x, storage) = float_compute(F::NAME, x)?;
        let (y, _) = float_compute(F::NAME, y)?;
        let (g, _) = float_compute(F::NAME, g)?;
        let gx = with_float!(x.dtype(), F::NAME, T => {
            let gx = x.with_contiguous(|xs: &[T]| {
                y.with_contiguous(|ys: &[T]| {
                    g.with_contiguous(|gs: &[T]| {
                        let run = |((&x, &y), &g): ((&T, &T), &T)| g * f.df(x, y);
                        if xs.len() >= PAR_THRESHOLD {
                            xs.par_iter().zip(ys.par_iter()).zip(gs.par_iter()).map(run).collect::<Vec<T>>()
                        } else {
                            xs.iter().zip(ys).zip(gs).map(run).collect::<Vec<T>>()
                        }
                    })
                })
            })???;
            Tensor::from_vec(gx, x.shape())?
        });
        gx.cast_values(storage)
    }

    /// Per-element BCE-with-logits losses and their derivatives in the logits, in the input's
    /// dtype.
    fn bce_with_logits(input: &Tensor, target: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "bce_with_logits";
        let (x, storage) = float_compute(OP, input)?;
        let (y, _) = float_compute(OP, target)?;
        let (losses, dx) = with_float!(x.dtype(), OP, T => {
            let (l, dx) = x.with_contiguous(|xs: &[T]| {
                y.with_contiguous(|ys: &[T]| bce_values(xs, ys))
            })??;
            (Tensor::from_vec(l, x.shape())?, Tensor::from_vec(dx, x.shape())?)
        });
        Ok((losses.cast_values(storage)?, dx.cast_values(storage)?))
    }
}
