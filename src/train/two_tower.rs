//! Training a [`TwoTower`]: [`TwoTowerConfig`] (everything that defines the model and its
//! training; stored in checkpoints) builds a [`TwoTowerTrainer`], which takes batches of
//! positive (query, candidate) pairs and trains with pointwise BCE (TorchRec's retrieval
//! example) or a sampled softmax over the batch's candidates, with the log-Q correction of
//! Yi et al. 2019 from a streaming [`FrequencyEstimator`], optionally mixed with uniformly
//! drawn random negatives (Yang et al. 2020, "Mixed negative sampling"), accidental hits
//! (a negative that is the row's own positive item) masked out. Checkpoints are atomic and
//! hold the tables with their fused optimizer state, the MLPs with the dense optimizer's
//! state, the frequency estimator and the step: training continues exactly.

use std::collections::BTreeMap;
use std::path::Path;

use rand::Rng as _;

use super::{
    table_values, trainer_writer, weights_between, write_dense_state, DenseOptimizer, DenseState,
    TrainerFile,
};
use crate::embedding::checkpoint::StagedTables;
use crate::embedding::{EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer};
use crate::models::two_tower::{
    pointwise_bce, sampled_softmax, FrequencyEstimator, Tower, TwoTower,
};
use crate::nn::{Activation, Mlp, Module};
use crate::optim::Optimizer;
use crate::sparse::KeyedJaggedTensor;
use crate::tensor::rng::seeded;
use crate::{Device, Error, Result, Tensor};

const OP: &str = "TwoTowerTrainer";
const FORMAT: &str = "embers.two-tower-trainer.v1";
/// Added to the logit of an accidental hit (a sampled negative that is the row's positive):
/// −∞ removes it whatever the logits' scale (a finite −1e9 did not, past |⟨q, c⟩|/τ ≈ 1e9).
const HIT_MASK: f32 = f32::NEG_INFINITY;

/// The loss a [`TwoTowerTrainer`] trains with.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum TwoTowerLoss {
    /// Pointwise BCE on labelled pairs (TorchRec's retrieval example): every batch carries
    /// labels.
    Pointwise,
    /// Sampled softmax: each query's positive against the batch's other candidates and
    /// `random_negatives` uniformly drawn ones (shared by the batch); with `log_q`, logits are
    /// corrected by the log of each candidate's expected count in the sample (streaming
    /// frequency estimate for in-batch candidates, `random_negatives / catalogue` for the
    /// random ones).
    Softmax {
        /// Apply the log-Q correction.
        log_q: bool,
        /// Uniform negatives per batch (0: in-batch only); needs
        /// [`TwoTowerTrainer::with_negative_sampler`].
        random_negatives: usize,
    },
}

/// Everything that defines a TwoTower and its training. Every trainer checkpoint carries it as
/// JSON (metadata `model.config`, without the device).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TwoTowerConfig {
    /// The query tower's sparse features and their tables' rows (a table `t_<feature>` each).
    pub query_features: Vec<(String, usize)>,
    /// The candidate tower's sparse features and their tables' rows.
    pub candidate_features: Vec<(String, usize)>,
    /// Embedding dimension of every table.
    pub embedding_dim: usize,
    /// Each tower's MLP widths (ReLU between layers, none after the last); the last is the
    /// width of the towers' output embeddings.
    pub layers: Vec<usize>,
    /// L2-normalise the towers' outputs.
    pub normalize: bool,
    /// Scores are divided by this.
    pub temperature: f64,
    /// The loss.
    pub loss: TwoTowerLoss,
    /// Hash buckets of the frequency estimator (more than the catalogue's items).
    pub estimator_buckets: usize,
    /// The frequency estimator's learning rate, in (0, 1].
    pub estimator_alpha: f64,
    /// Optimizer fused into the tables' backward.
    pub sparse_optimizer: FusedOptimizer,
    /// Optimizer of the MLPs.
    pub dense_optimizer: DenseOptimizer,
    /// Seed of the initialisation and of the random negatives.
    pub seed: u64,
    /// Where the model trains. Not stored in checkpoints.
    #[serde(skip)]
    pub device: Device,
}

