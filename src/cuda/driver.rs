//! The real CUDA device: a context, its streams (the default one and those made by
//! `CudaDevice::new_stream`), the kernel modules compiled by NVRTC for the device's
//! architecture, and raw memory operations, each queued on the stream it is given.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::Mutex;

use cudarc::driver::{result, CudaContext, CudaFunction, CudaModule, CudaStream};

use super::allocator::StreamId;
use super::launch::LaunchConfig;
use super::pinned::{Staging, STAGING_CHUNK};
use super::{compile_ptx, Kernel};
use crate::device::Device;
use crate::error::{Error, Result};

pub(crate) struct Driver {
    pub(crate) context: Arc<CudaContext>,
    /// By id; 0 is the default stream.
    streams: Mutex<HashMap<StreamId, Arc<CudaStream>>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// Per stream: the pinned chunks small host-to-device copies are staged through.
    staging: Mutex<HashMap<StreamId, Staging>>,
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Copies may still read the staging chunks, which are freed with the fields.
        let _ = self.context.synchronize();
    }
}

/// Where an operation goes: the device (for errors) and the stream it is queued on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct At {
    pub(crate) ordinal: usize,
    pub(crate) stream: StreamId,
}

/// `cuMemHostAlloc`'s write-combined flag: fast for memory the host only writes and the GPU
/// reads (the staging ring), slow for host reads.
const WRITE_COMBINED: u32 = cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED;

fn failed(ordinal: usize, op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Device {
        device: Device::Cuda(ordinal),
        op,
        msg: e.to_string(),
    }
}

impl Driver {
    pub(crate) fn new(context: Arc<CudaContext>, ordinal: usize) -> Result<Self> {
        let stream = context
            .new_stream()
            .map_err(|e| failed(ordinal, "creating a stream", e))?;
        Ok(Driver {
            context,
            streams: Mutex::new(HashMap::from([(0, stream)])),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            staging: Mutex::new(HashMap::new()),
        })
    }

    /// Creates stream `id`.
    pub(crate) fn add_stream(&self, ordinal: usize, id: StreamId) -> Result<()> {
        let stream = self
            .context
            .new_stream()
            .map_err(|e| failed(ordinal, "creating a stream", e))?;
        self.streams.lock().insert(id, stream);
        Ok(())
    }

    /// The stream an operation goes to.
    pub(crate) fn stream(&self, at: At) -> Result<Arc<CudaStream>> {
        self.streams
            .lock()
            .get(&at.stream)
            .cloned()
            .ok_or_else(|| failed(at.ordinal, "stream", format!("no stream {}", at.stream)))
    }

    /// Makes later work on `waiter` wait for the work queued on `on` so far.
    pub(crate) fn stream_wait(&self, waiter: At, on: At) -> Result<()> {
        let event = self.record_event(on)?;
        self.wait_event(waiter, &event)
    }

    /// Makes later work on the stream of `at` wait for `event`.
    pub(crate) fn wait_event(&self, at: At, event: &cudarc::driver::CudaEvent) -> Result<()> {
        self.stream(at)?
            .wait(event)
            .map_err(|e| failed(at.ordinal, "making a stream wait for an event", e))
    }

    /// Waits for the work queued on every stream of the device.
    pub(crate) fn synchronize_all(&self, ordinal: usize) -> Result<()> {
        self.context.synchronize().map_err(|e| {
            failed(
                ordinal,
                "synchronize (an earlier kernel may have failed)",
                e,
            )
        })
    }

