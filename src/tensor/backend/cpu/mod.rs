//! The CPU backend: the tensor core's value kernels over host memory, rayon-parallel above
//! [`PAR_THRESHOLD`](crate::tensor::ops::PAR_THRESHOLD) elements, f16/bf16 computed in f32.

mod copy;
mod elementwise;
mod index;
mod matmul;
mod reduce;

use super::{Backend, BinaryOp, CompareOp, Cpu};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::ops::unary::UnaryFn;
use crate::Tensor;

impl Backend for Cpu {
    fn full(value: f64, shape: &[usize], dtype: DType, _device: Device) -> Result<Tensor> {
        Ok(copy::full(value, shape, dtype))
    }
    fn contiguous(t: &Tensor) -> Result<Tensor> {
        copy::contiguous(t)
    }
    fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
        copy::cast(t, dtype)
    }
    fn to_host(t: &Tensor) -> Result<Tensor> {
        Ok(t.detach())
    }
    fn from_host(host: &Tensor, _device: Device) -> Result<Tensor> {
        Ok(host.detach())
    }
    fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
        copy::copy_into(dst, src)
    }
    fn cat(parts: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
        copy::cat(parts, dim, shape)
    }

    fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        elementwise::binary(op, a, b)
    }
    fn compare(op: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        elementwise::compare(op, a, b)
    }
    fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
        elementwise::where_cond(cond, a, b, shape)
    }
    fn unary<F: UnaryFn>(f: &F, x: &Tensor) -> Result<Tensor> {
        elementwise::unary(f, x)
    }
    fn unary_backward<F: UnaryFn>(f: &F, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
        elementwise::unary_backward(f, x, y, g)
    }
    fn bce_with_logits(x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
        elementwise::bce_with_logits(x, y)
    }

    fn sum_dims(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        reduce::sum_dims(x, dims)
    }
    fn max_dim(x: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
        reduce::max_dim(x, d)
    }
    fn max_dim_backward(
        g: &Tensor,
        indices: &Tensor,
        input_shape: &[usize],
        d: usize,
    ) -> Result<Tensor> {
        reduce::max_dim_backward(g, indices, input_shape, d)
    }
    fn softmax(x: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        reduce::softmax(x, d, log)
    }

    fn index_select(t: &Tensor, rows: &[usize], shape: &[usize]) -> Result<Tensor> {
        index::index_select(t, rows, shape)
    }
    fn take(src: &Tensor, sources: &[usize], shape: &[usize]) -> Result<Tensor> {
        index::take(src, sources, shape)
    }
    fn put_add(g: &Tensor, targets: &[usize], shape: &[usize]) -> Result<Tensor> {
        index::put_add(g, targets, shape)
    }
    fn index_add_rows(t: &Tensor, rows: &[usize], values: &Tensor) -> Result<Tensor> {
        index::index_add_rows(t, rows, values)
    }

    fn matmul(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
        matmul::matmul(a, b, batch)
    }
    fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        matmul::linear(x, w, bias)
    }
}
