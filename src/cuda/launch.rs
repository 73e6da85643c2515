//! Kernel launches: the grid/block shape and the argument list, shared by the CUDA driver and
//! the host emulation (both take the arguments as an array of pointers to their values).

use std::ffi::c_void;

use super::buffer::{DeviceBuffer, DeviceElem};

/// The shape of a launch: grid and block dimensions and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

/// Most blocks a 1-D grid-stride launch uses (the kernels loop over the rest).
const MAX_LINEAR_BLOCKS: usize = 65_535;

impl LaunchConfig {
    /// One thread per item, `threads` per block (at least one block). Kernels launched this way
    /// loop grid-stride when `n` exceeds what the grid covers.
    pub fn linear(n: usize, threads: u32) -> Self {
        let blocks = n.div_ceil(threads as usize).clamp(1, MAX_LINEAR_BLOCKS);
        LaunchConfig {
            grid: (blocks as u32, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }

    /// One thread per item with no grid-stride loop: exactly `ceil(n / threads)` blocks.
    pub fn covering(n: usize, threads: u32) -> Self {
        LaunchConfig {
            grid: (n.div_ceil(threads as usize).max(1) as u32, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }

    /// One block of `threads` threads (the whole-array scans).
    pub fn single_block(threads: u32) -> Self {
        LaunchConfig {
            grid: (1, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }

    /// One warp per item, `warps` warps per block: blocks of `(32, warps)` threads.
    pub fn warp_per_item(items: usize, warps: u32) -> Self {
        LaunchConfig {
            grid: (items.div_ceil(warps as usize).max(1) as u32, 1, 1),
            block: (32, warps, 1),
            shared_bytes: 0,
        }
    }
}

/// The kind of one kernel argument (what the emulation checks against the kernel's parameter
/// list).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// A device pointer (possibly null).
    Pointer,
    /// `int`.
    I32,
    /// `unsigned int`.
    U32,
    /// `long long`.
    I64,
    /// `unsigned long long`.
    U64,
    /// `float`.
    F32,
    /// `double`.
    F64,
}

impl ArgKind {
    /// Size of the value in bytes.
    pub fn size(self) -> usize {
        match self {
            ArgKind::I32 | ArgKind::U32 | ArgKind::F32 => 4,
            ArgKind::Pointer | ArgKind::I64 | ArgKind::U64 | ArgKind::F64 => 8,
        }
    }

    /// Whether the argument is a pointer.
    pub fn is_pointer(self) -> bool {
        self == ArgKind::Pointer
    }
}

/// The argument list of one launch, built in the order of the kernel's parameters.
#[derive(Debug, Default)]
pub struct KernelArgs {
    values: Vec<u64>,
    kinds: Vec<ArgKind>,
}

impl KernelArgs {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(&mut self, bits: u64, kind: ArgKind) -> &mut Self {
        self.values.push(bits);
        self.kinds.push(kind);
        self
    }

    /// A buffer's device address (the kernel may read or write it).
    pub fn buffer<T: DeviceElem>(&mut self, b: &DeviceBuffer<T>) -> &mut Self {
        self.push(b.ptr(), ArgKind::Pointer)
    }

    /// A buffer's address, or null.
    pub fn opt_buffer<T: DeviceElem>(&mut self, b: Option<&DeviceBuffer<T>>) -> &mut Self {
        self.push(b.map_or(0, DeviceBuffer::ptr), ArgKind::Pointer)
    }

    /// A raw device address.
    pub fn pointer(&mut self, address: u64) -> &mut Self {
        self.push(address, ArgKind::Pointer)
    }

    /// An `int`.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.push(v as u32 as u64, ArgKind::I32)
    }

    /// An `unsigned int`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.push(v as u64, ArgKind::U32)
    }

    /// A `long long`.
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.push(v as u64, ArgKind::I64)
    }

    /// An `unsigned long long`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.push(v, ArgKind::U64)
    }

    /// A `float`.
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.push(v.to_bits() as u64, ArgKind::F32)
    }

    /// A `double`.
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.push(v.to_bits(), ArgKind::F64)
    }

    /// The kinds, in order.
    pub fn kinds(&self) -> &[ArgKind] {
        &self.kinds
    }

    /// Pointers to each value (the `void**` both the driver and the emulation take). Values sit
    /// in 8-byte slots, little-endian, so a pointer to a slot is a pointer to a 4-byte value.
    pub(crate) fn params(&mut self) -> Vec<*mut c_void> {
        self.values
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect()
    }
}
