//! RecMetrics: the metrics recommendation models report (NE, log loss, AUC, AUPRC,
//! calibration, CTR, MSE/RMSE/R², MAE, accuracy, precision, recall; throughput), each with a
//! lifetime and a sliding-window value, for several tasks, with TorchRec's definitions and
//! names (`ne-{task}|lifetime_ne`). The state can be saved and restored with a checkpoint.
//!
//! Windows follow TorchRec: sum metrics keep whole batches (the oldest batch is dropped while
//! the window holds more than `window_size` samples and more than one batch, or more than
//! [`MAX_WINDOW_BATCHES`] batches); AUC and AUPRC
//! keep exactly the last `window_size` samples. Lifetime AUC/AUPRC use bounded-memory score
//! histograms (AUPRC: TorchRec's 1000 equal bins; AUC: 65536 bins, an embers addition —
//! TorchRec has no lifetime AUC — cut finer toward 0 and 1 ([`auc::Binning::Mixed`]), so that
//! models of rare events keep their AUC).
//!
//! Degenerate values are TorchRec's: over no weight (before any update, a window of zero
//! weights, an empty evaluation) NE is NaN, CTR and calibration 0 and AUC 0.5; without
//! positives or without negatives AUC is 0.5 and NE follows TorchRec's clamp of the label
//! mean (about 1e11); an empty window's AUPRC is 0. Check the examples counted before
//! reading them.

pub mod auc;
pub mod sums;
mod throughput;

use std::collections::{BTreeMap, VecDeque};

pub use auc::Sample;
pub use sums::SumKind;
pub use throughput::Throughput;

use crate::{Error, Result};

/// The most batches a sum metric's window holds (TorchRec's `MAX_BUFFER_COUNT`): a window
/// of tiny batches is bounded in memory, and covers what TorchRec's covers.
pub const MAX_WINDOW_BATCHES: usize = 1000;

/// Bins of the lifetime AUC histogram.
pub const LIFETIME_AUC_BINS: usize = 1 << 16;
/// Bins of the lifetime AUPRC histogram (TorchRec's).
pub const LIFETIME_AUPRC_BINS: usize = 1000;

/// A metric that can be requested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// A sum-state metric.
    Sum(SumKind),
    /// ROC AUC: `window_auc` (TorchRec-compatible), `window_auc_tie_correct`, `lifetime_auc`.
    Auc,
    /// Area under the precision-recall curve: exact window, binned lifetime.
    Auprc,
}

impl MetricKind {
    /// Every metric, in report order.
    pub fn all() -> Vec<MetricKind> {
        use SumKind::*;
        let mut v: Vec<MetricKind> = [Ne, Calibration, Ctr, Mse, Mae, Accuracy, Precision, Recall]
            .into_iter()
            .map(MetricKind::Sum)
            .collect();
        v.extend([MetricKind::Auc, MetricKind::Auprc]);
        v
    }
}

#[derive(Clone, Debug)]
struct SumState {
    kind: SumKind,
    lifetime: Vec<f64>,
    /// Per batch in the window: sample count and state delta.
    batches: VecDeque<(usize, Vec<f64>)>,
    window_samples: usize,
}

impl SumState {
    fn new(kind: SumKind) -> Self {
        let n = kind.state_len();
        SumState {
            kind,
            lifetime: vec![0.0; n],
            batches: VecDeque::new(),
            window_samples: 0,
        }
    }

    /// Adds a batch (the window is trimmed by the caller, [`TaskState::trim`]).
    fn update(&mut self, p: &[f32], y: &[f32], w: &[f32]) {
        let mut delta = vec![0.0; self.kind.state_len()];
        self.kind.accumulate(&mut delta, p, y, w);
        self.lifetime
            .iter_mut()
            .zip(&delta)
            .for_each(|(l, d)| *l += d);
        self.batches.push_back((p.len(), delta));
        self.window_samples += p.len();
    }

