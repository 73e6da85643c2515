//! Matrix products on a CUDA device through cuBLAS (the emulation's plain loop elsewhere): f32
//! (TF32 when the device allows it) and f16/bf16 with f32 accumulation, one rounding of each
//! result.

use super::super::{Cuda, MatmulOps};
use super::{device_of, empty, expect_float_kernel_dtype, zeroed};
use crate::cuda::Gemm;
use crate::error::Result;
use crate::tensor::device::same_device;
use crate::Tensor;

impl MatmulOps for Cuda {
    /// `a · b` over the last two dimensions with broadcast batch dimensions `batch`; the operands
    /// have one float dtype (the caller checks).
    fn matmul(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
        same_device("matmul", a, b)?;
        let dtype = a.dtype();
        expect_float_kernel_dtype("matmul", a)?;
        let (ar, br) = (a.rank(), b.rank());
        let (m, k, n) = (a.shape()[ar - 2], a.shape()[ar - 1], b.shape()[br - 1]);
        let nb: usize = batch.iter().product();
        // An operand without batch dimensions is shared by every product (stride 0); otherwise it
        // is expanded to the full batch and made contiguous.
        let operand = |t: &Tensor, rows: usize, cols: usize| -> Result<(Tensor, usize)> {
            if t.rank() == 2 {
                return Ok((t.contiguous_values()?, 0));
            }
            let mut full = batch.to_vec();
            full.extend([rows, cols]);
            Ok((t.expand(&full)?.detach().contiguous_values()?, rows * cols))
        };
        let (ac, stride_a) = operand(a, m, k)?;
        let (bc, stride_b) = operand(b, k, n)?;
        let mut shape = batch.to_vec();
        shape.extend([m, n]);
        let dev = device_of(&ac)?;
        if k == 0 {
            // An empty inner dimension: the product is all zeros.
            return zeroed(&dev, dtype, &shape);
        }
        let out = empty(&dev, dtype, &shape)?;
        dev.gemm(&Gemm {
            dtype,
            batch: nb,
            m,
            n,
            k,
            a: &ac,
            stride_a,
            b: &bc,
            stride_b,
            c: &out,
        })?;
        Ok(out)
    }

    /// `x · wᵀ + bias` (x `[rows, in]`, w `[out, in]`): the product, then the broadcast bias.
    fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let out = Self::matmul(x, &w.detach().t()?, &[])?;
        match bias {
            Some(b) => crate::no_grad(|| out.add(&b.detach())),
            None => Ok(out),
        }
    }

    /// cuBLAS picks its algorithm by shape, so on a device this is the plain
    /// [`linear`](Self::linear): row invariance is a CPU promise only.
    fn linear_row_invariant(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        Self::linear(x, w, bias)
    }
}
