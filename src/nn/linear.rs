//! The fully connected layer.

use super::{Forward, Init, Module};
use crate::tensor::rng::Rng;
use crate::{DType, Result, Tensor};

/// `y = x·Wᵀ + b` with `W: [out, in]`, `b: [out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`, if the layer has a bias.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer with PyTorch's default initialisation (weight and bias U(±1/√in)).
    pub fn new(in_features: usize, out_features: usize, rng: &mut Rng) -> Result<Self> {
        Linear::with_init(
            in_features,
            out_features,
            true,
            Init::LinearDefault,
            Init::LinearDefault,
            DType::F32,
            rng,
        )
    }

    /// A layer with explicit initialisers and dtype.
    pub fn with_init(
        in_features: usize,
        out_features: usize,
        bias: bool,
        weight_init: Init,
        bias_init: Init,
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        let weight = weight_init
            .tensor(
                &[out_features, in_features],
                in_features,
                out_features,
                dtype,
                rng,
            )?
            .with_requires_grad(true);
        let bias = if bias {
            Some(
                bias_init
                    .tensor(&[out_features], in_features, out_features, dtype, rng)?
                    .with_requires_grad(true),
            )
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// Input width.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Module for Linear {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut p = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            p.push(("bias".to_string(), b.clone()));
        }
        p
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.weight, self.bias.as_ref())
    }
}
