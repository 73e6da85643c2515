//! Matrix products on the `gemm` crate: 2-D, batched with broadcasting, and the fused `linear`
//! (`x·Wᵀ + b`). Transposed operands are strided views; gemm reads them without a copy.

use gemm::Parallelism;
use rayon::prelude::*;

use super::{float_compute, with_float};
use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::layout::{broadcast_shapes, Layout};
use crate::{Error, Result, Tensor};

/// Products below this many multiply-adds run on one thread.
const GEMM_PAR_THRESHOLD: usize = 1 << 18;

/// A strided matrix operand: storage, offset of element (0,0), row stride, column stride.
#[derive(Clone, Copy)]
struct MatRef<'a, T> {
    data: &'a [T],
    offset: usize,
    row_stride: usize,
    col_stride: usize,
}

/// `dst[m×n] (row-major) = (accumulate ? dst : 0) + lhs[m×k]·rhs[k×n]`.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: 'static + Copy + num_traits::One + num_traits::Zero>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    accumulate: bool,
    parallel: bool,
) {
    debug_assert_eq!(dst.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.iter_mut().for_each(|d| *d = T::zero());
        }
        return;
    }
    // The last element each operand touches must be inside its storage (checked here so the
    // unsafe call below cannot read out of bounds).
    let last = |r: &MatRef<'_, T>, rows: usize, cols: usize| {
        r.offset + (rows - 1) * r.row_stride + (cols - 1) * r.col_stride
    };
    assert!(last(&lhs, m, k) < lhs.data.len() && last(&rhs, k, n) < rhs.data.len());
    let parallelism = if parallel && m * n * k >= GEMM_PAR_THRESHOLD {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: dst is m×n row-major (checked above); both operands' strided extents were
    // checked to lie inside their slices; gemm only reads lhs/rhs and writes dst.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

fn check_matmul(a: &Tensor, b: &Tensor) -> Result<(usize, usize, usize, Vec<usize>)> {
    if a.rank() < 2 || b.rank() < 2 {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
            detail: "both operands need at least 2 dimensions".into(),
        });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op: "matmul",
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let (m, k) = (a.shape()[a.rank() - 2], a.shape()[a.rank() - 1]);
    let (k2, n) = (b.shape()[b.rank() - 2], b.shape()[b.rank() - 1]);
    if k != k2 {
        return Err(Error::ShapeMismatch {
            op: "matmul",
            lhs: a.shape().to_vec(),
            rhs: b.shape().to_vec(),
            detail: format!("inner dimensions differ: {k} vs {k2}"),
        });
    }
    let batch = broadcast_shapes(
        "matmul",
        &a.shape()[..a.rank() - 2],
        &b.shape()[..b.rank() - 2],
    )?;
    Ok((m, k, n, batch))
}

/// Storage offsets of every matrix of a batched operand broadcast to `batch`.
fn batch_offsets(l: &Layout, batch: &[usize]) -> Vec<usize> {
    let r = l.shape().len();
    let own = Layout::new(
        l.shape()[..r - 2].to_vec(),
        l.strides()[..r - 2].to_vec(),
        l.offset(),
    );
    let strides = own.broadcast_strides(batch);
    Layout::new(batch.to_vec(), strides, l.offset()).offsets()
}

