//! The one error type of embers. User mistakes come back as values that name the operation, the
//! place (dimension, index position, table, feature) and what was expected.

/// Result alias used throughout embers.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error embers returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Two operands' shapes do not fit together.
    #[error("{op}: shape mismatch between {lhs:?} and {rhs:?}{}", fmt_detail(.detail))]
    ShapeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// Shape of the first operand.
        lhs: Vec<usize>,
        /// Shape of the second operand.
        rhs: Vec<usize>,
        /// What was expected, when more can be said.
        detail: String,
    },
    /// A shape or argument is invalid for the operation.
    #[error("{op}: {msg}")]
    Invalid {
        /// The operation that failed.
        op: &'static str,
        /// What was wrong and what was expected.
        msg: String,
    },
    /// Operands have different dtypes where equal ones are required.
    #[error("{op}: dtype mismatch between {lhs:?} and {rhs:?}")]
    DTypeMismatch {
        /// The operation that failed.
        op: &'static str,
        /// First operand's dtype.
        lhs: crate::dtype::DType,
        /// Second operand's dtype.
        rhs: crate::dtype::DType,
    },
    /// The operation does not support this dtype.
    #[error("{op}: dtype {dtype:?} is not supported (expected {expected})")]
    UnsupportedDType {
        /// The operation that failed.
        op: &'static str,
        /// The dtype that was given.
        dtype: crate::dtype::DType,
        /// What the operation accepts.
        expected: &'static str,
    },
    /// Operands live on different devices.
    #[error("{op}: device mismatch between {lhs} and {rhs}")]
    DeviceMismatch {
        /// The operation that failed.
        op: &'static str,
        /// First operand's device.
        lhs: crate::device::Device,
        /// Second operand's device.
        rhs: crate::device::Device,
    },
    /// A device was asked for that this machine or build cannot provide.
    #[error("device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: crate::device::Device,
        /// Why it cannot be used.
        reason: String,
    },
    /// An operation on a device failed: allocation, copy, kernel launch or a fault a kernel
    /// reported.
    #[error("{op} on {device}: {msg}")]
    Device {
        /// The device.
        device: crate::device::Device,
        /// The operation that failed.
        op: &'static str,
        /// What happened.
        msg: String,
    },
    /// A dimension index is out of range.
    #[error("{op}: dimension {dim} is out of range for a tensor of rank {rank}")]
    DimOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The dimension given (negative counts from the end).
        dim: isize,
        /// The tensor's rank.
        rank: usize,
    },
    /// An index value is out of range.
    #[error("{op}: index {index} at position {position} is out of range for size {size}")]
    IndexOutOfRange {
        /// The operation that failed.
        op: &'static str,
        /// The offending index value.
        index: i64,
        /// Where in the index tensor it was found.
        position: usize,
        /// The size of the indexed dimension.
        size: usize,
    },
    /// Backward was asked to run through a node whose saved state was already freed.
    #[error(
        "backward through `{op}` a second time: its saved tensors were freed by the first \
         backward; call `backward_with(grad, true)` (retain_graph) the first time to keep them"
    )]
    BackwardTwice {
        /// The operation whose state was freed.
        op: &'static str,
    },
    /// Backward through `op` needs a tensor its forward saved, and that tensor (or a view of
    /// its storage) was written in place since: its gradient would be computed from the new
    /// values. PyTorch refuses the same way.
    #[error(
        "backward through `{op}`: a tensor of shape {shape:?} that its forward saved was \
         modified in place since (version {saved} when saved, {now} now: copy_from, \
         update_in_place, data_mut, move_to_device or an optimizer step); run the forward \
         again after the change, or change a copy"
    )]
    ModifiedInPlace {
        /// The op whose backward needs the tensor.
        op: &'static str,
        /// The saved tensor's shape.
        shape: Vec<usize>,
        /// Its version when the forward saved it.
        saved: u64,
        /// Its version at the backward.
        now: u64,
    },
    /// Backward could not run (e.g. the tensor does not require grad, or a gradient has the
    /// wrong shape).
    #[error("backward: {0}")]
    Backward(String),
    /// A collective between ranks failed or timed out, or the ranks disagree (plan, keys,
    /// world size); the message names the rank, the op and its number.
    #[error("{0}")]
    Distributed(String),
    /// An I/O error, with the path involved.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

