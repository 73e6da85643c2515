//! Kernel launches: the grid/block shape and the typed argument list ([`KernelArg`]: device
//! buffers, tensors and scalars, never raw addresses), shared by the CUDA driver and the host
//! emulation (both take the arguments as an array of pointers to their values).

use std::ffi::c_void;

use super::buffer::{DeviceBuffer, DeviceElem};
use super::CudaDevice;
use crate::device::Device;
use crate::error::{Error, Result};

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

    /// `blocks` blocks of `threads` threads (one block per item or tile).
    pub fn blocks(blocks: usize, threads: u32) -> Self {
        LaunchConfig {
            grid: (blocks.max(1) as u32, 1, 1),
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

/// The argument list of one launch, built in the order of the kernel's parameters: each value
/// in an 8-byte slot with its kind.
#[derive(Debug, Default)]
pub struct KernelArgs {
    values: Vec<u64>,
    kinds: Vec<ArgKind>,
}

impl KernelArgs {
    fn push(&mut self, bits: u64, kind: ArgKind) {
        self.values.push(bits);
        self.kinds.push(kind);
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

/// Memory of a device that a kernel, a copy or a library call can be handed: a
/// [`DeviceBuffer`], or (in the tensor backend) a CUDA tensor's view.
pub trait DeviceOperand {
    /// The device address of the first element and the bytes from there to the end of the
    /// allocation, after checking the memory lives on `device`.
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)>;

    /// The device address of the first element (checked as [`device_span`](Self::device_span)).
    fn device_address(&self, device: &CudaDevice) -> Result<u64> {
        Ok(self.device_span(device)?.0)
    }
}

impl<T: DeviceElem> DeviceOperand for DeviceBuffer<T> {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        if !std::ptr::eq(self.device().as_ref(), device) {
            return Err(Error::DeviceMismatch {
                op: "kernel launch",
                lhs: Device::Cuda(device.ordinal()),
                rhs: Device::Cuda(self.device().ordinal()),
            });
        }
        Ok((self.ptr(), self.bytes()))
    }
}

/// One argument of a kernel launch: device memory (typed buffers and tensors, never raw
/// addresses), an optional one (null when absent), or a scalar of the kernel's C type.
pub trait KernelArg {
    /// Appends the argument for a launch on `device`.
    fn push_to(&self, device: &CudaDevice, args: &mut KernelArgs) -> Result<()>;
}

impl<T: DeviceOperand + ?Sized> KernelArg for T {
    fn push_to(&self, device: &CudaDevice, args: &mut KernelArgs) -> Result<()> {
        args.push(self.device_address(device)?, ArgKind::Pointer);
        Ok(())
    }
}

/// An absent operand is a null pointer.
impl<T: DeviceOperand> DeviceOperand for Option<&T> {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        self.map_or(Ok((0, 0)), |t| t.device_span(device))
    }
}

impl<T: DeviceOperand + ?Sized> DeviceOperand for &T {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        (**self).device_span(device)
    }
}

impl<T: DeviceOperand + ?Sized> DeviceOperand for &mut T {
    fn device_span(&self, device: &CudaDevice) -> Result<(u64, usize)> {
        (**self).device_span(device)
    }
}

/// Scalar kernel arguments: each Rust type is the kernel's C type of the same size.
macro_rules! scalar_arg {
    ($($t:ty => $kind:ident, |$v:ident| $bits:expr;)*) => {$(
        impl KernelArg for $t {
            fn push_to(&self, _: &CudaDevice, args: &mut KernelArgs) -> Result<()> {
                let $v = *self;
                args.push($bits, ArgKind::$kind);
                Ok(())
            }
        }
    )*};
}

scalar_arg! {
    i32 => I32, |v| v as u32 as u64;
    u32 => U32, |v| u64::from(v);
    i64 => I64, |v| v as u64;
    u64 => U64, |v| v;
    f32 => F32, |v| u64::from(v.to_bits());
    f64 => F64, |v| v.to_bits();
}

/// The argument list of a launch, in the kernel's parameter order:
/// `args![&weights, &offsets, n as i64, 0.5f32]` (buffers and tensors by reference, scalars of
/// the kernel's C types by value).
#[macro_export]
macro_rules! args {
    ($($arg:expr),* $(,)?) => {
        [$(&$arg as &dyn $crate::cuda::KernelArg),*]
    };
}

impl KernelArgs {
    /// The values of `args` for a launch on `device` (each device operand checked to live
    /// there).
    pub(crate) fn collect(device: &CudaDevice, args: &[&dyn KernelArg]) -> Result<KernelArgs> {
        let mut out = KernelArgs::default();
        for a in args {
            a.push_to(device, &mut out)?;
        }
        Ok(out)
    }
}
