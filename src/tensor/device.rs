//! Where a tensor's storage lives.

use std::fmt;

/// A compute device. Only the CPU exists today; CUDA devices slot in here without changing call
/// sites (every constructor takes a `Device`, every op checks its operands agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed with rayon-parallel kernels.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (tensors cannot live there yet; see [`crate::cuda`]).
    Cuda(usize),
}

impl Device {
    /// Returns the CUDA device `ordinal`, or an error saying why it cannot be used: no driver,
    /// no GPU, ordinal out of range, no NVRTC — or, when all of those are present, that tensors
    /// cannot live on the GPU yet (the device probe and kernel compilation exist, device storage
    /// does not).
    pub fn cuda(ordinal: usize) -> crate::Result<Device> {
        let device = crate::cuda::device(ordinal)?;
        Err(crate::Error::DeviceUnavailable {
            device: Device::Cuda(ordinal),
            reason: format!(
                "GPU found ({}), but tensors on CUDA devices are not implemented yet",
                device.arch()
            ),
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