    /// Drops the oldest batches while the window holds more than `window_size` samples and
    /// more than one batch, or more than [`MAX_WINDOW_BATCHES`] batches (TorchRec's bound;
    /// none for a window of `usize::MAX`, which keeps everything).
    fn trim(&mut self, window_size: usize) {
        let most = if window_size == usize::MAX {
            usize::MAX
        } else {
            MAX_WINDOW_BATCHES
        };
        while (self.window_samples > window_size && self.batches.len() > 1)
            || self.batches.len() > most
        {
            let (n, _) = self.batches.pop_front().expect("len > 1");
            self.window_samples -= n;
        }
    }

    /// The window's state: its batches' deltas summed afresh, oldest first. (A running sum
    /// that subtracted evicted batches kept their rounding: a window whose every label was 0
    /// read a positive weight of 1e-17, and precision or calibration over it garbage.)
    fn window(&self) -> Vec<f64> {
        let mut sum = vec![0.0; self.kind.state_len()];
        for (_, d) in &self.batches {
            sum.iter_mut().zip(d).for_each(|(s, d)| *s += d);
        }
        sum
    }
}

#[derive(Clone, Debug)]
struct TaskState {
    sums: Vec<SumState>,
    recent: VecDeque<Sample>,
    auc_histogram: Option<auc::ScoreHistogram>,
    auprc_histogram: Option<auc::ScoreHistogram>,
}

/// The metrics of several tasks (label columns), updated batch by batch.
#[derive(Clone, Debug)]
pub struct RecMetrics {
    tasks: Vec<String>,
    kinds: Vec<MetricKind>,
    window_size: usize,
    states: Vec<TaskState>,
}

fn check_finite(task: &str, what: &str, v: &[f32]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::invalid(
            "RecMetrics::update",
            format!("task `{task}`: {what}[{i}] is {} (must be finite)", v[i]),
        )),
        None => Ok(()),
    }
}

/// An error naming the first of `v` outside `range` (`what` it must be).
fn check_range(
    task: &str,
    name: &str,
    v: &[f32],
    range: std::ops::RangeInclusive<f32>,
    what: &str,
) -> Result<()> {
    match v.iter().position(|x| !range.contains(x)) {
        Some(i) => Err(Error::invalid(
            "RecMetrics::update",
            format!("task `{task}`: {name}[{i}] is {} (must be {what})", v[i]),
        )),
        None => Ok(()),
    }
}

impl RecMetrics {
    /// Whether some metric reads the predictions as probabilities of labels in [0, 1] (all
    /// but MSE and MAE, which take any real predictions and labels).
    fn probabilities(&self) -> bool {
        (self.kinds.iter()).any(|k| !matches!(k, MetricKind::Sum(SumKind::Mse | SumKind::Mae)))
    }

    /// Metrics `kinds` for `tasks`, with windows of `window_size` samples. Task names are
    /// distinct, non-empty and free of `|` (which ends the task in a value's name); kinds
    /// are distinct and at least one.
    pub fn new(tasks: &[&str], kinds: &[MetricKind], window_size: usize) -> Result<Self> {
        if tasks.is_empty() || window_size == 0 || kinds.is_empty() {
            return Err(Error::invalid(
                "RecMetrics::new",
                "need at least one task, one metric and a window of at least one sample",
            ));
        }
        // Two tasks of one name shared their values' and their states' names: one overwrote
        // the other without a word.
        for (i, task) in tasks.iter().enumerate() {
            if task.is_empty() || task.contains('|') {
                return Err(Error::invalid(
                    "RecMetrics::new",
                    format!("task name {task:?} must be non-empty, without `|`"),
                ));
            }
            if tasks[..i].contains(task) {
                return Err(Error::invalid(
                    "RecMetrics::new",
                    format!("task {task:?} is named twice"),
                ));
            }
        }
        if let Some(i) = (1..kinds.len()).find(|&i| kinds[..i].contains(&kinds[i])) {
            return Err(Error::invalid(
                "RecMetrics::new",
                format!("metric {:?} is asked for twice", kinds[i]),
            ));
        }
        let wants = |k: MetricKind| kinds.contains(&k);
        let states = tasks
            .iter()
            .map(|_| TaskState {
                sums: kinds
                    .iter()
                    .filter_map(|k| match k {
                        MetricKind::Sum(s) => Some(SumState::new(*s)),
                        _ => None,
                    })
                    .collect(),
                recent: VecDeque::new(),
                auc_histogram: wants(MetricKind::Auc).then(|| {
                    auc::ScoreHistogram::with_binning(LIFETIME_AUC_BINS, auc::Binning::Mixed)
                }),
                auprc_histogram: wants(MetricKind::Auprc)
                    .then(|| auc::ScoreHistogram::new(LIFETIME_AUPRC_BINS)),
            })
            .collect();
        Ok(RecMetrics {
            tasks: tasks.iter().map(|t| t.to_string()).collect(),
            kinds: kinds.to_vec(),
            window_size,
            states,
        })
    }

