//! [`CudaDevice`]: an open device — a GPU through the driver, or the host emulation of one —
//! with its caching allocator, streams, copies and kernel launches.

use std::sync::Arc;

use parking_lot::Mutex;

use super::allocator::{Block, CachingAllocator, RawAllocator, StreamId};
use super::launch::{DeviceOperand, KernelArg, KernelArgs, LaunchConfig};
use super::{blas, driver, sim, stream, AllocatorStats, DeviceBuffer, DeviceElem, Kernel};
use super::{PinnedBuffer, Stream};
use crate::device::Device;
use crate::error::{Error, Result};

/// How a [`CudaDevice`] executes: the CUDA driver, or the host emulation.
pub(super) enum Backend {
    Driver(Box<driver::Driver>),
    Sim(sim::Emulator),
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
    pub(super) backend: Backend,
    allocator: Mutex<DeviceAllocator>,
    /// Freed blocks other streams may still be using ([`DeviceBuffer::record_stream`]).
    pending_frees: Mutex<stream::PendingFrees<cudarc::driver::CudaEvent>>,
    /// The id the next [`CudaDevice::new_stream`] hands out.
    next_stream: std::sync::atomic::AtomicU64,
    /// The stream the embedding caches of this device prefetch on, once made.
    prefetch_stream: std::sync::OnceLock<StreamId>,
    pub(super) blas: blas::BlasSlot,
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
    pub(super) fn new(
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
            prefetch_stream: std::sync::OnceLock::new(),
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

    /// True for the host emulation ([`simulated_device`](super::simulated_device)).
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
        self.allocator.lock().stats()
    }

    /// Returns every wholly free cached segment to the device.
    pub fn empty_cache(&self) {
        self.allocator.lock().empty_cache();
    }

    /// Uninitialised device memory for `len` values.
    pub fn alloc<T: DeviceElem>(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::alloc(self, len)
    }