fn matmul_values(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (m, k, n, batch) = check_matmul(a, b)?;
    if a.device().is_cuda() || b.device().is_cuda() {
        let _ = (m, k, n);
        return crate::tensor::cuda::matmul_float(a, b, &batch);
    }
    let (ac, storage) = float_compute("matmul", a)?;
    let (bc, _) = float_compute("matmul", b)?;
    let nb: usize = batch.iter().product();
    let mut shape = batch.clone();
    shape.extend([m, n]);
    let out = with_float!(ac.dtype(), "matmul", T => {
        let out = ac.with_strided(|ad: &[T], al| {
            bc.with_strided(|bd: &[T], bl| {
                let (ar, br) = (al.shape().len(), bl.shape().len());
                let a_off = batch_offsets(al, &batch);
                let b_off = batch_offsets(bl, &batch);
                let lhs = |i: usize| MatRef { data: ad, offset: a_off[i], row_stride: al.strides()[ar - 2], col_stride: al.strides()[ar - 1] };
                let rhs = |i: usize| MatRef { data: bd, offset: b_off[i], row_stride: bl.strides()[br - 2], col_stride: bl.strides()[br - 1] };
                let mut out = vec![T::default(); nb * m * n];
                if m * n == 0 {
                    return out;
                }
                if nb > 1 && m * n * k < GEMM_PAR_THRESHOLD {
                    // Many small products: one thread per product.
                    out.par_chunks_mut(m * n).enumerate().for_each(|(i, dst)| gemm_into(m, n, k, dst, lhs(i), rhs(i), false, false));
                } else {
                    for (i, dst) in out.chunks_mut(m * n).enumerate() {
                        gemm_into(m, n, k, dst, lhs(i), rhs(i), false, true);
                    }
                }
                out
            })
        })??;
        Tensor::from_vec(out, &shape)?
    });
    out.cast_values(storage)
}

struct MatmulBackward {
    a: Tensor,
    b: Tensor,
}

impl BackwardOp for MatmulBackward {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        // dA = G·Bᵀ and dB = Aᵀ·G. When an operand is itself a transposed view (z·zᵀ), its
        // gradient is produced transposed too (dBᵀ = Gᵀ·A), so the transpose's backward hands
        // a contiguous gradient on instead of a strided one.
        let ga = if self.a.requires_grad() {
            let ga = if is_transposed(&self.a) {
                matmul_values(&self.b, &g.t()?)?.t()?
            } else {
                matmul_values(g, &self.b.t()?)?
            };
            Some(Gradient::Dense(ga.sum_to_shape(self.a.shape())?))
        } else {
            None
        };
        let gb = if self.b.requires_grad() {
            let gb = if is_transposed(&self.b) {
                matmul_values(&g.t()?, &self.a)?.t()?
            } else {
                matmul_values(&self.a.t()?, g)?
            };
            Some(Gradient::Dense(gb.sum_to_shape(self.b.shape())?))
        } else {
            None
        };
        Ok(vec![ga, gb])
    }
}

/// True when the last two dimensions are laid out column-major (a transposed view).
fn is_transposed(t: &Tensor) -> bool {
    let (s, r) = (t.layout().strides(), t.rank());
    r >= 2 && s[r - 2] == 1 && s[r - 1] != 1 && t.shape()[r - 2] > 1
}

struct LinearBackward {
    x: Tensor,
    w: Tensor,
    has_bias: bool,
}

impl BackwardOp for LinearBackward {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let out_features = self.w.shape()[0];
        let rows = g.numel() / out_features.max(1);
        let g2 = g.reshape(&[rows, out_features])?;
        let x2 = self.x.reshape(&[rows, self.w.shape()[1]])?;
        let gx = self
            .x
            .requires_grad()
            .then(|| matmul_values(&g2, &self.w)?.reshape(self.x.shape()))
            .transpose()?;
        let gw = self
            .w
            .requires_grad()
            .then(|| matmul_values(&g2.t()?, &x2))
            .transpose()?;
        let mut grads = vec![gx.map(Gradient::Dense), gw.map(Gradient::Dense)];
        if self.has_bias {
            grads.push(Some(Gradient::Dense(g2.sum(&[0], false)?)));
        }
        Ok(grads)
    }
}

