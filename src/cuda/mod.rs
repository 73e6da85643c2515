//! The CUDA backend: probing for the driver and NVRTC, opening devices, compiling the kernels of
//! `kernels/` with NVRTC for the GPU present (cached per device), device memory from a caching
//! allocator, pinned host memory ([`PinnedBuffer`]; small uploads are staged through a pinned
//! ring so they never stall the stream), kernel launches, cuBLAS products, [`CudaTbe`] and
//! [`CudaEmbeddingBagCollection`]. Tensors on a device (`Device::Cuda(n)`, `Tensor::to_device`)
//! use the same launches from `src/tensor/cuda.rs`.
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
//! and warp shuffles emulated, divergent barriers reported), launched through the same
//! [`KernelArgs`] as on a GPU — and each launch checked against the kernel's real parameter list.
//! It is how every launch path is tested in CI, where there is no GPU; it proves logic, not speed.
//!
//! State: the kernels and their launch paths are tested on the emulation in CI; none of the
//! GPU paths has run on a real GPU yet.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::{Device, Error, Result};

pub mod allocator;
mod blas;
mod buffer;
mod driver;
mod ebc;
mod launch;
mod pinned;
mod sim;
mod sort;
mod stream;
mod tbe;
pub use allocator::{AllocatorStats, CachingAllocator, DriverAllocator};
use allocator::{Block, RawAllocator, StreamId};
pub(crate) use blas::Gemm;
pub use buffer::{DeviceBuffer, DeviceElem};
pub use ebc::CudaEmbeddingBagCollection;
pub use launch::{ArgKind, KernelArgs, LaunchConfig};
pub use pinned::PinnedBuffer;
pub use sim::HOST_SIM_HEADER;
pub use sort::radix_sort_u64;
pub use stream::Stream;
pub use tbe::CudaTbe;

/// Helpers prepended to every kernel source (NVRTC sees no system headers).
pub const PRELUDE: &str = include_str!("../../kernels/prelude.cuh");

