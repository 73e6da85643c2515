//! TwoTower (TorchRec's retrieval model): a query tower and a candidate tower, each an
//! [`EmbeddingBagCollection`] over its own features followed by an MLP, scored by the inner
//! product of their outputs (optionally L2-normalised, divided by a temperature). Trained with
//! pointwise BCE on labelled pairs (TorchRec's example) or an in-batch sampled softmax with the
//! log-Q correction of Yi et al., "Sampling-bias-corrected neural modeling for large corpus item
//! recommendations" (RecSys 2019), whose item frequencies [`FrequencyEstimator`] estimates in
//! streaming as that paper does. The tables train through their fused optimizers, the MLPs
//! through a dense optimizer over [`TwoTower::dense_parameters`].

use crate::embedding::EmbeddingBagCollection;
use crate::nn::{Forward, Mlp, Module};
use crate::retrieval::{Neighbors, Search};
use crate::sparse::KeyedJaggedTensor;
use crate::tensor::Reduction;
use crate::{no_grad, DType, Device, Error, Result, Tensor};

/// One tower: tables, then an MLP over their pooled outputs.
#[derive(Clone, Debug)]
pub struct Tower {
    /// The tower's tables (one pooled output per feature).
    pub tables: EmbeddingBagCollection,
    /// The MLP over the concatenated pooled outputs.
    pub mlp: Mlp,
}

impl Tower {
    /// A tower; the MLP's input width must be the tables' total pooled width.
    pub fn new(tables: EmbeddingBagCollection, mlp: Mlp) -> Result<Self> {
        let width: usize = tables.output_keys_and_dims().1.iter().sum();
        if mlp.in_features() != width {
            return Err(Error::invalid(
                "Tower::new",
                format!(
                    "the MLP takes {} inputs, the tables pool {width}",
                    mlp.in_features()
                ),
            ));
        }
        Ok(Tower { tables, mlp })
    }

    /// Output width.
    pub fn out_features(&self) -> usize {
        self.mlp.out_features()
    }

    /// `features` (a KJT of the tables' features) → `[B, out]`.
    pub fn forward(&self, features: &KeyedJaggedTensor) -> Result<Tensor> {
        let pooled = self.tables.forward(features)?;
        self.mlp.forward(pooled.values())
    }
}

/// TorchRec's `TwoTower`: query and candidate towers of the same output width.
#[derive(Clone, Debug)]
pub struct TwoTower {
    /// Embeds queries (users, contexts).
    pub query: Tower,
    /// Embeds candidates (items).
    pub candidate: Tower,
    /// L2-normalise both towers' outputs (scores become cosines).
    pub normalize: bool,
    /// Scores are divided by this (> 0).
    pub temperature: f64,
}

impl TwoTower {
    /// Joins two towers of equal output width; `temperature` must be positive and finite.
    pub fn new(query: Tower, candidate: Tower, normalize: bool, temperature: f64) -> Result<Self> {
        if query.out_features() != candidate.out_features() {
            return Err(Error::invalid(
                "TwoTower::new",
                format!(
                    "the query tower gives {} values, the candidate tower {}",
                    query.out_features(),
                    candidate.out_features()
                ),
            ));
        }
        check_temperature("TwoTower::new", temperature)?;
        Ok(TwoTower {
            query,
            candidate,
            normalize,
            temperature,
        })
    }

    /// Query embeddings `[B, D]` (normalised when the model normalises).
    pub fn embed_queries(&self, features: &KeyedJaggedTensor) -> Result<Tensor> {
        let x = self.query.forward(features)?;
        self.finish(x)
    }

    /// Candidate embeddings `[B, D]` (normalised when the model normalises).
    pub fn embed_candidates(&self, features: &KeyedJaggedTensor) -> Result<Tensor> {
        let x = self.candidate.forward(features)?;
        self.finish(x)
    }

    fn finish(&self, x: Tensor) -> Result<Tensor> {
        if self.normalize {
            l2_normalize(&x)
        } else {
            Ok(x)
        }
    }

    /// Embeddings of a whole catalogue of candidates (`[n × D]` row-major, no autograd), to
    /// add to an index ([`FlatIndex`](crate::retrieval::FlatIndex) with inner product, or an
    /// [`IvfPqIndex`](crate::retrieval::IvfPqIndex)).
    pub fn embed_catalogue(&self, candidates: &KeyedJaggedTensor) -> Result<Vec<f32>> {
        no_grad(|| self.embed_candidates(candidates)?.to_vec::<f32>())
    }

