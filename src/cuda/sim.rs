//! The host emulation of a CUDA device: each kernel source compiled with the system C++
//! compiler against `kernels/host_sim.hpp` into a shared library of its own (at the first launch
//! of one of its kernels), "device" memory in host memory (through the same [`CachingAllocator`](super::CachingAllocator) policy), launches run
//! on the calling thread with one fiber per CUDA thread.
//!
//! It exists so that every launch path of the CUDA backend — argument lists, grid shapes, buffer
//! sizes, the kernels' logic — runs in CI and on machines without a GPU, against the CPU
//! implementations. It says nothing about speed, and it cannot see races that the GPU's
//! memory model would expose. It is chosen with `EMBERS_CUDA_SIM=<devices>` (then
//! [`super::device`] hands out emulated devices) or explicitly with [`super::simulated_device`].
//!
//! A source's library is built once per version of it (a hash of its text and the header names
//! it) under the system temporary directory, written to a temporary name and renamed, so
//! parallel builds agree.
//! Every launch checks its arguments against the kernel's real parameter list (count, sizes,
//! which ones are pointers) — the check the CUDA driver cannot make.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::allocator::RawAllocator;
use super::launch::{ArgKind, LaunchConfig};
use super::{Kernel, KernelSource, PRELUDE};
use crate::device::Device;
use crate::error::{Error, Result};

/// The emulation header (kernels/host_sim.hpp).
pub const HOST_SIM_HEADER: &str = include_str!("../../kernels/host_sim.hpp");

type LaunchFn = unsafe extern "C" fn(*const c_uint, c_uint, *mut *mut c_void) -> c_int;
type SignatureFn = unsafe extern "C" fn(*mut c_int, *mut c_int, c_int) -> c_int;
type ErrorFn = unsafe extern "C" fn() -> *const c_char;

/// A kernel of the emulation library with its parameter list.
#[derive(Clone, Copy)]
struct SimKernel {
    launch: LaunchFn,
    params: &'static [(i32, bool)],
}

/// The emulation library of one kernel source.
struct Library {
    _lib: libloading::Library,
    kernels: HashMap<&'static str, SimKernel>,
    last_error: ErrorFn,
}

fn unavailable(ordinal: usize, reason: impl Into<String>) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(ordinal),
        reason: format!("CUDA host emulation: {}", reason.into()),
    }
}

/// The C++ compiler used: `$CXX`, else `g++`, else `c++`.
fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["g++".to_string(), "c++".to_string()]);
    for c in candidates {
        let ok = Command::new(&c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(c);
        }
    }
    None
}

/// One translation unit per kernel file, plus the exported launch/signature wrappers.
fn translation_unit(file: &str, source: &str, entries: &[&str]) -> String {
    let mut tu = format!(
        "#define EMBERS_HOST_SIM 1\n#include \"host_sim.hpp\"\n{PRELUDE}\n#line 1 \"{file}\"\n{source}\n"
    );
    for e in entries {
        tu.push_str(&format!(
            "extern \"C\" int embers_sim_launch_{e}(const unsigned* d, unsigned s, void** a) \
             {{ return embers_sim::launch(&{e}, d, s, a); }}\n\
             extern \"C\" int embers_sim_signature_{e}(int* s, int* p, int c) \
             {{ return embers_sim::signature(&{e}, s, p, c); }}\n"
        ));
    }
    tu
}

const RUNTIME_TU: &str = "#include \"host_sim.hpp\"\n\
    extern \"C\" const char* embers_sim_last_error() { return embers_sim::last_error.c_str(); }\n";

fn source_hash(source: &KernelSource) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    HOST_SIM_HEADER.hash(&mut h);
    PRELUDE.hash(&mut h);
    RUNTIME_TU.hash(&mut h);
    translation_unit(source.file, source.source, source.entries).hash(&mut h);
    h.finish()
}

