//! Metrics whose state is a handful of weighted sums (NE, log loss, calibration, CTR, MSE,
//! MAE, accuracy, precision, recall): one pass over a batch builds the state delta, values are
//! computed from the (lifetime or window) state, with TorchRec's formulas and edge cases.

/// Clamp applied to predictions and rates before taking logarithms (TorchRec's `eta`).
pub const ETA: f64 = 1e-12;

/// Decision threshold of accuracy, precision and recall.
pub const THRESHOLD: f64 = 0.5;

/// The sum-state metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SumKind {
    /// Normalized entropy and log loss (base-2).
    Ne,
    /// Σ p·w / Σ y·w.
    Calibration,
    /// Σ y·w / Σ w.
    Ctr,
    /// Mean squared error, its root, and R².
    Mse,
    /// Mean absolute error.
    Mae,
    /// Weighted share of thresholded predictions equal to the label.
    Accuracy,
    /// TP / (TP + FP) at threshold 0.5.
    Precision,
    /// TP / (TP + FN) at threshold 0.5 (FN counts p ≤ 0.5, as TorchRec).
    Recall,
}

impl SumKind {
    /// TorchRec's namespace for the metric (the part before `-task`).
    pub fn namespace(self) -> &'static str {
        match self {
            SumKind::Ne => "ne",
            SumKind::Calibration => "calibration",
            SumKind::Ctr => "ctr",
            SumKind::Mse => "mse",
            SumKind::Mae => "mae",
            SumKind::Accuracy => "accuracy",
            SumKind::Precision => "precision",
            SumKind::Recall => "recall",
        }
    }

    /// Number of sums in the state.
    pub fn state_len(self) -> usize {
        match self {
            SumKind::Ne | SumKind::Mse => 4,
            _ => 2,
        }
    }

    /// Adds one batch's contribution to `state` (length [`state_len`](Self::state_len)).
    pub fn accumulate(self, state: &mut [f64], p: &[f32], y: &[f32], w: &[f32]) {
        for ((&p, &y), &w) in p.iter().zip(y).zip(w) {
            let (p, y, w) = (p as f64, y as f64, w as f64);
            match self {
                SumKind::Ne => {
                    let q = p.clamp(ETA, 1.0 - ETA);
                    state[0] += -w * y * q.log2() - w * (1.0 - y) * (1.0 - q).log2();
                    state[1] += w;
                    state[2] += w * y;
                    state[3] += w * (1.0 - y);
                }
                SumKind::Calibration => {
                    state[0] += p * w;
                    state[1] += y * w;
                }
                SumKind::Ctr => {
                    state[0] += y * w;
                    state[1] += w;
                }
                SumKind::Mse => {
                    state[0] += w * (y - p) * (y - p);
                    state[1] += w;
                    state[2] += w * y;
                    state[3] += w * y * y;
                }
                SumKind::Mae => {
                    state[0] += w * (y - p).abs();
                    state[1] += w;
                }
                SumKind::Accuracy => {
                    let predicted = if p >= THRESHOLD { 1.0 } else { 0.0 };
                    state[0] += w * f64::from(u8::from(predicted == y));
                    state[1] += w;
                }
                SumKind::Precision => {
                    let positive = f64::from(u8::from(p >= THRESHOLD));
                    state[0] += w * positive * y;
                    state[1] += w * positive * (1.0 - y);
                }
                SumKind::Recall => {
                    state[0] += w * f64::from(u8::from(p >= THRESHOLD)) * y;
                    state[1] += w * f64::from(u8::from(p <= THRESHOLD)) * y;
                }
            }
        }
    }

    /// The metric values a state yields, named as TorchRec names them.
    pub fn values(self, s: &[f64]) -> Vec<(&'static str, f64)> {
        let ratio = |num: f64, den: f64| if den == 0.0 { 0.0 } else { num / den };
        match self {
            SumKind::Ne => {
                let (ce, weight, pos, neg) = (s[0], s[1], s[2], s[3]);
                let mean = (pos / weight.max(ETA)).clamp(ETA, 1.0 - ETA);
                let baseline = -pos * mean.log2() - neg * (1.0 - mean).log2();
                vec![
                    ("ne", ce / baseline),
                    ("logloss", ce / (pos + neg).max(ETA)),
                ]
            }
            SumKind::Calibration => {
                vec![("calibration", if s[1] <= 0.0 { 0.0 } else { s[0] / s[1] })]
            }
            SumKind::Ctr => vec![("ctr", ratio(s[0], s[1]))],
            SumKind::Mse => {
                let (err, weight, label, label_sq) = (s[0], s[1], s[2], s[3]);
                let mse = ratio(err, weight);
                // Total sum of squares; labels that are all equal leave only rounding noise
                // (about 1e-16 of the squares' sum per operation), which counts as zero: R² = 1,
                // as TorchRec's module reports for a zero denominator. With no weight at all
                // the value is undefined (NaN), as in TorchRec. (A tolerance of 1e-12 of the
                // squares called labels 1e6 and 1e6+1 equal, and any error on them R² = 1.)
                let total = label_sq - label * label / weight;
                let r2 = if total.abs() <= 1e-13 * label_sq.abs() {
                    1.0
                } else {
                    1.0 - err / total
                };
                vec![("mse", mse), ("rmse", mse.sqrt()), ("r_squared", r2)]
            }
            SumKind::Mae => vec![("mae", ratio(s[0], s[1]))],
            SumKind::Accuracy => vec![("accuracy", ratio(s[0], s[1]))],
            SumKind::Precision => vec![("precision", ratio(s[0], s[0] + s[1]))],
            SumKind::Recall => vec![("recall", ratio(s[0], s[0] + s[1]))],
        }
    }
}