/// Every kernel source of `kernels/`: (file name, source, entry points).
pub const KERNELS: &[(&str, &str, &[&str])] = &[
    (
        "tbe_forward.cu",
        include_str!("../../kernels/tbe_forward.cu"),
        &[
            "tbe_forward_f32",
            "tbe_forward_f32_v4",
            "tbe_forward_f32_v4_d128",
            "tbe_forward_f16",
            "tbe_forward_bf16",
            "tbe_sequence_f32",
        ],
    ),
    (
        "tbe_forward_quantized.cu",
        include_str!("../../kernels/tbe_forward_quantized.cu"),
        &["tbe_forward_quantized", "tbe_sequence_quantized"],
    ),
    (
        "tbe_backward.cu",
        include_str!("../../kernels/tbe_backward.cu"),
        &[
            "tbe_backward_keys",
            "tbe_sparse_heads",
            "tbe_backward_update",
            "tbe_backward_update_d128",
        ],
    ),
    (
        "sort.cu",
        include_str!("../../kernels/sort.cu"),
        &[
            "radix_histogram",
            "radix_scan_digits",
            "radix_scatter",
            "scan_exclusive_i64",
        ],
    ),
    (
        "bucketize.cu",
        include_str!("../../kernels/bucketize.cu"),
        &[
            "block_bucketize_count_i64",
            "block_bucketize_count_i32",
            "block_bucketize_scatter_i64",
            "block_bucketize_scatter_i32",
        ],
    ),
    (
        "jagged.cu",
        include_str!("../../kernels/jagged.cu"),
        &[
            "jagged_to_padded_dense_f32",
            "dense_to_jagged_f32",
            "gather_rows_or_fill_f32",
        ],
    ),
    (
        "elementwise.cu",
        include_str!("../../kernels/elementwise.cu"),
        &[
            "fill_f32",
            "binary_f32",
            "unary_f32",
            "axpby_f32",
            "gather_b1",
            "gather_b2",
            "gather_b4",
            "gather_b8",
            "scatter_b1",
            "scatter_b2",
            "scatter_b4",
            "scatter_b8",
            "binary_strided_f32",
            "unary_fn_f32",
            "unary_backward_f32",
            "sum_middle_f32",
            "binary_strided_f16",
            "unary_fn_f16",
            "unary_backward_f16",
            "sum_middle_f16",
            "binary_strided_bf16",
            "binary_strided_i64",
            "binary_strided_i32",
            "binary_strided_u8",
            "sum_middle_i64",
            "sum_middle_i32",
            "sum_middle_u8",
            "sum_rows_f32",
            "sum_rows_f16",
            "sum_rows_bf16",
            "softmax_rows_f32",
            "max_rows_f32",
            "softmax_rows_f16",
            "max_rows_f16",
            "softmax_rows_bf16",
            "max_rows_bf16",
            "unary_fn_bf16",
            "unary_backward_bf16",
            "sum_middle_bf16",
            "cast_strided",
            "compare_strided",
            "where_b1",
            "where_b2",
            "where_b4",
            "where_b8",
            "softmax_middle_f32",
            "max_middle_f32",
            "max_middle_backward_f32",
            "softmax_middle_f16",
            "max_middle_f16",
            "max_middle_backward_f16",
            "softmax_middle_bf16",
            "max_middle_bf16",
            "max_middle_backward_bf16",
            "take_b1",
            "take_b2",
            "take_b4",
            "take_b8",
            "put_add_sorted_f32",
            "put_add_sorted_f16",
            "put_add_sorted_bf16",
            "bce_logits_f32",
        ],
    ),
    (
        "optim.cu",
        include_str!("../../kernels/optim.cu"),
        &["sgd_step_f32", "adagrad_step_f32", "adam_step_f32"],
    ),
    (
        "index.cu",
        include_str!("../../kernels/index.cu"),
        &[
            "index_select_b1",
            "index_select_b2",
            "index_select_b4",
            "index_select_b8",
            "index_add_rows_f32",
        ],
    ),
    (
        "interaction.cu",
        include_str!("../../kernels/interaction.cu"),
        &["dot_interaction_f32", "dot_interaction_backward_f32"],
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

/// Where compiled kernels are kept between runs: `EMBERS_KERNEL_CACHE` (`off`: nowhere),
/// else `$XDG_CACHE_HOME/embers/kernels`, else `$HOME/.cache/embers/kernels`.
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    match std::env::var_os("EMBERS_KERNEL_CACHE") {
        Some(v) if v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .map(|d| d.join("embers").join("kernels")),
    }
}

/// NVRTC's version, part of the cache key (another NVRTC may emit other PTX).
fn nvrtc_version() -> (i32, i32) {
    static VERSION: OnceLock<(i32, i32)> = OnceLock::new();
    *VERSION.get_or_init(|| {
        let (mut major, mut minor) = (0, 0);
        if nvrtc_present() {
            // SAFETY: the library is present; the call only writes the two integers.
            let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        }
        (major, minor)
    })
}

/// The first line of a cached PTX file: its key and the length of the PTX after the line.
fn cache_header(key: u64, len: usize) -> String {
    format!("// embers kernel cache {key:016x} {len}\n")
}

/// The PTX cached under `path` for `key`, if the file is whole and for that key.
fn cache_read(path: &std::path::Path, key: u64) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let (first, ptx) = text.split_at(text.find('\n')? + 1);
    (first == cache_header(key, ptx.len())).then(|| ptx.to_string())
}

/// Stores `ptx` under `path` (temporary file, then rename: readers never see half a file)
/// and removes the files of older versions of the same source and architecture (names
/// sharing `stale_prefix`). Failures only cost a compile next time.
fn cache_write(path: &std::path::Path, stale_prefix: &str, key: u64, ptx: &str) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ptx"),
        std::process::id()
    ));
    let written = std::fs::write(&tmp, format!("{}{ptx}", cache_header(key, ptx.len())));
    if written.is_err() || std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
        return;
    }
    let stale = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with(stale_prefix) && name.ends_with(".ptx") && e.path() != path
        });
    for entry in stale {
        let _ = std::fs::remove_file(entry.path());
    }
}

/// Compiles kernel source `name` (one of [`KERNELS`], with the prelude) to PTX for `arch`
/// (`compute_80`, `compute_90`, ...). Needs NVRTC, not a GPU. The PTX is kept in
/// [`kernel_cache_dir`], keyed by the source, architecture, options and NVRTC version, so
/// later processes skip the compile.
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
    let options = vec!["--std=c++17".to_string()];
    let key = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&full, arch, &options, nvrtc_version()).hash(&mut h);
        h.finish()
    };
    let prefix = format!("{file}-{arch}-");
    let cached = kernel_cache_dir().map(|d| d.join(format!("{prefix}{key:016x}.ptx")));
    if let Some(ptx) = cached.as_deref().and_then(|p| cache_read(p, key)) {
        return Ok(Ptx::from_src(ptx));
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        full,
        CompileOptions {
            arch: Some(arch),
            name: Some(file.to_string()),
            options,
            ..Default::default()
        },
    )
    .map_err(|e| Error::invalid("cuda::compile_ptx", format!("{file} for {arch}: {e}")))?;
    if let Some(path) = &cached {
        cache_write(path, &prefix, key, &ptx.to_src());
    }
    Ok(ptx)
}