fn fmt_detail(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" ({detail})")
    }
}

impl Error {
    /// Shorthand for [`Error::Invalid`].
    pub fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            msg: msg.into(),
        }
    }

    /// The same error again, for each of several callers waiting on one operation: every
    /// variant and field as it is, an I/O error's source as its kind and text.
    pub fn duplicate(&self) -> Self {
        use Error::*;
        match self {
            ShapeMismatch {
                op,
                lhs,
                rhs,
                detail,
            } => ShapeMismatch {
                op,
                lhs: lhs.clone(),
                rhs: rhs.clone(),
                detail: detail.clone(),
            },
            Invalid { op, msg } => Invalid {
                op,
                msg: msg.clone(),
            },
            DTypeMismatch { op, lhs, rhs } => DTypeMismatch {
                op,
                lhs: *lhs,
                rhs: *rhs,
            },
            UnsupportedDType {
                op,
                dtype,
                expected,
            } => UnsupportedDType {
                op,
                dtype: *dtype,
                expected,
            },
            DeviceMismatch { op, lhs, rhs } => DeviceMismatch {
                op,
                lhs: *lhs,
                rhs: *rhs,
            },
            DeviceUnavailable { device, reason } => DeviceUnavailable {
                device: *device,
                reason: reason.clone(),
            },
            Device { device, op, msg } => Device {
                device: *device,
                op,
                msg: msg.clone(),
            },
            DimOutOfRange { op, dim, rank } => DimOutOfRange {
                op,
                dim: *dim,
                rank: *rank,
            },
            IndexOutOfRange {
                op,
                index,
                position,
                size,
            } => IndexOutOfRange {
                op,
                index: *index,
                position: *position,
                size: *size,
            },
            BackwardTwice { op } => BackwardTwice { op },
            ModifiedInPlace {
                op,
                shape,
                saved,
                now,
            } => ModifiedInPlace {
                op,
                shape: shape.clone(),
                saved: *saved,
                now: *now,
            },
            Backward(msg) => Backward(msg.clone()),
            Distributed(msg) => Distributed(msg.clone()),
            Io { path, source } => Io {
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }

    /// Shorthand for [`Error::ShapeMismatch`] without detail.
    pub fn shape(op: &'static str, lhs: &[usize], rhs: &[usize]) -> Self {
        Error::ShapeMismatch {
            op,
            lhs: lhs.to_vec(),
            rhs: rhs.to_vec(),
            detail: String::new(),
        }
    }
}

impl From<crate::device::ParseDeviceError> for Error {
    fn from(e: crate::device::ParseDeviceError) -> Self {
        Error::invalid("Device", e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::dtype::DType;

    /// A duplicate says what the original says, as the same variant; an I/O error keeps its
    /// kind.
    #[test]
    fn a_duplicate_is_the_same_error() {
        let errors = [
            Error::shape("matmul", &[2, 3], &[4, 5]),
            Error::invalid("op", "bad"),
            Error::DTypeMismatch {
                op: "add",
                lhs: DType::F32,
                rhs: DType::I64,
            },
            Error::UnsupportedDType {
                op: "sum",
                dtype: DType::I64,
                expected: "a float",
            },
            Error::DeviceMismatch {
                op: "add",
                lhs: Device::Cpu,
                rhs: Device::Cuda(0),
            },
            Error::DeviceUnavailable {
                device: Device::Cuda(1),
                reason: "none".into(),
            },
            Error::Device {
                device: Device::Cuda(0),
                op: "copy",
                msg: "fault".into(),
            },
            Error::DimOutOfRange {
                op: "sum",
                dim: -3,
                rank: 2,
            },
            Error::IndexOutOfRange {
                op: "gather",
                index: 9,
                position: 1,
                size: 4,
            },
            Error::BackwardTwice { op: "mul" },
            Error::Backward("no grad".into()),
            Error::Distributed("rank 1".into()),
            Error::Io {
                path: "a/b".into(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "gone"),
            },
        ];
        for e in &errors {
            let d = e.duplicate();
            assert_eq!(d.to_string(), e.to_string());
            assert_eq!(std::mem::discriminant(&d), std::mem::discriminant(e));
            if let (Error::Io { source: a, .. }, Error::Io { source: b, .. }) = (e, &d) {
                assert_eq!(a.kind(), b.kind());
            }
        }
    }
}
