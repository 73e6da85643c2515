//! Finite-difference gradient checking, used by the tests of every differentiable op here and
//! in the jagged and embedding modules.

use rand::Rng as _;

use super::rng::seeded;
use crate::{no_grad, DType, Error, Result, Tensor};

/// Compares autograd gradients of `f` against central finite differences in f64.
///
/// `inputs` that require grad must be f64 leaves; others (e.g. index tensors) are passed
/// through. The scalar checked is `Σ f(inputs) ⊙ r` for a fixed random `r`, so every output
/// element takes part. Passes when `|analytic − numeric| ≤ tol·(1 + |numeric|)` everywhere;
/// otherwise the error names the input, the element and both values.
pub fn check_gradients(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    eps: f64,
    tol: f64,
) -> Result<()> {
    for (i, t) in inputs.iter().enumerate() {
        if t.requires_grad() && t.dtype() != DType::F64 {
            return Err(Error::invalid(
                "check_gradients",
                format!("input {i} requires grad but is {:?}, not f64", t.dtype()),
            ));
        }
        t.zero_grad();
    }
    let out = f(inputs)?;
    let mut rng = seeded(0x6772_6164);
    let weights: Vec<f64> = (0..out.numel())
        .map(|_| rng.random_range(0.5..1.5))
        .collect();
    let r = Tensor::from_vec(weights, out.shape())?.cast_values(out.dtype())?;
    out.mul(&r)?.sum_all()?.backward()?;

    let project = |args: &[Tensor]| -> Result<f64> {
        no_grad(|| {
            f(args)?
                .to_dtype(DType::F64)?
                .mul(&r.to_dtype(DType::F64)?)?
                .sum_all()?
                .item()
        })
    };
    for (i, t) in inputs.iter().enumerate() {
        if !t.requires_grad() {
            continue;
        }
        let analytic = match t.grad() {
            Some(g) => g.to_vec_f64()?,
            None => vec![0.0; t.numel()],
        };
        let base = t.to_vec_f64()?;
        for j in 0..base.len() {
            let mut args: Vec<Tensor> = inputs.iter().map(|x| x.detach()).collect();
            let mut shifted = base.clone();
            shifted[j] = base[j] + eps;
            args[i] = Tensor::from_vec(shifted.clone(), t.shape())?;
            let plus = project(&args)?;
            shifted[j] = base[j] - eps;
            args[i] = Tensor::from_vec(shifted, t.shape())?;
            let minus = project(&args)?;
            let numeric = (plus - minus) / (2.0 * eps);
            if (analytic[j] - numeric).abs() > tol * (1.0 + numeric.abs()) || analytic[j].is_nan() {
                return Err(Error::invalid(
                    "check_gradients",
                    format!(
                        "input {i} element {j}: autograd gives {}, finite differences give {numeric}",
                        analytic[j]
                    ),
                ));
            }
        }
    }
    Ok(())
}
