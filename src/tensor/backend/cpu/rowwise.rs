//! The row-invariant `linear` (see [`row_invariant`](crate::tensor::row_invariant)): every
//! output element is `bias + x_row · w_row` summed in one fixed order that depends only on the
//! two rows, never on how many other rows the batch holds or where this one sits in it. gemm
//! cannot promise that: it picks a different kernel (dot products, matrix-vector, packed
//! panels) and a different depth blocking by shape, so a sample scored alone and inside a batch
//! of 256 could differ in the last bits.
//!
//! The order: eight lane sums over the depth in steps of 8 (lane `l` adds element `8c + l`),
//! reduced as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, then the tail elements in order, then
//! the bias. Blocks of 4 rows × 2 outputs share loads; each element keeps its own accumulator,
//! so a block's shape never changes a value.

use rayon::prelude::*;

use crate::tensor::dtype::FloatElem;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 32;
/// Multiply-adds below which one thread does everything.
const PAR_WORK: usize = 1 << 18;

/// One task's share: `out[r, j] = bias[j] + x[r]·w[j]` for its rows.
pub(super) struct Args<'a, T> {
    x: &'a [T],
    w: &'a [T],
    bias: Option<&'a [T]>,
    k: usize,
    n: usize,
    out: &'a mut [T],
}

/// `x [rows, k]` times `w [n, k]` transposed, plus `bias [n]`, row-major and contiguous.
pub(super) fn linear<T: FloatElem + RowwiseElem>(
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    rows: usize,
    k: usize,
    n: usize,
) -> Vec<T> {
    let mut out = vec![T::zero(); rows * n];
    if k == 0 || n == 0 {
        // No depth: each output is its bias alone.
        if let (Some(b), true) = (bias, n > 0) {
            out.chunks_mut(n).for_each(|r| r.copy_from_slice(b));
        }
        return out;
    }
    assert_eq!(x.len(), rows * k, "x is [rows, k]");
    assert_eq!(w.len(), n * k, "w is [n, k]");
    if rows * n * k < PAR_WORK {
        T::kernel(Args {
            x,
            w,
            bias,
            k,
            n,
            out: &mut out,
        });
    } else {
        out.par_chunks_mut(ROWS_PER_TASK * n)
            .zip(x.par_chunks(ROWS_PER_TASK * k))
            .for_each(|(out, x)| {
                T::kernel(Args {
                    x,
                    w,
                    bias,
                    k,
                    n,
                    out,
                })
            });
    }
    out
}

/// The element types with a row-invariant kernel.
pub(super) trait RowwiseElem: Sized {
    /// Runs one task.
    fn kernel(args: Args<'_, Self>);
}

impl RowwiseElem for f64 {
    fn kernel(args: Args<'_, f64>) {
        portable(args)
    }
}

impl RowwiseElem for f32 {
    fn kernel(args: Args<'_, f32>) {
        kernel_f32(args)
    }
}

crate::multiversion!(
    fn kernel_f32(args: Args<'_, f32>) => avx2: avx2_f32, portable: portable::<f32>
);

/// Eight lane sums reduced in the fixed tree order, then the tail, then the bias.
#[inline(always)]
fn finish<T: FloatElem>(
    lanes: [T; 8],
    x: &[T],
    w: &[T],
    full: usize,
    bias: Option<T>,
    fma: bool,
) -> T {
    let l = lanes;
    let mut s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for i in full..x.len() {
        s = if fma {
            x[i].mul_add(w[i], s)
        } else {
            s + x[i] * w[i]
        };
    }
    match bias {
        Some(b) => s + b,
        None => s,
    }
}

/// The portable kernel: the same order with separate multiplies and adds (the compiler may
/// vectorise the lanes; it never fuses them).
#[inline(always)]
fn portable<T: FloatElem>(args: Args<'_, T>) {
    let Args {
        x,
        w,
        bias,
        k,
        n,
        out,
    } = args;
    let full = k / 8 * 8;
    for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
        for (j, o) in or.iter_mut().enumerate() {
            let wr = &w[j * k..(j + 1) * k];
            let mut lanes = [T::zero(); 8];
            for c in (0..full).step_by(8) {
                for l in 0..8 {
                    lanes[l] += xr[c + l] * wr[c + l];
                }
            }
            *o = finish(lanes, xr, wr, full, bias.map(|b| b[j]), false);
        }
    }
}

/// The AVX2 + FMA kernel: blocks of up to 4 rows × 2 outputs, one 8-lane accumulator each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn avx2_f32(args: Args<'_, f32>) {
    let Args {
        x,
        w,
        bias,
        k,
        n,
        out,
    } = args;
    let rows = x.len() / k;
    let mut j = 0;
    while j < n {
        let cols = (n - j).min(2);
        let mut r = 0;
        while r < rows {
            let block = (rows - r).min(4);
            match (block, cols) {
                (4, 2) => block_f32::<4, 2>(x, w, bias, k, n, r, j, out),
                (4, _) => block_f32::<4, 1>(x, w, bias, k, n, r, j, out),
                (_, 2) => block_f32::<1, 2>(x, w, bias, k, n, r, j, out),
                _ => block_f32::<1, 1>(x, w, bias, k, n, r, j, out),
            }
            r += if block == 4 { 4 } else { 1 };
        }
        j += cols;
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn avx2_f32(args: Args<'_, f32>) {
    portable(args)
}

/// Rows `r..r+R`, outputs `j..j+C`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_f32<const R: usize, const C: usize>(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    n: usize,
    r: usize,
    j: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let full = k / 8 * 8;
    let xs: [&[f32]; R] = std::array::from_fn(|i| &x[(r + i) * k..(r + i + 1) * k]);
    let ws: [&[f32]; C] = std::array::from_fn(|c| &w[(j + c) * k..(j + c + 1) * k]);
    // SAFETY: this function is only reached from `kernel_f32`'s AVX2 + FMA variant, which runs
    // only where the CPU has those features; every load reads 8 floats at an offset c with
    // c + 8 ≤ full ≤ k, the length of each row slice.
    let lanes: [[[f32; 8]; C]; R] = unsafe {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut c = 0;
        while c < full {
            let wv: [__m256; C] = std::array::from_fn(|q| _mm256_loadu_ps(ws[q].as_ptr().add(c)));
            for i in 0..R {
                let xv = _mm256_loadu_ps(xs[i].as_ptr().add(c));
                for q in 0..C {
                    acc[i][q] = _mm256_fmadd_ps(xv, wv[q], acc[i][q]);
                }
            }
            c += 8;
        }
        std::array::from_fn(|i| {
            std::array::from_fn(|q| {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), acc[i][q]);
                l
            })
        })
    };
    for i in 0..R {
        for q in 0..C {
            out[(r + i) * n + j + q] = finish(
                lanes[i][q],
                xs[i],
                ws[q],
                full,
                bias.map(|b| b[j + q]),
                true,
            );
        }
    }
}
