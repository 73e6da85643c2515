//! Jagged (variable-length) data: [`JaggedTensor`], [`KeyedJaggedTensor`], [`KeyedTensor`] and
//! the jagged op set of [`ops`].
//!
//! A jagged tensor stores the rows of every sample back to back in one `values` buffer and
//! describes where each sample starts with `lengths` (rows per sample) or `offsets` (their
//! exclusive cumulative sum, one entry longer). The keyed variants put several features in one
//! buffer, key-major: all samples of key 0, then all samples of key 1, and so on — one buffer to
//! copy to a device or across ranks instead of one per feature.
//!
//! Constructors validate their inputs and name the key and position of the first problem; the
//! `*_unchecked` constructors skip that pass for data that was validated upstream (violating the
//! invariants there gives wrong results or a panic, never undefined behaviour).

mod jagged_tensor;
mod keyed_jagged_tensor;
mod keyed_tensor;
pub mod ops;

pub use jagged_tensor::JaggedTensor;
pub use keyed_jagged_tensor::KeyedJaggedTensor;
pub use keyed_tensor::KeyedTensor;
