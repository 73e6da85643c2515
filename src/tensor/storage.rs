//! Typed element buffers. A tensor shares its storage (reference-counted) with its views.

use half::{bf16, f16};

use super::dtype::{DType, WithDType};
use crate::{Device, Error, Result};

/// A host buffer of one dtype.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// i64 elements.
    I64(Vec<i64>),
    /// i32 elements.
    I32(Vec<i32>),
    /// u8 elements.
    U8(Vec<u8>),
}

/// Dispatches `$body` with `$v` bound to the storage's typed vector.
macro_rules! match_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::tensor::storage::CpuStorage::F32($v) => $body,
            $crate::tensor::storage::CpuStorage::F64($v) => $body,
            $crate::tensor::storage::CpuStorage::F16($v) => $body,
            $crate::tensor::storage::CpuStorage::BF16($v) => $body,
            $crate::tensor::storage::CpuStorage::I64($v) => $body,
            $crate::tensor::storage::CpuStorage::I32($v) => $body,
            $crate::tensor::storage::CpuStorage::U8($v) => $body,
        }
    };
}
pub(crate) use match_storage;

impl CpuStorage {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F64(_) => DType::F64,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I64(_) => DType::I64,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match_storage!(self, v => v.len())
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `n` elements of `value` (cast to `dtype` as [`Tensor::full`](super::Tensor::full)
    /// casts), or an error naming `what` when the memory cannot be had: a failed allocation
    /// is an error here, not an abort.
    pub(crate) fn try_full(what: &'static str, dtype: DType, value: f64, n: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(try_filled(what, value as f32, n)?),
            DType::F64 => CpuStorage::F64(try_filled(what, value, n)?),
            DType::F16 => {
                CpuStorage::F16(try_filled(what, <f16 as WithDType>::from_f64(value), n)?)
            }
            DType::BF16 => {
                CpuStorage::BF16(try_filled(what, <bf16 as WithDType>::from_f64(value), n)?)
            }
            DType::I64 => CpuStorage::I64(try_filled(what, value as i64, n)?),
            DType::I32 => CpuStorage::I32(try_filled(what, value as i32, n)?),
            DType::U8 => CpuStorage::U8(try_filled(what, value as u8, n)?),
        })
    }

    /// A zero-filled buffer.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::I64 => CpuStorage::I64(vec![0; n]),
            DType::I32 => CpuStorage::I32(vec![0; n]),
            DType::U8 => CpuStorage::U8(vec![0; n]),
        }
    }
}

/// `n` copies of `value` in a new vector, or an error naming `what` when the allocator
/// refuses the bytes. Zeros come from the allocator's zeroed pages, as `vec![0; n]`'s do.
pub(crate) fn try_filled<T: bytemuck::NoUninit + bytemuck::Zeroable>(
    what: &'static str,
    value: T,
    n: usize,
) -> Result<Vec<T>> {
    let refused = || out_of_memory(what, n.saturating_mul(std::mem::size_of::<T>()));
    if bytemuck::bytes_of(&value).iter().all(|&b| b == 0) {
        return bytemuck::allocation::try_zeroed_vec(n).map_err(|()| refused());
    }
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| refused())?;
    v.resize(n, value);
    Ok(v)
}

/// An empty vector with room for `n` elements, or an error naming `what` when the allocator
/// refuses the bytes.
pub(crate) fn try_with_capacity<T>(what: &'static str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| out_of_memory(what, n.saturating_mul(std::mem::size_of::<T>())))?;
    Ok(v)
}

/// Checks that an output of `shape`, `elem_bytes` an element, can be allocated, before a
/// kernel that allocates it infallibly (inside closures that return plain vectors): a shape
/// past a `usize` or an allocation the allocator refuses is an error naming `what`, where the
/// kernel would abort the process. Small outputs (under 16 MiB) are not probed.
pub(crate) fn ensure_allocatable(
    what: &'static str,
    shape: &[usize],
    elem_bytes: usize,
) -> Result<()> {
    let n = super::checked_numel(shape).ok_or_else(|| {
        crate::Error::invalid(
            what,
            format!("an output of shape {shape:?} is past a usize"),
        )
    })?;
    let bytes = n
        .checked_mul(elem_bytes)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| out_of_memory(what, usize::MAX))?;
    if bytes >= 16 << 20 {
        // Reserved and freed at once: pages are not touched.
        Vec::<u8>::new()
            .try_reserve_exact(bytes)
            .map_err(|_| out_of_memory(what, bytes))?;
    }
    Ok(())
}

/// The error of an allocation of `bytes` for `what` that the allocator refused.
pub(crate) fn out_of_memory(what: &'static str, bytes: usize) -> Error {
    Error::invalid(what, format!("out of memory allocating {bytes} bytes"))
}

/// Storage on some device.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuStorage),
    /// Memory of a CUDA device (or of its host emulation).
    Cuda(super::backend::CudaStorage),
}

fn not_on_cpu(op: &'static str, device: Device) -> Error {
    Error::invalid(
        op,
        format!(
            "has no CUDA path yet and the tensor is on {device}: move it with \
             to_device(Device::Cpu) first"
        ),
    )
}

impl Storage {
    /// The device the storage lives on.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => Device::Cuda(s.device().ordinal()),
        }
    }

    /// The host buffer, or an error naming `op` if the storage is elsewhere.
    pub fn cpu(&self, op: &'static str) -> Result<&CpuStorage> {
        match self {
            Storage::Cpu(s) => Ok(s),
            Storage::Cuda(_) => Err(not_on_cpu(op, self.device())),
        }
    }

    /// The host buffer, mutably.
    pub fn cpu_mut(&mut self, op: &'static str) -> Result<&mut CpuStorage> {
        let device = self.device();
        match self {
            Storage::Cpu(s) => Ok(s),
            Storage::Cuda(_) => Err(not_on_cpu(op, device)),
        }
    }
}

/// Makes glibc's `malloc` keep freed host memory for reuse instead of returning it to the
/// kernel at once; called by the trainers (`DlrmTrainer`, `TwoTowerTrainer`) when they are
/// built, once per process. A no-op off glibc, or when the environment sets
/// `EMBERS_MALLOC_DEFAULTS=1`.
///
/// Why: a training step allocates and frees the same few megabytes of tensors every time. By
/// default glibc serves blocks above 128 KiB–32 MiB with fresh `mmap`s and trims a thread
/// arena's free top above twice that, so each step page-faults (and zeroes) its buffers again:
/// that was a third of the time of a CPU TwoTower step with an in-batch softmax (measured with
/// `perf`; the same run with these settings went from 87k to 116k pairs/s). After this call,
/// blocks up to 32 MiB (glibc's largest threshold) come from the arenas and up to 256 MiB of
/// free memory stays in each arena. PyTorch's CPU steps showed no such cost (they did not
/// change with the same settings), so this is embers' allocation pattern meeting glibc's
/// defaults, and the process keeps a bounded amount more memory.
pub fn keep_freed_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if std::env::var_os("EMBERS_MALLOC_DEFAULTS").is_some_and(|v| v == "1") {
                return;
            }
            // SAFETY: mallopt only changes the allocator's tuning parameters; both values are
            // within glibc's accepted ranges (it returns 0 and changes nothing otherwise).
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
            }
        });
    }
}
