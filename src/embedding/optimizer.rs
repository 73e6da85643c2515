//! Optimizers fused into the TBE backward: each touched row is updated in place, once per
//! backward, with the gradient summed over every occurrence of the row (within a bag, across
//! bags and across the features that share the table).
//!
//! Update rules (`g` = the row's summed gradient, all in f32):
//! * SGD: `w −= lr·g`
//! * Adagrad (exact, element-wise): `m += g²`, `w −= lr·g / (√m + eps)`
//! * row-wise Adagrad (exact): `m += mean(g²)` (one value per row), `w −= lr·g / (√m + eps)`
//! * Adam (lazy: only touched rows move), with `t` the number of backward calls so far:
//!   `m = β₁m + (1−β₁)g`, `v = β₂v + (1−β₂)g²`, `w −= lr·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + eps)`
//!
//! Weight decay, on the touched rows: [`WeightDecay::L2`] adds `λ·w` to `g` before the rule;
//! [`WeightDecay::Decoupled`] subtracts `lr·λ·w` (w before the step) after it. FBGEMM's CPU build
//! silently ignores weight decay; embers applies it.

use crate::{Error, Result};

/// Weight decay applied to the rows a backward touches.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum WeightDecay {
    /// No decay.
    #[default]
    None,
    /// `g += λ·w` before the update.
    L2(f32),
    /// `w −= lr·λ·w` beside the update (AdamW-style).
    Decoupled(f32),
}

/// The optimizer fused into a TBE's backward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FusedOptimizer {
    /// No update: backward produces row-sparse gradients instead.
    None,
    /// Plain SGD.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Exact element-wise Adagrad.
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to √m.
        eps: f32,
    },
    /// Exact row-wise Adagrad (one accumulator per row).
    RowWiseAdagrad {
        /// Learning rate.
        lr: f32,
        /// Added to √m.
        eps: f32,
    },
    /// Lazy Adam.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to √v̂.
        eps: f32,
    },
}

/// Shape of one optimizer state buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateShape {
    /// One value per row.
    PerRow,
    /// One value per weight element.
    PerElement,
}

impl FusedOptimizer {
    /// Names and shapes of the state buffers this optimizer keeps beside the weights.
    pub fn state_buffers(&self) -> &'static [(&'static str, StateShape)] {
        match self {
            FusedOptimizer::None | FusedOptimizer::Sgd { .. } => &[],
            FusedOptimizer::Adagrad { .. } => &[("momentum1", StateShape::PerElement)],
            FusedOptimizer::RowWiseAdagrad { .. } => &[("momentum1", StateShape::PerRow)],
            FusedOptimizer::Adam { .. } => &[
                ("momentum1", StateShape::PerElement),
                ("momentum2", StateShape::PerElement),
            ],
        }
    }

    /// A short name (`none`, `sgd`, `adagrad`, `rowwise_adagrad`, `adam`).
    pub fn name(&self) -> &'static str {
        match self {
            FusedOptimizer::None => "none",
            FusedOptimizer::Sgd { .. } => "sgd",
            FusedOptimizer::Adagrad { .. } => "adagrad",
            FusedOptimizer::RowWiseAdagrad { .. } => "rowwise_adagrad",
            FusedOptimizer::Adam { .. } => "adam",
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let finite = |x: f32| x.is_finite();
        let ok = match *self {
            FusedOptimizer::None => true,
            FusedOptimizer::Sgd { lr } => finite(lr),
            FusedOptimizer::Adagrad { lr, eps } | FusedOptimizer::RowWiseAdagrad { lr, eps } => {
                finite(lr) && finite(eps) && eps >= 0.0
            }
            FusedOptimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                finite(lr)
                    && (0.0..1.0).contains(&beta1)
                    && (0.0..1.0).contains(&beta2)
                    && finite(eps)
                    && eps >= 0.0
            }
        };
        if !ok {
            return Err(Error::invalid(
                "FusedOptimizer",
                format!("invalid hyper-parameters {self:?}"),
            ));
        }
        Ok(())
    }
}

/// `Σ a_i·b_i` with eight independent partial sums. A single running sum is a chain of
/// dependent adds the compiler may not reorder (it would change the rounding); eight lanes in a
/// fixed order vectorise and stay deterministic.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((lane, &xv), &yv) in lanes.iter_mut().zip(x).zip(y) {
            *lane += xv * yv;
        }
    }
    let mut total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (x, y) in ra.iter().zip(rb) {
        total += x * y;
    }
    total
}

/// Mutable optimizer state of one row.
pub(crate) struct RowState<'a> {
    pub m1: &'a mut [f32],
    pub m2: &'a mut [f32],
}

/// Applies one fused step to `row` with gradient `grad` (modified in place for L2 decay).
/// `step` is the 1-based number of this backward (Adam's bias correction).
#[inline(always)]
pub(crate) fn update_row(
    opt: &FusedOptimizer,
    decay: WeightDecay,
    step: u64,
    row: &mut [f32],
    grad: &mut [f32],
    state: RowState<'_>,
) {
    if let WeightDecay::L2(lambda) = decay {
        for (g, &w) in grad.iter_mut().zip(row.iter()) {
            *g += lambda * w;
        }
    }
    let (lr, decoupled) = match (*opt, decay) {
        (FusedOptimizer::None, _) => return,
        (
            FusedOptimizer::Sgd { lr }
            | FusedOptimizer::Adagrad { lr, .. }
            | FusedOptimizer::RowWiseAdagrad { lr, .. }
            | FusedOptimizer::Adam { lr, .. },
            WeightDecay::Decoupled(lambda),
        ) => (lr, lr * lambda),
        (
            FusedOptimizer::Sgd { lr }
            | FusedOptimizer::Adagrad { lr, .. }
            | FusedOptimizer::RowWiseAdagrad { lr, .. }
            | FusedOptimizer::Adam { lr, .. },
            _,
        ) => (lr, 0.0),
    };
    match *opt {
        FusedOptimizer::None => {}
        FusedOptimizer::Sgd { .. } => {
            for (w, &g) in row.iter_mut().zip(grad.iter()) {
                *w -= lr * g + decoupled * *w;
            }
        }
        FusedOptimizer::Adagrad { eps, .. } => {
            for ((w, &g), m) in row.iter_mut().zip(grad.iter()).zip(state.m1.iter_mut()) {
                *m += g * g;
                *w -= lr * g / (m.sqrt() + eps) + decoupled * *w;
            }
        }
        FusedOptimizer::RowWiseAdagrad { eps, .. } => {
            let mean_square = dot(grad, grad) / grad.len() as f32;
            let m = &mut state.m1[0];
            *m += mean_square;
            let step_size = lr / (m.sqrt() + eps);
            for (w, &g) in row.iter_mut().zip(grad.iter()) {
                *w -= step_size * g + decoupled * *w;
            }
        }
        FusedOptimizer::Adam {
            beta1, beta2, eps, ..
        } => {
            let t = step.min(i32::MAX as u64) as i32;
            let correction1 = 1.0 - beta1.powi(t);
            let correction2 = 1.0 - beta2.powi(t);
            for (((w, &g), m), v) in row
                .iter_mut()
                .zip(grad.iter())
                .zip(state.m1.iter_mut())
                .zip(state.m2.iter_mut())
            {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                let m_hat = *m / correction1;
                let v_hat = *v / correction2;
                *w -= lr * m_hat / (v_hat.sqrt() + eps) + decoupled * *w;
            }
        }
    }
}
