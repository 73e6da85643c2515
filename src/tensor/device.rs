//! Device checks of tensor operands; [`Device`] itself lives in [`crate::device`].

pub use crate::device::Device;

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
