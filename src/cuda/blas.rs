//! Matrix products on a device: cuBLAS on a GPU (strided-batched SGEMM, FP32 math unless TF32
//! is allowed; f16/bf16 operands through `cublasGemmStridedBatchedEx` with f32 compute), a plain
//! loop with an f64 accumulator on the host emulation (each result rounded to f32, then to the
//! storage type).

use cudarc::cublas::{result as cublas, sys as cublas_sys};
use parking_lot::Mutex;

use super::device::Backend;
use super::{CudaDevice, DeviceOperand};
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A device's cuBLAS handle (set to the calling thread's current stream before each product).
pub(crate) struct BlasHandle(cublas_sys::cublasHandle_t);

// SAFETY: the handle is only used behind the device's mutex, one call at a time.
unsafe impl Send for BlasHandle {}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { cublas::destroy_handle(self.0) };
    }
}

/// Row-major batched product `C[b] = A[b] · B[b]` of contiguous matrices of one float dtype
/// (f32, f16 or bf16): A `[m, k]`, B `[k, n]`, C `[m, n]`, consecutive batch entries `stride_*`
/// elements apart (0: the same matrix for every batch entry).
pub(crate) struct Gemm<'a> {
    pub dtype: DType,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: &'a dyn DeviceOperand,
    pub stride_a: usize,
    pub b: &'a dyn DeviceOperand,
    pub stride_b: usize,
    pub c: &'a dyn DeviceOperand,
}

/// A [`Gemm`]'s operands resolved to addresses on the device.
struct Addresses {
    a: u64,
    b: u64,
    c: u64,
}

fn blas_error(device: &CudaDevice, msg: impl Into<String>) -> Error {
    Error::Device {
        device: Device::Cuda(device.ordinal()),
        op: "matmul (cuBLAS)",
        msg: msg.into(),
    }
}

impl CudaDevice {
    /// Runs `g` (every operand on this device and as large as `g`'s sizes say).
    pub(crate) fn gemm(&self, g: &Gemm<'_>) -> Result<()> {
        let at = Addresses {
            a: g.a.device_address(self)?,
            b: g.b.device_address(self)?,
            c: g.c.device_address(self)?,
        };
        let data_type = match g.dtype {
            DType::F32 => cublas_sys::cudaDataType::CUDA_R_32F,
            DType::F16 => cublas_sys::cudaDataType::CUDA_R_16F,
            DType::BF16 => cublas_sys::cudaDataType::CUDA_R_16BF,
            other => {
                return Err(blas_error(
                    self,
                    format!("no matrix product for {other:?} (f32, f16 or bf16)"),
                ))
            }
        };
        if g.batch == 0 || g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let too_big = [g.m, g.n, g.k].iter().any(|&d| d > i32::MAX as usize);
        if too_big {
            return Err(blas_error(self, "a matrix dimension exceeds 2^31 − 1"));
        }
        match &self.backend {
            Backend::Driver(d) => {
                let mut slot = self.blas.lock();
                if slot.is_none() {
                    // SAFETY: only probes for the library.
                    if !unsafe { cublas_sys::is_culib_present() } {
                        return Err(blas_error(
                            self,
                            "libcublas.so could not be loaded (install the CUDA toolkit or the \
                             nvidia-cublas wheel and put it on LD_LIBRARY_PATH)",
                        ));
                    }
                    d.context
                        .bind_to_thread()
                        .map_err(|e| blas_error(self, e.to_string()))?;
                    let h = cublas::create_handle().map_err(|e| blas_error(self, e.to_string()))?;
                    *slot = Some(BlasHandle(h));
                }
                let handle = slot.as_ref().expect("created above");
                // The calling thread's current stream, and the TF32 setting of now.
                let stream = d.stream(self.at())?;
                // SAFETY: a live handle and a live stream of this device.
                unsafe {
                    cublas::set_stream(handle.0, stream.cu_stream() as _)
                        .map_err(|e| blas_error(self, e.to_string()))?;
                    let mode = if self.allow_tf32() {
                        cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
                    } else {
                        cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH
                    };
                    cublas_sys::cublasSetMathMode(handle.0, mode)
                        .result()
                        .map_err(|e| blas_error(self, e.to_string()))?;
                }
                let (alpha, beta) = (1.0f32, 0.0f32);
                // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: swap the operands.
                if g.dtype != DType::F32 {
                    // f32 compute: products accumulate in f32 (cuBLAS may add split-K partial
                    // sums in the output type, as PyTorch allows by default).
                    // SAFETY: per `Gemm`'s contract; alpha/beta are host f32 values, as the
                    // f32 compute type requires.
                    return unsafe {
                        cublas::gemm_strided_batched_ex(
                            handle.0,
                            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                            g.n as i32,
                            g.m as i32,
                            g.k as i32,
                            (&alpha as *const f32).cast(),
                            at.b as *const std::ffi::c_void,
                            data_type,
                            g.n as i32,
                            g.stride_b as i64,
                            at.a as *const std::ffi::c_void,
                            data_type,
                            g.k as i32,
                            g.stride_a as i64,
                            (&beta as *const f32).cast(),
                            at.c as *mut std::ffi::c_void,
                            data_type,
                            g.n as i32,
                            (g.m * g.n) as i64,
                            g.batch as i32,
                            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                    .map_err(|e| blas_error(self, e.to_string()));
                }
                // SAFETY: per `Gemm`'s contract; alpha/beta are host values.
                unsafe {
                    cublas::sgemm_strided_batched(
                        handle.0,
                        cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                        cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                        g.n as i32,
                        g.m as i32,
                        g.k as i32,
                        &alpha,
                        at.b as *const f32,
                        g.n as i32,
                        g.stride_b as i64,
                        at.a as *const f32,
                        g.k as i32,
                        g.stride_a as i64,
                        &beta,
                        at.c as *mut f32,
                        g.n as i32,
                        (g.m * g.n) as i64,
                        g.batch as i32,
                    )
                }
                .map_err(|e| blas_error(self, e.to_string()))
            }
            Backend::Sim(_) => {
                let _ = data_type;
                match g.dtype {
                    DType::F16 => sim_gemm(g, &at, |v: half::f16| v.to_f32(), half::f16::from_f32),
                    DType::BF16 => {
                        sim_gemm(g, &at, |v: half::bf16| v.to_f32(), half::bf16::from_f32)
                    }
                    _ => sim_gemm(g, &at, |v: f32| v, |v| v),
                }
                Ok(())
            }
        }
    }
}

/// The emulation's product: f64 accumulation of the loaded values, each result rounded to f32
/// and stored as `T`.
fn sim_gemm<T: Copy>(
    g: &Gemm<'_>,
    at: &Addresses,
    load: impl Fn(T) -> f32,
    store: impl Fn(f32) -> T,
) {
    // SAFETY: emulated device memory is host memory, sized per `Gemm`'s contract.
    unsafe {
        for bi in 0..g.batch {
            let a = (at.a as *const T).add(bi * g.stride_a);
            let b = (at.b as *const T).add(bi * g.stride_b);
            let c = (at.c as *mut T).add(bi * g.m * g.n);
            for i in 0..g.m {
                for j in 0..g.n {
                    let mut acc = 0.0f64;
                    for p in 0..g.k {
                        acc += load(*a.add(i * g.k + p)) as f64 * load(*b.add(p * g.n + j)) as f64;
                    }
                    *c.add(i * g.n + j) = store(acc as f32);
                }
            }
        }
    }
}

/// The cuBLAS handle slot of a device.
pub(crate) type BlasSlot = Mutex<Option<BlasHandle>>;