impl TwoTowerConfig {
    /// Builds the model (initialised from `seed`) and its trainer. Tunes the process's
    /// `malloc` once (see [`keep_freed_host_memory`](crate::tensor::keep_freed_host_memory)).
    pub fn build(&self) -> Result<TwoTowerTrainer> {
        if self.query_features.is_empty() || self.candidate_features.is_empty() {
            return Err(Error::invalid(
                "TwoTowerConfig",
                "each tower needs at least one sparse feature",
            ));
        }
        if self.embedding_dim == 0 || self.layers.is_empty() {
            return Err(Error::invalid(
                "TwoTowerConfig",
                "the embedding dimension and the MLP widths must be given",
            ));
        }
        let mut rng = seeded(self.seed);
        let mut tower = |features: &[(String, usize)]| -> Result<Tower> {
            let configs = (features.iter())
                .map(|(f, rows)| {
                    EmbeddingBagConfig::new(format!("t_{f}"), *rows, self.embedding_dim, &[f])
                })
                .collect();
            let tables = EmbeddingBagCollection::new(configs, self.sparse_optimizer, &mut rng)?;
            // (No overflow: at most the tables' elements, which fit.)
            let width = features.len() * self.embedding_dim;
            let mlp =
                Mlp::new(width, &self.layers, Activation::Relu, &mut rng)?.activate_last(false);
            Tower::new(tables, mlp)
        };
        let query = tower(&self.query_features)?;
        let candidate = tower(&self.candidate_features)?;
        let model = TwoTower::new(query, candidate, self.normalize, self.temperature)?;
        model.to_device(self.device)?;
        let optimizer = self.dense_optimizer.build(model.dense_parameters())?;
        let estimator = FrequencyEstimator::new(self.estimator_buckets, self.estimator_alpha)?;
        crate::tensor::keep_freed_host_memory();
        Ok(TwoTowerTrainer {
            config: self.clone(),
            model,
            optimizer,
            estimator,
            negatives: None,
            step: 0,
            examples: 0,
            run: crate::checkpoint::unique_id(),
        })
    }

    /// The configuration a trainer checkpoint was written with (the device is the CPU). A
    /// configuration whose weights need more bytes than the file and its parts hold is
    /// refused.
    pub fn from_checkpoint(path: impl AsRef<Path>) -> Result<TwoTowerConfig> {
        let f = open(path)?;
        let config: TwoTowerConfig = f.config("a TwoTowerConfig")?;
        f.could_hold(config.least_checkpoint_bytes())?;
        Ok(config)
    }

    /// A lower bound on the bytes of a checkpoint of this model: both towers' tables and
    /// MLP weight matrices (4 bytes a value) and the frequency estimator's buckets (16 bytes
    /// each); `None` when past a `u64`.
    fn least_checkpoint_bytes(&self) -> Option<u64> {
        let dim = self.embedding_dim as u64;
        let tower = |features: &[(String, usize)]| -> Option<u64> {
            let width = (features.len() as u64).checked_mul(dim)?;
            let widths = [&[usize::try_from(width).ok()?][..], &self.layers].concat();
            table_values(features, self.embedding_dim)?.checked_add(weights_between(&widths)?)
        };
        let weights = tower(&self.query_features)?.checked_add(tower(&self.candidate_features)?)?;
        weights
            .checked_mul(4)?
            .checked_add((self.estimator_buckets as u64).checked_mul(16)?)
    }
}

fn open(path: impl AsRef<Path>) -> Result<TrainerFile> {
    TrainerFile::open(path, FORMAT, "a TwoTower trainer checkpoint")
}

/// A batch of positive pairs: row `i` of `queries` interacted with row `i` of `candidates`.
#[derive(Clone, Debug)]
pub struct PairBatch {
    /// The query tower's features, `B` rows.
    pub queries: KeyedJaggedTensor,
    /// The candidate tower's features, `B` rows.
    pub candidates: KeyedJaggedTensor,
    /// The candidates' item ids (frequency estimate, accidental hits), `B`.
    pub candidate_ids: Vec<i64>,
    /// Labels `[B]` (0/1), for [`TwoTowerLoss::Pointwise`] only.
    pub labels: Option<Tensor>,
}