fn run(cmd: &mut Command, what: &str) -> std::result::Result<(), String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: could not start the compiler: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Compiles `source`'s library into `dir` (if not already there) and returns its path.
fn build(dir: &Path, cxx: &str, source: &KernelSource) -> std::result::Result<PathBuf, String> {
    let lib = dir.join("lib.so");
    if lib.exists() {
        return Ok(lib);
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    // Private scratch space: parallel builders never share object files.
    let scratch = dir.join(format!("build-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)
        .map_err(|e| format!("creating {}: {e}", scratch.display()))?;
    let write = |name: &str, text: &str| {
        let p = scratch.join(name);
        std::fs::write(&p, text).map_err(|e| format!("writing {}: {e}", p.display()))?;
        Ok::<_, String>(p)
    };
    write("host_sim.hpp", HOST_SIM_HEADER)?;
    let stem = source.file.trim_end_matches(".cu");
    let text = format!(
        "{}\n{RUNTIME_TU}",
        translation_unit(source.file, source.source, source.entries)
    );
    let unit = write(&format!("{stem}.cpp"), &text)?;
    let tmp = scratch.join("lib.so");
    let mut cmd = Command::new(cxx);
    cmd.args([
        "-std=c++20",
        "-O1",
        "-fPIC",
        "-shared",
        "-Wall",
        "-Wno-sign-compare",
        "-Wno-unknown-pragmas",
        "-Wno-unused-function",
    ])
    .arg(&unit)
    .arg("-o")
    .arg(&tmp);
    run(
        &mut cmd,
        &format!("compiling {} for the host emulation", source.file),
    )?;
    std::fs::rename(&tmp, &lib).map_err(|e| format!("installing {}: {e}", lib.display()))?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(lib)
}

impl Library {
    fn load(path: &Path, source: &KernelSource) -> std::result::Result<Library, String> {
        // SAFETY: the library is the one just built from our own sources; loading it runs no
        // initialisers besides the C++ runtime's.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("loading {}: {e}", path.display()))?;
        let mut kernels = HashMap::new();
        {
            for &e in source.entries {
                // SAFETY: the symbols are the wrappers `translation_unit` wrote, with these types.
                let (launch, signature) = unsafe {
                    let l: libloading::Symbol<LaunchFn> = lib
                        .get(format!("embers_sim_launch_{e}").as_bytes())
                        .map_err(|err| format!("{e}: {err}"))?;
                    let s: libloading::Symbol<SignatureFn> = lib
                        .get(format!("embers_sim_signature_{e}").as_bytes())
                        .map_err(|err| format!("{e}: {err}"))?;
                    (*l, *s)
                };
                let mut sizes = [0 as c_int; 64];
                let mut pointers = [0 as c_int; 64];
                // SAFETY: both arrays hold 64 entries, as passed.
                let n = unsafe { signature(sizes.as_mut_ptr(), pointers.as_mut_ptr(), 64) };
                let params: Vec<(i32, bool)> = (0..n.clamp(0, 64) as usize)
                    .map(|i| (sizes[i], pointers[i] != 0))
                    .collect();
                kernels.insert(
                    e,
                    SimKernel {
                        launch,
                        params: Box::leak(params.into_boxed_slice()),
                    },
                );
            }
        }
        // SAFETY: defined by RUNTIME_TU with this type.
        let last_error = unsafe {
            *lib.get::<ErrorFn>(b"embers_sim_last_error")
                .map_err(|e| format!("embers_sim_last_error: {e}"))?
        };
        Ok(Library {
            _lib: lib,
            kernels,
            last_error,
        })
    }

    /// Runs `kernel` to completion on the calling thread.
    ///
    /// # Safety
    /// `params` point to the argument values; pointer arguments must be valid host addresses of
    /// buffers as large as the kernel reads and writes (the parameter list is checked here,
    /// buffer sizes are not).
    unsafe fn launch(
        &self,
        ordinal: usize,
        kernel: &'static str,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        kinds: &[ArgKind],
    ) -> Result<()> {
        let fail = |msg: String| Error::Device {
            device: Device::Cuda(ordinal),
            op: "kernel launch",
            msg: format!("{kernel}: {msg}"),
        };
        let k = self
            .kernels
            .get(kernel)
            .ok_or_else(|| fail("no such kernel in kernels/".into()))?;
        if k.params.len() != kinds.len() {
            return Err(fail(format!(
                "the kernel takes {} arguments, {} were given",
                k.params.len(),
                kinds.len()
            )));
        }
        for (i, (&(size, pointer), kind)) in k.params.iter().zip(kinds).enumerate() {
            if size as usize != kind.size() || pointer != kind.is_pointer() {
                return Err(fail(format!(
                    "argument {i} is a {} of {size} bytes in the kernel, {kind:?} was given",
                    if pointer { "pointer" } else { "value" }
                )));
            }
        }
        let dims = [
            cfg.grid.0,
            cfg.grid.1,
            cfg.grid.2,
            cfg.block.0,
            cfg.block.1,
            cfg.block.2,
        ];
        // SAFETY: per this function's contract; `dims` holds the six dimensions.
        let status = unsafe { (k.launch)(dims.as_ptr(), cfg.shared_bytes, params.as_mut_ptr()) };
        if status != 0 {
            // SAFETY: a NUL-terminated string owned by the library's thread-local state.
            let msg = unsafe { CStr::from_ptr((self.last_error)()) };
            return Err(fail(msg.to_string_lossy().into_owned()));
        }
        Ok(())
    }
}

/// The host emulation behind an emulated device: the C++ compiler, and each kernel source's
/// library, built at the first launch of one of its kernels.
pub(crate) struct Emulator {
    cxx: String,
}

/// Libraries by source file, shared by every emulated device of the process.
type Libraries =
    Mutex<HashMap<&'static str, Arc<OnceLock<std::result::Result<Arc<Library>, String>>>>>;

impl Emulator {
    /// The emulation for device `ordinal`; fails when no C++ compiler is found.
    pub(crate) fn new(ordinal: usize) -> Result<Emulator> {
        static CXX: OnceLock<Option<String>> = OnceLock::new();
        let cxx = CXX.get_or_init(compiler).clone().ok_or_else(|| {
            unavailable(
                ordinal,
                "no C++ compiler found ($CXX, g++ or c++) to build the kernels for the CPU",
            )
        })?;
        Ok(Emulator { cxx })
    }

    /// `source`'s library, built at first use (once per process and version of the source).
    fn library(&self, ordinal: usize, source: &'static KernelSource) -> Result<Arc<Library>> {
        static LIBRARIES: OnceLock<Libraries> = OnceLock::new();
        let slot = LIBRARIES
            .get_or_init(Default::default)
            .lock()
            .entry(source.file)
            .or_default()
            .clone();
        // Built outside the map's lock: other sources build meanwhile; this one once.
        slot.get_or_init(|| {
            let dir = std::env::temp_dir().join("embers-cuda-sim").join(format!(
                "{}-{:016x}",
                source.file.trim_end_matches(".cu"),
                source_hash(source)
            ));
            let path = build(&dir, &self.cxx, source)?;
            Library::load(&path, source).map(Arc::new)
        })
        .clone()
        .map_err(|e| unavailable(ordinal, e))
    }

    /// Runs `kernel` to completion on the calling thread.
    ///
    /// # Safety
    /// As [`Library::launch`].
    pub(crate) unsafe fn launch(
        &self,
        ordinal: usize,
        kernel: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
        kinds: &[ArgKind],
    ) -> Result<()> {
        let library = self.library(ordinal, kernel.source)?;
        // SAFETY: per this function's contract.
        unsafe { library.launch(ordinal, kernel.name, cfg, params, kinds) }
    }
}

/// Host memory standing in for device memory (256-byte aligned, like `cuMemAlloc`).
#[derive(Default)]
pub(crate) struct HostMemory {
    live: HashMap<u64, std::alloc::Layout>,
}

/// The layout of `bytes` of emulated device memory (at least 1 byte, 256-byte aligned).
pub(crate) fn host_layout(bytes: usize) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(bytes.max(1), 256).ok()
}

/// Zeroed host memory of `layout` standing in for device memory, if there is room.
pub(crate) fn host_alloc(layout: std::alloc::Layout) -> Option<u64> {
    // SAFETY: a non-zero size (`host_layout`). Zeroed, so a kernel reading memory it never
    // wrote sees zeros rather than stale host data (a GPU gives no such promise; nothing
    // relies on it).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    (!p.is_null()).then_some(p as u64)
}

/// Frees memory of [`host_alloc`].
///
/// # Safety
/// `ptr` came from `host_alloc(layout)` and is freed once.
pub(crate) unsafe fn host_free(ptr: u64, layout: std::alloc::Layout) {
    // SAFETY: the caller's promise.
    unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
}

impl RawAllocator for HostMemory {
    fn alloc(&mut self, bytes: usize) -> Option<u64> {
        let layout = host_layout(bytes)?;
        let p = host_alloc(layout)?;
        self.live.insert(p, layout);
        Some(p)
    }

    fn free(&mut self, ptr: u64, _bytes: usize) {
        if let Some(layout) = self.live.remove(&ptr) {
            // SAFETY: allocated above with this layout, freed once (removed from the map).
            unsafe { host_free(ptr, layout) };
        }
    }
}
