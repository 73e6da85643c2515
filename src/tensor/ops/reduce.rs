//! Reductions: sum, mean and max along dimensions or over everything, and `sum_to_shape` (the
//! backward of broadcasting).

use crate::tensor::autograd::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::tensor::backend::{with_backend, ElementwiseOps, ReduceOps};
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

/// Sums over `dims` (sorted, unique, resolved) keeping them as size 1, no autograd.
fn sum_values(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    with_backend!(x.device(), B => B::sum_dims(x, dims))
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
    /// Where each maximum was (`[outer, inner]`, on the input's device; the storage of the
    /// indices handed to the caller).
    indices: SavedTensor,
}

impl BackwardOp for MaxBackward {
    fn name(&self) -> &'static str {
        "max"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let gx = with_backend!(g.device(), B => {
            B::max_dim_backward(g, self.indices.get("max")?, &self.input_shape, self.dim)
        })?;
        Ok(vec![Some(Gradient::Dense(gx))])
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
        if self.shape()[d] == 0 {
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
        let (values, indices) = with_backend!(self.device(), B => B::max_dim(self, d))?;
        let out = values.reshape(&shape)?;
        let indices_out = indices.reshape(&shape)?;
        if !self.dtype().is_float() {
            return Ok((out, indices_out));
        }
        let out = record_op(
            out,
            &[self],
            MaxBackward {
                input_shape: self.shape().to_vec(),
                dim: d,
                indices: SavedTensor::new(&indices),
            },
        );
        Ok((out, indices_out))
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
        let f = super::unary::Affine { mul, add: 0.0 };
        with_backend!(self.device(), B => B::unary(&f, self))
    }
}
