//! The CUDA C sources of `kernels/` as the ops that own them declare them ([`KernelSource`],
//! [`Kernel`]), and their compilation by NVRTC to PTX for a device's architecture, kept on disk
//! between runs.

use std::collections::HashMap;
use std::sync::OnceLock;

use cudarc::nvrtc::{CompileOptions, Ptx};
use parking_lot::Mutex;

use crate::device::Device;
use crate::error::{Error, Result};

/// Helpers prepended to every kernel source (NVRTC sees no system headers).
pub const PRELUDE: &str = include_str!("../../kernels/prelude.cuh");

/// One CUDA C file of `kernels/` and the entry points it defines, declared by the op that
/// launches them (with [`kernel_source!`](crate::kernel_source)).
#[derive(Debug)]
pub struct KernelSource {
    /// The file's name in `kernels/` (unique: it keys the compiled modules).
    pub file: &'static str,
    /// Its text.
    pub source: &'static str,
    /// The `extern "C" __global__` functions embers launches from it.
    pub entries: &'static [&'static str],
}

/// An entry point of a [`KernelSource`], as a launch names it.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// The file defining it.
    pub source: &'static KernelSource,
    /// The entry point's name.
    pub name: &'static str,
}

const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

impl KernelSource {
    /// Entry point `name` of this file; a name the file does not list fails to compile (the
    /// check runs at compile time where the kernel is a `const`).
    pub const fn kernel(&'static self, name: &'static str) -> Kernel {
        let mut i = 0;
        while i < self.entries.len() {
            if same(self.entries[i], name) {
                return Kernel { source: self, name };
            }
            i += 1;
        }
        panic!("the kernel source does not list this entry point")
    }

    /// Whether the file defines entry point `name`.
    pub fn defines(&self, name: &str) -> bool {
        self.entries.contains(&name)
    }
}

/// Declares a [`KernelSource`] static for a file of `kernels/`:
/// `kernel_source!(pub(crate) static TBE_FORWARD = "tbe_forward.cu", ["tbe_forward_f32", ...]);`
#[macro_export]
macro_rules! kernel_source {
    ($(#[$meta:meta])* $vis:vis static $name:ident = $file:literal, [$($entry:literal),* $(,)?];) => {
        $(#[$meta])*
        $vis static $name: $crate::cuda::KernelSource = $crate::cuda::KernelSource {
            file: $file,
            source: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/", $file)),
            entries: &[$($entry),*],
        };
    };
}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(0),
        reason: reason.into(),
    }
}

/// Whether NVRTC can be loaded.
pub fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library names cudarc would use.
    *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// The NVRTC architecture name of a compute capability (`(9, 0)` → `compute_90`).
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock();
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

/// Compiles `source` (with the prelude) to PTX for `arch` (`compute_80`, `compute_90`, ...).
/// Needs NVRTC, not a GPU. The PTX is kept in [`kernel_cache_dir`], keyed by the source,
/// architecture, options and NVRTC version, so later processes skip the compile.
pub fn compile_ptx(source: &KernelSource, arch: &'static str) -> Result<Ptx> {
    let file = source.file;
    if !nvrtc_present() {
        return Err(unavailable(
            "NVRTC not found: libnvrtc.so could not be loaded (install the PyPI wheel \
             nvidia-cuda-nvrtc-cu12 and put its nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH)",
        ));
    }
    let full = format!("{PRELUDE}\n#line 1 \"{file}\"\n{}", source.source);
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