/// The file of `kernels/` that defines entry point `kernel`.
pub(crate) fn file_of(kernel: &str) -> Result<&'static str> {
    KERNELS
        .iter()
        .find(|(_, _, entries)| entries.contains(&kernel))
        .map(|(file, _, _)| *file)
        .ok_or_else(|| Error::invalid("cuda", format!("no kernel `{kernel}` in kernels/")))
}

/// How a [`CudaDevice`] executes: the CUDA driver, or the host emulation.
enum Backend {
    Driver(Box<driver::Driver>),
    Sim(Arc<sim::Library>),
}

type DeviceAllocator = CachingAllocator<Box<dyn RawAllocator + Send>>;

/// An open CUDA device — a GPU through the driver, or the host emulation of one — with its
/// compiled kernels, its stream and its caching allocator.
///
/// Work is queued on the calling thread's current stream of the device (the default stream
/// unless [`Stream::run`] says otherwise), in order, and runs asynchronously on a GPU: the host
/// only waits when it reads a value back ([`DeviceBuffer::to_host`],
/// [`CudaDevice::synchronize`]).
pub struct CudaDevice {
    ordinal: usize,
    arch: &'static str,
    name: String,
    backend: Backend,
    allocator: Mutex<DeviceAllocator>,
    /// Freed blocks other streams may still be using ([`DeviceBuffer::record_stream`]).
    pending_frees: Mutex<stream::PendingFrees<cudarc::driver::CudaEvent>>,
    /// The id the next [`CudaDevice::new_stream`] hands out.
    next_stream: std::sync::atomic::AtomicU64,
    blas: blas::BlasSlot,
    tf32: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("arch", &self.arch)
            .finish()
    }
}

