//! The CUDA runtime: probing for the driver and NVRTC, opening devices ([`CudaDevice`]),
//! compiling the kernel sources that ops declare ([`KernelSource`]) with NVRTC for the GPU
//! present (cached per device and on disk), device memory from a caching allocator, streams,
//! pinned host memory ([`PinnedBuffer`]; small uploads are staged through a pinned ring so they
//! never stall the stream), typed kernel launches ([`KernelArg`], [`args!`](crate::args)),
//! cuBLAS products, a device radix sort, and a host emulation of a device. It knows nothing of
//! tensors, embeddings or models: those build on it (the tensor core's CUDA backend in
//! `tensor/backend/cuda`, and each domain op's `cuda.rs` beside its CPU half).
//!
//! Everything is loaded at run time (cudarc with dynamic loading), so embers builds and runs on
//! machines with no CUDA at all. cudarc panics inside some entry points when a library is
//! missing, so every path here probes for the library first and returns
//! [`crate::Error::DeviceUnavailable`] saying what is missing: the
//! driver (`libcuda.so`), a GPU, or NVRTC (`libnvrtc.so`, e.g. from the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12`, found through `LD_LIBRARY_PATH`).
//!
//! # Host emulation
//!
//! [`simulated_device`] (or `EMBERS_CUDA_SIM=<n>`, which makes [`device`] hand out `n`
//! emulated devices) is a CUDA device emulated on the CPU: the same kernel sources, compiled by
//! the system C++ compiler against `kernels/host_sim.hpp` (one fiber per CUDA thread, barriers
//! and warp shuffles emulated, divergent barriers reported), launched with the same arguments
//! as on a GPU — and each launch checked against the kernel's real parameter list. It is how
//! every launch path is tested in CI, where there is no GPU; it proves logic, not speed.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use parking_lot::Mutex;

use crate::device::Device;
use crate::error::{Error, Result};

pub mod allocator;
mod blas;
mod buffer;
mod compile;
mod device;
mod driver;
mod launch;
mod pinned;
mod sim;
mod sort;
mod stream;
use allocator::RawAllocator;
pub use allocator::{AllocatorStats, CachingAllocator, DriverAllocator};
pub(crate) use blas::Gemm;
pub use buffer::{DeviceBuffer, DeviceElem};
pub use compile::{
    arch_name, compile_ptx, kernel_cache_dir, nvrtc_present, Kernel, KernelSource, PRELUDE,
};
use device::Backend;
pub use device::{CudaDevice, DeviceEvent};
pub use launch::{ArgKind, DeviceOperand, KernelArg, KernelArgs, LaunchConfig};
pub(crate) use pinned::MappedHost;
pub use pinned::PinnedBuffer;
pub use sim::HOST_SIM_HEADER;
pub(crate) use sort::SORT;
pub use sort::{radix_sort_u64, scan_exclusive_i64};
pub use stream::Stream;

fn unavailable(ordinal: usize, reason: impl Into<String>) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason: reason.into(),
    }
}

/// Whether the CUDA driver library can be loaded (no cudarc call is made otherwise).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library names cudarc would use.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Number of CUDA devices, or why there are none usable.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(unavailable(
            0,
            "no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver installed?)",
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| unavailable(0, format!("the CUDA driver failed to initialise: {e}")))?;
    Ok(n.max(0) as usize)
}

impl Device {
    /// Returns the CUDA device `ordinal` once it has been opened, or an error saying why it
    /// cannot be used: no driver, no GPU, ordinal out of range, no NVRTC.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        device(ordinal)?;
        Ok(Device::Cuda(ordinal))
    }
}

/// The open device behind `device` (an error for the CPU).
pub fn open(device: Device) -> Result<Arc<CudaDevice>> {
    match device {
        Device::Cuda(n) => self::device(n),
        Device::Cpu => Err(Error::invalid("cuda", "the CPU is not a CUDA device")),
    }
}

