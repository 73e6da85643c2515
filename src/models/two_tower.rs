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
        let q = no_grad(|| self.embed_queries(queries)?.to_vec::<f32>())?;
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
        index.search_k(&q, k)
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

/// A temperature the logits can be divided by: positive and finite.
fn check_temperature(op: &'static str, temperature: f64) -> Result<()> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(Error::invalid(
            op,
            format!("temperature {temperature} must be positive and finite"),
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
/// `mask` (`[B, n]`, optional, additive: a large negative value removes an accidental hit);
/// both may be on any device and are constants (no gradient flows to them). Loss:
/// cross-entropy of the diagonal, mean over rows.
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
            last: vec![0; buckets],
            interval: vec![0.0; buckets],
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
