//! The dot interaction in host memory: per sample, four dot products at a time and weighted
//! row sums, AVX2/FMA intrinsics for f32 where the CPU has them, samples split over threads.

use rayon::prelude::*;

use super::SAMPLES_PER_TASK;
use crate::tensor::dtype::FloatElem;
use crate::{Result, Tensor};

/// Sums eight partial sums pairwise.
#[inline(always)]
fn reduce8<T: FloatElem>(acc: &[T; 8]) -> T {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `⟨a, b_k⟩` for `M` rows `b_k` at once: `a` is loaded once per 8 lanes and the `M` sums
/// are independent chains, so the loop vectorises and keeps the FMA units busy.
#[inline(always)]
fn dots<T: FloatElem, const M: usize>(a: &[T], b: [&[T]; M]) -> [T; M] {
    let d = a.len();
    let full = d / 8 * 8;
    let mut acc = [[T::zero(); 8]; M];
    let mut c = 0;
    while c < full {
        let x = &a[c..c + 8];
        for m in 0..M {
            let y = &b[m][c..c + 8];
            for k in 0..8 {
                acc[m][k] += x[k] * y[k];
            }
        }
        c += 8;
    }
    let mut out = [T::zero(); M];
    for m in 0..M {
        let mut tail = T::zero();
        for k in full..d {
            tail += a[k] * b[m][k];
        }
        out[m] = reduce8(&acc[m]) + tail;
    }
    out
}

/// `out[start..start+W] = Σ_j coef[j] · rows[j][start..start+W]`, the sums held in registers.
#[inline(always)]
fn combine_block<T: FloatElem, const W: usize>(
    coef: &[T],
    rows: &[&[T]],
    start: usize,
    out: &mut [T],
) {
    let mut acc = [T::zero(); W];
    for (&c, r) in coef.iter().zip(rows) {
        let x = &r[start..start + W];
        for k in 0..W {
            acc[k] += c * x[k];
        }
    }
    out[start..start + W].copy_from_slice(&acc);
}

/// `out = Σ_j coef[j] · rows[j]` (every row of `out`'s length).
#[inline(always)]
fn combine<T: FloatElem>(coef: &[T], rows: &[&[T]], out: &mut [T]) {
    let d = out.len();
    let mut s = 0;
    while s + 64 <= d {
        combine_block::<T, 64>(coef, rows, s, out);
        s += 64;
    }
    while s + 8 <= d {
        combine_block::<T, 8>(coef, rows, s, out);
        s += 8;
    }
    for k in s..d {
        out[k] = coef
            .iter()
            .zip(rows)
            .fold(T::zero(), |acc, (&c, r)| acc + c * r[k]);
    }
}

/// The `n` rows of one sample: the dense vector, then the `n − 1` embeddings.
#[inline(always)]
fn sample_rows<'a, T>(dense: &'a [T], sparse: &'a [T], d: usize, rows: &mut Vec<&'a [T]>) {
    rows.clear();
    rows.push(dense);
    rows.extend(sparse.chunks_exact(d));
}

/// The two inner kernels: four dot products at once, and a weighted sum of rows.
trait Kernels<T> {
    fn dots4(a: &[T], b: [&[T]; 4]) -> [T; 4];
    fn dot(a: &[T], b: &[T]) -> T;
    fn combine(coef: &[T], rows: &[&[T]], out: &mut [T]);
}

/// Portable kernels (any float type; vectorised as far as the compiler manages).
struct Portable;

impl<T: FloatElem> Kernels<T> for Portable {
    #[inline(always)]
    fn dots4(a: &[T], b: [&[T]; 4]) -> [T; 4] {
        dots(a, b)
    }
    #[inline(always)]
    fn dot(a: &[T], b: &[T]) -> T {
        dots(a, [b])[0]
    }
    #[inline(always)]
    fn combine(coef: &[T], rows: &[&[T]], out: &mut [T]) {
        combine(coef, rows, out)
    }
}

