//! The CUDA backend: tensor storage in device memory and the tensor core's value kernels on a
//! [`CudaDevice`] — strided copies and casts, arithmetic for every dtype (integers wrap around),
//! comparisons, `where`, and for f32, f16 and bf16 (computed in f32, rounded once, as on the
//! CPU) the float functions and their derivatives, sums, maxima, softmax, gathers and matrix
//! products (cuBLAS). Kernels come from `kernels/elementwise.cu` and `kernels/index.cu`.

mod copy;
mod elementwise;
mod index;
mod matmul;
mod reduce;

use std::sync::Arc;

use crate::cuda::{CudaDevice, DeviceBuffer, DeviceOperand, Kernel, KernelSource};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::storage::Storage;
use crate::Tensor;

pub(crate) use copy::copy_elements;

crate::kernel_source!(
    /// The tensor core's element-wise, reduction and gather kernels.
    pub(crate) static ELEMENTWISE = "elementwise.cu",
    [
        "gather_b1", "gather_b2", "gather_b4", "gather_b8",
        "scatter_b1", "scatter_b2", "scatter_b4", "scatter_b8",
        "binary_strided_f32", "binary_strided_f16", "binary_strided_bf16",
        "binary_strided_i64", "binary_strided_i32", "binary_strided_u8",
        "unary_fn_f32", "unary_fn_f16", "unary_fn_bf16",
        "unary_backward_f32", "unary_backward_f16", "unary_backward_bf16",
        "sum_middle_f32", "sum_middle_f16", "sum_middle_bf16",
        "sum_middle_i64", "sum_middle_i32", "sum_middle_u8",
        "sum_rows_f32", "sum_rows_f16", "sum_rows_bf16",
        "softmax_rows_f32", "softmax_rows_f16", "softmax_rows_bf16",
        "max_rows_f32", "max_rows_f16", "max_rows_bf16",
        "cast_strided", "compare_strided",
        "where_b1", "where_b2", "where_b4", "where_b8",
        "softmax_middle_f32", "softmax_middle_f16", "softmax_middle_bf16",
        "max_middle_f32", "max_middle_f16", "max_middle_bf16",
        "max_middle_backward_f32", "max_middle_backward_f16", "max_middle_backward_bf16",
        "take_b1", "take_b2", "take_b4", "take_b8",
        "put_add_sorted_f32", "put_add_sorted_f16", "put_add_sorted_bf16",
        "bce_logits_f32",
    ];
);

crate::kernel_source!(
    /// Row indexing of contiguous `[rows, row_len]` buffers.
    pub(crate) static INDEX = "index.cu",
    [
        "index_select_b1", "index_select_b2", "index_select_b4", "index_select_b8",
        "index_add_rows_f32",
    ];
);

/// Threads per block of the element-wise launches.
const THREADS: u32 = 256;

/// A tensor's storage in device memory: raw bytes of `len` elements of `dtype`.
pub struct CudaStorage {
    pub(crate) buffer: DeviceBuffer<u8>,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStorage(cuda:{}, {:?} x {})",
            self.buffer.device().ordinal(),
            self.dtype,
            self.len
        )
    }
}

impl CudaStorage {
    /// The device holding the storage.
    pub fn device(&self) -> &Arc<CudaDevice> {
        self.buffer.device()
    }
}

/// A CUDA tensor's view as a kernel operand: the address of its first element.
impl DeviceOperand for Tensor {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        let (base, bytes) = Base(self).device_span(device)?;
        let offset = self.layout().offset() * self.dtype().size_in_bytes();
        Ok((base + offset as u64, bytes.saturating_sub(offset)))
    }
}

/// A CUDA tensor's whole storage as a kernel operand (element 0 of the storage): the strided
/// kernels find the view inside it from their `meta`.
pub(crate) struct Base<'a>(pub &'a Tensor);

impl DeviceOperand for Base<'_> {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        match &*self.0.storage_read() {
            Storage::Cuda(s) => s.buffer.device_span(device),
            Storage::Cpu(_) => Err(Error::DeviceMismatch {
                op: "kernel launch",
                lhs: Device::Cuda(device.ordinal()),
                rhs: Device::Cpu,
            }),
        }
    }
}

/// The open device holding a CUDA tensor.
pub(crate) fn device_of(t: &Tensor) -> Result<Arc<CudaDevice>> {
    match &*t.storage_read() {
        Storage::Cuda(s) => Ok(s.device().clone()),
        Storage::Cpu(_) => Err(Error::invalid("cuda", "the tensor is on the CPU")),
    }
}

/// A new uninitialised contiguous tensor on `device`.
pub(crate) fn empty(device: &Arc<CudaDevice>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let len: usize = shape.iter().product();
    let buffer = device.alloc::<u8>(len * dtype.size_in_bytes())?;
    Ok(Tensor::from_cuda(CudaStorage { buffer, dtype, len }, shape))
}

/// A new contiguous tensor of zeros on `device`.
pub(crate) fn zeroed(device: &Arc<CudaDevice>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let len: usize = shape.iter().product();
    let buffer = device.zeros::<u8>(len * dtype.size_in_bytes())?;
    Ok(Tensor::from_cuda(CudaStorage { buffer, dtype, len }, shape))
}

