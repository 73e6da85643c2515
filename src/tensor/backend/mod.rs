//! The one place a tensor op picks its device.
//!
//! Crate-internal traits list the value kernels the tensor core needs, one op family each —
//! copies and casts, elementwise arithmetic, reductions, indexing, matrix products — and
//! `Cpu` (`backend/cpu/<family>.rs`) and `Cuda` (`backend/cuda/<family>.rs`) each implement
//! every family. An op in
//! `tensor/ops` checks its arguments, picks the backend of its operands' device with
//! `with_backend!` and records its autograd node; it never branches on the
//! device itself. The backends compute values only (no autograd).
//!
//! Ops outside the tensor core (the TBE, jagged ops, DLRM's interaction, optimizer steps)
//! implement [`DeviceOp`]: a CPU half and a CUDA half side by side in the op's own folder,
//! dispatched by [`run_on`].

pub(crate) mod cpu;
pub(crate) mod cuda;

use std::sync::Arc;

pub use cuda::CudaStorage;

use super::ops::unary::UnaryFn;
use crate::cuda::CudaDevice;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::Result;
use crate::Tensor;

/// The CPU backend (rayon-parallel kernels over host memory).
pub(crate) struct Cpu;

/// The CUDA backend (kernels of `kernels/` and cuBLAS on a [`CudaDevice`]).
pub(crate) struct Cuda;

/// Binds `$B` to the backend of `$device` ([`Cpu`] or [`Cuda`]) inside `$body`:
/// `with_backend!(a.device(), B => B::binary(op, a, b))`.
macro_rules! with_backend {
    ($device:expr, $B:ident => $body:expr) => {
        match $device {
            $crate::device::Device::Cpu => {
                type $B = $crate::tensor::backend::Cpu;
                $body
            }
            $crate::device::Device::Cuda(_) => {
                type $B = $crate::tensor::backend::Cuda;
                $body
            }
        }
    };
}
pub(crate) use with_backend;

/// The elementwise arithmetic ops (the discriminants are the op codes of
/// `binary_strided_*` in `kernels/elementwise.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinaryOp {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
    Maximum = 4,
    Minimum = 5,
}

impl BinaryOp {
    /// The op's name in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

/// Comparison predicates producing u8 masks (the discriminants are the codes of
/// `compare_strided` in `kernels/elementwise.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CompareOp {
    Eq = 0,
    Lt = 1,
    Le = 2,
    Gt = 3,
    Ge = 4,
}

impl CompareOp {
    /// The op's name in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CompareOp::Eq => "eq",
            CompareOp::Lt => "lt",
            CompareOp::Le => "le",
            CompareOp::Gt => "gt",
            CompareOp::Ge => "ge",
        }
    }

    /// The predicate on values widened to f64.
    pub(crate) fn holds(self, x: f64, y: f64) -> bool {
        match self {
            CompareOp::Eq => x == y,
            CompareOp::Lt => x < y,
            CompareOp::Le => x <= y,
            CompareOp::Gt => x > y,
            CompareOp::Ge => x >= y,
        }
    }
}

// The value kernels of the tensor core, one family per trait and file (`cpu/<family>.rs`,
// `cuda/<family>.rs`). Arguments are checked by the op that calls them (dtypes agree, shapes
// fit, indices in range, operands on this backend's device); results are new contiguous
// tensors without autograd history.