/// Builds the candidate tower's features of the given item ids (random negatives).
pub type NegativeSampler = Box<dyn Fn(&[i64]) -> Result<KeyedJaggedTensor> + Send>;

/// The MLPs of both towers as one module (names `query.*`, `candidate.*`) for checkpoints.
struct Mlps<'a>(&'a TwoTower);

impl Module for Mlps<'_> {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut p = crate::nn::prefixed("query", self.0.query.mlp.named_parameters());
        p.extend(crate::nn::prefixed(
            "candidate",
            self.0.candidate.mlp.named_parameters(),
        ));
        p
    }
}

/// Trains a [`TwoTower`] (see the module docs).
pub struct TwoTowerTrainer {
    config: TwoTowerConfig,
    model: TwoTower,
    optimizer: Box<dyn Optimizer + Send>,
    estimator: FrequencyEstimator,
    negatives: Option<(usize, NegativeSampler)>,
    step: u64,
    examples: u64,
    /// Drawn when the trainer is built, kept by its checkpoints: with the step it names the
    /// weights ([`model_id`](TwoTowerTrainer::model_id)).
    run: u64,
}

impl TwoTowerTrainer {
    /// The model.
    pub fn model(&self) -> &TwoTower {
        &self.model
    }

    /// The configuration.
    pub fn config(&self) -> &TwoTowerConfig {
        &self.config
    }

    /// Steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Training pairs seen.
    pub fn examples_seen(&self) -> u64 {
        self.examples
    }

    /// Names the weights: the run (an id drawn when the trainer was built, and kept by its
    /// checkpoints, so a resumed run keeps it) and the steps taken, `<run>.<step>`. An index
    /// of the candidates built from this model records it
    /// ([`IvfPqIndex::set_source`](crate::retrieval::IvfPqIndex::set_source)), so that a
    /// server refuses to pair it with other weights. A checkpoint written before runs had ids
    /// loads with run 0.
    pub fn model_id(&self) -> String {
        format!("{:016x}.{}", self.run, self.step)
    }

    /// The streaming frequency estimate of the candidates.
    pub fn estimator(&self) -> &FrequencyEstimator {
        &self.estimator
    }

    /// Random negatives are drawn uniformly from item ids `0..catalogue` (at least 1, at most
    /// `i64::MAX`); `features` builds their candidate features.
    pub fn with_negative_sampler(
        mut self,
        catalogue: usize,
        features: NegativeSampler,
    ) -> Result<Self> {
        if catalogue == 0 || i64::try_from(catalogue).is_err() {
            return Err(Error::invalid(
                OP,
                format!(
                    "a catalogue of {catalogue} items to draw negatives from: give 1 to {}",
                    i64::MAX
                ),
            ));
        }
        self.negatives = Some((catalogue, features));
        Ok(self)
    }

    /// One step on a batch of positive pairs: forward through both towers, the loss,
    /// backward (the tables update through their fused optimizer), the MLPs' optimizer step.
    /// Returns the loss; a non-finite loss is an error naming the step. A step that fails
    /// leaves the frequency estimator as it was; on the host a non-finite loss is found before
    /// the backward, and the step is not taken at all (on a GPU its update has been applied).
    pub fn train_step(&mut self, batch: &PairBatch) -> Result<f64> {
        if self.config.device == Device::Cpu {
            crate::tensor::on_worker(|| self.step_inner(batch))
        } else {
            self.step_inner(batch)
        }
    }

