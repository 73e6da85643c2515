//! The CUDA side: probing for the driver and NVRTC, opening devices, and compiling the kernels
//! of `kernels/` with NVRTC for the GPU present (cached per device).
//!
//! Everything is loaded at run time (cudarc with dynamic loading), so embers builds and runs on
//! machines with no CUDA at all. cudarc panics inside some entry points when a library is
//! missing, so every path here probes for the library first and returns
//! [`crate::Error::DeviceUnavailable`] saying what is missing: the
//! driver (`libcuda.so`), a GPU, or NVRTC (`libnvrtc.so`, e.g. from the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12`, found through `LD_LIBRARY_PATH`).
//!
//! State of the backend: device probe, NVRTC compilation of every kernel (checked in CI without
//! a GPU), the per-device module cache, [`CudaTbe`] (pooled TBE forward for FP32 and quantized
//! rows, fused backward) and the [`CachingAllocator`] (PyTorch's policy; its logic is tested on a
//! fake device) are here — none of the GPU paths has run on a GPU yet. Tensor storage on the
//! device (with the allocator wired into it), cuBLAS and the jagged/element-wise launch wrappers
//! are not.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::{Device, Error, Result};

pub mod allocator;
mod tbe;
pub use allocator::{CachingAllocator, DriverAllocator};
pub use tbe::CudaTbe;

/// Helpers prepended to every kernel source (NVRTC sees no system headers).
pub const PRELUDE: &str = include_str!("../../kernels/prelude.cuh");

/// Every kernel source of `kernels/`: (file name, source, entry points).
pub const KERNELS: &[(&str, &str, &[&str])] = &[
    (
        "tbe_forward.cu",
        include_str!("../../kernels/tbe_forward.cu"),
        &["tbe_forward_f32", "tbe_forward_f16", "tbe_forward_bf16"],
    ),
    (
        "tbe_forward_quantized.cu",
        include_str!("../../kernels/tbe_forward_quantized.cu"),
        &["tbe_forward_quantized"],
    ),
    (
        "tbe_backward.cu",
        include_str!("../../kernels/tbe_backward.cu"),
        &[
            "tbe_backward_keys",
            "tbe_backward_pad",
            "bitonic_step_u64",
            "tbe_backward_update",
        ],
    ),
    (
        "jagged.cu",
        include_str!("../../kernels/jagged.cu"),
        &["jagged_to_padded_dense_f32", "dense_to_jagged_f32"],
    ),
    (
        "elementwise.cu",
        include_str!("../../kernels/elementwise.cu"),
        &["fill_f32", "binary_f32", "unary_f32", "axpby_f32"],
    ),
];

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

/// Whether NVRTC can be loaded.
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library names cudarc would use.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
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

/// The NVRTC architecture name of a compute capability (`(9, 0)` → `compute_90`).
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .expect("arch name cache");
    names
        .entry((major, minor))
        .or_insert_with(|| Box::leak(format!("compute_{major}{minor}").into_boxed_str()))
}

/// Compiles kernel source `name` (one of [`KERNELS`], with the prelude) to PTX for `arch`
/// (`compute_80`, `compute_90`, ...). Needs NVRTC, not a GPU.
pub fn compile_ptx(name: &str, arch: &'static str) -> Result<Ptx> {
    let (file, source, _) = KERNELS
        .iter()
        .find(|(f, _, _)| *f == name)
        .ok_or_else(|| Error::invalid("cuda::compile_ptx", format!("no kernel file `{name}`")))?;
    if !nvrtc_present() {
        return Err(unavailable(
            0,
            "NVRTC not found: libnvrtc.so could not be loaded (install the PyPI wheel \
             nvidia-cuda-nvrtc-cu12 and put its nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH)",
        ));
    }
    let full = format!("{PRELUDE}\n#line 1 \"{file}\"\n{source}");
    cudarc::nvrtc::compile_ptx_with_opts(
        full,
        CompileOptions {
            arch: Some(arch),
            name: Some(file.to_string()),
            options: vec!["--std=c++17".to_string()],
            ..Default::default()
        },
    )
    .map_err(|e| Error::invalid("cuda::compile_ptx", format!("{file} for {arch}: {e}")))
}

/// An open CUDA device with its compiled kernel modules.
pub struct CudaDevice {
    ordinal: usize,
    context: Arc<CudaContext>,
    arch: &'static str,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("arch", &self.arch)
            .finish()
    }
}

impl CudaDevice {
    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The NVRTC architecture the kernels are compiled for.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The module of kernel file `name`, compiled for this device at first use.
    pub fn module(&self, name: &'static str) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().expect("module cache");
        if let Some(m) = modules.get(name) {
            return Ok(m.clone());
        }
        let ptx = compile_ptx(name, self.arch)?;
        let module = self
            .context
            .load_module(ptx)
            .map_err(|e| unavailable(self.ordinal, format!("loading {name}: {e}")))?;
        modules.insert(name, module.clone());
        Ok(module)
    }
}

/// Opens CUDA device `ordinal` (cached: later calls return the same device), or says why it
/// cannot: no driver, no GPU, ordinal out of range, no NVRTC.
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .expect("device cache");
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
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
    let d = Arc::new(CudaDevice {
        ordinal,
        context,
        arch: arch_name(major, minor),
        modules: Mutex::new(HashMap::new()),
    });
    devices.insert(ordinal, d.clone());
    Ok(d)
}
