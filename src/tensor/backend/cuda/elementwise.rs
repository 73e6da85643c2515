//! Element-wise kernels on a CUDA device: broadcasting arithmetic and comparisons, `where`, the
//! float functions of `ops/unary.rs` and their derivatives, and BCE with logits.

use super::super::{BinaryOp, CompareOp, Cuda, ElementwiseOps};
use super::{
    broadcast_meta, by_size, device_of, dtype_code, empty, expect_f32, float_kernel, float_kernels,
    Base, ELEMENTWISE, THREADS,
};
use crate::args;
use crate::cuda::LaunchConfig;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::device::same_device;
use crate::tensor::layout::broadcast_shapes;
use crate::tensor::ops::unary::UnaryFn;
use crate::Tensor;

/// The code of a float function in `kernels/elementwise.cu`, by the op's name.
fn unary_code(name: &'static str) -> Result<i32> {
    Ok(match name {
        "neg" => 0,
        "exp" => 1,
        "log" => 2,
        "sqrt" => 3,
        "abs" => 4,
        "relu" => 5,
        "tanh" => 6,
        "sigmoid" => 7,
        "gelu" => 8,
        "gelu_tanh" => 9,
        "affine" => 10,
        "pow" => 11,
        "clamp" => 12,
        _ => {
            return Err(Error::invalid(
                name,
                "this function has no CUDA kernel yet (move the tensor to the CPU)",
            ))
        }
    })
}

impl ElementwiseOps for Cuda {
    /// Broadcasting `a op b` of tensors of one dtype (the caller checks that they match): floats
    /// computed in f32, integers wrapping around, an integer division by zero an error (as on the
    /// CPU).
    fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let name = op.name();
        same_device(name, a, b)?;
        let kernel = match a.dtype() {
            DType::I64 => ELEMENTWISE.kernel("binary_strided_i64"),
            DType::I32 => ELEMENTWISE.kernel("binary_strided_i32"),
            DType::U8 => ELEMENTWISE.kernel("binary_strided_u8"),
            _ => float_kernel(name, a, float_kernels!("binary_strided"))?,
        };
        if op == BinaryOp::Div && !a.dtype().is_float() {
            // Integer division: find a zero divisor before dividing (reads the divisor back).
            let zero = Tensor::try_zeros(&[], b.dtype(), b.device())?;
            let zeros = Self::compare(CompareOp::Eq, b, &zero)?;
            let host = zeros.contiguous_values()?.to_vec::<u8>()?;
            if let Some(p) = host.iter().position(|&z| z != 0) {
                return Err(Error::invalid(
                    name,
                    format!("integer division by zero at position {p} of the divisor"),
                ));
            }
        }
        let shape = broadcast_shapes(name, a.shape(), b.shape())?;
        let dev = device_of(a)?;
        let out = empty(&dev, a.dtype(), &shape)?;
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(out);
        }
        let m = broadcast_meta(&dev, &shape, &[a, b])?;
        // The views lie inside their storages; the output holds n elements.
        dev.launch(
            kernel,
            LaunchConfig::linear(n, THREADS),
            &args![Base(a), Base(b), out, op as i32, n as i64, m],
        )?;
        Ok(out)
    }

    /// `a op b` as a u8 mask over broadcast operands of one dtype (any dtype).
    fn compare(op: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let name = op.name();
        same_device(name, a, b)?;
        let shape = broadcast_shapes(name, a.shape(), b.shape())?;
        let dev = device_of(a)?;
        let out = empty(&dev, DType::U8, &shape)?;
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(out);
        }
        let m = broadcast_meta(&dev, &shape, &[a, b])?;
        // The views lie inside their storages; the output holds n bytes.
        dev.launch(
            ELEMENTWISE.kernel("compare_strided"),
            LaunchConfig::linear(n, THREADS),
            &args![
                Base(a),
                Base(b),
                dtype_code(a.dtype()),
                out,
                op as i32,
                n as i64,
                m
            ],
        )?;
        Ok(out)
    }

    /// `cond ? a : b` broadcast to `shape` (cond u8; a and b of one dtype, any).
    fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
        same_device("where", cond, a)?;
        same_device("where", a, b)?;
        let dev = device_of(a)?;
        let out = empty(&dev, a.dtype(), shape)?;
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(out);
        }
        let m = broadcast_meta(&dev, shape, &[cond, a, b])?;
        let kernel = by_size(
            &ELEMENTWISE,
            ["where_b1", "where_b2", "where_b4", "where_b8"],
            a.dtype(),
        );
        // The views lie inside their storages; the output holds n elements.
        dev.launch(
            kernel,
            LaunchConfig::linear(n, THREADS),
            &args![Base(cond), Base(a), Base(b), out, n as i64, m],
        )?;
        Ok(out)
    }

    /// `f(x)` by the function's code and parameters in `kernels/elementwise.cu`.
    fn unary<F: UnaryFn>(f: &F, x: &Tensor) -> Result<Tensor> {
        let (name, p) = (F::NAME, f.params());
        let kernel = float_kernel(name, x, float_kernels!("unary_fn"))?;
        let code = unary_code(name)?;
        let x = x.contiguous_values()?;
        let dev = device_of(&x)?;
        let out = empty(&dev, x.dtype(), x.shape())?;
        let n = x.numel();
        if n > 0 {
            // Contiguous input and output of n elements.
            dev.launch(
                kernel,
                LaunchConfig::linear(n, THREADS),
                &args![x, out, code, p.0 as f32, p.1 as f32, n as i64],
            )?;
        }
        Ok(out)
    }

    /// `g · f'(x, y)` (all three of one float dtype).
    fn unary_backward<F: UnaryFn>(f: &F, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
        let (name, p) = (F::NAME, f.params());
        let code = unary_code(name)?;
        let kernel = float_kernel(name, x, float_kernels!("unary_backward"))?;
        for t in [y, g] {
            same_device(name, x, t)?;
            if t.dtype() != x.dtype() {
                return Err(Error::DTypeMismatch {
                    op: name,
                    lhs: x.dtype(),
                    rhs: t.dtype(),
                });
            }
        }
        let (x, y, g) = (
            x.contiguous_values()?,
            y.contiguous_values()?,
            g.contiguous_values()?,
        );
        let dev = device_of(&x)?;
        let out = empty(&dev, x.dtype(), x.shape())?;
        let n = x.numel();
        if n > 0 {
            // Contiguous inputs and output of n elements each.
            dev.launch(
                kernel,
                LaunchConfig::linear(n, THREADS),
                &args![x, y, g, out, code, p.0 as f32, p.1 as f32, n as i64],
            )?;
        }
        Ok(out)
    }

    /// Binary cross-entropy with logits per element and its derivative in `x` (f32).
    fn bce_with_logits(x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        const OP: &str = "bce_with_logits";
        expect_f32(OP, x)?;
        expect_f32(OP, y)?;
        same_device(OP, x, y)?;
        let (x, y) = (x.contiguous_values()?, y.contiguous_values()?);
        let dev = device_of(&x)?;
        let loss = empty(&dev, DType::F32, x.shape())?;
        let dx = empty(&dev, DType::F32, x.shape())?;
        let n = x.numel();
        if n > 0 {
            // Contiguous inputs and outputs of n elements each (the caller checked the shapes).
            dev.launch(
                ELEMENTWISE.kernel("bce_logits_f32"),
                LaunchConfig::linear(n, THREADS),
                &args![x, y, loss, dx, n as i64],
            )?;
        }
        Ok((loss, dx))
    }
}