    fn bind(&self, ordinal: usize) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(|e| failed(ordinal, "binding the context", e))
    }

    fn function(&self, ordinal: usize, arch: &'static str, kernel: Kernel) -> Result<CudaFunction> {
        let key = (kernel.source.file, kernel.name);
        if let Some(f) = self.functions.lock().get(&key) {
            return Ok(f.clone());
        }
        let module = {
            let mut modules = self.modules.lock();
            match modules.get(kernel.source.file) {
                Some(m) => m.clone(),
                None => {
                    let ptx = compile_ptx(kernel.source, arch)?;
                    let m = self
                        .context
                        .load_module(ptx)
                        .map_err(|e| failed(ordinal, "loading a kernel module", e))?;
                    modules.insert(kernel.source.file, m.clone());
                    m
                }
            }
        };
        let f = module
            .load_function(kernel.name)
            .map_err(|e| failed(ordinal, "loading a kernel", e))?;
        self.functions.lock().insert(key, f.clone());
        Ok(f)
    }

    pub(crate) fn copy_from_host(&self, at: At, dst: u64, src: &[u8]) -> Result<()> {
        self.bind(at.ordinal)?;
        if src.is_empty() {
            return Ok(());
        }
        if src.len() <= STAGING_CHUNK {
            let mut rings = self.staging.lock();
            let staging = rings.entry(at.stream).or_insert_with(Staging::new);
            let chunk = staging.reserve(
                at.ordinal,
                src.len(),
                || self.record_event(at),
                || self.malloc_pinned_with_flags(at.ordinal, STAGING_CHUNK, WRITE_COMBINED),
            )?;
            // SAFETY: the reserved room holds `src.len()` bytes and no queued copy reads it;
            // `dst` is a device allocation of at least that many (the caller's buffer).
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), chunk, src.len());
                let staged = std::slice::from_raw_parts(chunk as *const u8, src.len());
                return result::memcpy_htod_async(dst, staged, self.stream(at)?.cu_stream())
                    .map_err(|e| failed(at.ordinal, "host-to-device copy", e));
            }
        }
        // SAFETY: `dst` is a device allocation of at least `src.len()` bytes (the caller's
        // buffer); a copy from pageable memory is staged before this returns.
        unsafe { result::memcpy_htod_async(dst, src, self.stream(at)?.cu_stream()) }
            .map_err(|e| failed(at.ordinal, "host-to-device copy", e))
    }

    /// `bytes` of managed (unified) memory, kept on the host and read and written by this
    /// device in place (FBGEMM's `new_managed_tensor`: preferred location the CPU, accessed by
    /// the device), zeroed. The advice is a hint: a driver that refuses it still gives memory
    /// both sides can use.
    pub(crate) fn malloc_managed(&self, ordinal: usize, bytes: usize) -> Result<u64> {
        use cudarc::driver::sys;
        self.bind(ordinal)?;
        let bytes = bytes.max(1);
        // SAFETY: a plain allocation, owned by the caller from here on (freed by
        // `free_managed`).
        let ptr =
            unsafe { result::malloc_managed(bytes, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                .map_err(|e| failed(ordinal, "allocating managed memory", e))?;
        // `CU_DEVICE_CPU`: the host.
        const CPU: sys::CUdevice = -1;
        // SAFETY: advice on the range just allocated.
        unsafe {
            let _ = sys::cuMemAdvise(
                ptr,
                bytes,
                sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                CPU,
            );
            let _ = sys::cuMemAdvise(
                ptr,
                bytes,
                sys::CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY,
                ordinal as sys::CUdevice,
            );
        }
        // SAFETY: `bytes` bytes at `ptr` were just allocated; the device is idle on them.
        if let Err(e) = unsafe { result::memset_d8_sync(ptr, 0, bytes) } {
            // SAFETY: allocated above, used by nothing.
            let _ = unsafe { result::free_sync(ptr) };
            return Err(failed(ordinal, "zeroing managed memory", e));
        }
        Ok(ptr)
    }

    /// Frees memory of [`malloc_managed`](Self::malloc_managed) once the work queued on every
    /// stream has finished.
    ///
    /// # Safety
    /// `ptr` came from `malloc_managed` and is freed once.
    pub(crate) unsafe fn free_managed(&self, ordinal: usize, ptr: u64) {
        if self.bind(ordinal).is_ok() {
            let _ = self.context.synchronize();
            // SAFETY: the caller's promise; nothing queued uses it any more.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }

    /// `bytes` of page-locked host memory.
    pub(crate) fn malloc_pinned(&self, ordinal: usize, bytes: usize) -> Result<*mut u8> {
        self.malloc_pinned_with_flags(ordinal, bytes, 0)
    }

    fn malloc_pinned_with_flags(
        &self,
        ordinal: usize,
        bytes: usize,
        flags: u32,
    ) -> Result<*mut u8> {
        self.bind(ordinal)?;
        // SAFETY: a plain allocation; the memory is owned by the caller from here on.
        let p = unsafe { result::malloc_host(bytes.max(1), flags) }
            .map_err(|e| failed(ordinal, "allocating pinned host memory", e))?;
        Ok(p.cast())
    }

    /// Registers `bytes` of host memory at `host` with the GPU (pinned and mapped:
    /// FBGEMM's rows in host memory read by its kernels) and gives their device address.
    ///
    /// # Safety
    /// The memory stays allocated until [`unregister_host`](Self::unregister_host).
    pub(crate) unsafe fn register_host(
        &self,
        ordinal: usize,
        host: *mut u8,
        bytes: usize,
    ) -> Result<u64> {
        use cudarc::driver::sys;
        self.bind(ordinal)?;
        // SAFETY: the caller's promise.
        unsafe { sys::cuMemHostRegister_v2(host.cast(), bytes, sys::CU_MEMHOSTREGISTER_DEVICEMAP) }
            .result()
            .map_err(|e| failed(ordinal, "registering host memory with the GPU", e))?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: registered just above.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut address, host.cast(), 0) }
            .result()
            .map_err(|e| failed(ordinal, "mapping registered host memory", e));
        if let Err(e) = mapped {
            // SAFETY: registered above, used by nothing yet.
            let _ = unsafe { sys::cuMemHostUnregister(host.cast()) };
            return Err(e);
        }
        Ok(address)
    }

    /// Unregisters host memory registered by [`register_host`](Self::register_host), after
    /// the work queued before has finished.
    ///
    /// # Safety
    /// `host` was registered and is still allocated.
    pub(crate) unsafe fn unregister_host(&self, ordinal: usize, host: *mut u8) -> Result<()> {
        use cudarc::driver::sys;
        self.bind(ordinal)?;
        let _ = self.context.synchronize();
        // SAFETY: the caller's promise.
        unsafe { sys::cuMemHostUnregister(host.cast()) }
            .result()
            .map_err(|e| failed(ordinal, "unregistering host memory", e))
    }

    /// Queues a copy of `bytes` from pinned `src` to `dst` and returns an event reached when
    /// it is done.
    ///
    /// # Safety
    /// `src` is pinned memory and `dst` a device allocation, both of at least `bytes` bytes;
    /// `src` stays allocated and unwritten until the event is reached.
    pub(crate) unsafe fn copy_pinned_to_device(
        &self,
        at: At,
        dst: u64,
        src: *const u8,
        bytes: usize,
    ) -> Result<cudarc::driver::CudaEvent> {
        self.bind(at.ordinal)?;
        if bytes > 0 {
            // SAFETY: per this function's contract.
            unsafe {
                let src = std::slice::from_raw_parts(src, bytes);
                result::memcpy_htod_async(dst, src, self.stream(at)?.cu_stream())
                    .map_err(|e| failed(at.ordinal, "host-to-device copy (pinned)", e))?;
            }
        }
        self.record_event(at)
    }

    /// Queues a copy of `bytes` from `src` to pinned `dst` and returns an event reached when
    /// it is done.
    ///
    /// # Safety
    /// `dst` is pinned memory and `src` a device allocation, both of at least `bytes` bytes;
    /// `dst` stays allocated and untouched by the host until the event is reached.
    pub(crate) unsafe fn copy_device_to_pinned(
        &self,
        at: At,
        dst: *mut u8,
        src: u64,
        bytes: usize,
    ) -> Result<cudarc::driver::CudaEvent> {
        self.bind(at.ordinal)?;
        if bytes > 0 {
            // SAFETY: per this function's contract.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(dst, bytes);
                result::memcpy_dtoh_async(dst, src, self.stream(at)?.cu_stream())
                    .map_err(|e| failed(at.ordinal, "device-to-host copy (pinned)", e))?;
            }
        }
        self.record_event(at)
    }

    pub(crate) fn copy_to_host(&self, at: At, dst: &mut [u8], src: u64) -> Result<()> {
        self.bind(at.ordinal)?;
        // SAFETY: `src` holds at least `dst.len()` bytes; the stream is synchronised before
        // `dst` is used.
        unsafe {
            result::memcpy_dtoh_async(dst, src, self.stream(at)?.cu_stream())
                .map_err(|e| failed(at.ordinal, "device-to-host copy", e))?;
        }
        self.synchronize(at)
    }

    pub(crate) fn copy_on_device(&self, at: At, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind(at.ordinal)?;
        // SAFETY: both are device allocations of at least `bytes` bytes.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream(at)?.cu_stream()) }
            .map_err(|e| failed(at.ordinal, "device-to-device copy", e))
    }

    pub(crate) fn zero_bytes(&self, at: At, dst: u64, bytes: usize) -> Result<()> {
        self.bind(at.ordinal)?;
        // SAFETY: `dst` holds at least `bytes` bytes.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream(at)?.cu_stream()) }
            .map_err(|e| failed(at.ordinal, "memset", e))
    }

    pub(crate) fn synchronize(&self, at: At) -> Result<()> {
        self.stream(at)?.synchronize().map_err(|e| {
            failed(
                at.ordinal,
                "synchronize (an earlier kernel may have failed)",
                e,
            )
        })
    }

    /// An event without timing, recorded at the current point of `at`'s stream.
    pub(crate) fn record_marker(&self, at: At) -> Result<cudarc::driver::CudaEvent> {
        self.stream(at)?
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .map_err(|e| failed(at.ordinal, "recording an event", e))
    }

    pub(crate) fn record_event(&self, at: At) -> Result<cudarc::driver::CudaEvent> {
        self.stream(at)?
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| failed(at.ordinal, "recording an event", e))
    }

    /// # Safety
    /// `params` match the kernel's parameters; the buffers they point to are large enough.
    pub(crate) unsafe fn launch(
        &self,
        at: At,
        arch: &'static str,
        kernel: Kernel,
        cfg: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let f = self.function(at.ordinal, arch, kernel)?;
        self.bind(at.ordinal)?;
        // SAFETY: per this function's contract; the driver copies the argument values before
        // returning.
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                cfg.grid,
                cfg.block,
                cfg.shared_bytes,
                self.stream(at)?.cu_stream(),
                params,
            )
        }
        .map_err(|e| failed(at.ordinal, "kernel launch", format!("{}: {e}", kernel.name)))
    }
}
