//! Reductions in host memory: sums over dimensions, the maximum along one with its index, and
//! softmax.

use super::super::{Cpu, ReduceOps};
use rayon::prelude::*;

use crate::error::Result;
use crate::tensor::dtype::{DType, FloatElem, NumElem, WithDType};
use crate::tensor::ops::reduce::split_at_dim;
use crate::tensor::ops::{float_compute, with_float, with_num, PAR_THRESHOLD};
use crate::Tensor;

/// Sums a contiguous `[outer, n, inner]` buffer over its middle dimension.
fn sum_middle<T: NumElem>(x: &[T], outer: usize, n: usize, inner: usize) -> Vec<T> {
    if inner == 1 {
        let row = |o: usize| T::sum_of(x[o * n..(o + 1) * n].iter().copied());
        if outer * n >= PAR_THRESHOLD && outer > 1 {
            return (0..outer).into_par_iter().map(row).collect();
        }
        if outer == 1 && n >= PAR_THRESHOLD {
            // One long row: fixed-size chunks keep the summation order deterministic.
            let partial: Vec<T> = x
                .par_chunks(PAR_THRESHOLD)
                .map(|c| T::sum_of(c.iter().copied()))
                .collect();
            return vec![T::sum_of(partial.into_iter())];
        }
        return (0..outer).map(row).collect();
    }
    let block = |o: usize, out: &mut [T]| {
        for k in 0..n {
            let src = &x[(o * n + k) * inner..(o * n + k + 1) * inner];
            out.iter_mut()
                .zip(src)
                .for_each(|(d, &s)| *d = d.add_wrap(s));
        }
    };
    if outer == 0 || inner == 0 {
        // An output of no elements (chunks of `inner` = 0 elements panicked).
        return Vec::new();
    }
    let mut out = vec![T::ZERO; outer * inner];
    if outer * n * inner >= PAR_THRESHOLD {
        if outer > 1 {
            out.par_chunks_mut(inner)
                .enumerate()
                .for_each(|(o, dst)| block(o, dst));
        } else {
            // Split the columns instead.
            let cols = inner.div_ceil(rayon::current_num_threads().max(1)).max(64);
            out.par_chunks_mut(cols).enumerate().for_each(|(ci, dst)| {
                let start = ci * cols;
                for k in 0..n {
                    let src = &x[k * inner + start..k * inner + start + dst.len()];
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(d, &s)| *d = d.add_wrap(s));
                }
            });
        }
    } else {
        for (o, dst) in out.chunks_mut(inner).enumerate() {
            block(o, dst);
        }
    }
    out
}

fn sum_one_dim(x: &Tensor, dim: usize) -> Result<Tensor> {
    let (outer, n, inner) = split_at_dim(x.shape(), dim);
    let mut shape = x.shape().to_vec();
    shape[dim] = 1;
    with_num!(x.dtype(), "sum", T => {
        let v = x.with_contiguous(|s: &[T]| sum_middle(s, outer, n, inner))?;
        Tensor::from_vec(v, &shape)
    })
}

fn softmax_kernel<T: FloatElem>(
    x: &[T],
    outer: usize,
    n: usize,
    inner: usize,
    log: bool,
) -> Vec<T> {
    if x.is_empty() {
        // No element (rows of 0 elements panicked in `chunks`).
        return Vec::new();
    }
    let mut out = vec![T::zero(); x.len()];
    if inner == 1 {
        // Along the last dimension: rows are contiguous, each one independent (in parallel
        // when the tensor is large enough).
        let row = |(src, dst): (&[T], &mut [T])| {
            let m = src.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
            let mut s = T::zero();
            for (d, &v) in dst.iter_mut().zip(src) {
                let e = (v - m).exp();
                *d = e;
                s += e;
            }
            if log {
                let ls = s.ln();
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d = v - m - ls;
                }
            } else {
                let inv = T::one() / s;
                for d in dst.iter_mut() {
                    *d *= inv;
                }
            }
        };
        if x.len() >= PAR_THRESHOLD && outer > 1 {
            x.par_chunks(n)
                .zip(out.par_chunks_mut(n))
                .with_min_len((PAR_THRESHOLD / n.max(1)).max(1))
                .for_each(row);
        } else {
            x.chunks(n).zip(out.chunks_mut(n)).for_each(row);
        }
        return out;
    }
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * n + k) * inner + i;
            let mut m = T::neg_infinity();
            for k in 0..n {
                m = m.max(x[at(k)]);
            }
            let mut s = T::zero();
            for k in 0..n {
                s += (x[at(k)] - m).exp();
            }
            let ls = s.ln();
            for k in 0..n {
                let z = x[at(k)] - m;
                out[at(k)] = if log { z - ls } else { z.exp() / s };
            }
        }
    }
    out
}

