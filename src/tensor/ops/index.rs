//! Indexing: index_select and gather along dim 0, row scatter-add, masked_fill, where, and the
//! triu index helper.

use crate::tensor::autograd::{record_op, BackwardOp, Gradient, RowSparseGrad, SavedTensor};
use crate::tensor::backend::{with_backend, ElementwiseOps, IndexOps};
use crate::tensor::dtype::WithDType;
use crate::tensor::layout::broadcast_shapes;
use crate::{DType, Error, Result, Tensor};

/// Reads an index tensor (i64 or i32) and checks every entry lies in `0..size`; the error names
/// the first offending position.
pub fn checked_indices(op: &'static str, index: &Tensor, size: usize) -> Result<Vec<usize>> {
    let raw: Vec<i64> = match index.dtype() {
        DType::I64 => index.to_vec::<i64>()?,
        DType::I32 => index.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        d => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: d,
                expected: "i64 or i32 indices",
            })
        }
    };
    checked_index_slice(op, &raw, size)
}

/// Checks a slice of indices against `0..size`, naming the first offending position.
pub fn checked_index_slice(op: &'static str, raw: &[i64], size: usize) -> Result<Vec<usize>> {
    raw.iter()
        .enumerate()
        .map(|(position, &i)| {
            if i < 0 || i as u64 >= size as u64 {
                Err(Error::IndexOutOfRange {
                    op,
                    index: i,
                    position,
                    size,
                })
            } else {
                Ok(i as usize)
            }
        })
        .collect()
}

struct IndexSelectBackward {
    rows: Vec<i64>,
    num_rows: usize,
    /// `[rows.len(), ...row shape]`.
    values_shape: Vec<usize>,
}

impl BackwardOp for IndexSelectBackward {
    fn name(&self) -> &'static str {
        "index_select"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![
            Some(Gradient::RowSparse(RowSparseGrad {
                rows: self.rows.clone(),
                values: g.contiguous_values()?.reshape(&self.values_shape)?,
                num_rows: self.num_rows,
            })),
            None,
        ])
    }
}

struct GatherBackward {
    input_shape: Vec<usize>,
    index: Vec<usize>,
    index_shape: Vec<usize>,
}

impl BackwardOp for GatherBackward {
    fn name(&self) -> &'static str {
        "gather"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let rest_in: usize = self.input_shape[1..].iter().product();
        let targets: Vec<usize> = (0..self.index.len())
            .map(|p| {
                gather_source(
                    p,
                    &self.index,
                    &self.index_shape,
                    &self.input_shape,
                    rest_in,
                )
            })
            .collect();
        let gx = with_backend!(g.device(), B => B::put_add(g, &targets, &self.input_shape))?;
        Ok(vec![Some(Gradient::Dense(gx)), None])
    }
}

/// Flat position in the input that output element `p` of a dim-0 gather reads.
fn gather_source(
    p: usize,
    index: &[usize],
    index_shape: &[usize],
    input_shape: &[usize],
    rest_in: usize,
) -> usize {
    // Decompose p over index_shape[1..], recompose over input_shape[1..].
    let mut rem = p;
    let mut within = 0;
    let mut stride_in = rest_in;
    let rest_idx: usize = index_shape[1..].iter().product();
    rem %= rest_idx.max(1);
    let mut stride_idx = rest_idx;
    for d in 1..index_shape.len() {
        stride_idx /= index_shape[d];
        stride_in /= input_shape[d];
        within += (rem / stride_idx) * stride_in;
        rem %= stride_idx;
    }
    index[p] * rest_in + within
}

struct MaskedFillBackward {
    mask: SavedTensor,
}

impl BackwardOp for MaskedFillBackward {
    fn name(&self) -> &'static str {
        "masked_fill"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let zero = Tensor::try_zeros(&[], g.dtype(), g.device())?;
        let mask = self.mask.get("masked_fill")?;
        Ok(vec![Some(Gradient::Dense(Tensor::where_cond(
            mask, &zero, g,
        )?))])
    }
}

struct WhereBackward {
    cond: SavedTensor,
    a_shape: Vec<usize>,
    b_shape: Vec<usize>,
}

impl BackwardOp for WhereBackward {
    fn name(&self) -> &'static str {
        "where"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let cond = self.cond.get("where")?;
        let zero = Tensor::try_zeros(&[], g.dtype(), g.device())?;
        let ga = Tensor::where_cond(cond, g, &zero)?.sum_to_shape(&self.a_shape)?;
        let gb = Tensor::where_cond(cond, &zero, g)?.sum_to_shape(&self.b_shape)?;
        Ok(vec![
            None,
            Some(Gradient::Dense(ga)),
            Some(Gradient::Dense(gb)),
        ])
    }
}

impl Tensor {
    /// Rows of this tensor picked by `indices` (i64/i32, any shape): the result has shape
    /// `indices.shape() ++ self.shape()[1..]`. Out-of-range indices are an error naming the
    /// position. The gradient is row-sparse.
    pub fn index_select(&self, indices: &Tensor) -> Result<Tensor> {
        if self.rank() == 0 {
            return Err(Error::invalid(
                "index_select",
                "cannot index a 0-dimensional tensor",
            ));
        }
        let rows = checked_indices("index_select", indices, self.shape()[0])?;
        let mut shape = indices.shape().to_vec();
        shape.extend_from_slice(&self.shape()[1..]);
        let out = with_backend!(self.device(), B => B::index_select(self, &rows, &shape))?;
        if !self.dtype().is_float() {
            return Ok(out);
        }
        Ok(record_op(
            out,
            &[self, indices],
            IndexSelectBackward {
                rows: rows.iter().map(|&r| r as i64).collect(),
                num_rows: self.shape()[0],
                values_shape: [&[rows.len()], &self.shape()[1..]].concat(),
            },
        ))
    }

