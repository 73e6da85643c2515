//! Parameter initialisations (PyTorch's conventions for fan-in/fan-out).

use crate::tensor::rng::Rng;
use crate::{DType, Error, Result, Tensor};

/// How to fill a new parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// PyTorch's `nn.Linear` default: U(−1/√fan_in, 1/√fan_in).
    LinearDefault,
    /// Glorot uniform: U(−a, a), a = √(6 / (fan_in + fan_out)).
    XavierUniform,
    /// Glorot normal: N(0, 2 / (fan_in + fan_out)).
    XavierNormal,
    /// He uniform for ReLU: U(−a, a), a = √(6 / fan_in).
    KaimingUniform,
    /// He normal for ReLU: N(0, 2 / fan_in).
    KaimingNormal,
    /// N(0, std²).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// U(low, high).
    Uniform {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// All zeros.
    Zeros,
}

impl Init {
    /// A new tensor of `shape` for a layer with the given fan-in/fan-out.
    pub fn tensor(
        self,
        shape: &[usize],
        fan_in: usize,
        fan_out: usize,
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType {
                op: "init",
                dtype,
                expected: "a float dtype",
            });
        }
        // The values are drawn as f64 first: 8 bytes each must be addressable.
        if crate::tensor::addressable_bytes(shape, 8).is_none() {
            return Err(Error::invalid(
                "init",
                format!("a tensor of shape {shape:?} is past any memory"),
            ));
        }
        let (fi, fo) = (fan_in.max(1) as f64, fan_out.max(1) as f64);
        let uniform = |a: f64, rng: &mut Rng| Tensor::try_rand_uniform(shape, -a, a, dtype, rng);
        match self {
            Init::LinearDefault => uniform(1.0 / fi.sqrt(), rng),
            Init::XavierUniform => uniform((6.0 / (fi + fo)).sqrt(), rng),
            Init::XavierNormal => {
                Tensor::try_randn(shape, 0.0, (2.0 / (fi + fo)).sqrt(), dtype, rng)
            }
            Init::KaimingUniform => uniform((6.0 / fi).sqrt(), rng),
            Init::KaimingNormal => Tensor::try_randn(shape, 0.0, (2.0 / fi).sqrt(), dtype, rng),
            Init::Normal { std } => Tensor::try_randn(shape, 0.0, std, dtype, rng),
            Init::Uniform { low, high } => Tensor::try_rand_uniform(shape, low, high, dtype, rng),
            Init::Zeros => Tensor::try_zeros(shape, dtype, crate::Device::Cpu),
        }
    }
}
