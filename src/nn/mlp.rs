//! Multi-layer perceptrons and sequential composition.

use super::{prefixed, Forward, Init, Linear, Module};
use crate::tensor::rng::Rng;
use crate::{DType, Error, Result, Tensor};

/// An elementwise activation, usable as a module with no parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// Logistic sigmoid.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// Exact GELU.
    Gelu,
    /// No-op.
    Identity,
}

impl Activation {
    /// Applies the activation.
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::Tanh => x.tanh(),
            Activation::Gelu => x.gelu(),
            Activation::Identity => Ok(x.clone()),
        }
    }
}

impl Module for Activation {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}

impl Forward for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x)
    }
}

/// A stack of [`Linear`] layers with an activation after each (optionally not after the last),
/// as TorchRec's `MLP`. Parameters are named `layers.{i}.weight` / `layers.{i}.bias`.
#[derive(Clone, Debug)]
pub struct Mlp {
    layers: Vec<Linear>,
    activation: Activation,
    activate_last: bool,
}

impl Mlp {
    /// Layers `in → sizes[0] → … → sizes[n-1]`, each followed by `activation` (including the
    /// last, as TorchRec's MLP does; see [`Mlp::activate_last`]).
    pub fn new(
        in_features: usize,
        sizes: &[usize],
        activation: Activation,
        rng: &mut Rng,
    ) -> Result<Self> {
        Mlp::with_dtype(in_features, sizes, activation, DType::F32, rng)
    }

    /// [`Mlp::new`] with parameters of `dtype` (f64 for gradient checks, bf16 storage, ...).
    pub fn with_dtype(
        in_features: usize,
        sizes: &[usize],
        activation: Activation,
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        if sizes.is_empty() || in_features == 0 || sizes.contains(&0) {
            return Err(Error::invalid(
                "Mlp::new",
                format!(
                    "layer sizes must be non-empty and positive, got {in_features} → {sizes:?}"
                ),
            ));
        }
        let mut layers = Vec::with_capacity(sizes.len());
        let mut prev = in_features;
        for &s in sizes {
            layers.push(Linear::with_init(
                prev,
                s,
                true,
                Init::LinearDefault,
                Init::LinearDefault,
                dtype,
                rng,
            )?);
            prev = s;
        }
        Ok(Mlp {
            layers,
            activation,
            activate_last: true,
        })
    }

    /// Whether the activation follows the last layer too (default true).
    pub fn activate_last(mut self, yes: bool) -> Self {
        self.activate_last = yes;
        self
    }

    /// The layers.
    pub fn layers(&self) -> &[Linear] {
        &self.layers
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.layers.last().map_or(0, Linear::out_features)
    }

    /// Input width.
    pub fn in_features(&self) -> usize {
        self.layers.first().map_or(0, Linear::in_features)
    }
}

impl Module for Mlp {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| prefixed(&format!("layers.{i}"), l.named_parameters()))
            .collect()
    }
}

impl Forward for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        let n = self.layers.len();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i + 1 < n || self.activate_last {
                h = self.activation.apply(&h)?;
            }
        }
        Ok(h)
    }
}

/// Modules applied one after another; parameters named `{index}.{name}`.
#[derive(Default)]
pub struct Sequential {
    modules: Vec<Box<dyn Forward>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Self {
        Sequential::default()
    }

    /// Appends a module.
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, module: impl Forward + 'static) -> Self {
        self.modules.push(Box::new(module));
        self
    }

    /// Number of modules.
    pub fn len(&self) -> usize {
        self.modules.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.modules.is_empty()
    }
}

impl Module for Sequential {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.modules
            .iter()
            .enumerate()
            .flat_map(|(i, m)| prefixed(&i.to_string(), m.named_parameters()))
            .collect()
    }
}

impl Forward for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.modules
            .iter()
            .try_fold(x.clone(), |h, m| m.forward(&h))
    }
}
