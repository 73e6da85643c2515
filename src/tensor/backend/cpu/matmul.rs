//! Matrix products in host memory on the `gemm` crate: 2-D, batched with broadcasting, and
//! `linear` (`x·Wᵀ + b` accumulated onto the broadcast bias). Transposed operands are strided
//! views; gemm reads them without a copy.

use super::super::{Cpu, MatmulOps};
use gemm::Parallelism;
use rayon::prelude::*;

use crate::error::Result;
use crate::tensor::layout::Layout;
use crate::tensor::ops::{float_compute, with_float};
use crate::Tensor;

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

/// `linear`'s operands in their compute dtype (f16/bf16 → f32), and the output's storage dtype.
fn linear_operands(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Tensor, Option<Tensor>, crate::DType)> {
    let (xc, storage) = float_compute("linear", x)?;
    let (wc, _) = float_compute("linear", w)?;
    let bc = bias
        .map(|b| float_compute("linear", b))
        .transpose()?
        .map(|(b, _)| b);
    Ok((xc, wc, bc, storage))
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

impl MatmulOps for Cpu {
    fn matmul(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
        let (ar, br) = (a.rank(), b.rank());
        let (m, k, n) = (a.shape()[ar - 2], a.shape()[ar - 1], b.shape()[br - 1]);
        let (ac, storage) = float_compute("matmul", a)?;
        let (bc, _) = float_compute("matmul", b)?;
        let nb: usize = batch.iter().product();
        let mut shape = batch.to_vec();
        shape.extend([m, n]);
        crate::tensor::storage::ensure_allocatable("matmul", &shape, ac.dtype().size_in_bytes())?;
        let out = with_float!(ac.dtype(), "matmul", T => {
            let out = ac.with_strided(|ad: &[T], al| {
                bc.with_strided(|bd: &[T], bl| {
                    let a_off = batch_offsets(al, batch);
                    let b_off = batch_offsets(bl, batch);
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

    fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (rows, in_f, out_f) = (x.shape()[0], x.shape()[1], w.shape()[0]);
        let (xc, wc, bc, storage) = linear_operands(x, w, bias)?;
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
            Tensor::from_vec(out, &[rows, out_f])?
        });
        out.cast_values(storage)
    }

    fn linear_row_invariant(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (rows, in_f, out_f) = (x.shape()[0], x.shape()[1], w.shape()[0]);
        let (xc, wc, bc, storage) = linear_operands(x, w, bias)?;
        let out = with_float!(xc.dtype(), "linear", T => {
            let out = xc.with_contiguous(|xd: &[T]| {
                wc.with_contiguous(|wd: &[T]| match &bc {
                    Some(b) => b.with_contiguous(|bd: &[T]| {
                        super::rowwise::linear(xd, wd, Some(bd), rows, in_f, out_f)
                    }),
                    None => Ok(super::rowwise::linear(xd, wd, None, rows, in_f, out_f)),
                })
            })???;
            Tensor::from_vec(out, &[rows, out_f])?
        });
        out.cast_values(storage)
    }
}

/// `out [m × n] = x [m × k] · w [n × k]ᵀ` for contiguous f32 host slices, into the caller's
/// buffer: what `Tensor::linear` computes without its tensors, copies or fresh output (the
/// retrieval scans call it once per block of queries and stored vectors). Row-invariant when
/// [`is_row_invariant`](crate::tensor::is_row_invariant) is on for this thread, as `linear` is.
pub(crate) fn linear_into(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() == m * k && w.len() == n * k && out.len() == m * n);
    if crate::tensor::is_row_invariant() {
        out.copy_from_slice(&super::rowwise::linear(x, w, None, m, k, n));
        return;
    }
    let lhs = MatRef {
        data: x,
        offset: 0,
        row_stride: k,
        col_stride: 1,
    };
    // Wᵀ as a strided view: element (i, o) of Wᵀ is W[o, i].
    let rhs = MatRef {
        data: w,
        offset: 0,
        row_stride: 1,
        col_stride: k,
    };
    gemm_into(m, n, k, out, lhs, rhs, false, true);
}
