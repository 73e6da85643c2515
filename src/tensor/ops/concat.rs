//! Joining and splitting along a dimension: cat, stack, split, chunk.

use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::backend::{with_backend, CopyOps};
use crate::tensor::layout::resolve_dim;
use crate::{Error, Result, Tensor};

struct CatBackward {
    dim: usize,
    sizes: Vec<usize>,
}

impl BackwardOp for CatBackward {
    fn name(&self) -> &'static str {
        "cat"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(self.sizes.len());
        for &s in &self.sizes {
            out.push(Some(Gradient::Dense(
                g.narrow(self.dim as isize, start, s)?.contiguous()?,
            )));
            start += s;
        }
        Ok(out)
    }
}

impl Tensor {
    /// Concatenates tensors along `dim`; all other dimensions must agree.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("cat", "no tensors given"))?;
        let d = resolve_dim("cat", dim, first.rank())?;
        let mut shape = first.shape().to_vec();
        shape[d] = 0;
        for (i, t) in tensors.iter().enumerate() {
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "cat",
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            let same = t.rank() == first.rank()
                && (0..t.rank()).all(|j| j == d || t.shape()[j] == first.shape()[j]);
            if !same {
                return Err(Error::ShapeMismatch {
                    op: "cat",
                    lhs: first.shape().to_vec(),
                    rhs: t.shape().to_vec(),
                    detail: format!("tensor {i} differs outside dimension {d}"),
                });
            }
            shape[d] += t.shape()[d];
        }
        let parts: Vec<Tensor> = tensors.iter().map(|t| t.detach()).collect();
        for t in tensors {
            crate::tensor::device::same_device("cat", first, t)?;
        }
        let out = with_backend!(first.device(), B => B::cat(&parts, d, &shape))?;
        if !first.dtype().is_float() {
            return Ok(out);
        }
        Ok(record_op(
            out,
            tensors,
            CatBackward {
                dim: d,
                sizes: tensors.iter().map(|t| t.shape()[d]).collect(),
            },
        ))
    }

    /// Stacks equally shaped tensors along a new dimension `dim`.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("stack", "no tensors given"))?;
        let d = resolve_dim("stack", dim, first.rank() + 1)?;
        let expanded: Vec<Tensor> = tensors
            .iter()
            .map(|t| {
                if t.shape() != first.shape() {
                    return Err(Error::shape("stack", first.shape(), t.shape()));
                }
                t.unsqueeze(d as isize)
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = expanded.iter().collect();
        Tensor::cat(&refs, d as isize)
    }

    /// Splits along `dim` into pieces of the given sizes (views), which must sum to the size.
    pub fn split(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = resolve_dim("split", dim, self.rank())?;
        let total = crate::tensor::checked_sum(sizes);
        if total != Some(self.shape()[d]) {
            return Err(Error::invalid(
                "split",
                format!(
                    "sizes {sizes:?} sum to {}, dimension {d} has size {}",
                    total.map_or("more than a usize holds".to_string(), |t| t.to_string()),
                    self.shape()[d]
                ),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&s| {
                let t = self.narrow(d as isize, start, s);
                start += s;
                t
            })
            .collect()
    }

    /// Splits along `dim` into `chunks` pieces of equal size (the last may be smaller).
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = resolve_dim("chunk", dim, self.rank())?;
        if chunks == 0 {
            return Err(Error::invalid("chunk", "chunks must be at least 1"));
        }
        let size = self.shape()[d];
        let step = size.div_ceil(chunks).max(1);
        let mut sizes = Vec::new();
        let mut left = size;
        while left > 0 {
            sizes.push(step.min(left));
            left -= step.min(left);
        }
        if sizes.is_empty() {
            sizes.push(0);
        }
        self.split(&sizes, d as isize)
    }
}
