//! The general tensor core: [`Tensor`] with shared storage and strided views, dtypes, the ops
//! with their gradients (`ops`), reverse-mode autograd, and the backends that compute the ops'
//! values on each device (`backend`: CPU and CUDA side by side).

pub mod autograd;
pub mod backend;
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
pub use backend::{run_on, CudaStorage, DeviceOp};
pub use device::Device;
pub use dtype::{DType, FloatElem, NumElem, WithDType};
pub use layout::Layout;
pub use ops::loss::Reduction;
pub use ops::matmul::{is_row_invariant, row_invariant};
pub use storage::CpuStorage;
pub use tensor::Tensor;