    /// `out[i, j, ...] = self[index[i, j, ...], j, ...]` (gather along dim 0). `index` has this
    /// tensor's rank and no larger trailing dimensions.
    pub fn gather(&self, index: &Tensor) -> Result<Tensor> {
        if index.rank() != self.rank()
            || self.rank() == 0
            || (1..self.rank()).any(|d| index.shape()[d] > self.shape()[d])
        {
            return Err(Error::ShapeMismatch {
                op: "gather",
                lhs: self.shape().to_vec(),
                rhs: index.shape().to_vec(),
                detail: "index must have the input's rank and no larger trailing dimensions".into(),
            });
        }
        let idx = checked_indices("gather", index, self.shape()[0])?;
        crate::tensor::device::same_device("gather", self, index)?;
        let rest_in: usize = self.shape()[1..].iter().product();
        let sources: Vec<usize> = (0..idx.len())
            .map(|p| gather_source(p, &idx, index.shape(), self.shape(), rest_in))
            .collect();
        let out = with_backend!(self.device(), B => B::take(self, &sources, index.shape()))?;
        if !self.dtype().is_float() {
            return Ok(out);
        }
        Ok(record_op(
            out,
            &[self, index],
            GatherBackward {
                input_shape: self.shape().to_vec(),
                index: idx,
                index_shape: index.shape().to_vec(),
            },
        ))
    }

    /// A copy of this tensor with `values[i]` added to row `rows[i]` (duplicates accumulate, in
    /// order). No autograd: this is the scatter used to densify row-sparse gradients.
    pub fn index_add_rows(&self, rows: &[i64], values: &Tensor) -> Result<Tensor> {
        if self.rank() == 0
            || values.rank() == 0
            || values.shape()[0] != rows.len()
            || values.shape()[1..] != self.shape()[1..]
        {
            return Err(Error::ShapeMismatch {
                op: "index_add_rows",
                lhs: self.shape().to_vec(),
                rhs: values.shape().to_vec(),
                detail: format!(
                    "expected values of shape [{}, ...{:?}]",
                    rows.len(),
                    &self.shape()[1..]
                ),
            });
        }
        let rows = checked_index_slice("index_add_rows", rows, self.shape()[0])?;
        crate::tensor::device::same_device("index_add_rows", self, values)?;
        with_backend!(self.device(), B => B::index_add_rows(self, &rows, values))
    }

    /// Replaces elements where `mask` (u8, broadcastable) is nonzero by `value`.
    pub fn masked_fill(&self, mask: &Tensor, value: f64) -> Result<Tensor> {
        let fill = Tensor::try_full(value, &[], self.dtype(), self.device())?;
        let out = Tensor::where_cond(mask, &fill, &self.detach())?;
        if out.shape() != self.shape() {
            return Err(Error::shape("masked_fill", self.shape(), mask.shape()));
        }
        Ok(record_op(
            out,
            &[self],
            MaskedFillBackward {
                mask: SavedTensor::new(&mask.detach()),
            },
        ))
    }

    /// `cond ? a : b` elementwise with broadcasting; `cond` is a u8 mask.
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        if cond.dtype() != DType::U8 {
            return Err(Error::UnsupportedDType {
                op: "where",
                dtype: cond.dtype(),
                expected: "a u8 mask",
            });
        }
        if a.dtype() != b.dtype() {
            return Err(Error::DTypeMismatch {
                op: "where",
                lhs: a.dtype(),
                rhs: b.dtype(),
            });
        }
        crate::tensor::device::same_device("where", cond, a)?;
        crate::tensor::device::same_device("where", a, b)?;
        let shape = broadcast_shapes(
            "where",
            &broadcast_shapes("where", cond.shape(), a.shape())?,
            b.shape(),
        )?;
        let out = with_backend!(a.device(), B => B::where_cond(cond, a, b, &shape))?;
        if !a.dtype().is_float() {
            return Ok(out);
        }
        Ok(record_op(
            out,
            &[cond, a, b],
            WhereBackward {
                cond: SavedTensor::new(&cond.detach()),
                a_shape: a.shape().to_vec(),
                b_shape: b.shape().to_vec(),
            },
        ))
    }

    /// Row and column indices (i64) of the upper triangle of an `n×n` matrix, starting at
    /// diagonal `offset` (1 excludes the diagonal), in row-major order. A side whose n² indices
    /// no memory holds is an error.
    pub fn triu_indices(n: usize, offset: i64) -> Result<(Tensor, Tensor)> {
        const OP: &str = "triu_indices";
        let (mut rows, mut cols) = (Vec::new(), Vec::new());
        let side = i64::try_from(n)
            .map_err(|_| crate::Error::invalid(OP, format!("a side of {n} is past an i64")))?;
        if offset < side {
            // At most n² of them, a row and a column (16 bytes) each.
            crate::tensor::storage::ensure_allocatable(OP, &[n, n], 16)?;
            for i in 0..side {
                // Saturating: an offset near i64::MAX wrapped and gave the whole square.
                for j in i.saturating_add(offset).max(0)..side {
                    rows.push(i);
                    cols.push(j);
                }
            }
        }
        let len = rows.len();
        Ok((
            Tensor::from_cpu(i64::into_storage(rows), &[len]),
            Tensor::from_cpu(i64::into_storage(cols), &[len]),
        ))
    }
}
