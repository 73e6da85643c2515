//! Batched matrix products with a jagged side: `jagged_dense_bmm` (`[L, K] × [B, K, N]`),
//! `jagged_jagged_bmm` (`Σ_l x_lᵀ y_l` per bag) and `batched_dense_vec_jagged_2d_mul`. The
//! backward of each is expressed with the forward kernels of the others.

use std::sync::Arc;

use num_traits::Zero;
use rayon::prelude::*;

use super::{read_offsets, PARALLEL_MIN_ELEMENTS};
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::with_float;
use crate::tensor::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::{DType, Error, Result, Tensor};

/// Casts float operands to their common compute dtype; returns them and the storage dtype the
/// results go back to.
pub(crate) fn float_operands(
    op: &'static str,
    tensors: &[&Tensor],
) -> Result<(Vec<Tensor>, DType)> {
    let dtype = tensors[0].dtype();
    for t in tensors {
        if !t.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op,
                dtype: t.dtype(),
                expected: "a floating-point dtype (f32, f64, f16, bf16)",
            });
        }
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch {
                op,
                lhs: dtype,
                rhs: t.dtype(),
            });
        }
    }
    let compute = dtype.compute_dtype();
    let cast = tensors
        .iter()
        .map(|t| t.cast_values(compute))
        .collect::<Result<_>>()?;
    Ok((cast, dtype))
}

/// `out[l] = x[l] · y[b(l)]` (`x: [L, k]`, `y: [B, k, n]`) for the first `max_l` rows of each
/// bag; later rows are zero.
fn jagged_dense_bmm_kernel<T: FloatElem>(
    x: &[T],
    offsets: &[i64],
    y: &[T],
    k: usize,
    n: usize,
    max_l: usize,
) -> Vec<T> {
    let rows = *offsets.last().unwrap_or(&0) as usize;
    let mut out = vec![T::zero(); rows * n];
    if n == 0 || k == 0 {
        // No column, or no term: the zero product (chunks of 0 columns cannot be taken).
        return out;
    }
    let bags: Vec<(usize, &mut [T])> = {
        let mut rest = out.as_mut_slice();
        let mut v = Vec::with_capacity(offsets.len());
        for (b, w) in offsets.windows(2).enumerate() {
            let (head, tail) = rest.split_at_mut((w[1] - w[0]) as usize * n);
            v.push((b, head));
            rest = tail;
        }
        v
    };
    let work = |(b, dst): (usize, &mut [T])| {
        let start = offsets[b] as usize;
        let ym = &y[b * k * n..(b + 1) * k * n];
        for (pos, out_row) in dst.chunks_exact_mut(n).enumerate().take(max_l) {
            let x_row = &x[(start + pos) * k..(start + pos + 1) * k];
            for (kk, &xv) in x_row.iter().enumerate() {
                for (o, &yv) in out_row.iter_mut().zip(&ym[kk * n..(kk + 1) * n]) {
                    *o += xv * yv;
                }
            }
        }
    };
    if rows * n * k >= PARALLEL_MIN_ELEMENTS {
        bags.into_par_iter().for_each(work);
    } else {
        bags.into_iter().for_each(work);
    }
    out
}

/// `out[b] = Σ_{l in bag b, pos < max_l} x[l]ᵀ y[l]` (`x: [L, m]`, `y: [L, n]`, out `[B, m, n]`).
fn jagged_jagged_bmm_kernel<T: FloatElem>(
    x: &[T],
    y: &[T],
    offsets: &[i64],
    m: usize,
    n: usize,
    max_l: usize,
) -> Vec<T> {
    let batch = offsets.len() - 1;
    let mut out = vec![T::zero(); batch * m * n];
    let work = |(b, dst): (usize, &mut [T])| {
        let start = offsets[b] as usize;
        let len = ((offsets[b + 1] - offsets[b]) as usize).min(max_l);
        for l in start..start + len {
            let (xr, yr) = (&x[l * m..(l + 1) * m], &y[l * n..(l + 1) * n]);
            for (i, &xv) in xr.iter().enumerate() {
                for (o, &yv) in dst[i * n..(i + 1) * n].iter_mut().zip(yr) {
                    *o += xv * yv;
                }
            }
        }
    };
    if m * n > 0 {
        if x.len() * n >= PARALLEL_MIN_ELEMENTS {
            out.par_chunks_mut(m * n).enumerate().for_each(work);
        } else {
            out.chunks_mut(m * n).enumerate().for_each(work);
        }
    }
    out
}

