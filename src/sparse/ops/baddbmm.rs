//! `permute102_baddbmm_permute102`: `C[m, b, :] = bias[b] + A[m, b, :] · B[b]`, a batched matmul
//! whose batch is the middle dimension (so neither operand has to be permuted in memory).
//! f32, f64, and f16/bf16 (computed in f32), forward and backward.

use rayon::prelude::*;

use super::bmm::float_operands;
use crate::tensor::dtype::FloatElem;
use crate::tensor::ops::with_float;
use crate::tensor::{record_op, BackwardOp, Gradient, SavedTensor};
use crate::{DType, Error, Result, Tensor};

/// `(m, b, k, n)` of the operands.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    b: usize,
    k: usize,
    n: usize,
}

fn forward_kernel<T: FloatElem>(bias: &[T], a: &[T], bm: &[T], d: Dims) -> Vec<T> {
    let mut out = vec![T::zero(); d.m * d.b * d.n];
    let row = |(mb, o): (usize, &mut [T])| {
        let batch = mb % d.b;
        o.copy_from_slice(&bias[batch * d.n..(batch + 1) * d.n]);
        let a_row = &a[mb * d.k..(mb + 1) * d.k];
        for (kk, &av) in a_row.iter().enumerate() {
            let b_row = &bm[(batch * d.k + kk) * d.n..(batch * d.k + kk + 1) * d.n];
            for (x, &bv) in o.iter_mut().zip(b_row) {
                *x += av * bv;
            }
        }
    };
    if d.n > 0 {
        if out.len() * d.k >= super::PARALLEL_MIN_ELEMENTS {
            out.par_chunks_mut(d.n).enumerate().for_each(row);
        } else {
            out.chunks_mut(d.n).enumerate().for_each(row);
        }
    }
    out
}

/// Gradients of bias, A and B from the output gradient `g` (`[m, b, n]`).
fn backward_kernel<T: FloatElem>(a: &[T], bm: &[T], g: &[T], d: Dims) -> (Vec<T>, Vec<T>, Vec<T>) {
    let mut g_bias = vec![T::zero(); d.b * d.n];
    let mut g_a = vec![T::zero(); a.len()];
    let mut g_b = vec![T::zero(); bm.len()];
    for mi in 0..d.m {
        for batch in 0..d.b {
            let mb = mi * d.b + batch;
            let g_row = &g[mb * d.n..(mb + 1) * d.n];
            for (x, &gv) in g_bias[batch * d.n..(batch + 1) * d.n].iter_mut().zip(g_row) {
                *x += gv;
            }
            for kk in 0..d.k {
                let b_row = &bm[(batch * d.k + kk) * d.n..(batch * d.k + kk + 1) * d.n];
                g_a[mb * d.k + kk] = b_row.iter().zip(g_row).map(|(&x, &y)| x * y).sum();
                let av = a[mb * d.k + kk];
                let gb_row = &mut g_b[(batch * d.k + kk) * d.n..(batch * d.k + kk + 1) * d.n];
                for (x, &gv) in gb_row.iter_mut().zip(g_row) {
                    *x += av * gv;
                }
            }
        }
    }
    (g_bias, g_a, g_b)
}

struct Permute102BaddbmmBackward {
    a: SavedTensor,
    b: SavedTensor,
    dims: Dims,
    storage: DType,
    bias_shape: Vec<usize>,
}

impl BackwardOp for Permute102BaddbmmBackward {
    fn name(&self) -> &'static str {
        "permute102_baddbmm_permute102"
    }
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let (a, b) = (self.a.get(self.name())?, self.b.get(self.name())?);
        let g = grad_output.cast_values(a.dtype())?;
        let grads = with_float!(a.dtype(), "permute102_baddbmm_permute102", T => {
            let (gb, ga, gm) = backward_kernel(&a.to_vec::<T>()?, &b.to_vec::<T>()?, &g.to_vec::<T>()?, self.dims);
            [
                Tensor::from_vec(gb, &self.bias_shape)?,
                Tensor::from_vec(ga, self.a.shape())?,
                Tensor::from_vec(gm, self.b.shape())?,
            ]
        });
        grads
            .into_iter()
            .map(|t| Ok(Some(Gradient::Dense(t.cast_values(self.storage)?))))
            .collect()
    }
}

/// `C[m, b, :] = bias[b] + A[m, b, :] · B[b]` with `bias: [b, n]` (or `[n]`, broadcast over
/// b), `A: [m, b, k]`, `B: [b, k, n]`; the result is `[m, b, n]`, in the operands' dtype (f16
/// and bf16 accumulate in f32). Differentiable in all three (FBGEMM only has the f16 forward).
pub fn permute102_baddbmm_permute102(bias: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "permute102_baddbmm_permute102";
    let ok = a.rank() == 3
        && b.rank() == 3
        && a.shape()[1] == b.shape()[0]
        && a.shape()[2] == b.shape()[1];
    if !ok {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
            detail: "expected A [m, b, k] and B [b, k, n]".into(),
        });
    }
    let dims = Dims {
        m: a.shape()[0],
        b: a.shape()[1],
        k: a.shape()[2],
        n: b.shape()[2],
    };
    let bias_full = match bias.shape() {
        [bb, nn] if *bb == dims.b && *nn == dims.n => bias.clone(),
        [nn] if *nn == dims.n => bias.unsqueeze(0)?.expand(&[dims.b, dims.n])?,
        s => {
            return Err(Error::invalid(
                OP,
                format!(
                    "bias has shape {s:?}; expected [{}, {}] or [{}]",
                    dims.b, dims.n, dims.n
                ),
            ))
        }
    };
    let (ops, storage) = float_operands(OP, &[&bias_full, a, b])?;
    let out = with_float!(ops[0].dtype(), OP, T => {
        let v = forward_kernel(&ops[0].to_vec::<T>()?, &ops[1].to_vec::<T>()?, &ops[2].to_vec::<T>()?, dims);
        Tensor::from_vec(v, &[dims.m, dims.b, dims.n])?
    })
    .cast_values(storage)?;
    Ok(record_op(
        out,
        &[&bias_full, a, b],
        Permute102BaddbmmBackward {
            a: SavedTensor::new(&ops[1]),
            b: SavedTensor::new(&ops[2]),
            dims,
            storage,
            bias_shape: vec![dims.b, dims.n],
        },
    ))
}
