//! Modules with named parameters: the [`Module`] trait (state dict), [`Linear`], [`Mlp`] and
//! [`Sequential`].

mod init;
mod linear;
mod mlp;
pub mod toy;

use std::collections::BTreeMap;

pub use init::Init;
pub use linear::Linear;
pub use mlp::{Activation, Mlp, Sequential};

use crate::{Error, Result, Tensor};

/// Something with trainable parameters, addressable by name.
pub trait Module {
    /// Every parameter with its dotted name (`layers.0.weight`), in a stable order.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    /// The parameters, in the order of [`named_parameters`](Module::named_parameters).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// Name → parameter handle (shares storage with the module).
    fn state_dict(&self) -> BTreeMap<String, Tensor> {
        self.named_parameters().into_iter().collect()
    }

    /// Copies values from `state` into the parameters. Every parameter must be present with
    /// its exact shape, and no extra entry may be given.
    fn load_state_dict(&self, state: &BTreeMap<String, Tensor>) -> Result<()> {
        let params = self.named_parameters();
        for (name, p) in &params {
            let src = state.get(name).ok_or_else(|| {
                Error::invalid("load_state_dict", format!("missing parameter `{name}`"))
            })?;
            if src.shape() != p.shape() {
                return Err(Error::ShapeMismatch {
                    op: "load_state_dict",
                    lhs: p.shape().to_vec(),
                    rhs: src.shape().to_vec(),
                    detail: format!("parameter `{name}`"),
                });
            }
        }
        if let Some(extra) = state.keys().find(|k| !params.iter().any(|(n, _)| n == *k)) {
            return Err(Error::invalid(
                "load_state_dict",
                format!("unexpected parameter `{extra}`"),
            ));
        }
        for (name, p) in &params {
            p.copy_from(&state[name])?;
        }
        Ok(())
    }

    /// Moves every parameter to `device` in place (handles held elsewhere, e.g. by an
    /// optimizer built later or earlier, follow; build optimizer state after the move). On an
    /// error (out of memory, say) the parameters moved so far go back: nothing moved.
    fn to_device(&self, device: crate::Device) -> Result<()> {
        let params = self.parameters();
        for (i, p) in params.iter().enumerate() {
            let from = p.device();
            if let Err(e) = p.move_to_device(device) {
                for moved in &params[..i] {
                    moved.move_to_device(from)?;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// Total number of parameter elements.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(Tensor::numel).sum()
    }
}

/// A module mapping one tensor to one tensor.
pub trait Forward: Module + Send + Sync {
    /// Applies the module.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

/// Prefixes every name of `params` with `prefix.`.
pub fn prefixed(prefix: &str, params: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    params
        .into_iter()
        .map(|(n, t)| (format!("{prefix}.{n}"), t))
        .collect()
}
