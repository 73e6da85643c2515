//! Page-locked ("pinned") host memory: the only host memory a GPU's copy engines read and write
//! directly, so copies from and to it are truly asynchronous — the host queues them and runs on.
//! A copy from ordinary (pageable) memory is staged by the driver, which may first wait for the
//! stream to drain, stalling the host exactly where it should run ahead.
//!
//! Two users: [`PinnedBuffer`], which callers fill with a batch and upload without waiting
//! (PyTorch's `pin_memory()` + `non_blocking=True`), and [`Staging`], the ring of pinned chunks
//! every small host-to-device copy of a device goes through (the strided-op metadata, ids,
//! offsets), so those never stall the stream either.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, CudaEvent};

use super::{CudaDevice, DeviceBuffer, DeviceElem};
use crate::{Device, Error, Result};

/// Bytes of one staging chunk; copies larger than this go to the driver directly.
pub(crate) const STAGING_CHUNK: usize = 2 << 20;
/// Chunks in a device's staging ring (16 MiB of pinned memory, allocated at first use).
const STAGING_CHUNKS: usize = 8;
/// Offsets inside a chunk are kept aligned to this (the driver's preferred DMA alignment).
const STAGING_ALIGN: usize = 256;

fn failed(device: Device, op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Device {
        device,
        op,
        msg: e.to_string(),
    }
}

/// The memory of a pinned allocation.
enum Memory {
    /// `cuMemHostAlloc`ed on a GPU's context.
    Driver(*mut u8),
    /// The host emulation: ordinary memory (its copies are synchronous memcpys).
    Host(std::alloc::Layout, *mut u8),
}

impl Memory {
    fn ptr(&self) -> *mut u8 {
        match self {
            Memory::Driver(p) | Memory::Host(_, p) => *p,
        }
    }
}

/// `len` values of `T` in page-locked host memory of a device, for asynchronous copies to and
/// from it ([`DeviceBuffer::copy_from_pinned`], [`DeviceBuffer::copy_to_pinned`]).
///
/// Reading or writing the values on the host ([`PinnedBuffer::as_slice`],
/// [`PinnedBuffer::as_mut_slice`]) first waits for the copies queued on the buffer, so the host
/// never sees a half-written buffer nor overwrites one a copy still reads.
pub struct PinnedBuffer<T: DeviceElem> {
    device: Arc<CudaDevice>,
    memory: Memory,
    len: usize,
    /// Reached once the last queued copy touching the memory is done (GPU only).
    pending: parking_lot::Mutex<Option<CudaEvent>>,
    _elem: PhantomData<T>,
}

// SAFETY: the buffer owns its memory exclusively (like a Vec<T>); the event is behind a mutex.
unsafe impl<T: DeviceElem> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads the memory (after waiting for pending copies) or queues
// copies that read it.
unsafe impl<T: DeviceElem> Sync for PinnedBuffer<T> {}

impl<T: DeviceElem> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("device", &self.device.ordinal())
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T: DeviceElem> PinnedBuffer<T> {
    /// `len` zeros in pinned memory of `device`.
    pub(crate) fn zeros(device: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(
                    "PinnedBuffer",
                    format!("{len} values overflow the address space"),
                )
            })?;
        let memory = match device.driver() {
            Some(d) => Memory::Driver(d.malloc_pinned(device.ordinal(), bytes)?),
            None => {
                let layout = std::alloc::Layout::from_size_align(bytes.max(1), 64)
                    .map_err(|e| Error::invalid("PinnedBuffer", e.to_string()))?;
                // SAFETY: a non-zero size.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(failed(
                        Device::Cuda(device.ordinal()),
                        "PinnedBuffer",
                        format!("out of host memory for {bytes} bytes"),
                    ));
                }
                Memory::Host(layout, p)
            }
        };
        if let Memory::Driver(p) = memory {
            // SAFETY: a fresh allocation of `bytes` bytes; all-zero bytes are valid values.
            unsafe { std::ptr::write_bytes(p, 0, bytes) };
        }
        Ok(PinnedBuffer {
            device: device.clone(),
            memory,
            len,
            pending: parking_lot::Mutex::new(None),
            _elem: PhantomData,
        })
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a buffer of no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device whose copies the memory serves.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Waits until every copy queued on the buffer is done.
    pub fn wait(&self) -> Result<()> {
        if let Some(e) = self.pending.lock().take() {
            e.synchronize().map_err(|err| {
                failed(
                    Device::Cuda(self.device.ordinal()),
                    "PinnedBuffer (a copy or an earlier kernel failed)",
                    err,
                )
            })?;
        }
        Ok(())
    }

    /// The values, once the copies queued on the buffer are done.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait()?;
        // SAFETY: `len` initialised values owned by the buffer; no copy writes them now, and
        // queuing one needs `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts(self.memory.ptr() as *const T, self.len) })
    }

    /// The values for writing, once the copies queued on the buffer are done.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        // SAFETY: as above, and `&mut self` excludes every other access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.memory.ptr() as *mut T, self.len) })
    }

    /// Makes the stream of `at` wait (on the device, not the host) for the copies queued on
    /// the buffer so far.
    fn order_after_pending(&self, d: &super::driver::Driver, at: super::driver::At) -> Result<()> {
        match &*self.pending.lock() {
            Some(e) => d.wait_event(at, e),
            None => Ok(()),
        }
    }

    /// Notes a queued copy touching the memory (GPU only).
    fn track(&self, event: Option<CudaEvent>) {
        if let Some(e) = event {
            *self.pending.lock() = Some(e);
        }
    }

    fn host_ptr(&self) -> *mut u8 {
        self.memory.ptr()
    }
}

