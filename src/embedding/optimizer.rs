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
//! * partial row-wise Adam: Adam with one second moment per row, `v = β₂v + (1−β₂)·mean(g²)`
//! * LAMB, per row as FBGEMM's TBE applies it: Adam's direction
//!   `r = (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + eps)`, then `w −= lr·(‖w‖/‖r‖)·r` with the row's norms
//!   (the trust ratio is 1 when either norm is 0, where FBGEMM divides by zero)
//! * partial row-wise LAMB: LAMB with partial row-wise Adam's per-row second moment
//!
//! Weight decay, on the touched rows: [`WeightDecay::L2`] adds `λ·w` to `g` before the rule;
//! [`WeightDecay::Decoupled`] subtracts `lr·λ·w` (w before the step) after it, except for the
//! LAMB rules, where it adds `λ·w` to `r` before the trust ratio (LAMB's own decay, FBGEMM's
//! `weight_decay` for LAMB). FBGEMM's CPU build silently ignores weight decay, and has no LAMB
//! or partial row-wise Adam at all; embers applies both.

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
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Lazy Adam with one second moment per row (FBGEMM's `PARTIAL_ROWWISE_ADAM`).
    PartialRowWiseAdam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to √v̂.
        eps: f32,
    },
    /// LAMB with a per-row trust ratio (FBGEMM's `LAMB`).
    Lamb {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to √v̂.
        eps: f32,
    },
    /// LAMB with one second moment per row (FBGEMM's `PARTIAL_ROWWISE_LAMB`).
    PartialRowWiseLamb {
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
    /// Values of state buffer `i` for `rows` rows of `dim` (0 when the optimizer has none).
    pub(crate) fn state_len(&self, i: usize, rows: usize, dim: usize) -> usize {
        match self.state_shape(i) {
            None => 0,
            Some(StateShape::PerRow) => rows,
            Some(StateShape::PerElement) => rows * dim,
        }
    }

    /// Names and shapes of the state buffers this optimizer keeps beside the weights.
    pub fn state_buffers(&self) -> &'static [(&'static str, StateShape)] {
        match self {
            FusedOptimizer::None | FusedOptimizer::Sgd { .. } => &[],
            FusedOptimizer::Adagrad { .. } => &[("momentum1", StateShape::PerElement)],
            FusedOptimizer::RowWiseAdagrad { .. } => &[("momentum1", StateShape::PerRow)],
            FusedOptimizer::Adam { .. } | FusedOptimizer::Lamb { .. } => &[
                ("momentum1", StateShape::PerElement),
                ("momentum2", StateShape::PerElement),
            ],
            FusedOptimizer::PartialRowWiseAdam { .. }
            | FusedOptimizer::PartialRowWiseLamb { .. } => &[
                ("momentum1", StateShape::PerElement),
                ("momentum2", StateShape::PerRow),
            ],
        }
    }

    /// The shape of state buffer `i` (0: `momentum1`, 1: `momentum2`), if the optimizer keeps
    /// one.
    pub fn state_shape(&self, i: usize) -> Option<StateShape> {
        self.state_buffers().get(i).map(|&(_, shape)| shape)
    }

    /// The learning rate (0 for `None`).
    pub fn lr(&self) -> f32 {
        match *self {
            FusedOptimizer::None => 0.0,
            FusedOptimizer::Sgd { lr }
            | FusedOptimizer::Adagrad { lr, .. }
            | FusedOptimizer::RowWiseAdagrad { lr, .. }
            | FusedOptimizer::Adam { lr, .. }
            | FusedOptimizer::PartialRowWiseAdam { lr, .. }
            | FusedOptimizer::Lamb { lr, .. }
            | FusedOptimizer::PartialRowWiseLamb { lr, .. } => lr,
        }
    }

    /// The Adam-family moments' parameters `(β₁, β₂, eps)`, for the optimizers that have them.
    pub(crate) fn moments(&self) -> Option<(f32, f32, f32)> {
        match *self {
            FusedOptimizer::Adam {
                beta1, beta2, eps, ..
            }
            | FusedOptimizer::PartialRowWiseAdam {
                beta1, beta2, eps, ..
            }
            | FusedOptimizer::Lamb {
                beta1, beta2, eps, ..
            }
            | FusedOptimizer::PartialRowWiseLamb {
                beta1, beta2, eps, ..
            } => Some((beta1, beta2, eps)),
            _ => None,
        }
    }

    /// True for the LAMB rules (decoupled weight decay goes inside the trust ratio).
    pub(crate) fn is_lamb(&self) -> bool {
        matches!(
            self,
            FusedOptimizer::Lamb { .. } | FusedOptimizer::PartialRowWiseLamb { .. }
        )
    }

    /// A short name (`none`, `sgd`, `adagrad`, `rowwise_adagrad`, `adam`,
    /// `partial_rowwise_adam`, `lamb`, `partial_rowwise_lamb`).
    pub fn name(&self) -> &'static str {
        match self {
            FusedOptimizer::None => "none",
            FusedOptimizer::Sgd { .. } => "sgd",
            FusedOptimizer::Adagrad { .. } => "adagrad",
            FusedOptimizer::RowWiseAdagrad { .. } => "rowwise_adagrad",
            FusedOptimizer::Adam { .. } => "adam",
            FusedOptimizer::PartialRowWiseAdam { .. } => "partial_rowwise_adam",
            FusedOptimizer::Lamb { .. } => "lamb",
            FusedOptimizer::PartialRowWiseLamb { .. } => "partial_rowwise_lamb",
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        // Learning rates as torch.optim takes them: finite and not negative (a negative one
        // would climb the loss).
        let finite = |x: f32| x.is_finite();
        let rate = |x: f32| x.is_finite() && x >= 0.0;
        let ok = match *self {
            FusedOptimizer::None => true,
            FusedOptimizer::Sgd { lr } => rate(lr),
            FusedOptimizer::Adagrad { lr, eps } | FusedOptimizer::RowWiseAdagrad { lr, eps } => {
                rate(lr) && finite(eps) && eps > 0.0
            }
            opt => {
                let (beta1, beta2, eps) = opt.moments().expect("the Adam family");
                rate(opt.lr())
                    && (0.0..1.0).contains(&beta1)
                    && (0.0..1.0).contains(&beta2)
                    && finite(eps)
                    && eps > 0.0
            }
        };
        if !ok {
            return Err(Error::invalid(
                "FusedOptimizer",
                format!(
                    "invalid hyper-parameters {self:?}: the learning rate finite and not \
                     negative, betas within [0, 1), eps finite and above 0 (at eps 0 a touched \
                     row whose gradient is 0 divides 0 by 0: a NaN row)"
                ),
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

/// Where row `id` (of `dim` values) keeps its state in a table's buffer of `shape`.
#[inline(always)]
pub(crate) fn state_row_range(shape: StateShape, id: usize, dim: usize) -> std::ops::Range<usize> {
    match shape {
        StateShape::PerRow => id..id + 1,
        StateShape::PerElement => id * dim..(id + 1) * dim,
    }
}

/// Row `id`'s state in a table's buffer of `shape` (empty when the optimizer keeps none).
#[inline(always)]
pub(crate) fn state_row(
    buf: &mut [f32],
    shape: Option<StateShape>,
    id: usize,
    dim: usize,
) -> &mut [f32] {
    match shape {
        Some(shape) => &mut buf[state_row_range(shape, id, dim)],
        None => &mut [],
    }
}

/// Adam's bias corrections `(1 − β₁ᵗ, 1 − β₂ᵗ)` for 1-based step `step`, in f32 (the GPU
/// backward is handed these same values).
pub(crate) fn bias_corrections(beta1: f32, beta2: f32, step: u64) -> (f32, f32) {
    let t = step.min(i32::MAX as u64) as i32;
    (1.0 - beta1.powi(t), 1.0 - beta2.powi(t))
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
    let lr = opt.lr();
    // LAMB's decoupled decay joins its direction instead (below).
    let decoupled = match decay {
        WeightDecay::Decoupled(lambda) if !opt.is_lamb() => lr * lambda,
        _ => 0.0,
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
            let (correction1, correction2) = bias_corrections(beta1, beta2, step);
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
        FusedOptimizer::PartialRowWiseAdam {
            beta1, beta2, eps, ..
        } => {
            let (correction1, correction2) = bias_corrections(beta1, beta2, step);
            let denom = row_second_moment(grad, &mut state.m2[0], beta2, correction2, eps);
            for ((w, &g), m) in row.iter_mut().zip(grad.iter()).zip(state.m1.iter_mut()) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *w -= lr * (*m / correction1) / denom + decoupled * *w;
            }
        }
        FusedOptimizer::Lamb {
            beta1, beta2, eps, ..
        }
        | FusedOptimizer::PartialRowWiseLamb {
            beta1, beta2, eps, ..
        } => {
            let (correction1, correction2) = bias_corrections(beta1, beta2, step);
            let lambda = match decay {
                WeightDecay::Decoupled(l) => l,
                _ => 0.0,
            };
            let row_denom = match opt {
                FusedOptimizer::PartialRowWiseLamb { .. } => Some(row_second_moment(
                    grad,
                    &mut state.m2[0],
                    beta2,
                    correction2,
                    eps,
                )),
                _ => None,
            };
            // The direction r replaces the gradient in place.
            for (j, (r, w)) in grad.iter_mut().zip(row.iter()).enumerate() {
                let g = *r;
                let m = &mut state.m1[j];
                *m = beta1 * *m + (1.0 - beta1) * g;
                let denom = match row_denom {
                    Some(d) => d,
                    None => {
                        let v = &mut state.m2[j];
                        *v = beta2 * *v + (1.0 - beta2) * g * g;
                        (*v / correction2).sqrt() + eps
                    }
                };
                *r = (*m / correction1) / denom + lambda * w;
            }
            let step_size = lr * trust_ratio(dot(row, row).sqrt(), dot(grad, grad).sqrt());
            for (w, &r) in row.iter_mut().zip(grad.iter()) {
                *w -= step_size * r;
            }
        }
    }
}

/// Updates a row's second moment with the row's mean square gradient and returns the Adam
/// denominator `√(v/(1−β₂ᵗ)) + eps` (the partial row-wise rules).
#[inline(always)]
fn row_second_moment(grad: &[f32], v: &mut f32, beta2: f32, correction2: f32, eps: f32) -> f32 {
    let mean_square = dot(grad, grad) / grad.len() as f32;
    *v = beta2 * *v + (1.0 - beta2) * mean_square;
    (*v / correction2).sqrt() + eps
}

/// LAMB's trust ratio `‖w‖ / ‖r‖`, 1 when either norm is 0 (a zero row, or no direction).
#[inline(always)]
pub(crate) fn trust_ratio(w_norm: f32, r_norm: f32) -> f32 {
    if w_norm > 0.0 && r_norm > 0.0 {
        w_norm / r_norm
    } else {
        1.0
    }
}

/// Row-wise Adagrad (per-row state) and Adam (per-element state): what tests of the state's
/// layouts run through.
#[cfg(test)]
pub(crate) fn optimizers_of_both_state_shapes() -> [FusedOptimizer; 2] {
    [
        FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
        FusedOptimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    ]
}
