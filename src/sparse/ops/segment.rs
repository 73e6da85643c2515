//! `segment_sum_csr`: sums of consecutive segments of a flat buffer.

use super::bmm::float_operands;
use super::{read_ints, validate_offsets};
use crate::tensor::ops::with_float;
use crate::tensor::{record_op, BackwardOp, Gradient};
use crate::{DType, Error, Result, Tensor};

struct SegmentSumBackward {
    bounds: Vec<(usize, usize)>,
    len: usize,
    /// The values' shape (any: they are summed flat), which their gradient takes.
    shape: Vec<usize>,
    storage: DType,
}

impl BackwardOp for SegmentSumBackward {
    fn name(&self) -> &'static str {
        "segment_sum_csr"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let g = grad_output.to_vec_f64()?;
        let mut gv = vec![0.0f64; self.len];
        for (s, &(start, end)) in self.bounds.iter().enumerate() {
            gv[start..end].iter_mut().for_each(|x| *x = g[s]);
        }
        let gv = Tensor::from_vec(gv, &self.shape)?.cast_values(self.storage)?;
        Ok(vec![Some(Gradient::Dense(gv))])
    }
}

/// Segment `s` sums `values[csr_seg[s]·batch_size .. csr_seg[s+1]·batch_size]` (a CSR row
/// pointer in units of `batch_size` values). Differentiable in `values`.
pub fn segment_sum_csr(batch_size: usize, csr_seg: &Tensor, values: &Tensor) -> Result<Tensor> {
    const OP: &str = "segment_sum_csr";
    let seg = read_ints(OP, "csr_seg", csr_seg)?;
    validate_offsets(OP, &seg, |i| format!("segment {i}"))?;
    let len = values.numel();
    // Offsets are monotone: the last bound is the largest, checked (overflow included) first.
    let last = seg.last().copied().unwrap_or(0) as usize;
    if last.checked_mul(batch_size).is_none_or(|end| end > len) {
        return Err(Error::invalid(
            OP,
            format!("the last segment ends at {last} × {batch_size} but values has {len} elements"),
        ));
    }
    let bounds: Vec<(usize, usize)> = seg
        .windows(2)
        .map(|w| (w[0] as usize * batch_size, w[1] as usize * batch_size))
        .collect();
    let (ops, storage) = float_operands(OP, &[values])?;
    let out = with_float!(ops[0].dtype(), OP, T => {
        let v = ops[0].to_vec::<T>()?;
        let sums: Vec<T> = bounds.iter().map(|&(s, e)| v[s..e].iter().copied().sum()).collect();
        Tensor::from_vec(sums, &[bounds.len()])?
    })
    .cast_values(storage)?;
    Ok(record_op(
        out,
        &[values],
        SegmentSumBackward {
            bounds,
            len,
            shape: values.shape().to_vec(),
            storage,
        },
    ))
}