    /// Retrieval: the `k` best candidates of `index` for each query (`queries`: a KJT of the
    /// query tower's features), best first, with the index's scores (build it with
    /// [`Metric::InnerProduct`](crate::retrieval::Metric) over
    /// [`embed_catalogue`](Self::embed_catalogue) for the model's own ranking; IVF-PQ scores
    /// approximately).
    pub fn retrieve(
        &self,
        queries: &KeyedJaggedTensor,
        index: &impl Search,
        k: usize,
    ) -> Result<Neighbors> {
        index.search_k(&self.embed_queries_for(queries, index)?, k)
    }

    /// Query embeddings (`[B × D]` row-major, no autograd) to search `index` with: an error
    /// when the index holds vectors of another dimension than the towers give.
    pub fn embed_queries_for(
        &self,
        queries: &KeyedJaggedTensor,
        index: &impl Search,
    ) -> Result<Vec<f32>> {
        if index.dim() != self.query.out_features() {
            return Err(Error::invalid(
                "TwoTower::retrieve",
                format!(
                    "the index holds vectors of dimension {}, the towers give {}",
                    index.dim(),
                    self.query.out_features()
                ),
            ));
        }
        no_grad(|| self.embed_queries(queries)?.to_vec::<f32>())
    }

    /// Moves both towers (tables, with their optimizer state, and MLPs) to `device`, in place.
    pub fn to_device(&self, device: Device) -> Result<()> {
        for tower in [&self.query, &self.candidate] {
            tower.tables.to_device(device)?;
            tower.mlp.to_device(device)?;
        }
        Ok(())
    }

    /// The MLPs' parameters (query tower's first), for the dense optimizer.
    pub fn dense_parameters(&self) -> Vec<Tensor> {
        let mut p = self.query.mlp.parameters();
        p.extend(self.candidate.mlp.parameters());
        p
    }

    /// Pointwise BCE of `labels` (`[B]`, 0/1) against the scores of row-aligned query and
    /// candidate embeddings (TorchRec's example loss).
    pub fn pointwise_loss(
        &self,
        queries: &Tensor,
        candidates: &Tensor,
        labels: &Tensor,
    ) -> Result<Tensor> {
        pointwise_bce(queries, candidates, labels, self.temperature)
    }

    /// In-batch sampled softmax: see [`in_batch_softmax`].
    pub fn in_batch_loss(
        &self,
        queries: &Tensor,
        candidates: &Tensor,
        log_q: Option<&Tensor>,
    ) -> Result<Tensor> {
        in_batch_softmax(queries, candidates, log_q, self.temperature)
    }
}

/// `x / ‖x‖` per row (`[B, D]`), with `‖x‖` floored at 1e-12 so zero rows stay finite.
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x
        .mul(x)?
        .sum(&[1], true)?
        .clamp(1e-24, f64::INFINITY)?
        .sqrt()?;
    x.div(&norm)
}

fn check_pair(op: &'static str, q: &Tensor, c: &Tensor) -> Result<(usize, usize)> {
    if q.rank() != 2 || q.shape() != c.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: q.shape().to_vec(),
            rhs: c.shape().to_vec(),
            detail: "expected query and candidate embeddings of one shape [B, D]".into(),
        });
    }
    Ok((q.shape()[0], q.shape()[1]))
}

/// A temperature the logits can be divided by: positive, and both it and its inverse normal
/// f32 numbers (1e-40 made the logits infinite, then NaN; 1e300 made them all 0, a loss
/// without gradient).
fn check_temperature(op: &'static str, temperature: f64) -> Result<()> {
    let normal = |x: f64| (x as f32).is_normal();
    if !(temperature > 0.0 && normal(temperature) && normal(1.0 / temperature)) {
        return Err(Error::invalid(
            op,
            format!(
                "temperature {temperature} must be positive, with it and its inverse normal \
                 f32 numbers (within about 1e-38 to 1e38)"
            ),
        ));
    }
    Ok(())
}

