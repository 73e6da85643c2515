//! Ranking metrics: ROC AUC (TorchRec-compatible and tie-correct) and the area under the
//! precision-recall curve, exact over a set of samples or binned over a histogram.

/// One scored sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Predicted probability.
    pub prediction: f32,
    /// Label (1 positive, 0 negative; soft labels weigh both sides).
    pub label: f32,
    /// Sample weight.
    pub weight: f32,
}

/// Indices sorted by prediction, descending; ties keep their input order (stable).
pub fn descending_order(samples: &[Sample]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by(|&a, &b| samples[b].prediction.total_cmp(&samples[a].prediction));
    order
}

/// TorchRec's AUC over samples visited in `order`: trapezoids between consecutive cumulative
/// (false positive, true positive) points, ties *not* grouped — so with tied predictions the
/// value depends on the order. 0.5 when there are no positives or no negatives.
pub fn auc_in_order(samples: &[Sample], order: &[usize]) -> f64 {
    let (mut fp, mut tp) = (0.0f64, 0.0f64);
    let mut area = 0.0;
    let mut prev: Option<(f64, f64)> = None;
    for &i in order {
        let s = samples[i];
        let (y, w) = (s.label as f64, s.weight as f64);
        fp += w * (1.0 - y);
        tp += w * y;
        if let Some((pfp, ptp)) = prev {
            area += (fp - pfp) * (tp + ptp) / 2.0;
        }
        prev = Some((fp, tp));
    }
    if fp * tp == 0.0 {
        0.5
    } else {
        area / fp / tp
    }
}

/// TorchRec-compatible AUC with a stable descending order.
pub fn auc(samples: &[Sample]) -> f64 {
    auc_in_order(samples, &descending_order(samples))
}

/// ROC AUC with tied predictions grouped (each tie group is one step of the curve, as
/// scikit-learn's `roc_auc_score`): independent of input order.
pub fn auc_tie_correct(samples: &[Sample]) -> f64 {
    let order = descending_order(samples);
    curve_area(tie_groups(samples, &order))
}

/// Area under the ROC curve traced by groups of (positive weight, negative weight) visited from
/// the highest score down, each group one straight segment.
fn curve_area(groups: impl Iterator<Item = (f64, f64)>) -> f64 {
    let (mut fp, mut tp, mut area) = (0.0, 0.0, 0.0);
    for (pos, neg) in groups {
        area += neg * (tp + tp + pos) / 2.0;
        fp += neg;
        tp += pos;
    }
    if fp * tp == 0.0 {
        0.5
    } else {
        area / fp / tp
    }
}

/// Runs of equal predictions along `order`, as (Σ w·y, Σ w·(1−y)).
fn tie_groups<'a>(
    samples: &'a [Sample],
    order: &'a [usize],
) -> impl Iterator<Item = (f64, f64)> + 'a {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= order.len() {
            return None;
        }
        let p = samples[order[i]].prediction;
        let (mut pos, mut neg) = (0.0, 0.0);
        while i < order.len() && samples[order[i]].prediction == p {
            let s = samples[order[i]];
            pos += s.weight as f64 * s.label as f64;
            neg += s.weight as f64 * (1.0 - s.label as f64);
            i += 1;
        }
        Some((pos, neg))
    })
}

/// Area under the precision-recall curve from threshold groups visited from the highest score
/// down: precision and recall at the end of each group, the curve closed at (recall 0,
/// precision 1), integrated as a step function (TorchRec's `compute_auprc`).
fn pr_area(groups: impl Iterator<Item = (f64, f64)>) -> f64 {
    let (mut tp, mut fp) = (0.0, 0.0);
    let mut points: Vec<(f64, f64)> = Vec::new();
    for (pos, neg) in groups {
        tp += pos;
        fp += neg;
        points.push((tp, fp));
    }
    let total_pos = tp;
    // (recall, precision) from the lowest threshold up, then the closing point.
    let mut curve: Vec<(f64, f64)> = points
        .iter()
        .rev()
        .map(|&(tp, fp)| {
            let recall = if total_pos == 0.0 {
                0.0
            } else {
                tp / total_pos
            };
            let precision = if tp + fp == 0.0 { 1.0 } else { tp / (tp + fp) };
            (recall, precision)
        })
        .collect();
    curve.push((0.0, 1.0));
    -curve
        .windows(2)
        .map(|w| (w[1].0 - w[0].0) * w[0].1)
        .sum::<f64>()
}

