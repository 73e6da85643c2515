//! The CPU backend: the tensor core's value kernels over host memory, rayon-parallel above
//! [`PAR_THRESHOLD`](crate::tensor::ops::PAR_THRESHOLD) elements, f16/bf16 computed in f32.

mod copy;
mod elementwise;
mod index;
mod matmul;
pub(crate) use matmul::linear_into;
mod reduce;
mod rowwise;
