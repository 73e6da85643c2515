//! # embers
//!
//! A recommendation and embedding engine: jagged tensors, table-batched embedding bags, sharding
//! and recommendation models, all on one general reverse-mode autograd tensor core.
//!
//! The core types live in [`tensor`] ([`Tensor`], [`DType`], [`Device`]), trainable modules in
//! [`nn`] and dense optimizers in [`optim`].
//!
//! ```
//! use embers::{Tensor, Result};
//! # fn main() -> Result<()> {
//! let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?.with_requires_grad(true);
//! let x = Tensor::from_vec(vec![0.5f32, 1.0], &[1, 2])?;
//! let loss = x.matmul(&w)?.relu()?.sum_all()?;
//! loss.backward()?;
//! // d/dW Σ relu(x·W) = xᵀ·1 where x·W > 0.
//! assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![0.5, 0.5, 1.0, 1.0]);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

pub mod checkpoint;
pub mod cuda;
pub mod device;
pub mod distributed;
pub mod dtype;
pub mod embedding;
pub mod error;
pub mod kernels;
pub mod metrics;
pub mod models;
pub mod nn;
pub mod optim;
pub mod retrieval;
pub mod serve;
pub mod simd;
pub mod sparse;
pub mod tensor;
pub mod train;

pub use device::Device;
pub use dtype::DType;
pub use error::{Error, Result};
pub use tensor::{no_grad, Gradient, Tensor};

/// The README's code runs as a doctest, so the tour stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
