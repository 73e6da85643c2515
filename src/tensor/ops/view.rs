//! Shape ops that build a new layout over the same storage: no element is copied (except
//! `reshape` of a non-contiguous tensor and `contiguous`, which must copy).

use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::layout::{contiguous_strides, resolve_dim, Layout};
use crate::{Error, Result, Tensor};

struct ReshapeBackward {
    input_shape: Vec<usize>,
}
impl BackwardOp for ReshapeBackward {
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![Some(Gradient::Dense(g.reshape(&self.input_shape)?))])
    }
}

struct PermuteBackward {
    inverse: Vec<usize>,
}
impl BackwardOp for PermuteBackward {
    fn name(&self) -> &'static str {
        "permute"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![Some(Gradient::Dense(g.permute(&self.inverse)?))])
    }
}

struct NarrowBackward {
    input_shape: Vec<usize>,
    dim: usize,
    start: usize,
}
impl BackwardOp for NarrowBackward {
    fn name(&self) -> &'static str {
        "narrow"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        // Zeros before and after the narrowed range, the gradient inside it.
        let mut parts = Vec::new();
        let mut before = self.input_shape.clone();
        before[self.dim] = self.start;
        let mut after = self.input_shape.clone();
        after[self.dim] = self.input_shape[self.dim] - self.start - g.shape()[self.dim];
        let zb = Tensor::try_zeros(&before, g.dtype(), g.device())?;
        let za = Tensor::try_zeros(&after, g.dtype(), g.device())?;
        if before[self.dim] > 0 {
            parts.push(&zb);
        }
        parts.push(g);
        if after[self.dim] > 0 {
            parts.push(&za);
        }
        Ok(vec![Some(Gradient::Dense(Tensor::cat(
            &parts,
            self.dim as isize,
        )?))])
    }
}

struct ExpandBackward {
    input_shape: Vec<usize>,
}
impl BackwardOp for ExpandBackward {
    fn name(&self) -> &'static str {
        "expand"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![Some(Gradient::Dense(
            g.sum_to_shape(&self.input_shape)?,
        ))])
    }
}

struct ContiguousBackward;
impl BackwardOp for ContiguousBackward {
    fn name(&self) -> &'static str {
        "contiguous"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![Some(Gradient::Dense(g.clone()))])
    }
}

impl Tensor {
    /// Same elements in a new shape (see [`reshape_infer`](Tensor::reshape_infer) for an
    /// inferred dimension). A view when the tensor is contiguous, a copy otherwise.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let n = crate::tensor::checked_numel(shape);
        if n != Some(self.numel()) {
            return Err(Error::ShapeMismatch {
                op: "reshape",
                lhs: self.shape().to_vec(),
                rhs: shape.to_vec(),
                detail: format!(
                    "{} elements cannot take a shape of {}",
                    self.numel(),
                    n.map_or("more than a usize holds".to_string(), |n| n.to_string())
                ),
            });
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let base = if self.is_contiguous() {
            self.detach()
        } else {
            self.contiguous_values()?
        };
        let out = base.view_with_layout(Layout::new(
            shape.to_vec(),
            contiguous_strides(shape),
            base.layout().offset(),
        ));
        Ok(record_op(
            out,
            &[self],
            ReshapeBackward {
                input_shape: self.shape().to_vec(),
            },
        ))
    }

    /// Reshape where one dimension may be `-1` (inferred from the element count).
    pub fn reshape_infer(&self, shape: &[isize]) -> Result<Tensor> {
        // The known dimensions' product, checked (an overflow panicked in debug builds).
        let known = (shape.iter().filter(|&&d| d != -1))
            .try_fold(1isize, |n, &d| n.checked_mul(d))
            .unwrap_or(-1);
        let holes = shape.iter().filter(|&&d| d == -1).count();
        if holes > 1 || shape.iter().any(|&d| d < -1) || known < 0 || (holes == 1 && known == 0) {
            return Err(Error::invalid(
                "reshape",
                format!("invalid target shape {shape:?}"),
            ));
        }
        let resolved: Vec<usize> = shape
            .iter()
            .map(|&d| {
                if d == -1 {
                    self.numel() / known as usize
                } else {
                    d as usize
                }
            })
            .collect();
        self.reshape(&resolved)
    }

