//! Where a tensor's storage lives.

use std::fmt;

/// A compute device. Only the CPU exists today; CUDA devices slot in here without changing call
/// sites (every constructor takes a `Device`, every op checks its operands agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed with rayon-parallel kernels.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (not yet available in this build).
    Cuda(usize),
}

impl Device {
    /// Returns the CUDA device `ordinal`, or an error saying why it cannot be used.
    pub fn cuda(ordinal: usize) -> crate::Result<Device> {
        Err(crate::Error::DeviceUnavailable {
            device: Device::Cuda(ordinal),
            reason: "this build of embers has no CUDA backend yet".into(),
        })
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
