//! The general tensor core: [`Tensor`] with shared storage and strided views, dtypes, CPU
//! kernels, and reverse-mode autograd.

pub mod autograd;
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod layout;
pub mod ops;
pub mod rng;
pub mod storage;
#[allow(clippy::module_inception)]
mod tensor;
pub mod testing;

pub use autograd::{
    is_grad_enabled, no_grad, record_op, record_op_with_state, BackwardOp, Gradient, NoGradGuard,
    RowSparseGrad,
};
pub use cuda::CudaStorage;
pub use device::Device;
pub use dtype::{DType, FloatElem, NumElem, WithDType};
pub use layout::Layout;
pub use ops::loss::Reduction;
pub use storage::CpuStorage;
pub use tensor::Tensor;
