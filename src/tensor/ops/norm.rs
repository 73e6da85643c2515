//! Layer normalisation, composed from differentiable ops (its backward follows).

use crate::{Error, Result, Tensor};

impl Tensor {
    /// Normalises over the trailing dimensions `normalized_shape` to zero mean and unit
    /// (biased) variance, then applies the optional elementwise `weight` and `bias`.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        // As torch: eps is added to the variance; a negative or NaN one made NaN rows.
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::invalid(
                "layer_norm",
                format!("eps {eps} must be finite and not negative"),
            ));
        }
        let k = normalized_shape.len();
        if k == 0 || k > self.rank() || self.shape()[self.rank() - k..] != *normalized_shape {
            return Err(Error::ShapeMismatch {
                op: "layer_norm",
                lhs: self.shape().to_vec(),
                rhs: normalized_shape.to_vec(),
                detail: "normalized_shape must equal the input's trailing dimensions".into(),
            });
        }
        for p in [weight, bias].into_iter().flatten() {
            if p.shape() != normalized_shape {
                return Err(Error::shape("layer_norm", normalized_shape, p.shape()));
            }
        }
        let dims: Vec<isize> = (self.rank() - k..self.rank()).map(|d| d as isize).collect();
        let centered = self.sub(&self.mean(&dims, true)?)?;
        let var = centered.square()?.mean(&dims, true)?;
        let mut y = centered.div(&var.add_scalar(eps)?.sqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(w)?;
        }
        if let Some(b) = bias {
            y = y.add(b)?;
        }
        Ok(y)
    }
}
