//! Element types and the traits that tie Rust scalar types to them.

use half::{bf16, f16};

pub use crate::dtype::DType;

use super::storage::CpuStorage;
use crate::{Error, Result};

/// A Rust scalar type that can be stored in a tensor.
pub trait WithDType: Copy + Send + Sync + std::fmt::Debug + PartialOrd + Default + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Converts from f64 (rounding/saturating as `as` does for integers).
    fn from_f64(v: f64) -> Self;
    /// Converts to f64.
    fn to_f64(self) -> f64;
    /// Wraps a vector into CPU storage.
    fn into_storage(v: Vec<Self>) -> CpuStorage;
    /// Borrows the storage's buffer if it holds this type.
    fn slice(s: &CpuStorage) -> Option<&[Self]>;
    /// Mutably borrows the storage's buffer if it holds this type.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! with_dtype {
    ($t:ty, $variant:ident, $from:expr, $to:expr) => {
        impl WithDType for $t {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn into_storage(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$variant(v)
            }
            fn slice(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

with_dtype!(f32, F32, |v: f64| v as f32, |v: f32| v as f64);
with_dtype!(f64, F64, |v: f64| v, |v: f64| v);
with_dtype!(f16, F16, f16_from_f64, f16::to_f64);
with_dtype!(bf16, BF16, bf16_from_f64, bf16::to_f64);

/// `v` rounded to f32 by rounding to odd: truncated, with the last bit set when anything was
/// cut off. Rounding that to a format of at most 22 significant bits (f16, bf16) to nearest
/// gives the correctly rounded result of `v` itself, which rounding through `v as f32` (two
/// roundings) does not always. The CUDA kernels use the same steps (`kernels/prelude.cuh`).
fn f64_to_f32_round_odd(v: f64) -> f32 {
    let f = v as f32;
    if f as f64 == v || v.is_nan() {
        return f;
    }
    let mut bits = f.to_bits();
    if (f as f64).abs() > v.abs() {
        bits -= 1; // rounded away from zero: step back toward it
    }
    f32::from_bits(bits | 1)
}

/// `v` correctly rounded (to nearest, ties to even) to f16.
fn f16_from_f64(v: f64) -> f16 {
    f16::from_f32(f64_to_f32_round_odd(v))
}

/// `v` correctly rounded (to nearest, ties to even) to bf16.
fn bf16_from_f64(v: f64) -> bf16 {
    bf16::from_f32(f64_to_f32_round_odd(v))
}
with_dtype!(i64, I64, |v: f64| v as i64, |v: i64| v as f64);
with_dtype!(i32, I32, |v: f64| v as i32, |v: i32| v as f64);
with_dtype!(u8, U8, |v: f64| v as u8, |v: u8| v as f64);

/// Scalar types arithmetic runs in: f32, f64, and the integer types (for index math).
pub trait NumElem:
    WithDType
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::iter::Sum
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
    /// Smallest value (−∞ for floats), the identity of `max`.
    const MIN: Self;
    /// True for a float NaN (never for integers).
    fn is_nan_value(self) -> bool;
    /// `self + o`; integers wrap around (as the CUDA kernels do), never panic.
    fn add_wrap(self, o: Self) -> Self;
    /// `self − o`; integers wrap around.
    fn sub_wrap(self, o: Self) -> Self;
    /// `self · o`; integers wrap around.
    fn mul_wrap(self, o: Self) -> Self;
    /// `self / o`; integers wrap around (`MIN / −1 = MIN`); the caller rules out `o = 0`.
    fn div_wrap(self, o: Self) -> Self;
    /// The sum of `it` in order (floats as `Iterator::sum`; integers wrap around).
    fn sum_of(it: impl Iterator<Item = Self>) -> Self;
}

macro_rules! num_elem {
    (float $t:ty) => {
        impl NumElem for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const MIN: Self = <$t>::NEG_INFINITY;
            #[inline(always)]
            fn is_nan_value(self) -> bool {
                self.is_nan()
            }
            #[inline(always)]
            fn add_wrap(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn sub_wrap(self, o: Self) -> Self {
                self - o
            }
            #[inline(always)]
            fn mul_wrap(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn div_wrap(self, o: Self) -> Self {
                self / o
            }
            #[inline(always)]
            fn sum_of(it: impl Iterator<Item = Self>) -> Self {
                it.sum()
            }
        }
    };
    (int $t:ty) => {
        impl NumElem for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const MIN: Self = <$t>::MIN;
            #[inline(always)]
            fn is_nan_value(self) -> bool {
                false
            }
            #[inline(always)]
            fn add_wrap(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn sub_wrap(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn mul_wrap(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn div_wrap(self, o: Self) -> Self {
                self.wrapping_div(o)
            }
            #[inline(always)]
            fn sum_of(it: impl Iterator<Item = Self>) -> Self {
                it.fold(0, |a, b| a.wrapping_add(b))
            }
        }
    };
}
num_elem!(float f32);
num_elem!(float f64);
num_elem!(int i64);
num_elem!(int i32);
num_elem!(int u8);

/// Floating-point compute types (f32, f64).
pub trait FloatElem:
    NumElem + num_traits::Float + std::ops::AddAssign + std::ops::MulAssign
{
}
impl FloatElem for f32 {}
impl FloatElem for f64 {}

/// Checks that `dtype` is a floating-point dtype.
pub(crate) fn expect_float(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::UnsupportedDType {
            op,
            dtype,
            expected: "a floating-point dtype (f32, f64, f16, bf16)",
        })
    }
}