    /// The task names.
    pub fn tasks(&self) -> &[String] {
        &self.tasks
    }

    /// The window's size in samples.
    pub fn window_size(&self) -> usize {
        self.window_size
    }

    /// These metrics with windows of `window_size` samples (the state kept, trimmed to the
    /// new width when narrower; `usize::MAX` keeps everything, whatever the batch count).
    pub fn with_window_size(&self, window_size: usize) -> Result<RecMetrics> {
        if window_size == 0 {
            return Err(Error::invalid(
                "RecMetrics::with_window_size",
                "a window holds at least one sample",
            ));
        }
        let mut out = self.clone();
        out.window_size = window_size;
        for state in &mut out.states {
            state.trim(window_size);
        }
        Ok(out)
    }

    /// Adds a batch: per task, predictions (probabilities), labels and optional weights (1 if
    /// absent), all of one length. Non-finite values, negative weights and (unless every
    /// metric is MSE or MAE) predictions or labels outside [0, 1] are an error naming task
    /// and position; nothing is added then.
    pub fn update(
        &mut self,
        predictions: &[&[f32]],
        labels: &[&[f32]],
        weights: Option<&[&[f32]]>,
    ) -> Result<()> {
        let t = self.tasks.len();
        if predictions.len() != t || labels.len() != t || weights.is_some_and(|w| w.len() != t) {
            return Err(Error::invalid(
                "RecMetrics::update",
                format!("expected {t} task(s) of predictions, labels and weights"),
            ));
        }
        for (i, task) in self.tasks.iter().enumerate() {
            let n = predictions[i].len();
            let w_len = weights.map_or(n, |w| w[i].len());
            if labels[i].len() != n || w_len != n {
                return Err(Error::invalid(
                    "RecMetrics::update",
                    format!(
                        "task `{task}`: {n} predictions, {} labels, {w_len} weights",
                        labels[i].len()
                    ),
                ));
            }
            check_finite(task, "predictions", predictions[i])?;
            check_finite(task, "labels", labels[i])?;
            if let Some(w) = weights {
                check_finite(task, "weights", w[i])?;
                check_range(task, "weights", w[i], 0.0..=f32::MAX, "not negative")?;
            }
            if self.probabilities() {
                // Logits for probabilities clamped silently into the histograms' end bins,
                // and a label of 2 made NE negative.
                check_range(
                    task,
                    "predictions",
                    predictions[i],
                    0.0..=1.0,
                    "a probability",
                )?;
                check_range(task, "labels", labels[i], 0.0..=1.0, "within [0, 1]")?;
            }
        }
        for i in 0..t {
            let (p, y) = (predictions[i], labels[i]);
            let ones;
            let w: &[f32] = match weights {
                Some(w) => w[i],
                None => {
                    ones = vec![1.0f32; p.len()];
                    &ones
                }
            };
            let samples = p
                .iter()
                .zip(y)
                .zip(w)
                .map(|((&prediction, &label), &weight)| Sample {
                    prediction,
                    label,
                    weight,
                });
            let window = self.window_size;
            let state = &mut self.states[i];
            for s in &mut state.sums {
                s.update(p, y, w);
            }
            if self.kinds.contains(&MetricKind::Auc) || self.kinds.contains(&MetricKind::Auprc) {
                state.recent.extend(samples.clone());
            }
            state.trim(window);
            if let Some(h) = &mut state.auc_histogram {
                h.add(samples.clone());
            }
            if let Some(h) = &mut state.auprc_histogram {
                h.add(samples);
            }
        }
        Ok(())
    }