impl ReduceOps for Cpu {
    fn sum_dims(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        let (xc, storage) = if x.dtype().is_float() {
            float_compute("sum", x)?
        } else {
            (x.clone(), x.dtype())
        };
        let mut out = xc;
        for &d in dims.iter().rev() {
            out = sum_one_dim(&out, d)?;
        }
        if dims.is_empty() {
            out = out.contiguous_values()?;
        }
        out.cast_values(storage)
    }

    fn max_dim(x: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
        let (outer, n, inner) = split_at_dim(x.shape(), d);
        let (xc, storage) = if x.dtype().is_float() {
            float_compute("max", x)?
        } else {
            (x.clone(), x.dtype())
        };
        let (values, argmax) = with_num!(xc.dtype(), "max", T => {
            xc.with_contiguous(|s: &[T]| {
                let mut vals = Vec::with_capacity(outer * inner);
                let mut arg = Vec::with_capacity(outer * inner);
                for o in 0..outer {
                    for i in 0..inner {
                        let mut best = s[o * n * inner + i];
                        let mut bi = 0i64;
                        for k in 1..n {
                            let v = s[(o * n + k) * inner + i];
                            // NaN wins, as in PyTorch.
                            if v > best || (v.is_nan_value() && !best.is_nan_value()) {
                                best = v;
                                bi = k as i64;
                            }
                        }
                        vals.push(best);
                        arg.push(bi);
                    }
                }
                (T::into_storage(vals), arg)
            })?
        });
        let values = Tensor::from_storage(values, &[outer, inner])?.cast_values(storage)?;
        Ok((values, Tensor::from_vec(argmax, &[outer, inner])?))
    }

    fn max_dim_backward(
        g: &Tensor,
        indices: &Tensor,
        input_shape: &[usize],
        d: usize,
    ) -> Result<Tensor> {
        let (outer, n, inner) = split_at_dim(input_shape, d);
        let argmax = indices.to_vec::<i64>()?;
        let (gc, storage) = float_compute("max", g)?;
        let gx = with_float!(gc.dtype(), "max", T => {
            let mut gx = vec![T::ZERO; outer * n * inner];
            gc.with_contiguous(|gs: &[T]| {
                for o in 0..outer {
                    for i in 0..inner {
                        let k = argmax[o * inner + i] as usize;
                        gx[(o * n + k) * inner + i] = gs[o * inner + i];
                    }
                }
            })?;
            Tensor::from_vec(gx, input_shape)?
        });
        gx.cast_values(storage)
    }

    /// Along the last dimension of f32 tensors: one pass per row (in parallel over rows), the
    /// same formulas as the composed default without its intermediate tensors.
    fn softmax_backward(y: &Tensor, g: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        let f32s = y.dtype() == DType::F32 && g.dtype() == DType::F32;
        if !f32s || d + 1 != y.rank() || g.shape() != y.shape() {
            return crate::tensor::ops::softmax::softmax_backward_composed(y, g, d, log);
        }
        let n = y.shape()[d].max(1);
        let mut out = vec![0f32; y.numel()];
        y.with_contiguous(|ys: &[f32]| {
            g.with_contiguous(|gs: &[f32]| {
                let rows = (PAR_THRESHOLD / n).max(1);
                if ys.len() >= PAR_THRESHOLD && ys.len() > n {
                    (ys.par_chunks(rows * n).zip(gs.par_chunks(rows * n)))
                        .zip(out.par_chunks_mut(rows * n))
                        .for_each(|((y, g), out)| {
                            softmax_grad_rows(SoftmaxGradRows { y, g, out, n, log })
                        });
                } else {
                    softmax_grad_rows(SoftmaxGradRows {
                        y: ys,
                        g: gs,
                        out: &mut out,
                        n,
                        log,
                    });
                }
            })
        })??;
        Tensor::from_vec(out, y.shape())
    }

