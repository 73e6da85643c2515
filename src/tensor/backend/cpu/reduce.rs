//! Reductions in host memory: sums over dimensions, the maximum along one with its index, and
//! softmax.

use super::super::{Cpu, ReduceOps};
use rayon::prelude::*;

use crate::error::Result;
use crate::tensor::dtype::{DType, FloatElem, NumElem, WithDType};
use crate::tensor::ops::reduce::split_at_dim;
use crate::tensor::ops::{float_compute, with_float, with_num, PAR_THRESHOLD};
use crate::Tensor;

/// Sums a contiguous `[outer, n, inner]` buffer over its middle dimension.
fn sum_middle<T: NumElem>(x: &[T], outer: usize, n: usize, inner: usize) -> Vec<T> {
    if inner == 1 {
        let row = |o: usize| T::sum_of(x[o * n..(o + 1) * n].iter().copied());
        if outer * n >= PAR_THRESHOLD && outer > 1 {
            return (0..outer).into_par_iter().map(row).collect();
        }
        if outer == 1 && n >= PAR_THRESHOLD {
            // One long row: fixed-size chunks keep the summation order deterministic.
            let partial: Vec<T> = x
                .par_chunks(PAR_THRESHOLD)
                .map(|c| T::sum_of(c.iter().copied()))
                .collect();
            return vec![T::sum_of(partial.into_iter())];
        }
        return (0..outer).map(row).collect();
    }
    let block = |o: usize, out: &mut [T]| {
        for k in 0..n {
            let src = &x[(o * n + k) * inner..(o * n + k + 1) * inner];
            out.iter_mut()
                .zip(src)
                .for_each(|(d, &s)| *d = d.add_wrap(s));
        }
    };
    let mut out = vec![T::ZERO; outer * inner];
    if outer * n * inner >= PAR_THRESHOLD {
        if outer > 1 {
            out.par_chunks_mut(inner)
                .enumerate()
                .for_each(|(o, dst)| block(o, dst));
        } else {
            // Split the columns instead.
            let cols = inner.div_ceil(rayon::current_num_threads().max(1)).max(64);
            out.par_chunks_mut(cols).enumerate().for_each(|(ci, dst)| {
                let start = ci * cols;
                for k in 0..n {
                    let src = &x[k * inner + start..k * inner + start + dst.len()];
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(d, &s)| *d = d.add_wrap(s));
                }
            });
        }
    } else {
        for (o, dst) in out.chunks_mut(inner).enumerate() {
            block(o, dst);
        }
    }
    out
}

fn sum_one_dim(x: &Tensor, dim: usize) -> Result<Tensor> {
    let (outer, n, inner) = split_at_dim(x.shape(), dim);
    let mut shape = x.shape().to_vec();
    shape[dim] = 1;
    with_num!(x.dtype(), "sum", T => {
        let v = x.with_contiguous(|s: &[T]| sum_middle(s, outer, n, inner))?;
        Tensor::from_vec(v, &shape)
    })
}

fn softmax_kernel<T: FloatElem>(
    x: &[T],
    outer: usize,
    n: usize,
    inner: usize,
    log: bool,
) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    if inner == 1 {
        // Along the last dimension: rows are contiguous, each one independent (in parallel
        // when the tensor is large enough).
        let row = |(src, dst): (&[T], &mut [T])| {
            let m = src.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
            let mut s = T::zero();
            for (d, &v) in dst.iter_mut().zip(src) {
                let e = (v - m).exp();
                *d = e;
                s += e;
            }
            if log {
                let ls = s.ln();
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = v - m - ls;
                }
            } else {
                let inv = T::one() / s;
                for d in dst.iter_mut() {
                    *d *= inv;
                }
            }
        };
        if x.len() >= PAR_THRESHOLD && outer > 1 {
            x.par_chunks(n)
                .zip(out.par_chunks_mut(n))
                .with_min_len((PAR_THRESHOLD / n.max(1)).max(1))
                .for_each(row);
        } else {
            x.chunks(n).zip(out.chunks_mut(n)).for_each(row);
        }
        return out;
    }
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