    /// Every value, keyed `{metric}-{task}|{lifetime|window}_{name}`.
    pub fn compute(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for (task, state) in self.tasks.iter().zip(&self.states) {
            for s in &state.sums {
                let ns = s.kind.namespace();
                for (name, v) in s.kind.values(&s.lifetime) {
                    out.insert(format!("{ns}-{task}|lifetime_{name}"), v);
                }
                for (name, v) in s.kind.values(&s.window()) {
                    out.insert(format!("{ns}-{task}|window_{name}"), v);
                }
            }
            let recent: Vec<Sample> = state.recent.iter().copied().collect();
            if let Some(h) = &state.auc_histogram {
                out.insert(format!("auc-{task}|window_auc"), auc::auc(&recent));
                out.insert(
                    format!("auc-{task}|window_auc_tie_correct"),
                    auc::auc_tie_correct(&recent),
                );
                out.insert(format!("auc-{task}|lifetime_auc"), h.auc());
            }
            if let Some(h) = &state.auprc_histogram {
                out.insert(format!("auprc-{task}|window_auprc"), auc::auprc(&recent));
                out.insert(format!("auprc-{task}|lifetime_auprc"), h.auprc());
            }
        }
        out
    }

    /// The whole state as named f64 vectors (for checkpoints).
    pub fn state_dict(&self) -> BTreeMap<String, Vec<f64>> {
        let mut out = BTreeMap::new();
        for (task, state) in self.tasks.iter().zip(&self.states) {
            for s in &state.sums {
                let ns = s.kind.namespace();
                out.insert(format!("{ns}-{task}.lifetime"), s.lifetime.clone());
                // Written for readers of the format; a load sums the batches again.
                out.insert(format!("{ns}-{task}.window"), s.window());
                let batches = s
                    .batches
                    .iter()
                    .flat_map(|(n, d)| std::iter::once(*n as f64).chain(d.iter().copied()))
                    .collect();
                out.insert(format!("{ns}-{task}.batches"), batches);
            }
            let recent = state
                .recent
                .iter()
                .flat_map(|s| [s.prediction as f64, s.label as f64, s.weight as f64])
                .collect();
            out.insert(format!("samples-{task}.recent"), recent);
            for (name, h) in [
                ("auc", &state.auc_histogram),
                ("auprc", &state.auprc_histogram),
            ] {
                if let Some(h) = h {
                    let kind = histogram_kind(h.binning);
                    out.insert(
                        format!("{name}-{task}.{kind}positives"),
                        h.positives.clone(),
                    );
                    out.insert(
                        format!("{name}-{task}.{kind}negatives"),
                        h.negatives.clone(),
                    );
                }
            }
        }
        out
    }