/// Creation, host↔device moves, copies, casts and concatenation.
pub(crate) trait CopyOps {
    /// A tensor of `shape` filled with `value` converted to `dtype`, on `device`.
    fn full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor>;
    /// A contiguous copy of `t`'s view, starting at element 0 of its own storage.
    fn contiguous(t: &Tensor) -> Result<Tensor>;
    /// `t`'s values converted to `dtype` (as `to_dtype` converts them on the CPU).
    fn cast(t: &Tensor, dtype: DType) -> Result<Tensor>;
    /// `t`'s values in host memory.
    fn to_host(t: &Tensor) -> Result<Tensor>;
    /// Host values `host` on `device` (a device of this backend).
    fn from_host(host: &Tensor, device: Device) -> Result<Tensor>;
    /// Overwrites `dst` (contiguous) with `src`'s values (same shape, any device and dtype).
    fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()>;
    /// Concatenation of `parts` (one dtype and device) along `dim` into a tensor of `shape`.
    fn cat(parts: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor>;
}

/// Elementwise arithmetic, comparisons, selection, the float functions and BCE.
pub(crate) trait ElementwiseOps {
    /// `a op b`, broadcasting, one dtype: floats computed in their compute dtype, integers
    /// wrapping; an integer division by zero is an error.
    fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `a op b` as a u8 mask, broadcasting, one dtype.
    fn compare(op: CompareOp, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `cond ? a : b` broadcast to `shape` (`cond` u8; `a`, `b` of one dtype).
    fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor>;
    /// `f(x)` elementwise (float dtypes).
    fn unary<F: UnaryFn>(f: &F, x: &Tensor) -> Result<Tensor>;
    /// `g · f'(x, y)` elementwise, `y = f(x)`.
    fn unary_backward<F: UnaryFn>(f: &F, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor>;
    /// Binary cross-entropy with logits per element and its derivative in `x`.
    fn bce_with_logits(x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)>;
}

/// Reductions along dimensions.
pub(crate) trait ReduceOps {
    /// Sum over `dims` (sorted, distinct), kept as size 1.
    fn sum_dims(x: &Tensor, dims: &[usize]) -> Result<Tensor>;
    /// Maximum along dimension `d` (not empty) and the index of its first occurrence (NaN
    /// wins), both shaped `[outer, inner]`.
    fn max_dim(x: &Tensor, d: usize) -> Result<(Tensor, Tensor)>;
    /// `g` (`[outer, inner]`) placed at the maxima `indices` of a zero tensor of
    /// `input_shape`.
    fn max_dim_backward(
        g: &Tensor,
        indices: &Tensor,
        input_shape: &[usize],
        d: usize,
    ) -> Result<Tensor>;
    /// softmax (or log_softmax) along dimension `d`.
    fn softmax(x: &Tensor, d: usize, log: bool) -> Result<Tensor>;
    /// The gradient of softmax (or log_softmax) along `d` from its output `y` and the output
    /// gradient `g`; by default composed of tensor ops.
    fn softmax_backward(y: &Tensor, g: &Tensor, d: usize, log: bool) -> Result<Tensor> {
        crate::tensor::ops::softmax::softmax_backward_composed(y, g, d, log)
    }
}

/// Row and element indexing.
pub(crate) trait IndexOps {
    /// Rows `rows` (in range) of `t`, shaped `shape`.
    fn index_select(t: &Tensor, rows: &[usize], shape: &[usize]) -> Result<Tensor>;
    /// `out[i] = src[sources[i]]` over `src`'s contiguous values (offsets in range), shaped
    /// `shape`.
    fn take(src: &Tensor, sources: &[usize], shape: &[usize]) -> Result<Tensor>;
    /// The adjoint of [`take`](IndexOps::take): zeros of `shape` with `g[p]` added at
    /// `targets[p]`, repeats summed in position order.
    fn put_add(g: &Tensor, targets: &[usize], shape: &[usize]) -> Result<Tensor>;
    /// A copy of `t` with `values[i]` added to row `rows[i]` (in range), repeats in order.
    fn index_add_rows(t: &Tensor, rows: &[usize], values: &Tensor) -> Result<Tensor>;
}

/// Matrix products.
pub(crate) trait MatmulOps {
    /// `a · b` over the last two dimensions, batch dimensions broadcast to `batch` (shapes
    /// and dtypes checked).
    fn matmul(a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor>;
    /// `x · wᵀ + bias` for `x` `[rows, in]`, `w` `[out, in]`, `bias` `[out]`.
    fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;
    /// [`linear`](Self::linear) with each output element summed in an order that depends
    /// only on its own input row (see [`row_invariant`](crate::tensor::row_invariant)).
    fn linear_row_invariant(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;
}

/// An operation with a CPU half and a CUDA half, written side by side in the op's own folder
/// (`mod.rs` the op, `cpu.rs` and `cuda.rs` its halves); [`run_on`] picks the half.
pub trait DeviceOp {
    /// What the op returns.
    type Output;
    /// The CPU half.
    fn cpu(&self) -> Result<Self::Output>;
    /// The CUDA half, on the open device.
    fn cuda(&self, device: &Arc<CudaDevice>) -> Result<Self::Output>;
}

/// Runs `op` on `device`: its CPU half, or its CUDA half on the opened device.
pub fn run_on<O: DeviceOp + ?Sized>(device: Device, op: &O) -> Result<O::Output> {
    match device {
        Device::Cpu => op.cpu(),
        Device::Cuda(_) => op.cuda(&crate::cuda::open(device)?),
    }
}