    /// Flattens dimensions `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        let s = resolve_dim("flatten", start, self.rank())?;
        let e = resolve_dim("flatten", end, self.rank())?;
        if s > e {
            return Err(Error::invalid("flatten", format!("start {s} > end {e}")));
        }
        let mut shape = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(&shape)
    }

    /// Reorders dimensions: output dimension `i` is input dimension `dims[i]`. A view.
    pub fn permute(&self, dims: &[usize]) -> Result<Tensor> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if dims.len() != rank
            || dims
                .iter()
                .any(|&d| d >= rank || std::mem::replace(&mut seen[d], true))
        {
            return Err(Error::invalid(
                "permute",
                format!(
                    "{dims:?} is not a permutation of the {rank} dimensions of {:?}",
                    self.shape()
                ),
            ));
        }
        let l = self.layout();
        let shape = dims.iter().map(|&d| l.shape()[d]).collect();
        let strides = dims.iter().map(|&d| l.strides()[d]).collect();
        let out = self.view_with_layout(Layout::new(shape, strides, l.offset()));
        let mut inverse = vec![0; rank];
        for (i, &d) in dims.iter().enumerate() {
            inverse[d] = i;
        }
        Ok(record_op(out, &[self], PermuteBackward { inverse }))
    }

    /// Swaps two dimensions. A view.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let a = resolve_dim("transpose", d0, self.rank())?;
        let b = resolve_dim("transpose", d1, self.rank())?;
        let mut dims: Vec<usize> = (0..self.rank()).collect();
        dims.swap(a, b);
        self.permute(&dims)
    }

    /// Transpose of a 2-D tensor (swaps the last two dimensions of higher-rank tensors).
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::invalid(
                "t",
                format!("needs at least 2 dimensions, got shape {:?}", self.shape()),
            ));
        }
        self.transpose(-2, -1)
    }

    /// `len` entries of dimension `dim` starting at `start`. A view.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = resolve_dim("narrow", dim, self.rank())?;
        let size = self.shape()[d];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::invalid(
                "narrow",
                format!(
                    "range {start}..{} is outside dimension {d} of size {size}",
                    start.saturating_add(len)
                ),
            ));
        }
        let l = self.layout();
        let mut shape = l.shape().to_vec();
        shape[d] = len;
        let out = self.view_with_layout(Layout::new(
            shape,
            l.strides().to_vec(),
            l.offset() + start * l.strides()[d],
        ));
        Ok(record_op(
            out,
            &[self],
            NarrowBackward {
                input_shape: self.shape().to_vec(),
                dim: d,
                start,
            },
        ))
    }

    /// Broadcasts size-1 (or missing leading) dimensions to `shape` without copying.
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        let target = crate::tensor::layout::broadcast_shapes("expand", self.shape(), shape)?;
        if target != shape {
            return Err(Error::shape("expand", self.shape(), shape));
        }
        // A view costs nothing, but its element count must fit a `usize` (it overflowed
        // later, in any op that counts them).
        if crate::tensor::checked_numel(shape).is_none() {
            return Err(Error::invalid(
                "expand",
                format!("a shape of {shape:?} holds more elements than a usize counts"),
            ));
        }
        if shape == self.shape() {
            return Ok(self.clone());
        }
        let strides = self.layout().broadcast_strides(shape);
        let out =
            self.view_with_layout(Layout::new(shape.to_vec(), strides, self.layout().offset()));
        Ok(record_op(
            out,
            &[self],
            ExpandBackward {
                input_shape: self.shape().to_vec(),
            },
        ))
    }

    /// Inserts a size-1 dimension at `dim` (which may equal the rank).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut shape = self.shape().to_vec();
        shape.insert(d, 1);
        self.reshape_view_or_copy(&shape)
    }

    /// Removes dimension `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim("squeeze", dim, self.rank())?;
        if self.shape()[d] != 1 {
            return Err(Error::invalid(
                "squeeze",
                format!(
                    "dimension {d} of {:?} has size {}, not 1",
                    self.shape(),
                    self.shape()[d]
                ),
            ));
        }
        let mut shape = self.shape().to_vec();
        shape.remove(d);
        self.reshape_view_or_copy(&shape)
    }

    fn reshape_view_or_copy(&self, shape: &[usize]) -> Result<Tensor> {
        // Adding/removing size-1 dims never needs a copy: keep the other strides.
        let l = self.layout();
        let mut strides = Vec::with_capacity(shape.len());
        let mut src = l
            .shape()
            .iter()
            .zip(l.strides())
            .filter(|(&d, _)| d != 1)
            .map(|(_, &s)| s);
        for &d in shape {
            strides.push(if d == 1 { 0 } else { src.next().unwrap_or(0) });
        }
        let out = self.view_with_layout(Layout::new(shape.to_vec(), strides, l.offset()));
        Ok(record_op(
            out,
            &[self],
            ReshapeBackward {
                input_shape: self.shape().to_vec(),
            },
        ))
    }

    /// A contiguous copy if the tensor is not contiguous; itself otherwise.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        Ok(record_op(
            self.contiguous_values()?,
            &[self],
            ContiguousBackward,
        ))
    }
}