/// Exact AUPRC over samples (ties grouped into one threshold).
pub fn auprc(samples: &[Sample]) -> f64 {
    let order = descending_order(samples);
    pr_area(tie_groups(samples, &order))
}

/// How a [`ScoreHistogram`] cuts [0, 1] into bins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binning {
    /// Equal widths (TorchRec's lifetime AUPRC).
    Uniform,
    /// Equal steps of `u(p) = (p + (clamp(logit p, ±16) + 16) / 32) / 2`, the mean of the
    /// probability and its logit scaled to [0, 1]: in the middle at most about twice as wide
    /// as equal bins, near 0 and 1 about 0.1% of `p` (or `1 − p`) wide down to 1e-7. Equal
    /// bins tie every prediction below 1/bins (1.5e-5 for 65536): a model of rare events
    /// read an AUC pulled toward 0.5.
    Mixed,
}

/// The logit range [`Binning::Mixed`] resolves (beyond it the probability part alone).
const LOGIT_RANGE: f64 = 16.0;

impl Binning {
    /// The bin of `p` among `bins`.
    fn bin(self, p: f64, bins: usize) -> usize {
        let u = match self {
            Binning::Uniform => p,
            Binning::Mixed => {
                let logit = (p.ln() - (1.0 - p).ln()).clamp(-LOGIT_RANGE, LOGIT_RANGE);
                // NaN only for p outside [0, 1], which updates refuse; clamped below anyway.
                0.5 * (p + (logit + LOGIT_RANGE) / (2.0 * LOGIT_RANGE))
            }
        };
        ((u * bins as f64) as i64).clamp(0, bins as i64 - 1) as usize
    }
}

/// A fixed-bin histogram of weighted positives and negatives over predictions in [0, 1]: the
/// bounded-memory state of lifetime AUC and AUPRC.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreHistogram {
    /// Σ w·y per bin.
    pub positives: Vec<f64>,
    /// Σ w·(1−y) per bin.
    pub negatives: Vec<f64>,
    /// How predictions map to bins.
    pub binning: Binning,
}

impl ScoreHistogram {
    /// An empty histogram of `bins` equal bins on [0, 1].
    pub fn new(bins: usize) -> Self {
        ScoreHistogram::with_binning(bins, Binning::Uniform)
    }

    /// An empty histogram of `bins` bins cut by `binning`.
    pub fn with_binning(bins: usize, binning: Binning) -> Self {
        ScoreHistogram {
            positives: vec![0.0; bins],
            negatives: vec![0.0; bins],
            binning,
        }
    }

    /// Adds samples, each to the bin of its prediction.
    pub fn add(&mut self, samples: impl Iterator<Item = Sample>) {
        let bins = self.positives.len();
        for s in samples {
            let b = self.binning.bin(s.prediction as f64, bins);
            self.positives[b] += s.weight as f64 * s.label as f64;
            self.negatives[b] += s.weight as f64 * (1.0 - s.label as f64);
        }
    }

    /// Adds the counts of `other`, a histogram of equal bins (its bins' centres binned by
    /// this one's binning): how a state saved before the binning changed carries on.
    pub fn add_uniform(&mut self, positives: &[f64], negatives: &[f64]) {
        let (bins, theirs) = (self.positives.len(), positives.len());
        for (i, (&p, &n)) in positives.iter().zip(negatives).enumerate() {
            let b = self.binning.bin((i as f64 + 0.5) / theirs as f64, bins);
            self.positives[b] += p;
            self.negatives[b] += n;
        }
    }

    fn groups(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.positives
            .iter()
            .zip(&self.negatives)
            .rev()
            .map(|(&p, &n)| (p, n))
    }

    fn degenerate(&self) -> bool {
        self.positives.iter().sum::<f64>() == 0.0 || self.negatives.iter().sum::<f64>() == 0.0
    }

    /// AUPRC over bins (0.5 without positives or negatives), TorchRec's lifetime AUPRC (its
    /// module reports 0.5 there, checked against the golden values, where its window AUPRC
    /// is 0 or 1).
    pub fn auprc(&self) -> f64 {
        if self.degenerate() {
            0.5
        } else {
            pr_area(self.groups())
        }
    }

    /// ROC AUC over bins (each bin one tie group).
    pub fn auc(&self) -> f64 {
        curve_area(self.groups())
    }
}