impl<T: DeviceElem> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        // A copy may still read or write the memory: wait for it before freeing.
        let _ = self.wait();
        match self.memory {
            // SAFETY: allocated by cuMemHostAlloc, freed once, no copy pending.
            Memory::Driver(p) => unsafe {
                let _ = result::free_host(p.cast());
            },
            // SAFETY: allocated with this layout, freed once.
            Memory::Host(layout, p) => unsafe { std::alloc::dealloc(p, layout) },
        }
    }
}

impl<T: DeviceElem> DeviceBuffer<T> {
    fn check_pinned(&self, op: &'static str, pinned: &PinnedBuffer<T>) -> Result<()> {
        self.check_prefix(op, pinned, 0)?;
        if pinned.len != self.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "the pinned buffer holds {} values, the device buffer {}",
                    pinned.len,
                    self.len()
                ),
            ));
        }
        Ok(())
    }

    /// Queues a copy of `src` into this buffer and returns without waiting for it (the host
    /// may go on reading `src`; writing it waits for the copy).
    pub fn copy_from_pinned(&mut self, src: &PinnedBuffer<T>) -> Result<()> {
        self.check_pinned("copy_from_pinned", src)?;
        self.copy_prefix_from_pinned(src, self.len())
    }

    /// [`copy_from_pinned`](Self::copy_from_pinned) of the first `len` values only (both
    /// buffers hold at least `len`).
    pub(crate) fn copy_prefix_from_pinned(
        &mut self,
        src: &PinnedBuffer<T>,
        len: usize,
    ) -> Result<()> {
        self.check_prefix("copy_from_pinned", src, len)?;
        let bytes = len * std::mem::size_of::<T>();
        let device = self.device().clone();
        match device.driver() {
            Some(d) => {
                // A copy into `src` queued on another stream comes first.
                src.order_after_pending(d, device.at())?;
                // SAFETY: both allocations hold at least `bytes` bytes (check_prefix); the event keeps the host from
                // writing or freeing `src` before the copy is done.
                let e = unsafe {
                    d.copy_pinned_to_device(device.at(), self.ptr(), src.host_ptr(), bytes)?
                };
                src.track(Some(e));
                Ok(())
            }
            None => {
                // SAFETY: emulated device memory is host memory of at least `bytes` bytes.
                let host = unsafe { std::slice::from_raw_parts(src.host_ptr(), bytes) };
                device.copy_from_host(self.ptr(), host)
            }
        }
    }

    /// Checks that this buffer and `pinned` share a device and both hold `len` values.
    fn check_prefix(&self, op: &'static str, pinned: &PinnedBuffer<T>, len: usize) -> Result<()> {
        if !Arc::ptr_eq(self.device(), &pinned.device) {
            return Err(Error::DeviceMismatch {
                op,
                lhs: Device::Cuda(self.device().ordinal()),
                rhs: Device::Cuda(pinned.device.ordinal()),
            });
        }
        if len > pinned.len || len > self.len() {
            return Err(Error::invalid(
                op,
                format!(
                    "{len} values to copy, the pinned buffer holds {}, the device buffer {}",
                    pinned.len,
                    self.len()
                ),
            ));
        }
        Ok(())
    }

    /// Queues a copy of this buffer into `dst` and returns without waiting for it: reading
    /// `dst` ([`PinnedBuffer::as_slice`]) waits.
    pub fn copy_to_pinned(&self, dst: &mut PinnedBuffer<T>) -> Result<()> {
        self.check_pinned("copy_to_pinned", dst)?;
        self.copy_prefix_to_pinned(dst, self.len())
    }

    /// [`copy_to_pinned`](Self::copy_to_pinned) of the first `len` values only (both buffers
    /// hold at least `len`).
    pub(crate) fn copy_prefix_to_pinned(
        &self,
        dst: &mut PinnedBuffer<T>,
        len: usize,
    ) -> Result<()> {
        self.check_prefix("copy_to_pinned", dst, len)?;
        let bytes = len * std::mem::size_of::<T>();
        let device = self.device().clone();
        match device.driver() {
            Some(d) => {
                // Earlier copies touching `dst`, on any stream, come first.
                dst.order_after_pending(d, device.at())?;
                // SAFETY: both allocations hold at least `bytes` bytes (check_prefix); `dst` is borrowed mutably and
                // its readers wait for the event.
                let e = unsafe {
                    d.copy_device_to_pinned(device.at(), dst.host_ptr(), self.ptr(), bytes)?
                };
                dst.track(Some(e));
                Ok(())
            }
            None => {
                // SAFETY: `dst` owns at least `bytes` bytes, borrowed mutably.
                let host = unsafe { std::slice::from_raw_parts_mut(dst.host_ptr(), bytes) };
                device.copy_to_host(host, self.ptr())
            }
        }
    }
}