/// Explicit AVX2/FMA f32 kernels (only called after the CPU was checked).
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Kernels<f32> for Avx2 {
    #[inline(always)]
    fn dots4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        use std::arch::x86_64::*;
        let d = a.len();
        let full = d / 8 * 8;
        // SAFETY: every load reads 8 floats at c < full ≤ len of each slice (the rows of one
        // sample all have length d); AVX2/FMA were detected before any Avx2 kernel runs.
        unsafe {
            let (mut s0, mut s1, mut s2, mut s3) = (
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
            );
            let mut c = 0;
            while c < full {
                let x = _mm256_loadu_ps(a.as_ptr().add(c));
                s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[0].as_ptr().add(c)), s0);
                s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[1].as_ptr().add(c)), s1);
                s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[2].as_ptr().add(c)), s2);
                s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[3].as_ptr().add(c)), s3);
                c += 8;
            }
            let h = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            let mut out = [0.0f32; 4];
            _mm_storeu_ps(out.as_mut_ptr(), sums);
            for (m, o) in out.iter_mut().enumerate() {
                for k in full..d {
                    *o += a[k] * b[m][k];
                }
            }
            out
        }
    }
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        Self::dots4(a, [b, b, b, b])[0]
    }
    #[inline(always)]
    fn combine(coef: &[f32], rows: &[&[f32]], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let d = out.len();
        let mut s = 0;
        // SAFETY: loads and stores stay below d, every row has length d; AVX2/FMA detected.
        unsafe {
            while s + 64 <= d {
                let mut acc = [_mm256_setzero_ps(); 8];
                for (&c, r) in coef.iter().zip(rows) {
                    let cv = _mm256_set1_ps(c);
                    let p = r.as_ptr().add(s);
                    for (k, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(cv, _mm256_loadu_ps(p.add(8 * k)), *a);
                    }
                }
                for (k, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(s + 8 * k), *a);
                }
                s += 64;
            }
            while s + 8 <= d {
                let mut acc = _mm256_setzero_ps();
                for (&c, r) in coef.iter().zip(rows) {
                    acc =
                        _mm256_fmadd_ps(_mm256_set1_ps(c), _mm256_loadu_ps(r.as_ptr().add(s)), acc);
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(s), acc);
                s += 8;
            }
        }
        for k in s..d {
            out[k] = coef
                .iter()
                .zip(rows)
                .fold(0.0, |acc, (&c, r)| acc + c * r[k]);
        }
    }
}

/// One task's samples: `dense [S, D]` and `sparse [S, n − 1, D]`.
struct Samples<'a, T> {
    dense: &'a [T],
    sparse: &'a [T],
    /// Rows per sample (the dense one and the embeddings).
    n: usize,
    /// Embedding dim.
    d: usize,
}

/// The forward of one task: its samples and their output rows `[S, D + n(n−1)/2]`.
pub(super) struct Forward<'a, T> {
    samples: Samples<'a, T>,
    out: &'a mut [T],
}

/// The backward of one task: its samples, their output gradient and the input gradients.
pub(super) struct Backward<'a, T> {
    samples: Samples<'a, T>,
    grad_out: &'a [T],
    grad_dense: &'a mut [T],
    grad_sparse: &'a mut [T],
}

#[inline(always)]
fn forward_samples<T: FloatElem, K: Kernels<T>>(args: Forward<'_, T>) {
    let Forward {
        samples:
            Samples {
                dense,
                sparse,
                n,
                d,
            },
        out,
    } = args;
    let width = out.len() / (dense.len() / d);
    let mut rows = Vec::with_capacity(n);
    for ((o, ds), ss) in out
        .chunks_exact_mut(width)
        .zip(dense.chunks_exact(d))
        .zip(sparse.chunks_exact((n - 1) * d))
    {
        o[..d].copy_from_slice(ds);
        sample_rows(ds, ss, d, &mut rows);
        let mut k = d;
        for i in 0..n {
            let ri = rows[i];
            let mut j = i + 1;
            while j + 4 <= n {
                let v = K::dots4(ri, [rows[j], rows[j + 1], rows[j + 2], rows[j + 3]]);
                o[k..k + 4].copy_from_slice(&v);
                k += 4;
                j += 4;
            }
            while j < n {
                o[k] = K::dot(ri, rows[j]);
                k += 1;
                j += 1;
            }
        }
    }
}