    /// `len` zeros in managed (unified) memory: kept on the host and read and written by this
    /// device's kernels in place, over the bus (FBGEMM's `MANAGED` placement: more than the
    /// device's memory holds). Not from the caching allocator: it does not count in
    /// [`memory_stats`](Self::memory_stats). Host memory on the emulation.
    pub fn managed_zeros<T: DeviceElem>(self: &Arc<Self>, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid("managed_zeros", format!("{len} values overflow")))?
            .max(1);
        let ptr = match &self.backend {
            Backend::Driver(d) => d.malloc_managed(self.ordinal(), bytes)?,
            // Freed by `free_managed`, with the same layout.
            Backend::Sim(_) => sim::host_layout(bytes)
                .and_then(sim::host_alloc)
                .ok_or_else(|| {
                    Error::invalid(
                        "managed_zeros",
                        format!("out of host memory for {bytes} bytes"),
                    )
                })?,
        };
        Ok(DeviceBuffer::managed(self, ptr, bytes, len))
    }

    /// Frees `bytes` of managed memory at `ptr` ([`managed_zeros`](Self::managed_zeros)).
    pub(crate) fn free_managed(&self, ptr: u64, bytes: usize) {
        match &self.backend {
            // SAFETY: from `managed_zeros`, freed once (by the buffer's drop).
            Backend::Driver(d) => unsafe { d.free_managed(self.ordinal(), ptr) },
            Backend::Sim(_) => {
                if let Some(layout) = sim::host_layout(bytes) {
                    // SAFETY: allocated by `managed_zeros` with this layout, freed once.
                    unsafe { sim::host_free(ptr, layout) };
                }
            }
        }
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

    /// Queues `kernel` on the calling thread's current stream with `args` (built by
    /// [`args!`](crate::args): device buffers and tensors by reference, scalars by value).
    ///
    /// The one place embers launches a kernel. A kernel trusts its arguments, so this is
    /// crate-internal and every caller keeps two promises: `args` follow the kernel's parameter
    /// list in `kernels/` (the host emulation checks count, sizes and pointers at every launch,
    /// and CI runs every launch path on it), and every buffer is as large as the kernel reads
    /// and writes for the sizes passed (each caller says how those sizes were checked). Device
    /// operands are checked here to live on this device.
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        cfg: LaunchConfig,
        args: &[&dyn KernelArg],
    ) -> Result<()> {
        let mut args = KernelArgs::collect(self, args)?;
        let mut params = args.params();
        match &self.backend {
            // SAFETY: the callers' promises above; the values live in `args` until the call
            // returns (the driver copies them when it queues the launch).
            Backend::Driver(d) => unsafe {
                d.launch(self.at(), self.arch, kernel, &cfg, &mut params)
            },
            // SAFETY: as above; emulated device memory is host memory.
            Backend::Sim(sim) => unsafe {
                sim.launch(self.ordinal, kernel, &cfg, &mut params, args.kinds())
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

    /// Marks the current point of the calling thread's stream for ordering only (no timing:
    /// cheaper to record; [`DeviceEvent::elapsed_ms`] refuses it on a GPU), to be waited for
    /// by [`wait_event`](Self::wait_event) on another stream.
    pub fn record_marker(&self) -> Result<DeviceEvent> {
        match &self.backend {
            Backend::Driver(d) => d.record_marker(self.at()).map(DeviceEvent::Driver),
            Backend::Sim(_) => Ok(DeviceEvent::Host(std::time::Instant::now())),
        }
    }

    /// Makes the work queued from now on the calling thread's current stream wait until
    /// `event` (recorded on any stream of this device) is reached, without blocking the host.
    pub fn wait_event(&self, event: &DeviceEvent) -> Result<()> {
        match (&self.backend, event) {
            (Backend::Driver(d), DeviceEvent::Driver(e)) => d.wait_event(self.at(), e),
            // The emulation runs every launch to completion before returning.
            (Backend::Sim(_), DeviceEvent::Host(_)) => Ok(()),
            _ => Err(Error::invalid(
                "CudaDevice::wait_event",
                "an event of another kind of device",
            )),
        }
    }

    /// Blocks the host until the work queued on the calling thread's current stream is done
    /// (the other streams' work may still run).
    pub(crate) fn synchronize_current(&self) -> Result<()> {
        self.synchronize_stream(self.at().stream)
    }

    /// The calling thread's current stream of this device.
    pub(crate) fn current_stream_id(&self) -> StreamId {
        self.at().stream
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

    /// The stream every embedding cache of this device prefetches on (made at the first
    /// call; one per device, however many caches come and go).
    pub(crate) fn prefetch_stream(self: &Arc<Self>) -> Result<Stream> {
        let id = match self.prefetch_stream.get() {
            Some(&id) => id,
            None => {
                let made = self.new_stream()?.id();
                *self.prefetch_stream.get_or_init(|| made)
            }
        };
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
            let mut pending = self.pending_frees.lock();
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
        let mut allocator = self.allocator.lock();
        self.reclaim_pending(&mut allocator, false);
        match allocator.alloc(bytes, stream) {
            Ok(b) => Ok(b),
            Err(e) => {
                // Out of memory: wait for the blocks other streams hold back, then retry.
                if self.pending_frees.lock().len() == 0 {
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
                    self.pending_frees.lock().push(block, events);
                    return;
                }
                // No event: wait for the whole device instead.
                Err(_) => {
                    let _ = d.synchronize_all(self.ordinal);
                }
            }
        }
        // A block this allocator handed out always goes back; an error here is a bug.
        let freed = self.allocator.lock().free(block);
        debug_assert!(freed.is_ok(), "{freed:?}");
    }

    /// Bytes `offset .. offset + len` of `operand` on this device, checked to lie inside it.
    fn span_at(
        &self,
        op: &'static str,
        operand: &dyn DeviceOperand,
        offset: usize,
        len: usize,
    ) -> Result<u64> {
        let (address, bytes) = operand.device_span(self)?;
        if offset.checked_add(len).is_none_or(|end| end > bytes) {
            return Err(Error::invalid(
                op,
                format!(
                    "bytes {offset}..{} of device memory of {bytes} bytes",
                    offset.saturating_add(len)
                ),
            ));
        }
        Ok(address + offset as u64)
    }

    /// Copies `src` into `dst` from byte `offset` on (the range checked to lie inside `dst`).
    pub fn write_bytes(&self, dst: &dyn DeviceOperand, offset: usize, src: &[u8]) -> Result<()> {
        let at = self.span_at("write_bytes", dst, offset, src.len())?;
        self.copy_from_host(at, src)
    }

    /// Fills `dst` with `src`'s bytes from byte `offset` on (checked), waiting for the work
    /// queued before.
    pub fn read_bytes(&self, src: &dyn DeviceOperand, offset: usize, dst: &mut [u8]) -> Result<()> {
        let at = self.span_at("read_bytes", src, offset, dst.len())?;
        self.copy_to_host(dst, at)
    }

    /// Copies `len` bytes of `src` from byte `src_offset` to `dst` from byte `dst_offset`, on
    /// the device (both ranges checked; they may overlap only if they are the same).
    pub fn copy_bytes(
        &self,
        dst: &dyn DeviceOperand,
        dst_offset: usize,
        src: &dyn DeviceOperand,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        let to = self.span_at("copy_bytes", dst, dst_offset, len)?;
        let from = self.span_at("copy_bytes", src, src_offset, len)?;
        if len == 0 || to == from {
            return Ok(());
        }
        if to < from + len as u64 && from < to + len as u64 {
            return Err(Error::invalid(
                "copy_bytes",
                "the source and destination ranges overlap",
            ));
        }
        self.copy_on_device(to, from, len)
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
