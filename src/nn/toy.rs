//! Small built-in synthetic datasets for examples and tests (no downloads).

use rand::Rng as _;

use crate::tensor::rng::Rng;
use crate::{Result, Tensor};

/// Interleaved 2-D spirals: `classes` arms of `points_per_class` points each, with Gaussian
/// noise of standard deviation `noise`. Returns features `[N, 2]` (f32) and labels `[N]` (i64).
/// Not linearly separable: a linear model stays near chance, a small MLP separates it.
pub fn spirals(
    points_per_class: usize,
    classes: usize,
    noise: f64,
    rng: &mut Rng,
) -> Result<(Tensor, Tensor)> {
    let n = points_per_class * classes;
    let mut x = Vec::with_capacity(2 * n);
    let mut y = Vec::with_capacity(n);
    for c in 0..classes {
        for i in 0..points_per_class {
            let r = i as f64 / points_per_class as f64;
            let theta = c as f64 * std::f64::consts::TAU / classes as f64 + 4.0 * r;
            let jitter =
                |rng: &mut Rng| noise * (rng.random::<f64>() + rng.random::<f64>() - 1.0) * 1.7;
            x.push((r * theta.sin() + jitter(rng)) as f32);
            x.push((r * theta.cos() + jitter(rng)) as f32);
            y.push(c as i64);
        }
    }
    Ok((Tensor::from_vec(x, &[n, 2])?, Tensor::from_vec(y, &[n])?))
}