    fn softmax(x: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let (xc, storage) = float_compute(op, x)?;
        let (outer, n, inner) = split_at_dim(x.shape(), d);
        if xc.dtype() == DType::F32 && inner == 1 {
            let v = xc.with_contiguous(|s: &[f32]| softmax_last_f32(s, n, log))?;
            return Tensor::from_vec(v, x.shape())?.cast_values(storage);
        }
        with_float!(xc.dtype(), op, T => {
            let v = xc.with_contiguous(|s: &[T]| softmax_kernel(s, outer, n, inner, log))?;
            Tensor::from_vec(v, x.shape())?
        })
        .cast_values(storage)
    }
}

/// `eˣ` for f32 in straight-line arithmetic that vectorises (Cephes' `expf`: `x = n·ln 2 + r`
/// with `n` rounded by the 1.5·2²³ trick and `ln 2` in two parts, a degree-7 polynomial in `r`,
/// `2ⁿ` built in the exponent bits): within 2 ulp of the exact value for normal results, 0
/// below the smallest normal (`x < −87.34`), capped at `e^88.7` (no `+∞`), NaN kept.
/// Plain multiplies and adds, no fused ones, so every build computes the same bits.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOW: f32 = -87.336_55; // ln(2⁻¹²⁶)
    const HIGH: f32 = 88.7;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let c = x.clamp(LOW, HIGH);
    let t = c * std::f32::consts::LOG2_E + MAGIC;
    let k = t - MAGIC;
    let r = c - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2ⁿ for n in −126..=128 as two exact halves, each a normal float.
    let n = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let half = n >> 1;
    let low = f32::from_bits(((half + 127) << 23) as u32);
    let high = f32::from_bits(((n - half + 127) << 23) as u32);
    let e = y * low * high;
    if x < LOW {
        0.0
    } else {
        e
    }
}

/// Rows of an f32 softmax (or log-softmax) along the last dimension: `src` and `dst` hold
/// whole rows of `n`.
struct SoftmaxRows<'a> {
    src: &'a [f32],
    dst: &'a mut [f32],
    n: usize,
    log: bool,
}

/// Each row's maximum, `exp(x − max)` and their sum in eight lanes (added in a fixed order),
/// then the normalisation: the same arithmetic whichever build of [`softmax_rows`] runs.
#[inline(always)]
fn softmax_rows_body(a: SoftmaxRows<'_>) {
    for (src, dst) in a.src.chunks_exact(a.n).zip(a.dst.chunks_exact_mut(a.n)) {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let s8 = src.chunks_exact(8);
        let tail = s8.remainder();
        for c in s8 {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l = if v > *l { v } else { *l };
            }
        }
        for (l, &v) in lanes.iter_mut().zip(tail) {
            *l = if v > *l { v } else { *l };
        }
        let m = lanes
            .iter()
            .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
        let mut sums = [0f32; 8];
        let mut d8 = dst.chunks_exact_mut(8);
        let s8 = src.chunks_exact(8);
        let tail = s8.remainder();
        for (d, s) in (&mut d8).zip(s8) {
            let s: &[f32; 8] = s.try_into().expect("8 values");
            let e: [f32; 8] = std::array::from_fn(|i| exp_f32(s[i] - m));
            d.copy_from_slice(&e);
            for i in 0..8 {
                sums[i] += e[i];
            }
        }
        for ((d, &v), sum) in d8
            .into_remainder()
            .iter_mut()
            .zip(tail)
            .zip(sums.iter_mut())
        {
            *d = exp_f32(v - m);
            *sum += *d;
        }
        let s: f32 = sums.iter().sum();
        if a.log {
            let shift = m + s.ln();
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = v - shift;
            }
        } else {
            let inv = 1.0 / s;
            for d in dst.iter_mut() {
                *d *= inv;
            }
        }
    }
}

crate::multiversion!(
    fn softmax_rows(args: SoftmaxRows<'_>) => softmax_rows_body
);

/// f32 softmax along the last dimension (`x` contiguous, rows of `n`), rows in parallel when
/// the tensor is large enough.
fn softmax_last_f32(x: &[f32], n: usize, log: bool) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    if n == 0 {
        return out;
    }
    let rows = (PAR_THRESHOLD / n).max(1);
    if x.len() >= PAR_THRESHOLD && x.len() > n {
        x.par_chunks(rows * n)
            .zip(out.par_chunks_mut(rows * n))
            .for_each(|(src, dst)| softmax_rows(SoftmaxRows { src, dst, n, log }));
    } else {
        softmax_rows(SoftmaxRows {
            src: x,
            dst: &mut out,
            n,
            log,
        });
    }
    out
}

