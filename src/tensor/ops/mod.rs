//! The tensor core's ops, one family per file: each op checks its arguments, computes its
//! values on its operands' device (through [`backend`](super::backend)) and records its
//! backward beside it. The helpers here serve the CPU kernels (here and in other modules).

pub mod binary;
pub mod cast;
pub mod concat;
pub mod device;
pub mod index;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod reduce;
pub mod softmax;
pub mod unary;
pub mod view;

use rayon::prelude::*;

use super::dtype::{expect_float, DType};
use super::Tensor;
use crate::Result;

/// Element count above which elementwise kernels split work across rayon threads.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

/// Binds the type alias `$T` to the Rust float type of `$dtype` (f32 or f64) inside `$body`.
macro_rules! with_float {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                #[allow(dead_code)]
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                #[allow(dead_code)]
                type $T = f64;
                $body
            }
            d => {
                return Err($crate::Error::UnsupportedDType {
                    op: $op,
                    dtype: d,
                    expected: "f32 or f64 (f16/bf16 compute in f32)",
                })
            }
        }
    };
}
pub(crate) use with_float;

/// Binds `$T` to the Rust type of any numeric compute dtype (f32, f64, i64, i32, u8).
macro_rules! with_num {
    ($dtype:expr, $op:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            d => {
                return Err($crate::Error::UnsupportedDType {
                    op: $op,
                    dtype: d,
                    expected: "a compute dtype",
                })
            }
        }
    };
}
pub(crate) use with_num;

/// Binds `$T` to the Rust element type of any dtype (copy-only kernels work on all of them).
macro_rules! with_any_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
        }
    };
}
pub(crate) use with_any_dtype;

/// Values of a float tensor in its compute dtype (f16/bf16 widened to f32), plus the dtype
/// results must be stored in.
pub(crate) fn float_compute(op: &'static str, t: &Tensor) -> Result<(Tensor, DType)> {
    expect_float(op, t.dtype())?;
    let storage = t.dtype();
    Ok((t.cast_values(storage.compute_dtype())?, storage))
}

/// Maps a slice elementwise, in parallel when it is large.
pub(crate) fn par_map<T: Copy + Send + Sync, U: Send>(
    src: &[T],
    f: impl Fn(T) -> U + Sync + Send,
) -> Vec<U> {
    if src.len() >= PAR_THRESHOLD {
        src.par_iter().map(|&x| f(x)).collect()
    } else {
        src.iter().map(|&x| f(x)).collect()
    }
}

/// Zips two equal-length slices elementwise, in parallel when they are large.
pub(crate) fn par_zip<A: Copy + Send + Sync, B: Copy + Send + Sync, U: Send>(
    a: &[A],
    b: &[B],
    f: impl Fn(A, B) -> U + Sync + Send,
) -> Vec<U> {
    debug_assert_eq!(a.len(), b.len());
    if a.len() >= PAR_THRESHOLD {
        a.par_iter()
            .zip(b.par_iter())
            .map(|(&x, &y)| f(x, y))
            .collect()
    } else {
        a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
    }
}