impl ReduceOps for Cpu {
    fn sum_dims(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        let (xc, storage) = if x.dtype().is_float() {
            float_compute("sum", x)?
        } else {
            (x.clone(), x.dtype())
        };
        let mut out = xc;
        for &d in dims.iter().rev() {
            out = sum_one_dim(&out, d)?;
        }
        if dims.is_empty() {
            out = out.contiguous_values()?;
        }
        out.cast_values(storage)
    }

    fn max_dim(x: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
        let (outer, n, inner) = split_at_dim(x.shape(), d);
        let (xc, storage) = if x.dtype().is_float() {
            float_compute("max", x)?
        } else {
            (x.clone(), x.dtype())
        };
        let (values, argmax) = with_num!(xc.dtype(), "max", T => {
            xc.with_contiguous(|s: &[T]| {
                let mut vals = Vec::with_capacity(outer * inner);
                let mut arg = Vec::with_capacity(outer * inner);
                for o in 0..outer {
                    for i in 0..inner {
                        let mut best = s[o * n * inner + i];
                        let mut bi = 0i64;
                        for k in 1..n {
                            let v = s[(o * n + k) * inner + i];
                            // NaN wins, as in PyTorch.
                            if v > best || (v.is_nan_value() && !best.is_nan_value()) {
                                best = v;
                                bi = k as i64;
                            }
                        }
                        vals.push(best);
                        arg.push(bi);
                    }
                }
                (T::into_storage(vals), arg)
            })?
        });
        let values = Tensor::from_storage(values, &[outer, inner])?.cast_values(storage)?;
        Ok((values, Tensor::from_vec(argmax, &[outer, inner])?))
    }

    fn max_dim_backward(
        g: &Tensor,
        indices: &Tensor,
        input_shape: &[usize],
        d: usize,
    ) -> Result<Tensor> {
        let (outer, n, inner) = split_at_dim(input_shape, d);
        let argmax = indices.to_vec::<i64>()?;
        let (gc, storage) = float_compute("max", g)?;
        let gx = with_float!(gc.dtype(), "max", T => {
            let mut gx = vec![T::ZERO; outer * n * inner];
            gc.with_contiguous(|gs: &[T]| {
                for o in 0..outer {
                    for i in 0..inner {
                        let k = argmax[o * inner + i] as usize;
                        gx[(o * n + k) * inner + i] = gs[o * inner + i];
                    }
                }
            })?;
            Tensor::from_vec(gx, input_shape)?
        });
        gx.cast_values(storage)
    }

    /// Along the last dimension of f32 tensors: one pass per row (in parallel over rows), the
    /// same formulas as the composed default without its intermediate tensors.
    fn softmax_backward(y: &Tensor, g: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        let f32s = y.dtype() == DType::F32 && g.dtype() == DType::F32;
        if !f32s || d + 1 != y.rank() || g.shape() != y.shape() {
            return crate::tensor::ops::softmax::softmax_backward_composed(y, g, d, log);
        }
        let n = y.shape()[d].max(1);
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
                if ys.len() >= PAR_THRESHOLD && ys.len() > n {
                    (ys.par_chunks(n).zip(gs.par_chunks(n)))
                        .zip(out.par_chunks_mut(n))
                        .with_min_len((PAR_THRESHOLD / n).max(1))
                        .for_each(row);
                } else {
                    (ys.chunks(n).zip(gs.chunks(n)))
                        .zip(out.chunks_mut(n))
                        .for_each(row);
                }
            })
        })??;
        Tensor::from_vec(out, y.shape())
    }

    fn softmax(x: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let (xc, storage) = float_compute(op, x)?;
        let (outer, n, inner) = split_at_dim(x.shape(), d);
        with_float!(xc.dtype(), op, T => {
            let v = xc.with_contiguous(|s: &[T]| softmax_kernel(s, outer, n, inner, log))?;
            Tensor::from_vec(v, x.shape())?
        })
        .cast_values(storage)
    }
}
