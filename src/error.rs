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
