//! Zipf sampling in O(1) time and memory per draw, whatever the table size.

use crate::{DatasetError, Result};

/// Samples ranks `1..=n` with P(k) ∝ k^(-s), by rejection-inversion (Hörmann & Derflinger,
/// "Rejection-inversion to generate variates from monotone discrete distributions", 1996).
///
/// No table-sized CDF is stored, so a 100M-row table costs the same as a 10-row one. The
/// uniforms come from the caller, which lets the synthetic generator stay counter-based.
#[derive(Debug, Clone, PartialEq)]
pub struct ZipfSampler {
    n: f64,
    exponent: f64,
    h_integral_x1: f64,
    h_integral_n: f64,
    squeeze: f64,
}

impl ZipfSampler {
    /// A sampler over `1..=n` with exponent `s > 0`.
    pub fn new(n: u64, s: f64) -> Result<Self> {
        if n == 0 {
            return Err(DatasetError::InvalidConfig(
                "Zipf support size must be at least 1".to_string(),
            ));
        }
        if !(s.is_finite() && s > 0.0) {
            return Err(DatasetError::InvalidConfig(format!(
                "Zipf exponent must be finite and > 0, got {s}"
            )));
        }
        let mut sampler = ZipfSampler {
            n: n as f64,
            exponent: s,
            h_integral_x1: 0.0,
            h_integral_n: 0.0,
            squeeze: 0.0,
        };
        sampler.h_integral_x1 = sampler.h_integral(1.5) - 1.0;
        sampler.h_integral_n = sampler.h_integral(n as f64 + 0.5);
        sampler.squeeze =
            2.0 - sampler.h_integral_inverse(sampler.h_integral(2.5) - sampler.h(2.0));
        Ok(sampler)
    }

    /// Draws a rank in `1..=n`. `uniform` must return values in (0, 1); it is called once per
    /// attempt (the expected number of attempts is close to 1).
    pub fn sample(&self, mut uniform: impl FnMut() -> f64) -> u64 {
        loop {
            let u = self.h_integral_n + uniform() * (self.h_integral_x1 - self.h_integral_n);
            let x = self.h_integral_inverse(u);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.squeeze || u >= self.h_integral(k + 0.5) - self.h(k) {
                return k as u64;
            }
        }
    }

    /// The exact probability of rank `k` (O(n): for tests and small tables only).
    pub fn probability(&self, k: u64) -> f64 {
        let n = self.n as u64;
        if k == 0 || k > n {
            return 0.0;
        }
        let normaliser: f64 = (1..=n).map(|i| (i as f64).powf(-self.exponent)).sum();
        (k as f64).powf(-self.exponent) / normaliser
    }

    fn h(&self, x: f64) -> f64 {
        (-self.exponent * x.ln()).exp()
    }

    fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        helper_expm1_over_x((1.0 - self.exponent) * log_x) * log_x
    }

    fn h_integral_inverse(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.exponent)).max(-1.0);
        (helper_log1p_over_x(t) * x).exp()
    }
}

/// ln(1+x)/x, continuous at 0.
fn helper_log1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// (e^x − 1)/x, continuous at 0.
fn helper_expm1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}
