//! Conversions between dtypes. Float↔float casts are differentiable (the gradient is cast
//! back), which is how bf16/f16 storage with f32 accumulation is expressed.

use half::{bf16, f16};

use crate::tensor::autograd::{record_op, BackwardOp, Gradient};
use crate::tensor::dtype::WithDType;
use crate::tensor::storage::CpuStorage;
use crate::{DType, Result, Tensor};

/// Converts a vector to `dtype` (rounding to nearest for floats; for integers truncating
/// toward zero and saturating as Rust's `as` does, NaN to 0: the cast every device computes
/// alike, bit for bit).
pub(crate) fn cast_vec<T: WithDType>(v: &[T], dtype: DType) -> CpuStorage {
    fn conv<T: WithDType, U: WithDType>(v: &[T], f: impl Fn(f64) -> U) -> Vec<U> {
        v.iter().map(|x| f(x.to_f64())).collect()
    }
    // Widening to f64 is exact, so each conversion below rounds exactly once.
    match dtype {
        DType::F32 => CpuStorage::F32(conv(v, |x| x as f32)),
        DType::F64 => CpuStorage::F64(conv(v, |x| x)),
        DType::F16 => CpuStorage::F16(conv(v, <f16 as WithDType>::from_f64)),
        DType::BF16 => CpuStorage::BF16(conv(v, <bf16 as WithDType>::from_f64)),
        DType::I64 => CpuStorage::I64(conv(v, |x| x as i64)),
        DType::I32 => CpuStorage::I32(conv(v, |x| x as i32)),
        DType::U8 => CpuStorage::U8(conv(v, |x| x as u8)),
    }
}

struct CastBackward {
    from: DType,
}

impl BackwardOp for CastBackward {
    fn name(&self) -> &'static str {
        "to_dtype"
    }
    fn backward(&self, g: &Tensor) -> Result<Vec<Option<Gradient>>> {
        Ok(vec![Some(Gradient::Dense(g.cast_values(self.from)?))])
    }
}

impl Tensor {
    /// Converts to `dtype`. Differentiable between float dtypes.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        let out = self.cast_values(dtype)?;
        if self.dtype().is_float() && dtype.is_float() {
            Ok(record_op(out, &[self], CastBackward { from: self.dtype() }))
        } else {
            Ok(out)
        }
    }
}