    fn step_inner(&mut self, batch: &PairBatch) -> Result<f64> {
        let b = batch.candidate_ids.len();
        if b == 0 {
            return Err(Error::invalid(
                OP,
                "an empty batch (no pair) has nothing to train on",
            ));
        }
        for (what, kjt) in [
            ("queries", &batch.queries),
            ("candidates", &batch.candidates),
        ] {
            if kjt.stride() != b {
                return Err(Error::invalid(
                    OP,
                    format!("{} {what} rows for {b} candidate ids", kjt.stride()),
                ));
            }
        }
        if batch.labels.is_some() && matches!(self.config.loss, TwoTowerLoss::Softmax { .. }) {
            // Rows labelled 0 would be trained as positives.
            return Err(Error::invalid(
                OP,
                "the batch carries labels, which the softmax loss does not read (every pair is \
                 a positive): drop them, or train with the pointwise loss",
            ));
        }
        // The estimator records the batch before its log-Q is read; a step that fails after
        // takes the record back (a retried batch was counted twice).
        let undo = match self.config.loss {
            TwoTowerLoss::Softmax { .. } => {
                Some(self.estimator.update_undoable(&batch.candidate_ids))
            }
            TwoTowerLoss::Pointwise => None,
        };
        let stepped = self.step_after_record(batch, b);
        if stepped.is_err() {
            if let Some(undo) = undo {
                self.estimator.undo(undo);
            }
        }
        stepped
    }

