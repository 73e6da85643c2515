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
pub(crate) use tensor::{addressable_bytes, checked_numel, checked_sum};
pub mod testing;

pub use autograd::{
    is_grad_enabled, no_grad, record_op, record_op_with_state, BackwardOp, Gradient, NoGradGuard,
    RowSparseGrad, SavedTensor,
};
pub use backend::{run_on, CudaStorage, DeviceOp};
pub use device::Device;
pub use dtype::{DType, FloatElem, NumElem, WithDType};
pub use layout::Layout;
pub use ops::loss::Reduction;
pub use ops::matmul::{is_row_invariant, row_invariant};
pub use storage::{keep_freed_host_memory, CpuStorage};
pub use tensor::Tensor;

/// Runs `f` on a thread of rayon's pool (directly when already on one), with this thread's
/// autograd and row-invariance modes. A whole training step run this way makes every parallel
/// op inside it start from a pool thread, so the calling thread does not sleep and wake once
/// per op (on few cores that round trip costs more than small ops themselves). The modes are
/// set explicitly on the pool thread, and restored after: a pool thread waiting inside one
/// job may run another (work stealing), whose modes are not the waiting job's.
pub fn on_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let grad = autograd::is_grad_enabled();
    let rows = is_row_invariant();
    let run =
        move || autograd::with_grad_enabled(grad, || ops::matmul::with_row_invariant(rows, f));
    if rayon::current_thread_index().is_some() {
        return run();
    }
    rayon::scope(move |_| run())
}