/// `[B, r, c]` → `[B, c, r]`.
fn transpose_batches<T: Copy + Zero>(a: &[T], batch: usize, r: usize, c: usize) -> Vec<T> {
    let mut out = vec![T::zero(); a.len()];
    for b in 0..batch {
        for i in 0..r {
            for j in 0..c {
                out[b * r * c + j * r + i] = a[b * r * c + i * c + j];
            }
        }
    }
    out
}

fn check_bags(op: &'static str, offsets: &[i64], rows: usize, batch: usize) -> Result<()> {
    super::expect_total(op, "offsets", *offsets.last().expect("validated"), rows)?;
    if offsets.len() - 1 != batch {
        return Err(Error::invalid(
            op,
            format!(
                "offsets describe {} bags but the dense operand has batch {batch}",
                offsets.len() - 1
            ),
        ));
    }
    Ok(())
}

/// Gradients computed in the compute dtype (`None`: not wanted), as dense gradients in the
/// operands' `storage` dtype.
fn stored_grads<const N: usize>(
    storage: DType,
    grads: [Option<Tensor>; N],
) -> Result<Vec<Option<Gradient>>> {
    (grads.into_iter())
        .map(|g| {
            Ok(g.map(|g| g.cast_values(storage))
                .transpose()?
                .map(Gradient::Dense))
        })
        .collect()
}

/// Keeps `x` only when `y`'s gradient is wanted and `y` only when `x`'s is (each gradient
/// reads the other operand).
struct JaggedDenseBmmBackward {
    x: SavedTensor,
    y: SavedTensor,
    x_needs: bool,
    y_needs: bool,
    offsets: Arc<Vec<i64>>,
    max_l: usize,
    storage: DType,
}

impl BackwardOp for JaggedDenseBmmBackward {
    fn name(&self) -> &'static str {
        "jagged_dense_bmm"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let g = grad_output.cast_values(self.x.dtype())?;
        let (xs, ys) = (self.x.shape(), self.y.shape());
        let (batch, k, n) = (ys[0], ys[1], ys[2]);
        let (gx, gy) = with_float!(self.x.dtype(), "jagged_dense_bmm", T => {
            let g = g.to_vec::<T>()?;
            let gx = self.x_needs.then(|| -> Result<Tensor> {
                let y = self.y.get(self.name())?.to_vec::<T>()?;
                let yt = transpose_batches(&y, batch, k, n);
                Tensor::from_vec(jagged_dense_bmm_kernel(&g, &self.offsets, &yt, n, k, self.max_l), xs)
            });
            let gy = self.y_needs.then(|| -> Result<Tensor> {
                let x = self.x.get(self.name())?.to_vec::<T>()?;
                Tensor::from_vec(jagged_jagged_bmm_kernel(&x, &g, &self.offsets, k, n, self.max_l), ys)
            });
            (gx.transpose()?, gy.transpose()?)
        });
        stored_grads(self.storage, [gx, gy])
    }
}

/// `out[l] = x[l] · y[b]` for every jagged row `l` of bag `b` (`x_values: [L, K]`,
/// `y: [B, K, N]`, result `[L, N]`); rows at position `≥ max_l` within their bag are zero.
/// Differentiable in `x_values` and `y`.
pub fn jagged_dense_bmm(
    x_values: &Tensor,
    x_offsets: &Tensor,
    y: &Tensor,
    max_l: usize,
) -> Result<Tensor> {
    const OP: &str = "jagged_dense_bmm";
    if x_values.rank() != 2 || y.rank() != 3 || x_values.shape()[1] != y.shape()[1] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: x_values.shape().to_vec(),
            rhs: y.shape().to_vec(),
            detail: "expected x_values [L, K] and y [B, K, N]".into(),
        });
    }
    let offsets = read_offsets(OP, x_offsets)?;
    check_bags(OP, &offsets, x_values.shape()[0], y.shape()[0])?;
    let (ops, storage) = float_operands(OP, &[x_values, y])?;
    let (k, n) = (y.shape()[1], y.shape()[2]);
    let out = with_float!(ops[0].dtype(), OP, T => {
        let x = ops[0].to_vec::<T>()?;
        let yv = ops[1].to_vec::<T>()?;
        Tensor::from_vec(jagged_dense_bmm_kernel(&x, &offsets, &yv, k, n, max_l), &[x_values.shape()[0], n])?
    })
    .cast_values(storage)?;
    Ok(record_op(
        out,
        &[x_values, y],
        JaggedDenseBmmBackward {
            x: SavedTensor::new_if(y.requires_grad(), &ops[0]),
            y: SavedTensor::new_if(x_values.requires_grad(), &ops[1]),
            x_needs: x_values.requires_grad(),
            y_needs: y.requires_grad(),
            offsets: Arc::new(offsets),
            max_l,
            storage,
        },
    ))
}