/// Pointwise BCE: logit `⟨q_i, c_i⟩ / τ` against `labels[i]` (each within [0, 1]), mean over
/// the batch. Bad labels are an error before anything is computed (a backward through a NaN
/// label wrote NaN into the tables).
pub fn pointwise_bce(q: &Tensor, c: &Tensor, labels: &Tensor, temperature: f64) -> Result<Tensor> {
    const OP: &str = "pointwise_bce";
    let (b, _) = check_pair(OP, q, c)?;
    check_temperature(OP, temperature)?;
    if b == 0 {
        // Its mean is 0/0.
        return Err(Error::invalid(OP, "an empty batch has no loss"));
    }
    if labels.shape() != [b] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: labels.shape().to_vec(),
            rhs: vec![b],
            detail: "one label per pair".into(),
        });
    }
    let values = labels.to_dtype(crate::DType::F64)?.to_vec::<f64>()?;
    if let Some((i, y)) = (values.iter().enumerate()).find(|(_, y)| !(0.0..=1.0).contains(*y)) {
        return Err(Error::invalid(
            OP,
            format!("label {i} is {y}: labels are within [0, 1]"),
        ));
    }
    let logits = q.mul(c)?.sum(&[1], false)?.div_scalar(temperature)?;
    let labels = labels
        .to_dtype(logits.dtype())?
        .to_device(logits.device())?;
    logits.bce_with_logits(&labels, None, Reduction::Mean)
}

/// In-batch sampled softmax: row `i`'s positive is candidate `i`, the other candidates of the
/// batch its negatives. Logits `⟨q_i, c_j⟩ / τ − log Q_j`, where `log_q` (`[B]`, optional, on
/// any device) is the log of candidate `j`'s probability of appearing in a batch — subtracting
/// it corrects the bias of in-batch sampling toward popular items (Yi et al. 2019). Loss:
/// cross-entropy of the diagonal, mean over rows. [`sampled_softmax`] with no extra
/// candidates and no mask.
pub fn in_batch_softmax(
    q: &Tensor,
    c: &Tensor,
    log_q: Option<&Tensor>,
    temperature: f64,
) -> Result<Tensor> {
    check_pair("in_batch_softmax", q, c)?;
    sampled_softmax(q, c, log_q, None, temperature)
}

/// Sampled softmax over `n ≥ B` candidates: row `i` of `q` (`[B, D]`) has candidate `i` of `c`
/// (`[n, D]`; the first `B` rows are the batch's positives, the rest e.g. random negatives)
/// as its positive and all the others as negatives. Logits `⟨q_i, c_j⟩ / τ − log Q_j + M_ij`
/// with `log_q` (`[n]`, optional) the log of each candidate's expected count in the sample and
/// `mask` (`[B, n]`, optional, additive: −∞ removes an accidental hit); both may be on any
/// device and are constants (no gradient flows to them). Loss: cross-entropy of the diagonal,
/// mean over rows. Refused: an empty batch, a `log_q` that is not finite, a mask holding NaN
/// or +∞ or removing a row's own positive, and a row left with no negative (a batch of one
/// row and no other candidates; every other column removed): its loss is 0, without gradient.
pub fn sampled_softmax(
    q: &Tensor,
    c: &Tensor,
    log_q: Option<&Tensor>,
    mask: Option<&Tensor>,
    temperature: f64,
) -> Result<Tensor> {
    const OP: &str = "sampled_softmax";
    if q.rank() != 2 || c.rank() != 2 || q.shape()[1] != c.shape()[1] || c.shape()[0] < q.shape()[0]
    {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: q.shape().to_vec(),
            rhs: c.shape().to_vec(),
            detail: "expected queries [B, D] and at least B candidates [n, D]".into(),
        });
    }
    check_temperature(OP, temperature)?;
    let (b, n) = (q.shape()[0], c.shape()[0]);
    check_softmax_constants(OP, b, n, log_q, mask)?;
    // The temperature scales the [B, D] queries rather than the [B, n] logits (fewer elements).
    let mut logits = q.mul_scalar(1.0 / temperature)?.matmul(&c.t()?)?;
    let device = logits.device();
    // log-Q and the mask are constants: folded into one bias first, so the logits (and their
    // backward) see one addition.
    let mut bias: Option<Tensor> = None;
    if let Some(lq) = log_q {
        if lq.shape() != [n] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: lq.shape().to_vec(),
                rhs: vec![n],
                detail: "one log-probability per candidate".into(),
            });
        }
        // On the logits' device (the estimator's tensors are made on the CPU).
        let lq = lq.to_dtype(logits.dtype())?.to_device(device)?;
        bias = Some(lq.reshape(&[1, n])?.neg()?);
    }
    if let Some(m) = mask {
        if m.shape() != [b, n] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: m.shape().to_vec(),
                rhs: vec![b, n],
                detail: "one mask value per query and candidate".into(),
            });
        }
        let m = m.to_dtype(logits.dtype())?.to_device(device)?;
        bias = Some(match bias {
            Some(lq) => m.add(&lq)?,
            None => m,
        });
    }
    if let Some(bias) = bias {
        logits = logits.add(&bias.detach())?;
    }
    let target = Tensor::arange(0, b as i64, DType::I64).to_device(device)?;
    logits.cross_entropy(&target, Reduction::Mean)
}

