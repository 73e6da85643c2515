//! Typed device buffers. Memory comes from the device's [`CachingAllocator`](super::CachingAllocator)
//! on the calling thread's current stream and goes back to it when the buffer is dropped (or,
//! for managed memory, [`CudaDevice::managed_zeros`], straight from and back to the driver); work
//! on one stream runs in order, so a block freed while kernels of its stream that use it are
//! still queued is only handed out again to work queued after them. A buffer also used on
//! other streams says so ([`DeviceBuffer::record_stream`]) and its block waits for them.

use std::marker::PhantomData;
use std::sync::Arc;

use super::allocator::{Block, StreamId};
use super::CudaDevice;
use crate::Result;

mod sealed {
    pub trait Sealed {}
}

/// Plain element types a device buffer can hold (every bit pattern is a valid value).
pub trait DeviceElem: Copy + Send + Sync + 'static + sealed::Sealed {}

macro_rules! device_elem {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl DeviceElem for $t {}
    )*};
}
device_elem!(u8, u16, i32, u32, i64, u64, f32, f64, half::f16, half::bf16);

/// `len` values of `T` in a device's memory (or in managed memory it reads in place).
pub struct DeviceBuffer<T: DeviceElem> {
    device: Arc<CudaDevice>,
    block: Option<Block>,
    len: usize,
    /// Streams besides the block's own that used the buffer ([`DeviceBuffer::record_stream`]).
    other_streams: parking_lot::Mutex<Vec<StreamId>>,
    /// The block is managed memory ([`CudaDevice::managed_zeros`]), not the allocator's.
    managed: bool,
    _elem: PhantomData<T>,
}

impl<T: DeviceElem> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device.ordinal())
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T: DeviceElem> DeviceBuffer<T> {
    /// Uninitialised memory for `len` values (any bit pattern is a valid `T`).
    pub(crate) fn alloc(device: &Arc<CudaDevice>, len: usize) -> Result<Self> {
        let bytes = len * std::mem::size_of::<T>();
        let block = device.alloc_block(bytes)?;
        Ok(DeviceBuffer {
            device: device.clone(),
            block: Some(block),
            len,
            other_streams: parking_lot::Mutex::new(Vec::new()),
            managed: false,
            _elem: PhantomData,
        })
    }

    /// A buffer over `bytes` of managed memory at `ptr`, freed with it.
    pub(crate) fn managed(device: &Arc<CudaDevice>, ptr: u64, bytes: usize, len: usize) -> Self {
        DeviceBuffer {
            device: device.clone(),
            block: Some(Block {
                ptr,
                size: bytes,
                stream: super::stream::current_stream_id(device),
            }),
            len,
            other_streams: parking_lot::Mutex::new(Vec::new()),
            managed: true,
            _elem: PhantomData,
        }
    }

    /// Whether the values are in managed memory ([`CudaDevice::managed_zeros`]).
    pub fn is_managed(&self) -> bool {
        self.managed
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

    /// The device the memory is on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The device address of the first value.
    pub fn ptr(&self) -> u64 {
        self.block.as_ref().map_or(0, |b| b.ptr)
    }

    /// The device address of value `i` (`i ≤ len`).
    pub fn ptr_at(&self, i: usize) -> u64 {
        assert!(i <= self.len, "ptr_at({i}) past a buffer of {}", self.len);
        self.ptr() + (i * std::mem::size_of::<T>()) as u64
    }

    /// Copies the values back to the host (waits for the work queued before).
    pub fn to_host(&self) -> Result<Vec<T>> {
        let mut out = Vec::<T>::with_capacity(self.len);
        // SAFETY: `out` has room for `len` values; the copy fills all of them before `set_len`.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, self.bytes());
            self.device.copy_to_host(dst, self.ptr())?;
            out.set_len(self.len);
        }
        Ok(out)
    }

    /// Overwrites the buffer with `host` (same length).
    pub fn copy_from_host(&mut self, host: &[T]) -> Result<()> {
        self.check_len("copy_from_host", host.len())?;
        // SAFETY: `host` is `bytes()` bytes of plain values.
        let src = unsafe {
            std::slice::from_raw_parts(host.as_ptr() as *const u8, std::mem::size_of_val(host))
        };
        self.device.copy_from_host(self.ptr(), src)
    }

    /// Overwrites the buffer with another buffer of the same device and length.
    pub fn copy_from(&mut self, other: &DeviceBuffer<T>) -> Result<()> {
        self.check_len("copy_from", other.len)?;
        if !Arc::ptr_eq(&self.device, &other.device) {
            return Err(crate::Error::DeviceMismatch {
                op: "DeviceBuffer::copy_from",
                lhs: crate::Device::Cuda(self.device.ordinal()),
                rhs: crate::Device::Cuda(other.device.ordinal()),
            });
        }
        self.device
            .copy_on_device(self.ptr(), other.ptr(), self.bytes())
    }

    /// The same memory as raw bytes (for tensor storage).
    pub(crate) fn into_bytes(mut self) -> DeviceBuffer<u8> {
        DeviceBuffer {
            device: self.device.clone(),
            block: self.block.take(),
            len: self.bytes(),
            other_streams: parking_lot::Mutex::new(std::mem::take(self.other_streams.get_mut())),
            managed: self.managed,
            _elem: PhantomData,
        }
    }

    /// The stream the buffer's block was allocated on, and the other streams noted as using
    /// it.
    #[cfg(test)]
    pub(crate) fn streams(&self) -> (Option<StreamId>, Vec<StreamId>) {
        (
            self.block.as_ref().map(|b| b.stream),
            self.other_streams.lock().clone(),
        )
    }

    /// Adds `stream` to the streams the buffer's memory must wait for when freed.
    pub(crate) fn note_stream(&self, stream: StreamId) {
        let own = self.block.as_ref().map(|b| b.stream);
        let mut others = self.other_streams.lock();
        if own != Some(stream) && !others.contains(&stream) {
            others.push(stream);
        }
    }

    /// Sets every byte to zero.
    pub fn fill_zero(&mut self) -> Result<()> {
        self.device.zero_bytes(self.ptr(), self.bytes())
    }

    fn check_len(&self, op: &'static str, n: usize) -> Result<()> {
        if n != self.len {
            return Err(crate::Error::invalid(
                op,
                format!("{n} values for a device buffer of {}", self.len),
            ));
        }
        Ok(())
    }
}

impl<T: DeviceElem> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            if self.managed {
                self.device.free_managed(block.ptr, block.size);
            } else {
                self.device.free_block(block, self.other_streams.get_mut());
            }
        }
    }
}