/// Keeps `x` only when `y`'s gradient is wanted and `y` only when `x`'s is (each gradient
/// reads the other operand).
struct JaggedJaggedBmmBackward {
    x: SavedTensor,
    y: SavedTensor,
    x_needs: bool,
    y_needs: bool,
    offsets: Arc<Vec<i64>>,
    max_l: usize,
    storage: DType,
}

impl BackwardOp for JaggedJaggedBmmBackward {
    fn name(&self) -> &'static str {
        "jagged_jagged_bmm"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let g = grad_output.cast_values(self.x.dtype())?;
        let (batch, m, n) = (g.shape()[0], g.shape()[1], g.shape()[2]);
        let (xs, ys) = (self.x.shape(), self.y.shape());
        let (gx, gy) = with_float!(self.x.dtype(), "jagged_jagged_bmm", T => {
            let g = g.to_vec::<T>()?;
            let gx = self.x_needs.then(|| -> Result<Tensor> {
                let y = self.y.get(self.name())?.to_vec::<T>()?;
                let gt = transpose_batches(&g, batch, m, n);
                Tensor::from_vec(jagged_dense_bmm_kernel(&y, &self.offsets, &gt, n, m, self.max_l), xs)
            });
            let gy = self.y_needs.then(|| -> Result<Tensor> {
                let x = self.x.get(self.name())?.to_vec::<T>()?;
                Tensor::from_vec(jagged_dense_bmm_kernel(&x, &self.offsets, &g, m, n, self.max_l), ys)
            });
            (gx.transpose()?, gy.transpose()?)
        });
        stored_grads(self.storage, [gx, gy])
    }
}

/// `out[b] = Σ x[l]ᵀ y[l]` over the first `max_l` rows `l` of bag `b` (`x_values: [L, M]`,
/// `y_values: [L, N]` sharing `offsets`; result `[B, M, N]`, zero for empty bags).
/// Differentiable in both.
pub fn jagged_jagged_bmm(
    x_values: &Tensor,
    y_values: &Tensor,
    offsets: &Tensor,
    max_l: usize,
) -> Result<Tensor> {
    const OP: &str = "jagged_jagged_bmm";
    if x_values.rank() != 2 || y_values.rank() != 2 || x_values.shape()[0] != y_values.shape()[0] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: x_values.shape().to_vec(),
            rhs: y_values.shape().to_vec(),
            detail: "expected x_values [L, M] and y_values [L, N]".into(),
        });
    }
    let offs = read_offsets(OP, offsets)?;
    check_bags(OP, &offs, x_values.shape()[0], offs.len() - 1)?;
    let (ops, storage) = float_operands(OP, &[x_values, y_values])?;
    let (m, n) = (x_values.shape()[1], y_values.shape()[1]);
    let batch = offs.len() - 1;
    let out = with_float!(ops[0].dtype(), OP, T => {
        let x = ops[0].to_vec::<T>()?;
        let y = ops[1].to_vec::<T>()?;
        Tensor::from_vec(jagged_jagged_bmm_kernel(&x, &y, &offs, m, n, max_l), &[batch, m, n])?
    })
    .cast_values(storage)?;
    Ok(record_op(
        out,
        &[x_values, y_values],
        JaggedJaggedBmmBackward {
            x: SavedTensor::new_if(y_values.requires_grad(), &ops[0]),
            y: SavedTensor::new_if(x_values.requires_grad(), &ops[1]),
            x_needs: x_values.requires_grad(),
            y_needs: y_values.requires_grad(),
            offsets: Arc::new(offs),
            max_l,
            storage,
        },
    ))
}

struct DenseVecJaggedMulBackward {
    v: SavedTensor,
    a: SavedTensor,
    offsets: Arc<Vec<i64>>,
    storage: DType,
}

/// Shapes of `batched_dense_vec_jagged_2d_mul`: (B, H, max_n, D).
fn vec_jagged_dims(v: &Tensor, a: &Tensor, batch: usize) -> (usize, usize, usize, usize) {
    let heads = v.shape()[0] / batch.max(1);
    let d = a.shape()[1] / heads.max(1);
    (batch, heads, v.shape()[1], d)
}