/// Rows of an f32 softmax's backward: the forward's output `y` (log-probabilities for a
/// log-softmax), the output gradient `g`, rows of `n`.
struct SoftmaxGradRows<'a> {
    y: &'a [f32],
    g: &'a [f32],
    out: &'a mut [f32],
    n: usize,
    log: bool,
}

/// `g − softmax·Σg` (log-softmax) or `y ⊙ (g − Σ g⊙y)` (softmax) per row, the sums in eight
/// lanes added in a fixed order.
#[inline(always)]
fn softmax_grad_rows_body(a: SoftmaxGradRows<'_>) {
    let n = a.n;
    for ((y, g), out) in
        (a.y.chunks_exact(n).zip(a.g.chunks_exact(n))).zip(a.out.chunks_exact_mut(n))
    {
        let mut lanes = [0f32; 8];
        let (y8, g8) = (y.chunks_exact(8), g.chunks_exact(8));
        let (yt, gt) = (y8.remainder(), g8.remainder());
        for (y, g) in y8.zip(g8) {
            for ((l, &y), &g) in lanes.iter_mut().zip(y).zip(g) {
                *l += if a.log { g } else { g * y };
            }
        }
        for ((l, &y), &g) in lanes.iter_mut().zip(yt).zip(gt) {
            *l += if a.log { g } else { g * y };
        }
        let sum: f32 = lanes.iter().sum();
        let grad = |y: f32, g: f32| {
            if a.log {
                g - exp_f32(y) * sum
            } else {
                y * (g - sum)
            }
        };
        let mut o8 = out.chunks_exact_mut(8);
        for ((o, y), g) in (&mut o8).zip(y.chunks_exact(8)).zip(g.chunks_exact(8)) {
            let (y, g): (&[f32; 8], &[f32; 8]) =
                (y.try_into().expect("8"), g.try_into().expect("8"));
            let v: [f32; 8] = std::array::from_fn(|i| grad(y[i], g[i]));
            o.copy_from_slice(&v);
        }
        for ((o, &y), &g) in o8.into_remainder().iter_mut().zip(yt).zip(gt) {
            *o = grad(y, g);
        }
    }
}

crate::multiversion!(
    fn softmax_grad_rows(args: SoftmaxGradRows<'_>) => softmax_grad_rows_body
);

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_f32` against f64's `exp` on a dense sweep of its whole range: within 2 ulp (relative
    /// 2.4e-7) where the result is normal, 0 below, NaN kept; and the softmax rows built on it
    /// against an f64 softmax, both builds giving the same bits.
    #[test]
    fn exp_f32_is_within_two_ulp_and_softmax_rows_match_f64() {
        let mut worst = 0f64;
        let mut x = -87.33f32;
        while x < 88.7 {
            let exact = f64::from(x).exp();
            let got = f64::from(exp_f32(x));
            worst = worst.max(((got - exact) / exact).abs());
            x += 0.000_37;
        }
        assert!(worst <= 2.4e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(-88.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(0.0), 1.0);

        let n = 37;
        let x: Vec<f32> = (0..5 * n)
            .map(|i| ((i * 7919) % 101) as f32 * 0.37 - 18.0)
            .collect();
        for log in [false, true] {
            let got = softmax_last_f32(&x, n, log);
            let mut portable = vec![0f32; x.len()];
            softmax_rows_body(SoftmaxRows {
                src: &x,
                dst: &mut portable,
                n,
                log,
            });
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                portable.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            for (row, out) in x.chunks_exact(n).zip(got.chunks_exact(n)) {
                let m = row
                    .iter()
                    .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
                let s: f64 = row.iter().map(|&v| (f64::from(v) - m).exp()).sum();
                for (&v, &o) in row.iter().zip(out) {
                    let p = (f64::from(v) - m).exp() / s;
                    let want = if log { p.ln() } else { p };
                    assert!(
                        (f64::from(o) - want).abs() <= 1e-6 * want.abs().max(1.0),
                        "log {log}: {o} vs {want}"
                    );
                }
            }
        }
    }
}