/// The checks of [`sampled_softmax`]'s batch size, log-Q and mask values (shapes are checked
/// where they are used).
fn check_softmax_constants(
    op: &'static str,
    b: usize,
    n: usize,
    log_q: Option<&Tensor>,
    mask: Option<&Tensor>,
) -> Result<()> {
    if b == 0 {
        return Err(Error::invalid(op, "an empty batch has no loss"));
    }
    if let Some(lq) = log_q.filter(|lq| lq.shape() == [n]) {
        let values = lq.to_dtype(DType::F64)?.to_vec::<f64>()?;
        if let Some((j, v)) = (values.iter().enumerate()).find(|(_, v)| !v.is_finite()) {
            return Err(Error::invalid(
                op,
                format!("log_q[{j}] is {v}: log-probabilities must be finite"),
            ));
        }
    }
    let no_negative = |i: usize| {
        Error::invalid(
            op,
            format!(
                "row {i} has no negative (a batch of one row and no other candidates, or every \
                 other column removed): its loss is 0, without gradient"
            ),
        )
    };
    match mask.filter(|m| m.shape() == [b, n]) {
        None if n < 2 => Err(no_negative(0)),
        None => Ok(()),
        Some(m) => {
            let values = m.to_dtype(DType::F32)?.to_vec::<f32>()?;
            for (i, row) in values.chunks_exact(n.max(1)).enumerate() {
                if let Some((j, v)) =
                    (row.iter().enumerate()).find(|(_, v)| v.is_nan() || **v == f32::INFINITY)
                {
                    return Err(Error::invalid(
                        op,
                        format!("mask[{i}][{j}] is {v}: a mask adds finite values or −∞"),
                    ));
                }
                if !row[i].is_finite() {
                    return Err(Error::invalid(
                        op,
                        format!("mask[{i}][{i}] removes row {i}'s own positive"),
                    ));
                }
                if !(row.iter().enumerate()).any(|(j, v)| j != i && v.is_finite()) {
                    return Err(no_negative(i));
                }
            }
            Ok(())
        }
    }
}

/// What [`FrequencyEstimator::undo`] restores: the step count and each touched bucket's old
/// values.
#[derive(Debug)]
pub(crate) struct EstimatorUndo {
    step: u64,
    buckets: Vec<(usize, u64, f64)>,
}

/// Streaming estimate of how often each item appears in training batches (Yi et al. 2019,
/// algorithm 2): hashed arrays hold the step an item was last seen (`A`) and a moving average
/// of the steps between sightings (`B`); the item's probability of being in a batch is `1/B`.
#[derive(Clone, Debug)]
pub struct FrequencyEstimator {
    last: Vec<u64>,
    interval: Vec<f64>,
    alpha: f64,
    step: u64,
}

impl FrequencyEstimator {
    /// `buckets` hash buckets (collisions merge items; use more than the catalogue) and
    /// learning rate `alpha` in (0, 1].
    pub fn new(buckets: usize, alpha: f64) -> Result<Self> {
        if buckets == 0 || !(alpha > 0.0 && alpha <= 1.0) {
            return Err(Error::invalid(
                "FrequencyEstimator",
                format!("need at least one bucket and alpha in (0, 1], got {buckets}, {alpha}"),
            ));
        }
        // Two 8-byte values a bucket must be addressable.
        if crate::tensor::addressable_bytes(&[buckets], 16).is_none() {
            return Err(Error::invalid(
                "FrequencyEstimator",
                format!("{buckets} buckets are past any memory"),
            ));
        }
        Ok(FrequencyEstimator {
            last: crate::tensor::storage::try_filled("FrequencyEstimator", 0u64, buckets)?,
            interval: crate::tensor::storage::try_filled("FrequencyEstimator", 0f64, buckets)?,
            alpha,
            step: 0,
        })
    }