impl BackwardOp for DenseVecJaggedMulBackward {
    fn name(&self) -> &'static str {
        "batched_dense_vec_jagged_2d_mul"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let v = self.v.get(self.name())?;
        let a = self.a.get(self.name())?;
        let g = grad_output.cast_values(v.dtype())?;
        let (batch, heads, max_n, d) = vec_jagged_dims(v, a, self.offsets.len() - 1);
        let hd = heads * d;
        let (gv, ga) = with_float!(v.dtype(), "batched_dense_vec_jagged_2d_mul", T => {
            let (vs, as_) = (v.shape(), a.shape());
            let (v, a, g) = (v.to_vec::<T>()?, a.to_vec::<T>()?, g.to_vec::<T>()?);
            let mut gv = vec![T::zero(); v.len()];
            let mut ga = vec![T::zero(); a.len()];
            for b in 0..batch {
                let start = self.offsets[b] as usize;
                let len = ((self.offsets[b + 1] - self.offsets[b]) as usize).min(max_n);
                for h in 0..heads {
                    let bh = b * heads + h;
                    let gr = &g[bh * d..(bh + 1) * d];
                    for pos in 0..len {
                        let arow = &a[(start + pos) * hd + h * d..(start + pos) * hd + (h + 1) * d];
                        gv[bh * max_n + pos] = arow.iter().zip(gr).map(|(&x, &y)| x * y).sum();
                        let vv = v[bh * max_n + pos];
                        let garow = &mut ga[(start + pos) * hd + h * d..(start + pos) * hd + (h + 1) * d];
                        for (o, &gg) in garow.iter_mut().zip(gr) {
                            *o = vv * gg;
                        }
                    }
                }
            }
            (Tensor::from_vec(gv, vs)?, Tensor::from_vec(ga, as_)?)
        });
        Ok(vec![
            Some(Gradient::Dense(gv.cast_values(self.storage)?)),
            Some(Gradient::Dense(ga.cast_values(self.storage)?)),
        ])
    }
}

/// Per (sample `b`, head `h`): `out[b·H + h] = v[b·H + h] · a_b[:, h·D..(h+1)·D]`, where `a_b` is
/// bag `b` of the jagged `a_values` (`[L, H·D]`) truncated to `v`'s width `max_N` (`v` is
/// `[B·H, max_N]`, the result `[B·H, D]`). Differentiable in `v` and `a_values`.
pub fn batched_dense_vec_jagged_2d_mul(
    v: &Tensor,
    a_values: &Tensor,
    a_offsets: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "batched_dense_vec_jagged_2d_mul";
    let offsets = read_offsets(OP, a_offsets)?;
    let batch = offsets.len() - 1;
    // No bag (FBGEMM's empty batch) is `[0, max_N]` against one head of `a_values`' width.
    let rows_fit = match batch {
        0 => v.rank() == 2 && v.shape()[0] == 0,
        _ => v.rank() == 2 && v.shape()[0] % batch == 0,
    };
    if !rows_fit || a_values.rank() != 2 {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: v.shape().to_vec(),
            rhs: a_values.shape().to_vec(),
            detail: format!("expected v [B·H, max_N] with B = {batch} bags and a_values [L, H·D]"),
        });
    }
    let heads = v.shape()[0].checked_div(batch).unwrap_or(1);
    if heads == 0 || a_values.shape()[1] % heads != 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "a_values has {} columns, not a multiple of H = {heads}",
                a_values.shape()[1]
            ),
        ));
    }
    super::expect_total(OP, "a_offsets", offsets[batch], a_values.shape()[0])?;
    let (ops, storage) = float_operands(OP, &[v, a_values])?;
    let (_, _, max_n, d) = vec_jagged_dims(v, a_values, batch);
    let hd = heads * d;
    let out = with_float!(ops[0].dtype(), OP, T => {
        let (vv, a) = (ops[0].to_vec::<T>()?, ops[1].to_vec::<T>()?);
        let mut out = vec![T::zero(); batch * heads * d];
        for b in 0..batch {
            let start = offsets[b] as usize;
            let len = ((offsets[b + 1] - offsets[b]) as usize).min(max_n);
            for h in 0..heads {
                let bh = b * heads + h;
                let o = &mut out[bh * d..(bh + 1) * d];
                for pos in 0..len {
                    let w = vv[bh * max_n + pos];
                    let arow = &a[(start + pos) * hd + h * d..(start + pos) * hd + (h + 1) * d];
                    for (x, &y) in o.iter_mut().zip(arow) {
                        *x += w * y;
                    }
                }
            }
        }
        Tensor::from_vec(out, &[batch * heads, d])?
    })
    .cast_values(storage)?;
    Ok(record_op(
        out,
        &[v, a_values],
        DenseVecJaggedMulBackward {
            v: SavedTensor::new(&ops[0]),
            a: SavedTensor::new(&ops[1]),
            offsets: Arc::new(offsets),
            storage,
        },
    ))
}