/// One chunk of the staging ring.
struct Chunk {
    ptr: *mut u8,
    /// Reached once the copies queued from this chunk are done.
    done: Option<CudaEvent>,
}

/// A device's ring of pinned chunks that small host-to-device copies are staged through: the
/// bytes are copied into the current chunk (so the caller's memory is free at once) and the
/// DMA is queued from there. A chunk is reused only after the copies queued from it are done,
/// which lets the host run thousands of small uploads ahead of the GPU.
pub(crate) struct Staging {
    chunks: Vec<Chunk>,
    current: usize,
    offset: usize,
}

// SAFETY: the chunks are owned pinned allocations, used behind the driver's mutex.
unsafe impl Send for Staging {}

impl Staging {
    pub(crate) fn new() -> Self {
        Staging {
            chunks: Vec::new(),
            current: 0,
            offset: 0,
        }
    }

    /// Room for `bytes` (≤ [`STAGING_CHUNK`]) in the ring: the host address to fill. `record`
    /// marks the end of the copies queued from a chunk being left; `alloc` makes a chunk.
    pub(crate) fn reserve(
        &mut self,
        ordinal: usize,
        bytes: usize,
        record: impl FnOnce() -> Result<CudaEvent>,
        alloc: impl FnOnce() -> Result<*mut u8>,
    ) -> Result<*mut u8> {
        debug_assert!(bytes <= STAGING_CHUNK);
        if self.chunks.is_empty() || self.offset + bytes > STAGING_CHUNK {
            if !self.chunks.is_empty() {
                self.chunks[self.current].done = Some(record()?);
                self.current = (self.current + 1) % STAGING_CHUNKS;
            }
            if self.current == self.chunks.len() {
                self.chunks.push(Chunk {
                    ptr: alloc()?,
                    done: None,
                });
            }
            if let Some(e) = self.chunks[self.current].done.take() {
                e.synchronize().map_err(|err| {
                    failed(Device::Cuda(ordinal), "staging a host-to-device copy", err)
                })?;
            }
            self.offset = 0;
        }
        let p = self.chunks[self.current].ptr.wrapping_add(self.offset);
        self.offset += bytes.div_ceil(STAGING_ALIGN) * STAGING_ALIGN;
        Ok(p)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for c in &mut self.chunks {
            if let Some(e) = c.done.take() {
                let _ = e.synchronize();
            }
            // SAFETY: allocated by cuMemHostAlloc; the copies from it are done (above, or by
            // the stream synchronisation in the driver's drop, which runs first).
            let _ = unsafe { result::free_host(c.ptr.cast()) };
        }
    }
}

/// Host memory the GPU's kernels read and write in place (registered, pinned and mapped:
/// `cuMemHostRegister`), given to kernels as a pointer. On the host emulation the host address
/// is the device address.
pub(crate) struct MappedHost {
    device: Arc<CudaDevice>,
    host: *mut u8,
    address: u64,
    bytes: usize,
}

// SAFETY: the registration is a handle to memory owned elsewhere; the driver calls are
// thread-safe.
unsafe impl Send for MappedHost {}
// SAFETY: as above; `&MappedHost` only hands out the address.
unsafe impl Sync for MappedHost {}

impl MappedHost {
    /// Registers `bytes` bytes at `host` with `device`.
    ///
    /// # Safety
    /// The memory stays allocated (and is not remapped) until the registration is dropped,
    /// and the host reads or writes it only when no kernel using it is running.
    pub(crate) unsafe fn register(
        device: &Arc<CudaDevice>,
        host: *mut u8,
        bytes: usize,
    ) -> Result<Self> {
        let address = match device.driver() {
            // SAFETY: the caller's promise.
            Some(d) => unsafe { d.register_host(device.ordinal(), host, bytes)? },
            None => host as u64,
        };
        Ok(MappedHost {
            device: device.clone(),
            host,
            address,
            bytes,
        })
    }
}

impl super::DeviceOperand for MappedHost {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        if !std::ptr::eq(self.device.as_ref(), device) {
            return Err(Error::DeviceMismatch {
                op: "kernel launch",
                lhs: Device::Cuda(device.ordinal()),
                rhs: Device::Cuda(self.device.ordinal()),
            });
        }
        Ok((self.address, self.bytes))
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        if let Some(d) = self.device.driver() {
            // SAFETY: registered by `register`; the memory is still allocated (its promise).
            let _ = unsafe { d.unregister_host(self.device.ordinal(), self.host) };
        }
    }
}
