//! Reductions: sum, mean and max along dimensions or over everything, and `sum_to_shape` (the
//! backward of broadcasting).

use rayon::prelude::*;

use super::{float_compute, with_float, with_num, PAR_THRESHOLD};
use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::dtype::{NumElem, WithDType};
use crate::tensor::layout::resolve_dim;
use crate::{Error, Result, Tensor};

/// Splits `shape` around `dim` into (outer, n, inner) element counts.
pub(crate) fn split_at_dim(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    (
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    )
}

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

/// Sums over `dims` (sorted, unique, resolved) keeping them as size 1, no autograd.
fn sum_values(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if x.device().is_cuda() {
        return crate::tensor::cuda::sum_dims(x, dims);
    }
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

fn resolve_dims(op: &'static str, dims: &[isize], rank: usize) -> Result<Vec<usize>> {
    let mut out = dims
        .iter()
        .map(|&d| resolve_dim(op, d, rank))
        .collect::<Result<Vec<_>>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid(
            op,
            format!("dimension repeated in {dims:?}"),
        ));
    }
    Ok(out)
}

struct SumBackward {
    input_shape: Vec<usize>,
    kept_shape: Vec<usize>,
    scale: f64,
}

impl BackwardOp for SumBackward {
    fn name(&self) -> &'static str {
        "sum"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let mut g = g.reshape(&self.kept_shape)?;
        if self.scale != 1.0 {
            g = g.mul_scalar(self.scale)?;
        }
        let g = g.expand(&self.input_shape)?.contiguous()?;
        Ok(vec![Some(Gradient::Dense(g))])
    }
}

fn reduce_sum(x: &Tensor, dims: &[isize], keepdim: bool, mean: bool) -> Result<Tensor> {
    let op = if mean { "mean" } else { "sum" };
    let dims = resolve_dims(op, dims, x.rank())?;
    let kept = sum_values(x, &dims)?;
    let count: usize = dims.iter().map(|&d| x.shape()[d]).product();
    let kept = if mean {
        kept.affine_values(1.0 / count as f64)?
    } else {
        kept
    };
    let out_shape: Vec<usize> = if keepdim {
        kept.shape().to_vec()
    } else {
        x.shape()
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(i))
            .map(|(_, &s)| s)
            .collect()
    };
    let out = kept.reshape(&out_shape)?;
    if !x.dtype().is_float() {
        return Ok(out);
    }
    Ok(record_op(
        out,
        &[x],
        SumBackward {
            input_shape: x.shape().to_vec(),
            kept_shape: kept.shape().to_vec(),
            scale: if mean { 1.0 / count as f64 } else { 1.0 },
        },
    ))
}

struct MaxBackward {
    input_shape: Vec<usize>,
    dim: usize,
    argmax: Argmax,
}

/// Where each maximum was: host positions, or a device tensor of them (CUDA inputs).
enum Argmax {
    Host(Vec<usize>),
    Device(Tensor),
}

impl BackwardOp for MaxBackward {
    fn name(&self) -> &'static str {
        "max"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let argmax = match &self.argmax {
            Argmax::Host(a) => a,
            Argmax::Device(indices) => {
                let gx =
                    crate::tensor::cuda::max_dim_backward(g, indices, &self.input_shape, self.dim)?;
                return Ok(vec![Some(Gradient::Dense(gx))]);
            }
        };
        let (outer, n, inner) = split_at_dim(&self.input_shape, self.dim);
        let (gc, storage) = float_compute("max", g)?;
        let gx = with_float!(gc.dtype(), "max", T => {
            let mut gx = vec![T::ZERO; outer * n * inner];
            gc.with_contiguous(|gs: &[T]| {
                for o in 0..outer {
                    for i in 0..inner {
                        let k = argmax[o * inner + i];
                        gx[(o * n + k) * inner + i] = gs[o * inner + i];
                    }
                }
            })?;
            Tensor::from_vec(gx, &self.input_shape)?
        });
        Ok(vec![Some(Gradient::Dense(gx.cast_values(storage)?))])
    }
}