    /// Restores a state saved by [`state_dict`](Self::state_dict) from metrics configured the
    /// same way. Missing entries or wrong lengths are errors naming the entry.
    pub fn load_state_dict(&mut self, dict: &BTreeMap<String, Vec<f64>>) -> Result<()> {
        let get = |key: String, len: Option<usize>| -> Result<&Vec<f64>> {
            let v = dict.get(&key).ok_or_else(|| {
                Error::invalid(
                    "RecMetrics::load_state_dict",
                    format!("missing entry `{key}`"),
                )
            })?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Error::invalid(
                    "RecMetrics::load_state_dict",
                    format!("entry `{key}` value {i} is {} (must be finite)", v[i]),
                ));
            }
            if len.is_some_and(|l| l != v.len()) {
                return Err(Error::invalid(
                    "RecMetrics::load_state_dict",
                    format!(
                        "entry `{key}` has {} values, expected {}",
                        v.len(),
                        len.unwrap_or(0)
                    ),
                ));
            }
            Ok(v)
        };
        let mut restored = self.states.clone();
        for (task, state) in self.tasks.iter().zip(&mut restored) {
            for s in &mut state.sums {
                let (ns, n) = (s.kind.namespace(), s.kind.state_len());
                s.lifetime = get(format!("{ns}-{task}.lifetime"), Some(n))?.clone();
                // Checked like every entry, then recomputed from the batches.
                get(format!("{ns}-{task}.window"), Some(n))?;
                let flat = get(format!("{ns}-{task}.batches"), None)?;
                if flat.len() % (n + 1) != 0 {
                    return Err(Error::invalid(
                        "RecMetrics::load_state_dict",
                        format!("entry `{ns}-{task}.batches` is not a whole number of batches"),
                    ));
                }
                // Each batch's sample count: a whole number an f64 holds exactly.
                let count = |c: f64| {
                    (c >= 0.0 && c.fract() == 0.0 && c < 2f64.powi(53)).then_some(c as usize)
                };
                s.batches = (flat.chunks(n + 1))
                    .map(|c| Some((count(c[0])?, c[1..].to_vec())))
                    .collect::<Option<_>>()
                    .ok_or_else(|| {
                        Error::invalid(
                            "RecMetrics::load_state_dict",
                            format!(
                                "entry `{ns}-{task}.batches` has a batch size that is not a count"
                            ),
                        )
                    })?;
                s.window_samples = (s.batches.iter())
                    .try_fold(0usize, |sum, b| sum.checked_add(b.0))
                    .ok_or_else(|| {
                        Error::invalid(
                            "RecMetrics::load_state_dict",
                            format!("entry `{ns}-{task}.batches` sums past a usize"),
                        )
                    })?;
            }
            let flat = get(format!("samples-{task}.recent"), None)?;
            if flat.len() % 3 != 0 {
                return Err(Error::invalid(
                    "RecMetrics::load_state_dict",
                    format!("entry `samples-{task}.recent` is not a whole number of samples"),
                ));
            }
            state.recent = flat
                .chunks(3)
                .map(|c| Sample {
                    prediction: c[0] as f32,
                    label: c[1] as f32,
                    weight: c[2] as f32,
                })
                .collect();
            for (name, h) in [
                ("auc", &mut state.auc_histogram),
                ("auprc", &mut state.auprc_histogram),
            ] {
                if let Some(h) = h {
                    let bins = h.positives.len();
                    let kind = histogram_kind(h.binning);
                    let key = |side: &str| format!("{name}-{task}.{kind}{side}");
                    if h.binning != auc::Binning::Uniform
                        && !dict.contains_key(&key("positives"))
                        && dict.contains_key(&format!("{name}-{task}.positives"))
                    {
                        // Saved with equal bins (before the mixed binning): carried over, each
                        // bin's counts to the bin of its centre.
                        let old = |side: &str| get(format!("{name}-{task}.{side}"), Some(bins));
                        let (p, n) = (old("positives")?, old("negatives")?);
                        *h = auc::ScoreHistogram::with_binning(bins, h.binning);
                        h.add_uniform(p, n);
                    } else {
                        h.positives = get(key("positives"), Some(bins))?.clone();
                        h.negatives = get(key("negatives"), Some(bins))?.clone();
                    }
                }
            }
        }
        // A state saved with a wider window reports over this one's from the start (it
        // reported over the saved width until the next update).
        for state in &mut restored {
            state.trim(self.window_size);
        }
        self.states = restored;
        Ok(())
    }
}

/// The prefix of a histogram's state entries: none for equal bins (their names before other
/// binnings existed), `mixed_` for [`auc::Binning::Mixed`].
fn histogram_kind(binning: auc::Binning) -> &'static str {
    match binning {
        auc::Binning::Uniform => "",
        auc::Binning::Mixed => "mixed_",
    }
}

impl TaskState {
    /// Keeps at most `window_size` samples of the windows (sum windows: whole batches, at
    /// least one).
    fn trim(&mut self, window_size: usize) {
        for s in &mut self.sums {
            s.trim(window_size);
        }
        let excess = self.recent.len().saturating_sub(window_size);
        self.recent.drain(..excess);
    }
}
