//! Where a tensor's storage lives: [`Device`].

use std::fmt;

/// A compute device: the CPU or a CUDA GPU (every constructor takes a `Device`, every op checks
/// its operands agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed with rayon-parallel kernels.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (see [`crate::cuda`]; with `EMBERS_CUDA_SIM=<n>` the host
    /// emulation of one). [`Device::cuda`] opens it and says why it cannot be used.
    Cuda(usize),
}

impl Device {
    /// True for CUDA devices.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
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

/// A device name that is not `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a device (expected cpu, cuda or cuda:N)")]
pub struct ParseDeviceError(pub String);

impl std::str::FromStr for Device {
    type Err = ParseDeviceError;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, ParseDeviceError> {
        let bad = || ParseDeviceError(s.to_string());
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                Ok(Device::Cuda(n.parse().map_err(|_| bad())?))
            }
        }
    }
}