impl Tensor {
    /// Sum over `dims` (empty: no reduction), keeping them as size 1 when `keepdim`.
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        reduce_sum(self, dims, keepdim, false)
    }

    /// Sum of all elements, as a 0-dimensional tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.rank() as isize).collect();
        reduce_sum(self, &dims, false, false)
    }

    /// Mean over `dims`.
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        reduce_sum(self, dims, keepdim, true)
    }

    /// Mean of all elements, as a 0-dimensional tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        let dims: Vec<isize> = (0..self.rank() as isize).collect();
        reduce_sum(self, &dims, false, true)
    }

    /// Maximum along `dim` and the index of the (first) maximum. The gradient flows to that
    /// index only.
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let d = resolve_dim("max", dim, self.rank())?;
        let (outer, n, inner) = split_at_dim(self.shape(), d);
        if n == 0 {
            return Err(Error::invalid(
                "max",
                format!("dimension {d} of {:?} is empty", self.shape()),
            ));
        }
        let mut shape = self.shape().to_vec();
        if keepdim {
            shape[d] = 1;
        } else {
            shape.remove(d);
        }
        if self.device().is_cuda() {
            let (values, indices) = crate::tensor::cuda::max_dim(self, d)?;
            let out = values.reshape(&shape)?;
            let out = record_op(
                out,
                &[self],
                MaxBackward {
                    input_shape: self.shape().to_vec(),
                    dim: d,
                    argmax: Argmax::Device(indices.clone()),
                },
            );
            return Ok((out, indices.reshape(&shape)?));
        }
        let (xc, storage) = if self.dtype().is_float() {
            float_compute("max", self)?
        } else {
            (self.clone(), self.dtype())
        };
        let (values, argmax) = with_num!(xc.dtype(), "max", T => {
            xc.with_contiguous(|s: &[T]| {
                let mut vals = Vec::with_capacity(outer * inner);
                let mut arg = Vec::with_capacity(outer * inner);
                for o in 0..outer {
                    for i in 0..inner {
                        let mut best = s[o * n * inner + i];
                        let mut bi = 0;
                        for k in 1..n {
                            let v = s[(o * n + k) * inner + i];
                            // NaN wins, as in PyTorch.
                            if v > best || (v.is_nan_value() && !best.is_nan_value()) {
                                best = v;
                                bi = k;
                            }
                        }
                        vals.push(best);
                        arg.push(bi);
                    }
                }
                (T::into_storage(vals), arg)
            })?
        });
        let out = Tensor::from_storage(values, &shape)?.cast_values(storage)?;
        let indices = Tensor::from_vec(argmax.iter().map(|&i| i as i64).collect(), &shape)?;
        if !self.dtype().is_float() {
            return Ok((out, indices));
        }
        let out = record_op(
            out,
            &[self],
            MaxBackward {
                input_shape: self.shape().to_vec(),
                dim: d,
                argmax: Argmax::Host(argmax),
            },
        );
        Ok((out, indices))
    }

    /// Maximum of all elements (0-dimensional).
    pub fn max_all(&self) -> Result<Tensor> {
        let flat = self.reshape(&[self.numel()])?;
        Ok(flat.max_dim(0, false)?.0)
    }

    /// Index of the maximum along `dim` (i64).
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        Ok(crate::no_grad(|| self.max_dim(dim, keepdim))?.1)
    }

    /// Sums broadcast dimensions away so the result has `shape` (the adjoint of broadcasting
    /// `shape` up to this tensor's shape).
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        let rank = self.rank();
        if shape.len() > rank {
            return Err(Error::shape("sum_to_shape", self.shape(), shape));
        }
        let lead = rank - shape.len();
        let mut dims = Vec::new();
        for i in 0..rank {
            if i < lead || (shape[i - lead] == 1 && self.shape()[i] != 1) {
                dims.push(i as isize);
            } else if shape[i - lead] != self.shape()[i] {
                return Err(Error::shape("sum_to_shape", self.shape(), shape));
            }
        }
        self.sum(&dims, true)?.reshape(shape)
    }

    /// `mul·x` without autograd (float dtypes).
    pub(crate) fn affine_values(&self, mul: f64) -> Result<Tensor> {
        if self.device().is_cuda() {
            return crate::tensor::cuda::unary_float("affine", (mul, 0.0), self);
        }
        let (xc, storage) = float_compute("affine", self)?;
        let v = with_float!(xc.dtype(), "affine", T => {
            let m = T::from_f64(mul);
            Tensor::from_vec(xc.with_contiguous(|s: &[T]| super::par_map(s, |x| x * m))?, xc.shape())?
        });
        v.cast_values(storage)
    }
}
