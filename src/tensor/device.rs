//! Where a tensor's storage lives.

use std::fmt;

/// A compute device: the CPU or a CUDA GPU (every constructor takes a `Device`, every op checks
/// its operands agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed with rayon-parallel kernels.
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (see [`crate::cuda`]; with `EMBERS_CUDA_SIM=<n>` the host
    /// emulation of one).
    Cuda(usize),
}

impl Device {
    /// Returns the CUDA device `ordinal` once it has been opened, or an error saying why it
    /// cannot be used: no driver, no GPU, ordinal out of range, no NVRTC.
    pub fn cuda(ordinal: usize) -> crate::Result<Device> {
        crate::cuda::device(ordinal)?;
        Ok(Device::Cuda(ordinal))
    }

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

impl std::str::FromStr for Device {
    type Err = crate::Error;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> crate::Result<Device> {
        let bad = || {
            crate::Error::invalid(
                "Device",
                format!("`{s}` is not a device (expected cpu, cuda or cuda:N)"),
            )
        };
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

/// Checks that `a` and `b` live on the same device (an error naming `op` and both otherwise).
pub(crate) fn same_device(
    op: &'static str,
    a: &super::Tensor,
    b: &super::Tensor,
) -> crate::Result<()> {
    if a.device() != b.device() {
        return Err(crate::Error::DeviceMismatch {
            op,
            lhs: a.device(),
            rhs: b.device(),
        });
    }
    Ok(())
}