impl Tensor {
    /// Matrix product over the last two dimensions; leading (batch) dimensions broadcast.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let out = matmul_values(self, rhs)?;
        Ok(record_op(
            out,
            &[self, rhs],
            MatmulBackward {
                a: self.clone_for_backward(),
                b: rhs.clone_for_backward(),
            },
        ))
    }

    /// Keeps the requires-grad flag (so backward knows which gradients are wanted) but drops
    /// the history, so saved operands don't keep the graph alive twice.
    fn clone_for_backward(&self) -> Tensor {
        self.detach().with_requires_grad(self.requires_grad())
    }

    /// `x·Wᵀ + b` for `x` of shape `[..., in]`, `weight` `[out, in]`, `bias` `[out]`: one
    /// gemm that accumulates onto the broadcast bias.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if weight.rank() != 2
            || self.rank() == 0
            || self.shape()[self.rank() - 1] != weight.shape()[1]
        {
            return Err(Error::ShapeMismatch {
                op: "linear",
                lhs: self.shape().to_vec(),
                rhs: weight.shape().to_vec(),
                detail: "expected input [..., in] and weight [out, in]".into(),
            });
        }
        let (out_f, in_f) = (weight.shape()[0], weight.shape()[1]);
        if let Some(b) = bias {
            if b.shape() != [out_f] {
                return Err(Error::ShapeMismatch {
                    op: "linear",
                    lhs: b.shape().to_vec(),
                    rhs: vec![out_f],
                    detail: "bias must be [out]".into(),
                });
            }
        }
        for t in [Some(weight), bias].into_iter().flatten() {
            if t.dtype() != self.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "linear",
                    lhs: self.dtype(),
                    rhs: t.dtype(),
                });
            }
        }
        let rows = self.numel() / in_f.max(1);
        if self.device().is_cuda() {
            let x2 = self.reshape(&[rows, in_f])?.detach();
            let mut out = matmul_values(&x2, &weight.detach().t()?)?;
            if let Some(b) = bias {
                out = crate::no_grad(|| out.add(&b.detach()))?;
            }
            let mut shape = self.shape().to_vec();
            *shape.last_mut().expect("rank >= 1") = out_f;
            let out = out.reshape(&shape)?;
            let mut inputs = vec![self, weight];
            inputs.extend(bias);
            return Ok(record_op(
                out,
                &inputs,
                LinearBackward {
                    x: self.clone_for_backward(),
                    w: weight.clone_for_backward(),
                    has_bias: bias.is_some(),
                },
            ));
        }
        let (xc, storage) = float_compute("linear", &self.reshape(&[rows, in_f])?.detach())?;
        let (wc, _) = float_compute("linear", weight)?;
        let bc = bias
            .map(|b| float_compute("linear", b))
            .transpose()?
            .map(|(b, _)| b);
        let out = with_float!(xc.dtype(), "linear", T => {
            let mut out = vec![T::default(); rows * out_f];
            if let Some(b) = &bc {
                b.with_contiguous(|bs: &[T]| out.chunks_mut(out_f.max(1)).for_each(|r| r.copy_from_slice(bs)))?;
            }
            xc.with_strided(|xd: &[T], xl| {
                wc.with_strided(|wd: &[T], wl| {
                    let lhs = MatRef { data: xd, offset: xl.offset(), row_stride: xl.strides()[0], col_stride: xl.strides()[1] };
                    // Wᵀ as a strided view: element (i, o) of Wᵀ is W[o, i].
                    let rhs = MatRef { data: wd, offset: wl.offset(), row_stride: wl.strides()[1], col_stride: wl.strides()[0] };
                    gemm_into(rows, out_f, in_f, &mut out, lhs, rhs, bc.is_some(), true);
                })
            })??;
            let mut shape = self.shape().to_vec();
            *shape.last_mut().expect("rank >= 1") = out_f;
            Tensor::from_vec(out, &shape)?
        });
        let out = out.cast_values(storage)?;
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        Ok(record_op(
            out,
            &inputs,
            LinearBackward {
                x: self.clone_for_backward(),
                w: weight.clone_for_backward(),
                has_bias: bias.is_some(),
            },
        ))
    }
}