/// A contiguous tensor of `shape` over a device buffer holding exactly its values.
pub(crate) fn from_buffer<T: crate::cuda::DeviceElem + crate::tensor::WithDType>(
    buffer: DeviceBuffer<T>,
    shape: &[usize],
) -> Result<Tensor> {
    let len: usize = shape.iter().product();
    if buffer.len() != len {
        return Err(Error::invalid(
            "cuda",
            format!("a buffer of {} values for shape {shape:?}", buffer.len()),
        ));
    }
    Ok(Tensor::from_cuda(
        CudaStorage {
            buffer: buffer.into_bytes(),
            dtype: T::DTYPE,
            len,
        },
        shape,
    ))
}

/// The `meta` array the strided kernels take: rank, shape, then strides and offset per operand.
fn meta(
    device: &Arc<CudaDevice>,
    shape: &[usize],
    operands: &[(&[usize], usize)],
) -> Result<DeviceBuffer<i64>> {
    let mut m = vec![shape.len() as i64];
    m.extend(shape.iter().map(|&s| s as i64));
    for (strides, offset) in operands {
        m.extend(strides.iter().map(|&s| s as i64));
        m.push(*offset as i64);
    }
    device.htod(&m)
}

/// The `meta` of `operands` broadcast to `shape` (each by its own strides and offset).
fn broadcast_meta(
    device: &Arc<CudaDevice>,
    shape: &[usize],
    operands: &[&Tensor],
) -> Result<DeviceBuffer<i64>> {
    let strides: Vec<(Vec<usize>, usize)> = (operands.iter())
        .map(|t| (t.layout().broadcast_strides(shape), t.layout().offset()))
        .collect();
    let views: Vec<(&[usize], usize)> = strides.iter().map(|(s, o)| (&s[..], *o)).collect();
    meta(device, shape, &views)
}

/// The instantiation of a float kernel of `kernels/elementwise.cu` (`{base}_f32`, `_f16`,
/// `_bf16`) for `t`'s dtype; other dtypes are refused naming `op`.
fn float_kernel(op: &'static str, t: &Tensor, kernels: [&'static str; 3]) -> Result<Kernel> {
    let name = match t.dtype() {
        DType::F32 => kernels[0],
        DType::F16 => kernels[1],
        DType::BF16 => kernels[2],
        dtype => {
            return Err(Error::Device {
                device: t.device(),
                op,
                msg: format!(
                    "no CUDA kernel for {dtype:?} tensors (f32, f16 and bf16 have one; move \
                     other dtypes to the CPU with to_device)"
                ),
            })
        }
    };
    Ok(ELEMENTWISE.kernel(name))
}

/// The three instantiations (f32, f16, bf16) of a float kernel of `kernels/elementwise.cu`.
macro_rules! float_kernels {
    ($base:literal) => {
        [
            concat!($base, "_f32"),
            concat!($base, "_f16"),
            concat!($base, "_bf16"),
        ]
    };
}
use float_kernels;

/// Refuses dtypes other than f32, f16 and bf16 for `op` (the float kernels' dtypes).
fn expect_float_kernel_dtype(op: &'static str, t: &Tensor) -> Result<()> {
    float_kernel(op, t, float_kernels!("unary_fn")).map(|_| ())
}

/// The kernel of `source` among `names` (by element size: 1, 2, 4, 8 bytes) for `dtype`.
fn by_size(source: &'static KernelSource, names: [&'static str; 4], dtype: DType) -> Kernel {
    source.kernel(match dtype.size_in_bytes() {
        1 => names[0],
        2 => names[1],
        4 => names[2],
        _ => names[3],
    })
}

/// Refuses a non-f32 tensor for an op whose CUDA kernel is f32 only.
pub(crate) fn expect_f32(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::UnsupportedDType {
            op,
            dtype: t.dtype(),
            expected: "f32 on CUDA devices (other dtypes: move to the CPU)",
        });
    }
    Ok(())
}

/// The dtype codes of `kernels/elementwise.cu` (`cast_strided`, `compare_strided`).
fn dtype_code(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I64 => 4,
        DType::I32 => 5,
        DType::U8 => 6,
    }
}

impl Tensor {
    /// Notes that work queued on `stream` uses this CUDA tensor's memory (PyTorch's
    /// `record_stream`): when the storage is freed, the memory is not handed out again before
    /// that work is done. Needed when a tensor made on one stream is used on another.
    pub fn record_stream(&self, stream: &crate::cuda::Stream) -> Result<()> {
        let guard = self.storage_read();
        match &*guard {
            Storage::Cuda(s) if Arc::ptr_eq(s.device(), stream.device()) => {
                s.buffer.record_stream(stream);
                Ok(())
            }
            _ => Err(Error::DeviceMismatch {
                op: "record_stream",
                lhs: self.device(),
                rhs: Device::Cuda(stream.device().ordinal()),
            }),
        }
    }
}