    fn bucket(&self, id: i64) -> usize {
        // Fibonacci hashing of the id.
        (((id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) % self.last.len() as u64) as usize
    }

    /// Records one training batch's candidate ids (an id repeated in the batch counts once).
    pub fn update(&mut self, ids: &[i64]) {
        self.update_undoable(ids);
    }

    /// [`update`](Self::update), returning what [`undo`](Self::undo) needs to take it back
    /// (the touched buckets' old values): a training step that fails after recording its
    /// batch leaves the estimator as it was.
    pub(crate) fn update_undoable(&mut self, ids: &[i64]) -> EstimatorUndo {
        let mut undo = EstimatorUndo {
            step: self.step,
            buckets: Vec::with_capacity(ids.len()),
        };
        for &id in ids {
            let h = self.bucket(id);
            undo.buckets.push((h, self.last[h], self.interval[h]));
        }
        self.record(ids);
        undo
    }

    /// Takes back the update `undo` came from (the last one).
    pub(crate) fn undo(&mut self, undo: EstimatorUndo) {
        // In reverse: a bucket listed twice gets its oldest value last.
        for (h, last, interval) in undo.buckets.into_iter().rev() {
            self.last[h] = last;
            self.interval[h] = interval;
        }
        self.step = undo.step;
    }

    fn record(&mut self, ids: &[i64]) {
        self.step += 1;
        let t = self.step;
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        for &id in ids {
            let h = self.bucket(id);
            if !seen.insert(h) {
                continue;
            }
            let gap = (t - self.last[h]) as f64;
            self.interval[h] = if self.last[h] == 0 {
                // First sighting: the gap since the start is the only evidence.
                gap
            } else {
                (1.0 - self.alpha) * self.interval[h] + self.alpha * gap
            };
            self.last[h] = t;
        }
    }

    /// The estimated probability that `id` appears in a batch (1 for an unseen id: no
    /// correction).
    pub fn probability(&self, id: i64) -> f64 {
        let b = self.interval[self.bucket(id)];
        if b > 0.0 {
            (1.0 / b).min(1.0)
        } else {
            1.0
        }
    }

    /// The estimator's state: per bucket the step an item was last seen and the moving
    /// average interval, then the learning rate and the steps recorded (for checkpoints).
    pub fn to_parts(&self) -> (&[u64], &[f64], f64, u64) {
        (&self.last, &self.interval, self.alpha, self.step)
    }

    /// An estimator from [`to_parts`](Self::to_parts)'s values, checked: equal bucket counts,
    /// `alpha` in (0, 1], no bucket seen after `step`, intervals finite and non-negative.
    pub fn from_parts(last: Vec<u64>, interval: Vec<f64>, alpha: f64, step: u64) -> Result<Self> {
        let mut e = FrequencyEstimator::new(last.len(), alpha)?;
        if interval.len() != last.len() {
            return Err(Error::invalid(
                "FrequencyEstimator",
                format!(
                    "{} last-seen steps, {} intervals",
                    last.len(),
                    interval.len()
                ),
            ));
        }
        if let Some(i) = last.iter().position(|&t| t > step) {
            return Err(Error::invalid(
                "FrequencyEstimator",
                format!(
                    "bucket {i} was last seen at step {}, after step {step}",
                    last[i]
                ),
            ));
        }
        if let Some(i) = interval.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
            return Err(Error::invalid(
                "FrequencyEstimator",
                format!("bucket {i}'s interval is {}", interval[i]),
            ));
        }
        e.last = last;
        e.interval = interval;
        e.step = step;
        Ok(e)
    }

    /// `log Q` of each id, as an f32 tensor `[n]` for [`in_batch_softmax`].
    pub fn log_q(&self, ids: &[i64]) -> Result<Tensor> {
        let v: Vec<f32> = ids
            .iter()
            .map(|&id| self.probability(id).ln() as f32)
            .collect();
        Tensor::from_vec(v, &[ids.len()])
    }
}