impl CudaDevice {
    fn new(
        ordinal: usize,
        arch: &'static str,
        name: String,
        backend: Backend,
        raw: Box<dyn RawAllocator + Send>,
    ) -> Self {
        CudaDevice {
            ordinal,
            arch,
            name,
            backend,
            allocator: Mutex::new(CachingAllocator::new(raw, Device::Cuda(ordinal))),
            pending_frees: Mutex::new(stream::PendingFrees::new()),
            next_stream: std::sync::atomic::AtomicU64::new(1),
            blas: Mutex::new(None),
            tf32: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The NVRTC architecture the kernels are compiled for (`compute_90`, ...; the emulation
    /// reports `host`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// The GPU's name, or `host emulation`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True for the host emulation ([`simulated_device`]).
    pub fn is_emulated(&self) -> bool {
        matches!(self.backend, Backend::Sim(_))
    }

    /// Lets f32 matrix products use TF32 tensor cores (10-bit mantissa inputs, f32
    /// accumulation; PyTorch's `allow_tf32`). Off by default: f32 products are exact FP32.
    /// Applies to the products queued from then on.
    pub fn set_allow_tf32(&self, allow: bool) {
        self.tf32.store(allow, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether f32 matrix products may use TF32.
    pub fn allow_tf32(&self) -> bool {
        self.tf32.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The allocator's counters (bytes in use and reserved, peaks, raw allocations).
    pub fn memory_stats(&self) -> AllocatorStats {
        self.allocator.lock().expect("allocator").stats()
    }

    /// Returns every wholly free cached segment to the device.
    pub fn empty_cache(&self) {
        self.allocator.lock().expect("allocator").empty_cache();
    }

    /// Uninitialised device memory for `len` values.
    pub fn alloc<T: DeviceElem>(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::alloc(self, len)
    }

    /// Device memory for `len` zeros.
    pub fn zeros<T: DeviceElem>(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer<T>> {
        let mut b = DeviceBuffer::alloc(self, len)?;
        b.fill_zero()?;
        Ok(b)
    }

    /// `len` zeros in page-locked host memory, for asynchronous copies to and from this device
    /// ([`DeviceBuffer::copy_from_pinned`]; ordinary host memory on the emulation).
    pub fn pinned<T: DeviceElem>(self: &Arc<Self>, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::zeros(self, len)
    }

    /// The driver behind a GPU (`None` on the host emulation).
    pub(crate) fn driver(&self) -> Option<&driver::Driver> {
        match &self.backend {
            Backend::Driver(d) => Some(d),
            Backend::Sim(_) => None,
        }
    }

    /// A device copy of `host`.
    pub fn htod<T: DeviceElem>(self: &Arc<Self>, host: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = DeviceBuffer::alloc(self, host.len())?;
        b.copy_from_host(host)?;
        Ok(b)
    }

    /// Waits for all work queued on the device, on every stream; reports a kernel fault.
    pub fn synchronize(&self) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.synchronize_all(self.ordinal),
            Backend::Sim(_) => Ok(()),
        }
    }

    /// Queues kernel `kernel` (an entry point of [`KERNELS`]) with `args`.
    ///
    /// # Safety
    /// `args` must follow the kernel's parameter list in `kernels/` and every buffer must be
    /// as large as the kernel reads and writes for this shape. The host emulation checks the
    /// parameter list (count, sizes, pointers); the driver cannot.
    pub unsafe fn launch(
        &self,
        kernel: &'static str,
        cfg: LaunchConfig,
        args: &mut KernelArgs,
    ) -> Result<()> {
        let mut params = args.params();
        match &self.backend {
            // SAFETY: per this function's contract.
            Backend::Driver(d) => unsafe {
                d.launch(self.at(), self.arch, kernel, &cfg, &mut params)
            },
            // SAFETY: per this function's contract; emulated device memory is host memory.
            Backend::Sim(lib) => unsafe {
                lib.launch(self.ordinal, kernel, &cfg, &mut params, args.kinds())
            },
        }
    }

    /// Marks the current point of the device's stream, for timing ([`DeviceEvent::elapsed_ms`]).
    pub fn record_event(&self) -> Result<DeviceEvent> {
        match &self.backend {
            Backend::Driver(d) => d.record_event(self.at()).map(DeviceEvent::Driver),
            Backend::Sim(_) => Ok(DeviceEvent::Host(std::time::Instant::now())),
        }
    }

    /// Where the calling thread's work on this device goes (for the driver).
    pub(crate) fn at(&self) -> driver::At {
        driver::At {
            ordinal: self.ordinal,
            stream: stream::current_stream_id(self),
        }
    }

    /// A new stream of this device ([`Stream`]).
    pub fn new_stream(self: &Arc<Self>) -> Result<Stream> {
        let id = self
            .next_stream
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Backend::Driver(d) = &self.backend {
            d.add_stream(self.ordinal, id)?;
        }
        Ok(Stream::new(self.clone(), id))
    }

    /// The device's default stream.
    pub fn default_stream(self: &Arc<Self>) -> Stream {
        Stream::new(self.clone(), stream::DEFAULT_STREAM)
    }

    /// The calling thread's current stream of this device ([`Stream::run`]).
    pub fn current_stream(self: &Arc<Self>) -> Stream {
        Stream::new(self.clone(), stream::current_stream_id(self))
    }

    pub(crate) fn stream_wait(&self, waiter: StreamId, on: StreamId) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.stream_wait(
                driver::At {
                    ordinal: self.ordinal,
                    stream: waiter,
                },
                driver::At {
                    ordinal: self.ordinal,
                    stream: on,
                },
            ),
            // The emulation runs every launch to completion before returning.
            Backend::Sim(_) => Ok(()),
        }
    }

    pub(crate) fn synchronize_stream(&self, id: StreamId) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.synchronize(driver::At {
                ordinal: self.ordinal,
                stream: id,
            }),
            Backend::Sim(_) => Ok(()),
        }
    }

    /// Hands the blocks whose other streams are done back to the allocator.
    fn reclaim_pending(&self, allocator: &mut DeviceAllocator, wait: bool) {
        let ready = {
            let mut pending = self.pending_frees.lock().expect("pending frees");
            if pending.len() == 0 {
                return;
            }
            if wait {
                pending.take_all()
            } else {
                pending.take_ready()
            }
        };
        for block in ready {
            let freed = allocator.free(block);
            debug_assert!(freed.is_ok(), "{freed:?}");
        }
    }

    /// A block for `bytes` on the calling thread's current stream.
    pub(crate) fn alloc_block(&self, bytes: usize) -> Result<Block> {
        let stream = stream::current_stream_id(self);
        let mut allocator = self.allocator.lock().expect("allocator");
        self.reclaim_pending(&mut allocator, false);
        match allocator.alloc(bytes, stream) {
            Ok(b) => Ok(b),
            Err(e) => {
                // Out of memory: wait for the blocks other streams hold back, then retry.
                if self.pending_frees.lock().expect("pending frees").len() == 0 {
                    return Err(e);
                }
                self.reclaim_pending(&mut allocator, true);
                allocator.alloc(bytes, stream)
            }
        }
    }

    /// Returns `block` to the allocator, once the work queued so far on `also_used_on`
    /// (streams other than the block's own) is done.
    pub(crate) fn free_block(&self, block: Block, also_used_on: &[StreamId]) {
        let others: Vec<StreamId> = also_used_on
            .iter()
            .copied()
            .filter(|&s| s != block.stream)
            .collect();
        if let (Backend::Driver(d), false) = (&self.backend, others.is_empty()) {
            let events: Result<Vec<_>> = others
                .iter()
                .map(|&stream| {
                    d.record_event(driver::At {
                        ordinal: self.ordinal,
                        stream,
                    })
                })
                .collect();
            match events {
                Ok(events) => {
                    self.pending_frees
                        .lock()
                        .expect("pending frees")
                        .push(block, events);
                    return;
                }
                // No event: wait for the whole device instead.
                Err(_) => {
                    let _ = d.synchronize_all(self.ordinal);
                }
            }
        }
        // A block this allocator handed out always goes back; an error here is a bug.
        let freed = self.allocator.lock().expect("allocator").free(block);
        debug_assert!(freed.is_ok(), "{freed:?}");
    }

    pub(crate) fn copy_from_host(&self, dst: u64, src: &[u8]) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.copy_from_host(self.at(), dst, src),
            Backend::Sim(_) => {
                // SAFETY: emulated device memory is host memory of at least `src.len()` bytes.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
                Ok(())
            }
        }
    }

    pub(crate) fn copy_to_host(&self, dst: &mut [u8], src: u64) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.copy_to_host(self.at(), dst, src),
            Backend::Sim(_) => {
                // SAFETY: as above.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len())
                };
                Ok(())
            }
        }
    }

    pub(crate) fn copy_on_device(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.copy_on_device(self.at(), dst, src, bytes),
            Backend::Sim(_) => {
                // SAFETY: as above (`copy` allows overlap).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }
        }
    }

    pub(crate) fn zero_bytes(&self, dst: u64, bytes: usize) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => d.zero_bytes(self.at(), dst, bytes),
            Backend::Sim(_) => {
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) };
                Ok(())
            }
        }
    }
}

