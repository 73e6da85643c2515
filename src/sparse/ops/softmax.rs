//! `jagged_softmax`: a softmax over the rows of each bag, per column.

use std::sync::Arc;

use num_traits::Zero;

use super::bmm::float_operands;
use super::read_offsets;
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::with_float;
use crate::tensor::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::{DType, Error, Result, Tensor};

/// Visits the rows of every bag truncated to `max_l`: `f(first_row, count)`.
fn for_each_bag(offsets: &[i64], max_l: usize, mut f: impl FnMut(usize, usize)) {
    for w in offsets.windows(2) {
        f(w[0] as usize, ((w[1] - w[0]) as usize).min(max_l));
    }
}

fn softmax_kernel<T: FloatElem>(x: &[T], offsets: &[i64], d: usize, max_l: usize) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    for_each_bag(offsets, max_l, |start, len| {
        for c in 0..d {
            let at = |i: usize| (start + i) * d + c;
            let max = (0..len).map(|i| x[at(i)]).fold(T::neg_infinity(), T::max);
            let mut sum = T::zero();
            for i in 0..len {
                let e = (x[at(i)] - max).exp();
                out[at(i)] = e;
                sum += e;
            }
            for i in 0..len {
                out[at(i)] = out[at(i)] / sum;
            }
        }
    });
    out
}

struct JaggedSoftmaxBackward {
    /// The output in its compute dtype (for f32 the very tensor handed to the caller).
    output: SavedTensor,
    offsets: Arc<Vec<i64>>,
    max_l: usize,
    storage: DType,
}

impl BackwardOp for JaggedSoftmaxBackward {
    fn name(&self) -> &'static str {
        "jagged_softmax"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let output = self.output.get(self.name())?;
        let g = grad_output.cast_values(output.dtype())?;
        let d = output.shape()[1];
        let gx = with_float!(output.dtype(), "jagged_softmax", T => {
            let (y, g) = (output.to_vec::<T>()?, g.to_vec::<T>()?);
            let mut gx = vec![T::zero(); y.len()];
            for_each_bag(&self.offsets, self.max_l, |start, len| {
                for c in 0..d {
                    let at = |i: usize| (start + i) * d + c;
                    let dot: T = (0..len).map(|i| y[at(i)] * g[at(i)]).sum();
                    for i in 0..len {
                        gx[at(i)] = y[at(i)] * (g[at(i)] - dot);
                    }
                }
            });
            Tensor::from_vec(gx, output.shape())?
        });
        Ok(vec![Some(Gradient::Dense(gx.cast_values(self.storage)?))])
    }
}

/// Softmax over the first `max_l` rows of each bag of `values` (`[L, D]`), independently per
/// column. Rows at position `≥ max_l` within their bag come out as zero (FBGEMM leaves them
/// uninitialised) and receive zero gradient. Differentiable in `values`.
pub fn jagged_softmax(values: &Tensor, offsets: &Tensor, max_l: usize) -> Result<Tensor> {
    const OP: &str = "jagged_softmax";
    if values.rank() != 2 {
        return Err(Error::invalid(
            OP,
            format!("values must be [L, D], got {:?}", values.shape()),
        ));
    }
    let offs = read_offsets(OP, offsets)?;
    super::expect_total(OP, "offsets", offs[offs.len() - 1], values.shape()[0])?;
    let (ops, storage) = float_operands(OP, &[values])?;
    let d = values.shape()[1];
    let out = with_float!(ops[0].dtype(), OP, T => {
        let x = ops[0].to_vec::<T>()?;
        Tensor::from_vec(softmax_kernel(&x, &offs, d, max_l), values.shape())?
    });
    let saved = SavedTensor::new(&out);
    let out = out.cast_values(storage)?;
    Ok(record_op(
        out,
        &[values],
        JaggedSoftmaxBackward {
            output: saved,
            offsets: Arc::new(offs),
            max_l,
            storage,
        },
    ))
}