    /// [`step_inner`](Self::step_inner) once the batch is checked and recorded.
    fn step_after_record(&mut self, batch: &PairBatch, b: usize) -> Result<f64> {
        self.optimizer.zero_grad();
        let q = self.model.embed_queries(&batch.queries)?;
        let c = self.model.embed_candidates(&batch.candidates)?;
        let loss = match self.config.loss {
            TwoTowerLoss::Pointwise => {
                let labels = batch.labels.as_ref().ok_or_else(|| {
                    Error::invalid(OP, "the pointwise loss needs labels in every batch")
                })?;
                pointwise_bce(&q, &c, labels, self.config.temperature)?
            }
            TwoTowerLoss::Softmax {
                log_q,
                random_negatives,
            } => {
                // The `b × n` logits' mask, allocated before anything else of the negatives'
                // size: a count past any memory is an error here, not an abort later.
                let n = b.checked_add(random_negatives);
                let mask = n.and_then(|n| b.checked_mul(n)).ok_or_else(|| {
                    Error::invalid(
                        OP,
                        format!("{random_negatives} random negatives for {b} rows overflow"),
                    )
                })?;
                let mut mask = crate::tensor::storage::try_filled(OP, 0f32, mask)?;
                let mut ids = batch.candidate_ids.clone();
                let mut lq: Vec<f32> = (ids.iter())
                    .map(|&id| self.estimator.probability(id).ln() as f32)
                    .collect();
                let mut candidates = c;
                if random_negatives > 0 {
                    let (catalogue, features) = self.negatives.as_ref().ok_or_else(|| {
                        Error::invalid(
                            OP,
                            "random negatives are configured but no sampler was given \
                             (with_negative_sampler)",
                        )
                    })?;
                    // Reproducible from the seed and the step alone (a resumed run draws
                    // the same negatives).
                    let mut rng = seeded(
                        self.config.seed ^ (self.step + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    );
                    let neg: Vec<i64> = (0..random_negatives)
                        .map(|_| rng.random_range(0..*catalogue as i64))
                        .collect();
                    let sampled = features(&neg)?;
                    if sampled.stride() != random_negatives {
                        return Err(Error::invalid(
                            OP,
                            format!(
                                "the negative sampler gave {} candidate rows for \
                                 {random_negatives} sampled ids",
                                sampled.stride()
                            ),
                        ));
                    }
                    let ne = self.model.embed_candidates(&sampled)?;
                    candidates = Tensor::cat(&[&candidates, &ne], 0)?;
                    let expected = (random_negatives as f64 / *catalogue as f64).ln() as f32;
                    lq.extend(std::iter::repeat_n(expected, random_negatives));
                    ids.extend(neg);
                }
                let n = ids.len();
                // Accidental hits: another column holding row i's own positive item.
                for i in 0..b {
                    for (j, &id) in ids.iter().enumerate() {
                        if j != i && id == ids[i] {
                            mask[i * n + j] = HIT_MASK;
                        }
                    }
                }
                let mask = Tensor::from_vec(mask, &[b, n])?;
                let lq = log_q.then(|| Tensor::from_vec(lq, &[n])).transpose()?;
                sampled_softmax(
                    &q,
                    &candidates,
                    lq.as_ref(),
                    Some(&mask),
                    self.config.temperature,
                )?
            }
        };
        super::refuse_diverged_on_host(OP, self.config.device, &loss, self.step)?;
        loss.backward()?;
        self.optimizer.step()?;
        let value = loss.item()?;
        self.step += 1;
        if !value.is_finite() {
            return Err(super::diverged(OP, self.step - 1, value, true));
        }
        self.examples += b as u64;
        Ok(value)
    }

    /// Writes everything needed to continue training exactly to `path` (atomically), with
    /// `user` metadata (returned by [`load_checkpoint`](Self::load_checkpoint)).
    pub fn save_checkpoint(
        &self,
        path: impl AsRef<Path>,
        user: &BTreeMap<String, String>,
    ) -> Result<()> {
        let mut w = trainer_writer(FORMAT, self.step, self.examples, Some(&self.config), user)?;
        // Tables cached in files go beside the file as their row files.
        w.parts_beside(path.as_ref());
        write_dense_state(&mut w, &Mlps(&self.model), self.optimizer.as_ref(), None)?;
        self.model
            .query
            .tables
            .checkpoint_into(&mut w, "query.tables.")?;
        self.model
            .candidate
            .tables
            .checkpoint_into(&mut w, "candidate.tables.")?;
        let (last, interval, _, steps) = self.estimator.to_parts();
        let last: Vec<i64> = last.iter().map(|&t| t as i64).collect();
        w.add("estimator.last", &[last.len()], &last)?;
        w.add("estimator.interval", &[interval.len()], interval)?;
        w.set_metadata("estimator.steps", steps.to_string());
        w.set_metadata("run", format!("{:016x}", self.run));
        w.write(path)
    }

    /// Restores a checkpoint of the same configuration written by
    /// [`save_checkpoint`](Self::save_checkpoint); returns its user metadata. Everything is
    /// read and checked before anything changes.
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
        let f = open(path)?;
        let named = |e| f.named(e);
        let (step, examples, steps) = (
            f.count("step")?,
            f.count("examples")?,
            f.count("estimator.steps")?,
        );
        let run = match f.r.metadata("run") {
            None => 0,
            Some(v) => u64::from_str_radix(v, 16)
                .ok()
                .filter(|_| v.len() == 16)
                .ok_or_else(|| f.bad(format!("metadata `run` = `{v}` is not 16 hex digits")))?,
        };
        let saved: TwoTowerConfig = f.config("a TwoTowerConfig")?;
        let mut mine = self.config.clone();
        mine.device = saved.device;
        f.same_config(&saved, &mine)?;
        let dense = DenseState::read(&f.r, &Mlps(&self.model), None).map_err(named)?;
        let query = self
            .model
            .query
            .tables
            .stage_from(&f.r, "query.tables.")
            .map_err(named)?;
        let candidate = (self.model.candidate.tables)
            .stage_from(&f.r, "candidate.tables.")
            .map_err(named)?;
        let buckets = self.config.estimator_buckets;
        let last: Vec<i64> = f.r.read("estimator.last", &[buckets]).map_err(named)?;
        let interval: Vec<f64> = f.r.read("estimator.interval", &[buckets]).map_err(named)?;
        if let Some(i) = last.iter().position(|&t| t < 0) {
            return Err(f.bad(format!("estimator.last[{i}] is negative")));
        }
        let estimator = FrequencyEstimator::from_parts(
            last.into_iter().map(|t| t as u64).collect(),
            interval,
            self.config.estimator_alpha,
            steps,
        )
        .map_err(named)?;
        let user = f.user();
        let previous = dense.apply(self.optimizer.as_mut(), None).map_err(named)?;
        // Both towers' cached tables commit together (all or none); on an error the dense
        // half is put back.
        let (queries, candidates) = (
            self.model.query.tables.tbes(),
            self.model.candidate.tables.tbes(),
        );
        if let Err(e) = StagedTables::apply_all(vec![(query, &queries), (candidate, &candidates)]) {
            previous
                .apply(self.optimizer.as_mut(), None)
                .map_err(named)?;
            return Err(named(e));
        }
        self.estimator = estimator;
        self.step = step;
        self.examples = examples;
        self.run = run;
        Ok(user)
    }
}