/// Input gradients `grad_dense [S, D]`, `grad_sparse [S, F, D]` from the output gradient
/// `[S, D + P]` and the saved inputs: with `G` the symmetric `n×n` matrix of the output
/// gradient's dot-product entries (zero diagonal), `∂rows = G · rows`.
#[inline(always)]
fn backward_samples<T: FloatElem, K: Kernels<T>>(args: Backward<'_, T>) {
    let Backward {
        samples:
            Samples {
                dense,
                sparse,
                n,
                d,
            },
        grad_out,
        grad_dense,
        grad_sparse,
    } = args;
    let width = grad_out.len() / (dense.len() / d);
    let f = n - 1;
    let mut rows = Vec::with_capacity(n);
    let mut sym = vec![T::zero(); n * n];
    for ((((g, gd), gs), ds), ss) in grad_out
        .chunks_exact(width)
        .zip(grad_dense.chunks_exact_mut(d))
        .zip(grad_sparse.chunks_exact_mut(f * d))
        .zip(dense.chunks_exact(d))
        .zip(sparse.chunks_exact(f * d))
    {
        sample_rows(ds, ss, d, &mut rows);
        let mut k = d;
        for i in 0..n {
            for j in i + 1..n {
                sym[i * n + j] = g[k];
                sym[j * n + i] = g[k];
                k += 1;
            }
        }
        K::combine(&sym[..n], &rows, gd);
        for (x, &pass) in gd.iter_mut().zip(&g[..d]) {
            *x += pass;
        }
        for (i, out) in gs.chunks_exact_mut(d).enumerate() {
            K::combine(&sym[(i + 1) * n..(i + 2) * n], &rows, out);
        }
    }
}

/// Element types the fused interaction runs on, with an AVX2 path for f32.
pub(super) trait InteractionElem: FloatElem {
    fn forward(args: Forward<'_, Self>) {
        forward_samples::<Self, Portable>(args)
    }
    fn backward(args: Backward<'_, Self>) {
        backward_samples::<Self, Portable>(args)
    }
}

impl InteractionElem for f64 {}

crate::multiversion!(
    fn forward_f32(args: Forward<'_, f32>) =>
        avx2: forward_samples::<f32, Avx2>, portable: forward_samples::<f32, Portable>
);

crate::multiversion!(
    fn backward_f32(args: Backward<'_, f32>) =>
        avx2: backward_samples::<f32, Avx2>, portable: backward_samples::<f32, Portable>
);

impl InteractionElem for f32 {
    fn forward(args: Forward<'_, f32>) {
        forward_f32(args)
    }
    fn backward(args: Backward<'_, f32>) {
        backward_f32(args)
    }
}

pub(super) fn run<T: InteractionElem>(
    dense: &Tensor,
    sparse: &Tensor,
    b: usize,
    n: usize,
    d: usize,
) -> Result<Vec<T>> {
    let width = d + n * (n - 1) / 2;
    dense.with_contiguous(|ds: &[T]| {
        sparse.with_contiguous(|ss: &[T]| {
            let mut out = vec![T::zero(); b * width];
            out.par_chunks_mut(width * SAMPLES_PER_TASK)
                .zip(ds.par_chunks(d * SAMPLES_PER_TASK))
                .zip(ss.par_chunks((n - 1) * d * SAMPLES_PER_TASK))
                .for_each(|((out, dense), sparse)| {
                    T::forward(Forward {
                        samples: Samples {
                            dense,
                            sparse,
                            n,
                            d,
                        },
                        out,
                    })
                });
            out
        })
    })?
}

type Grads<T> = (Vec<T>, Vec<T>);

pub(super) fn run_backward<T: InteractionElem>(
    saved: &super::SavedInputs,
    grad: &Tensor,
) -> Result<Grads<T>> {
    let (n, d) = (saved.n, saved.d);
    let f = n - 1;
    let b = saved.dense.shape()[0];
    let width = d + n * (n - 1) / 2;
    let chunk = SAMPLES_PER_TASK;
    let grads = saved.dense.with_contiguous(|ds: &[T]| {
        saved.sparse.with_contiguous(|ss: &[T]| {
            grad.with_contiguous(|gs: &[T]| {
                let mut gd = vec![T::zero(); b * d];
                let mut gsp = vec![T::zero(); b * f * d];
                gd.par_chunks_mut(d * chunk)
                    .zip(gsp.par_chunks_mut(f * d * chunk))
                    .zip(gs.par_chunks(width * chunk))
                    .zip(ds.par_chunks(d * chunk))
                    .zip(ss.par_chunks(f * d * chunk))
                    .for_each(|((((grad_dense, grad_sparse), grad_out), dense), sparse)| {
                        T::backward(Backward {
                            samples: Samples {
                                dense,
                                sparse,
                                n,
                                d,
                            },
                            grad_out,
                            grad_dense,
                            grad_sparse,
                        })
                    });
                (gd, gsp)
            })
        })
    })???;
    Ok(grads)
}