static EMULATED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Number of emulated devices [`device`] hands out: `EMBERS_CUDA_SIM=<n>`, or what
/// [`use_emulation`] set (the larger; 0: real GPUs only).
pub fn emulated_devices() -> usize {
    let env = std::env::var("EMBERS_CUDA_SIM")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    env.max(EMULATED.load(std::sync::atomic::Ordering::Relaxed))
}

/// From now on, in this process, `Device::Cuda(0..n)` are host-emulated devices (as
/// `EMBERS_CUDA_SIM=<n>` would make them): for tests and demos on machines without a GPU.
pub fn use_emulation(n: usize) {
    EMULATED.store(n, std::sync::atomic::Ordering::Relaxed);
}

/// Opened devices by ordinal.
type DeviceCache = OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>>;

/// Device `ordinal` from `cache`, opened by `open` the first time (under the cache's lock, so
/// it is opened once).
fn cached(
    cache: &'static DeviceCache,
    ordinal: usize,
    open: impl FnOnce() -> Result<CudaDevice>,
) -> Result<Arc<CudaDevice>> {
    let mut devices = cache.get_or_init(Default::default).lock();
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(open()?);
    devices.insert(ordinal, d.clone());
    Ok(d)
}

/// Opens CUDA device `ordinal` (cached: later calls return the same device), or says why it
/// cannot: no driver, no GPU, ordinal out of range, no NVRTC. With `EMBERS_CUDA_SIM=<n>` set,
/// devices `0..n` are the host emulation instead ([`simulated_device`]).
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    let emulated = emulated_devices();
    if emulated > 0 {
        if ordinal >= emulated {
            return Err(unavailable(
                ordinal,
                format!("EMBERS_CUDA_SIM={emulated}: only {emulated} emulated device(s)"),
            ));
        }
        return simulated_device(ordinal);
    }
    static DEVICES: DeviceCache = OnceLock::new();
    cached(&DEVICES, ordinal, || {
        let count = device_count().map_err(|e| match e {
            Error::DeviceUnavailable { reason, .. } => unavailable(ordinal, reason),
            other => other,
        })?;
        if count == 0 {
            return Err(unavailable(
                ordinal,
                "the CUDA driver is installed but reports no GPU",
            ));
        }
        if ordinal >= count {
            return Err(unavailable(
                ordinal,
                format!("only {count} GPU(s) present (ordinals 0..{count})"),
            ));
        }
        if !nvrtc_present() {
            return Err(unavailable(
                ordinal,
                "NVRTC not found: libnvrtc.so could not be loaded, so kernels cannot be compiled",
            ));
        }
        let context = CudaContext::new(ordinal)
            .map_err(|e| unavailable(ordinal, format!("creating a context failed: {e}")))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|e| unavailable(ordinal, format!("reading the compute capability: {e}")))?;
        let name = context.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let raw: Box<dyn RawAllocator + Send> = Box::new(DriverAllocator::new(context.clone()));
        let backend = Backend::Driver(Box::new(driver::Driver::new(context, ordinal)?));
        Ok(CudaDevice::new(
            ordinal,
            arch_name(major, minor),
            name,
            backend,
            raw,
        ))
    })
}

/// Emulated CUDA device `ordinal`: the kernels compiled for the CPU by the system C++
/// compiler (see [`sim`](self#host-emulation)); needs no GPU, driver or NVRTC. Cached like
/// [`device`].
pub fn simulated_device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static DEVICES: DeviceCache = OnceLock::new();
    cached(&DEVICES, ordinal, || {
        let emulator = sim::Emulator::new(ordinal)?;
        let raw: Box<dyn RawAllocator + Send> = Box::new(sim::HostMemory::default());
        let name = "host emulation".to_string();
        Ok(CudaDevice::new(
            ordinal,
            "host",
            name,
            Backend::Sim(emulator),
            raw,
        ))
    })
}