/// A point in a device's stream ([`CudaDevice::record_event`]).
pub enum DeviceEvent {
    /// A CUDA event (timed on the GPU).
    Driver(cudarc::driver::CudaEvent),
    /// The host emulation runs launches synchronously: the wall clock.
    Host(std::time::Instant),
}

impl DeviceEvent {
    /// Milliseconds from this event to `later` (waits for `later` to be reached).
    pub fn elapsed_ms(&self, later: &DeviceEvent) -> Result<f64> {
        match (self, later) {
            (DeviceEvent::Driver(a), DeviceEvent::Driver(b)) => {
                b.synchronize().map_err(|e| Error::Device {
                    device: Device::Cuda(0),
                    op: "event synchronize",
                    msg: e.to_string(),
                })?;
                a.elapsed_ms(b).map(f64::from).map_err(|e| Error::Device {
                    device: Device::Cuda(0),
                    op: "event timing",
                    msg: e.to_string(),
                })
            }
            (DeviceEvent::Host(a), DeviceEvent::Host(b)) => {
                Ok(b.saturating_duration_since(*a).as_secs_f64() * 1e3)
            }
            _ => Err(Error::invalid(
                "DeviceEvent::elapsed_ms",
                "events of different kinds of device",
            )),
        }
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
    let mut devices = cache
        .get_or_init(Default::default)
        .lock()
        .expect("device cache");
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
        let lib = sim::Library::get(ordinal)?;
        let raw: Box<dyn RawAllocator + Send> = Box::new(sim::HostMemory::default());
        let name = "host emulation".to_string();
        Ok(CudaDevice::new(
            ordinal,
            "host",
            name,
            Backend::Sim(lib),
            raw,
        ))
    })
}
