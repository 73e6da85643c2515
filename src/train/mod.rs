//! Training DLRM-style click models: [`Batch`] (dense features, one KJT, labels),
//! [`DlrmTrainer`] (forward, BCE loss, backward with the tables' fused optimizer, a dense
//! optimizer step, running [`RecMetrics`]), evaluation over a split, optionally through a
//! quantized copy of the tables, and checkpoints that resume bit-identically.
//!
//! A checkpoint is one safetensors file written atomically ([`crate::checkpoint`]): the dense
//! parameters (`dense.*`), the dense optimizer's state (`optim.*`), every table with its fused
//! optimizer state (`tables.*`), the training metrics' state (`metrics.*`), the step and
//! example counters, and caller metadata (`user.*`, e.g. the data position and the command
//! line). Loading reads and checks all of it before changing anything.

use std::collections::BTreeMap;
use std::path::Path;

use crate::checkpoint::{CheckpointReader, CheckpointWriter};
use crate::embedding::{
    EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizer, Placement,
    QuantizedEmbeddingBagCollection,
};
use crate::metrics::{MetricKind, RecMetrics};
use crate::models::{Dlrm, DlrmDense};
use crate::nn::Module;
use crate::optim::{Adagrad, Adam, AdamConfig, Optimizer, Sgd};
use crate::sparse::KeyedJaggedTensor;
use crate::tensor::ops::loss::Reduction;
use crate::tensor::rng::{seeded, Rng};
use crate::{no_grad, DType, Device, Error, Result, Tensor};

mod two_tower;

pub use two_tower::{NegativeSampler, PairBatch, TwoTowerConfig, TwoTowerLoss, TwoTowerTrainer};

const OP: &str = "DlrmTrainer";
const FORMAT: &str = "embers.dlrm-trainer.v1";
/// The checkpoint metadata holding the [`DlrmConfig`] as JSON.
const CONFIG_KEY: &str = "model.config";

/// One training or evaluation batch: dense features `[B, num_dense]` (f32), sparse features
/// (a KJT with batch size `B`) and labels `[B, T]` (f32 in `[0, 1]`), one column per task (`T`
/// = 1 for click prediction).
#[derive(Clone, Debug)]
pub struct Batch {
    /// Dense features `[B, num_dense]`.
    pub dense: Tensor,
    /// Sparse features, stride `B`.
    pub sparse: KeyedJaggedTensor,
    /// Labels `[B, T]`, one column per task.
    pub labels: Tensor,
}

impl Batch {
    /// Checks the parts fit together: dense is 2-D f32 and finite, labels are `[B, T]` (or
    /// `[B]`, one task) finite values in `[0, 1]`, the KJT's batch size is `B`.
    pub fn new(dense: Tensor, sparse: KeyedJaggedTensor, labels: Tensor) -> Result<Self> {
        const OP: &str = "Batch::new";
        if dense.dtype() != DType::F32 || dense.shape().len() != 2 {
            return Err(Error::invalid(
                OP,
                format!(
                    "dense features must be f32 [B, num_dense], got {:?} {:?}",
                    dense.dtype(),
                    dense.shape()
                ),
            ));
        }
        let b = dense.shape()[0];
        let labels = if labels.shape() == [b] {
            labels.reshape(&[b, 1])?
        } else {
            labels
        };
        let shape = labels.shape().to_vec();
        if labels.dtype() != DType::F32 || shape.len() != 2 || shape[0] != b || shape[1] == 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "labels must be f32 [{b}, tasks] (or [{b}] for one task), got {:?} {:?}",
                    labels.dtype(),
                    labels.shape()
                ),
            ));
        }
        let tasks = shape[1];
        if sparse.variable_stride_per_key() || sparse.stride() != b {
            return Err(Error::invalid(
                OP,
                format!(
                    "the KJT's batch size is {}, the dense features have {b} rows",
                    sparse.stride()
                ),
            ));
        }
        let d = dense.shape()[1];
        if let Some(i) = dense.to_vec::<f32>()?.iter().position(|x| !x.is_finite()) {
            return Err(Error::invalid(
                OP,
                format!(
                    "dense feature {} of sample {} is not finite",
                    i % d.max(1),
                    i / d.max(1)
                ),
            ));
        }
        if let Some((i, y)) = (labels.to_vec::<f32>()?.into_iter().enumerate())
            .find(|(_, y)| !(0.0..=1.0).contains(y))
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "label {} of sample {} is {y}, expected a value in [0, 1]",
                    i % tasks,
                    i / tasks
                ),
            ));
        }
        Ok(Batch {
            dense,
            sparse,
            labels,
        })
    }

    /// Builds a batch from flat buffers in TorchRec's layout: dense `[B × num_dense]`
    /// row-major, ids and lengths key-major (all samples of key 0, then key 1, …), labels
    /// `[B × num_tasks]` row-major.
    pub fn from_parts(
        dense: Vec<f32>,
        num_dense: usize,
        keys: Vec<String>,
        ids: Vec<i64>,
        lengths: Vec<i32>,
        labels: Vec<f32>,
        num_tasks: usize,
    ) -> Result<Self> {
        if num_tasks == 0 || labels.len() % num_tasks != 0 {
            return Err(Error::invalid(
                "Batch::from_parts",
                format!(
                    "{} labels are not a whole number of samples of {num_tasks} task(s)",
                    labels.len()
                ),
            ));
        }
        let b = labels.len() / num_tasks;
        let n = ids.len();
        let l = lengths.len();
        let sparse = KeyedJaggedTensor::from_lengths(
            keys,
            Tensor::from_vec(ids, &[n])?,
            Tensor::from_vec(lengths, &[l])?,
            None,
            Some(b),
        )?;
        Batch::new(
            Tensor::from_vec(dense, &[b, num_dense])?,
            sparse,
            Tensor::from_vec(labels, &[b, num_tasks])?,
        )
    }

    /// Number of samples.
    pub fn batch_size(&self) -> usize {
        self.dense.shape()[0]
    }

    /// Number of label columns (tasks).
    pub fn num_tasks(&self) -> usize {
        self.labels.shape()[1]
    }

    /// The labels task by task: `T` columns of `B` values.
    pub fn label_columns(&self) -> Result<Vec<Vec<f32>>> {
        columns(&self.labels.to_vec::<f32>()?, self.num_tasks())
    }
}

/// The dense-parameter optimizer of a [`DlrmConfig`].
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum DenseOptimizer {
    /// Plain SGD.
    Sgd {
        /// Learning rate.
        lr: f64,
    },
    /// Adagrad (initial accumulator 0, eps 1e-10), TorchRec's DLRM example default.
    Adagrad {
        /// Learning rate.
        lr: f64,
    },
    /// Adam (betas 0.9/0.999, eps 1e-8).
    Adam {
        /// Learning rate.
        lr: f64,
    },
}

impl DenseOptimizer {
    /// The optimizer over `params`.
    pub fn build(self, params: Vec<Tensor>) -> Result<Box<dyn Optimizer + Send>> {
        Ok(match self {
            DenseOptimizer::Sgd { lr } => Box::new(Sgd::new(params, lr)?),
            DenseOptimizer::Adagrad { lr } => Box::new(Adagrad::new(params, lr, 0.0)?),
            DenseOptimizer::Adam { lr } => Box::new(Adam::new(
                params,
                AdamConfig {
                    lr,
                    ..Default::default()
                },
            )?),
        })
    }
}

/// Everything that defines a DLRM and its training: the shape of TorchRec's `DLRM` /
/// `DLRM_DCN` plus optimizers and seed. Every trainer checkpoint carries it as JSON (metadata
/// `model.config`, without the device), so a checkpoint alone rebuilds its model
/// ([`from_checkpoint`](Self::from_checkpoint)).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlrmConfig {
    /// Dense features per sample.
    pub num_dense: usize,
    /// Sparse features and the rows of each one's table (one table per feature, named
    /// `t_<feature>`).
    pub sparse_features: Vec<(String, usize)>,
    /// Embedding dimension `D` (also the dense arch's output width).
    pub embedding_dim: usize,
    /// Hidden widths of the dense (bottom) arch; `D` is appended as its last layer.
    pub dense_arch: Vec<usize>,
    /// Hidden widths of the over (top) arch; the logit layer (one logit per task) is appended.
    pub over_arch: Vec<usize>,
    /// The tasks, one label column and one logit each, in label-column order (`["click"]`
    /// for click prediction). The first is the primary task: its metrics carry the plain
    /// names (`auc`, `ne`, …), the others' are suffixed `/<task>` (`auc/like`).
    pub tasks: Vec<String>,
    /// DLRM-DCN: `Some((layers, rank))` replaces the dot interaction by a low-rank cross net.
    pub dcn: Option<(usize, usize)>,
    /// Optimizer of the dense half.
    pub dense_optimizer: DenseOptimizer,
    /// Optimizer fused into the tables' backward.
    pub sparse_optimizer: FusedOptimizer,
    /// Seed of the initialisation.
    pub seed: u64,
    /// Samples in the training metrics' sliding window.
    pub metrics_window: usize,
    /// Where the model trains (`Device::Cuda(n)`: dense half and tables on that GPU). Not
    /// stored in checkpoints (a checkpoint loads on any device; the CPU when read back).
    #[serde(skip)]
    pub device: Device,
}

impl DlrmConfig {
    /// Builds the model (initialised from `seed`) and its trainer.
    pub fn build(&self) -> Result<DlrmTrainer> {
        self.build_with(&Placement::Memory)
    }

    /// [`build`](Self::build) with the tables placed by `placement` (e.g. in files behind a
    /// DRAM cache: tables larger than host memory). The same seed gives the same model and
    /// the same training, whatever the placement.
    pub fn build_with(&self, placement: &Placement) -> Result<DlrmTrainer> {
        if self.sparse_features.is_empty() || self.embedding_dim == 0 {
            return Err(Error::invalid(
                "DlrmConfig",
                "need at least one sparse feature and an embedding dim of at least 1",
            ));
        }
        check_tasks(&self.tasks)?;
        let mut rng = seeded(self.seed);
        // Cached tables get their cache on the model's device (HBM on a GPU).
        let ebc = EmbeddingBagCollection::with_placement_on(
            self.table_configs(),
            self.sparse_optimizer,
            placement,
            self.device,
            &mut rng,
        )?;
        let dense = self.dense_half(&mut rng)?;
        let mut model = Dlrm::new(ebc, dense)?;
        model.to_device(self.device)?;
        let optimizer = self.dense_optimizer.build(model.dense.parameters())?;
        let mut trainer = DlrmTrainer::new(model, optimizer, &self.tasks, self.metrics_window)?;
        trainer.config = Some(self.clone());
        Ok(trainer)
    }

    /// The configuration a trainer checkpoint was written with (its `model.config` metadata;
    /// the device is the CPU): `from_checkpoint(p)?.build()?.load_checkpoint(p)` restores
    /// the trainer from the file alone. A configuration whose weights need more bytes than
    /// the file and its parts hold is refused before anything is built: a few edited bytes
    /// of metadata cannot make a reader allocate a model no file of that size stores.
    pub fn from_checkpoint(path: impl AsRef<Path>) -> Result<DlrmConfig> {
        let f = TrainerFile::open(path, FORMAT, "a trainer checkpoint")?;
        let config: DlrmConfig = f.config("a DlrmConfig")?;
        check_tasks(&config.tasks).map_err(|e| f.bad(e))?;
        f.could_hold(config.least_checkpoint_bytes())?;
        Ok(config)
    }

    /// A lower bound on the bytes of a checkpoint of this model: its tables' rows, the
    /// weight matrices of its MLPs and (DCN) one of each cross layer's two, 4 bytes a value;
    /// `None` when past a `u64`.
    fn least_checkpoint_bytes(&self) -> Option<u64> {
        let dim = self.embedding_dim as u64;
        let f = self.sparse_features.len() as u64;
        let tables = table_values(&self.sparse_features, self.embedding_dim)?;
        // The over arch's input: the interaction's output.
        let (over_in, cross) = match self.dcn {
            None => (dim.checked_add(f.checked_mul(f + 1)? / 2)?, 0),
            Some((layers, rank)) => {
                let width = (f + 1).checked_mul(dim)?;
                let cross = width.checked_mul(rank as u64)?.checked_mul(layers as u64)?;
                (width, cross)
            }
        };
        let bottom = [
            &[self.num_dense][..],
            &self.dense_arch,
            &[self.embedding_dim],
        ]
        .concat();
        let top = [
            &[usize::try_from(over_in).ok()?][..],
            &self.over_arch,
            &[self.tasks.len()],
        ]
        .concat();
        let weights = tables
            .checked_add(cross)?
            .checked_add(weights_between(&bottom)?)?
            .checked_add(weights_between(&top)?)?;
        weights.checked_mul(4)
    }

    /// The tables: one per sparse feature, `t_<feature>`, of `embedding_dim` columns.
    pub fn table_configs(&self) -> Vec<EmbeddingBagConfig> {
        (self.sparse_features.iter())
            .map(|(f, rows)| {
                EmbeddingBagConfig::new(format!("t_{f}"), *rows, self.embedding_dim, &[f])
            })
            .collect()
    }

    /// The dense half (bottom MLP, interaction, top MLP) on the CPU, initialised from `rng`.
    pub fn dense_half(&self, rng: &mut Rng) -> Result<DlrmDense> {
        let mut dense_sizes = self.dense_arch.clone();
        dense_sizes.push(self.embedding_dim);
        let mut over_sizes = self.over_arch.clone();
        over_sizes.push(self.tasks.len());
        let f = self.sparse_features.len();
        match self.dcn {
            None => DlrmDense::dot(
                self.num_dense,
                &dense_sizes,
                f,
                &over_sizes,
                DType::F32,
                rng,
            ),
            Some((layers, rank)) => DlrmDense::dcn(
                self.num_dense,
                &dense_sizes,
                f,
                &over_sizes,
                layers,
                rank,
                DType::F32,
                rng,
            ),
        }
    }
}

/// What one training step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    /// Mean binary cross-entropy of the batch (before the update).
    pub loss: f64,
    /// Samples in the batch.
    pub batch_size: usize,
}

/// Metrics of an evaluation pass (`lifetime_*` values of [`RecMetrics`]; the primary task's
/// under plain names, the others' suffixed `/<task>`).
#[derive(Clone, Debug, PartialEq)]
pub struct EvalReport {
    /// Metric name (`auc`, `ne`, `logloss`, `calibration`, `ctr`, …) → value.
    pub metrics: BTreeMap<String, f64>,
    /// Examples evaluated.
    pub examples: u64,
}

impl EvalReport {
    /// A metric by short name (`auc`, `ne`, …); NaN if absent.
    pub fn get(&self, name: &str) -> f64 {
        self.metrics.get(name).copied().unwrap_or(f64::NAN)
    }
}

/// Checks a model's task names: at least one, unique, each a non-empty word of letters,
/// digits, `_` and `.` (they name metrics and label columns).
pub fn check_tasks(tasks: &[String]) -> Result<()> {
    if tasks.is_empty() {
        return Err(Error::invalid("tasks", "a model needs at least one task"));
    }
    let mut seen = std::collections::HashSet::with_capacity(tasks.len());
    for task in tasks {
        let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
        if task.is_empty() || !task.chars().all(word) {
            return Err(Error::invalid(
                "tasks",
                format!("task name `{task}` must be a non-empty word of letters, digits, `_`, `.`"),
            ));
        }
        if !seen.insert(task) {
            return Err(Error::invalid(
                "tasks",
                format!("task `{task}` is named twice"),
            ));
        }
    }
    Ok(())
}

/// The training metrics of `tasks` (every [`MetricKind`], windows of `window` samples).
pub fn task_metrics(tasks: &[String], window: usize) -> Result<RecMetrics> {
    let names: Vec<&str> = tasks.iter().map(String::as_str).collect();
    RecMetrics::new(&names, &MetricKind::all(), window)
}

/// Short metric names out of [`RecMetrics::compute`] keys, the first (primary) task's plain
/// and the others' suffixed with their name: `ne-click|lifetime_ne` → `ne`,
/// `ne-click|window_ne` → `window_ne`, `auc-like|lifetime_auc` → `auc/like` when `like` is
/// not the first task.
pub fn short_names(tasks: &[String], all: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    all.into_iter()
        .filter_map(|(k, v)| {
            let (metric, rest) = k.split_once('|')?;
            let name = rest.strip_prefix("lifetime_").unwrap_or(rest);
            let (_, task) = metric.rsplit_once('-')?;
            let task = tasks.iter().position(|t| t == task)?;
            Some(match task {
                0 => (name.to_string(), v),
                _ => (format!("{name}/{}", tasks[task]), v),
            })
        })
        .collect()
}

/// The lifetime values of [`RecMetrics::compute`] under their short names (see
/// [`short_names`]), window values left out: what an evaluation reports.
pub fn lifetime_metrics(tasks: &[String], all: BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    short_names(tasks, all)
        .into_iter()
        .filter(|(k, _)| !k.starts_with("window_"))
        .collect()
}

/// Splits row-major `[B, tasks]` values into `tasks` columns of `B` values.
pub fn columns(values: &[f32], tasks: usize) -> Result<Vec<Vec<f32>>> {
    if tasks == 0 || values.len() % tasks != 0 {
        return Err(Error::invalid(
            "columns",
            format!("{} values are not rows of {tasks} task(s)", values.len()),
        ));
    }
    Ok((0..tasks)
        .map(|t| values.iter().skip(t).step_by(tasks).copied().collect())
        .collect())
}

/// A trainer checkpoint being read (the DLRM trainer's and the TwoTower trainer's share this
/// header): the reader, and errors that name its file.
pub(crate) struct TrainerFile {
    pub(crate) r: CheckpointReader,
    path: String,
}

impl TrainerFile {
    /// Opens `path`; its `format` metadata must be `format` (`what` names the kind otherwise).
    pub(crate) fn open(path: impl AsRef<Path>, format: &str, what: &str) -> Result<Self> {
        let r = CheckpointReader::open(path)?;
        let path = r.path().display().to_string();
        let found = r.metadata("format").unwrap_or("");
        if found != format {
            return Err(Error::invalid(
                "checkpoint",
                format!("{path}: format is `{found}`, expected `{format}` (not {what})"),
            ));
        }
        Ok(TrainerFile { r, path })
    }

    /// An error about this file.
    pub(crate) fn bad(&self, msg: impl std::fmt::Display) -> Error {
        Error::invalid("checkpoint", format!("{}: {msg}", self.path))
    }

    /// `e`, naming this file if it does not already (the readers do not all know it).
    pub(crate) fn named(&self, e: Error) -> Error {
        if e.to_string().contains(&self.path) {
            e
        } else {
            self.bad(e)
        }
    }

    /// Refuses a model configuration read from this file when its weights need more bytes
    /// (`least`, a lower bound; `None`: past a `u64`) than the file and its parts directory
    /// hold: a few hundred bytes of metadata cannot make a reader build, and allocate, a
    /// model that no file of that size stores.
    pub(crate) fn could_hold(&self, least: Option<u64>) -> Result<()> {
        let held = self.stored_bytes()?;
        match least {
            Some(least) if least <= held => Ok(()),
            _ => Err(self.bad(format!(
                "its `{CONFIG_KEY}` describes weights of {} bytes or more; the file and its \
                 parts hold {held}",
                least.map_or("2^64".to_string(), |b| b.to_string())
            ))),
        }
    }

    /// The bytes of this file and of the files in its parts directory (tables cached in
    /// files keep their rows there, a directory each).
    fn stored_bytes(&self) -> Result<u64> {
        fn walk(path: &Path, depth: usize, held: &mut u64) -> std::io::Result<()> {
            let meta = std::fs::metadata(path)?;
            if meta.is_dir() && depth > 0 {
                for entry in std::fs::read_dir(path)? {
                    walk(&entry?.path(), depth - 1, held)?;
                }
            } else {
                *held = held.saturating_add(meta.len());
            }
            Ok(())
        }
        let io = |p: &Path| {
            let path = p.display().to_string();
            move |source| Error::Io { path, source }
        };
        let mut held = 0;
        walk(self.r.path(), 0, &mut held).map_err(io(self.r.path()))?;
        if let Some(parts) = self.r.parts_dir().map_err(|e| self.named(e))? {
            walk(&parts, 2, &mut held).map_err(io(&parts))?;
        }
        Ok(held)
    }

    /// Metadata `key` as a count.
    pub(crate) fn count(&self, key: &str) -> Result<u64> {
        let v = self.r.required_metadata(key).map_err(|e| self.named(e))?;
        crate::checkpoint::parse_count(v).ok_or_else(|| {
            self.bad(format!(
                "metadata `{key}` = `{v}` is not a count below 2^63"
            ))
        })
    }

    /// The `user.*` metadata, prefix removed.
    pub(crate) fn user(&self) -> BTreeMap<String, String> {
        (self.r.names_of_metadata().into_iter())
            .filter_map(|(k, v)| Some((k.strip_prefix("user.")?.to_string(), v)))
            .collect()
    }

    /// The model configuration (metadata `model.config`, JSON) as `what` (a `DlrmConfig`, ...).
    pub(crate) fn config<T: serde::de::DeserializeOwned>(&self, what: &str) -> Result<T> {
        let json = self.r.metadata(CONFIG_KEY).ok_or_else(|| {
            self.bad(format!(
                "no `{CONFIG_KEY}` metadata (written by a trainer not built from {what})"
            ))
        })?;
        serde_json::from_str(json)
            .map_err(|e| self.bad(format!("metadata `{CONFIG_KEY}` is not {what}: {e}")))
    }

    /// Refuses a checkpoint whose configuration `saved` is not `mine`, compared as both read
    /// back from JSON: the saved one went through it, and a float need not come back from
    /// its text bit for bit.
    pub(crate) fn same_config<T>(&self, saved: &T, mine: &T) -> Result<()>
    where
        T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
    {
        let json = serde_json::to_string(mine)
            .map_err(|e| self.bad(format!("this configuration does not serialise: {e}")))?;
        let mine: T = serde_json::from_str(&json)
            .map_err(|e| self.bad(format!("this configuration does not read back: {e}")))?;
        if *saved != mine {
            return Err(self.bad(format!(
                "written for another configuration:\n  saved: {saved:?}\n  this:  {mine:?}"
            )));
        }
        Ok(())
    }
}

/// The values of tables of `dim` columns, one per feature, `(name, rows)` (`None`: past a
/// `u64`).
pub(crate) fn table_values(features: &[(String, usize)], dim: usize) -> Option<u64> {
    let rows = (features.iter()).try_fold(0u64, |n, (_, r)| n.checked_add(*r as u64))?;
    rows.checked_mul(dim as u64)
}

/// The values of the weight matrices between consecutive `widths` (`None`: past a `u64`).
pub(crate) fn weights_between(widths: &[usize]) -> Option<u64> {
    (widths.windows(2)).try_fold(0u64, |n, w| {
        n.checked_add((w[0] as u64).checked_mul(w[1] as u64)?)
    })
}

/// A checkpoint writer holding a trainer checkpoint's header: `format`, the step, the examples
/// seen, the configuration as JSON (`model.config`, when there is one) and `user` as `user.*`.
pub(crate) fn trainer_writer<'a>(
    format: &str,
    step: u64,
    examples: u64,
    config: Option<&impl serde::Serialize>,
    user: &BTreeMap<String, String>,
) -> Result<CheckpointWriter<'a>> {
    let mut w = CheckpointWriter::new();
    w.set_metadata("format", format);
    w.set_metadata("step", step.to_string());
    w.set_metadata("examples", examples.to_string());
    if let Some(config) = config {
        let json = serde_json::to_string(config)
            .map_err(|e| Error::invalid("checkpoint", format!("{CONFIG_KEY}: {e}")))?;
        w.set_metadata(CONFIG_KEY, json);
    }
    for (k, v) in user {
        w.set_metadata(format!("user.{k}"), v.clone());
    }
    Ok(w)
}

/// Checks that `batch` carries one label column per task of `tasks` and `logits` (`[B, T]`)
/// one logit per task: what the trainer and the sharded example check after each forward.
pub fn check_logits(tasks: &[String], batch: &Batch, logits: &Tensor) -> Result<()> {
    let t = tasks.len();
    if batch.num_tasks() != t {
        return Err(Error::invalid(
            OP,
            format!(
                "the batch has {} label column(s), the model has {t} task(s) {tasks:?}",
                batch.num_tasks()
            ),
        ));
    }
    if logits.shape() != [batch.batch_size(), t] {
        return Err(Error::invalid(
            OP,
            format!(
                "the model gives logits {:?}, expected [{}, {t}] (one per task)",
                logits.shape(),
                batch.batch_size()
            ),
        ));
    }
    Ok(())
}

/// Feeds probabilities `[B, T]` (row-major, one per task) and `batch`'s labels `[B, T]` to
/// `metrics` (one task of `metrics` per column).
pub fn update_task_metrics(metrics: &mut RecMetrics, probs: &[f32], batch: &Batch) -> Result<()> {
    let t = batch.num_tasks();
    let probs = columns(probs, t)?;
    let labels = batch.label_columns()?;
    let probs: Vec<&[f32]> = probs.iter().map(Vec::as_slice).collect();
    let labels: Vec<&[f32]> = labels.iter().map(Vec::as_slice).collect();
    metrics.update(&probs, &labels, None)
}

/// Adds the dense half of a training state to `w`: the dense parameters (`dense.*`), the
/// dense optimizer's state (`optim.*`) and learning rate (metadata `optim.lr`: one changed
/// during the run resumes as it was) and, when given, the training metrics' state
/// (`metrics.*`). Shared
/// by [`DlrmTrainer`]'s checkpoints and the per-rank files of a sharded run.
pub fn write_dense_state(
    w: &mut CheckpointWriter,
    dense: &impl Module,
    optimizer: &dyn Optimizer,
    metrics: Option<&RecMetrics>,
) -> Result<()> {
    for (name, p) in dense.named_parameters() {
        w.add_tensor(format!("dense.{name}"), &p)?;
    }
    for (name, t) in optimizer.state_dict()? {
        w.add_tensor(format!("optim.{name}"), &t)?;
    }
    // Rust's shortest round-trip form: read back bit for bit.
    w.set_metadata(LR_KEY, format!("{:?}", optimizer.learning_rate()));
    for (name, values) in metrics.map(RecMetrics::state_dict).unwrap_or_default() {
        w.add(format!("metrics.{name}"), &[values.len()], &values)?;
    }
    Ok(())
}

/// The metadata key of the dense optimizer's learning rate.
const LR_KEY: &str = "optim.lr";

/// [`write_dense_state`]'s part of a checkpoint, read and checked, not yet applied.
pub struct DenseState {
    params: Vec<(Tensor, Tensor)>,
    optim: Vec<(String, Tensor)>,
    /// The learning rate saved (none in checkpoints written before it was).
    lr: Option<f64>,
    metrics: Option<RecMetrics>,
}

impl DenseState {
    /// Reads the state of `dense`'s parameters and of the dense optimizer from `r`, and, when
    /// `metrics` is given, the metrics' state (checked against its configuration).
    pub fn read(
        r: &CheckpointReader,
        dense: &impl Module,
        metrics: Option<&RecMetrics>,
    ) -> Result<DenseState> {
        let params = (dense.named_parameters().into_iter())
            .map(|(name, p)| {
                let new = r.read_like(&format!("dense.{name}"), &p)?;
                Ok((p, new))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut names = r.names();
        names.sort();
        let optim = (names.iter())
            .filter_map(|n| Some((n, n.strip_prefix("optim.")?)))
            .map(|(full, short)| Ok((short.to_string(), r.read_tensor(full)?)))
            .collect::<Result<Vec<_>>>()?;
        let metrics = match metrics {
            None => None,
            Some(like) => {
                let mut state = BTreeMap::new();
                for name in &names {
                    if let Some(short) = name.strip_prefix("metrics.") {
                        let len = r.shape(name).unwrap_or_default().iter().product::<usize>();
                        state.insert(short.to_string(), r.read::<f64>(name, &[len])?);
                    }
                }
                let mut metrics = like.clone();
                metrics.load_state_dict(&state)?;
                Some(metrics)
            }
        };
        let lr = match r.metadata(LR_KEY) {
            None => None,
            Some(v) => Some(
                (v.parse::<f64>().ok())
                    .filter(|lr| lr.is_finite() && *lr >= 0.0)
                    .ok_or_else(|| {
                        Error::invalid(
                            "checkpoint",
                            format!(
                                "{}: metadata `{LR_KEY}` = `{v}` is not a learning rate",
                                r.path().display()
                            ),
                        )
                    })?,
            ),
        };
        Ok(DenseState {
            params,
            optim,
            lr,
            metrics,
        })
    }

    /// Applies it: the optimizer's state first (it checks the whole state before changing
    /// anything; after it, nothing left can fail on a value already checked), then the
    /// parameters, then the metrics when they were read (into `metrics`, when given).
    /// Returns what it replaced, which applied the same way puts it back: the undo of a load
    /// whose later part (the tables) fails.
    pub fn apply(
        self,
        optimizer: &mut dyn Optimizer,
        metrics: Option<&mut RecMetrics>,
    ) -> Result<DenseState> {
        let mut previous = DenseState {
            params: Vec::with_capacity(self.params.len()),
            optim: optimizer.state_dict()?,
            lr: Some(optimizer.learning_rate()),
            metrics: None,
        };
        for (p, _) in &self.params {
            let old = p.zeros_like();
            old.copy_from(p)?;
            previous.params.push((p.clone(), old));
        }
        // A device's copy can still fail part way: what was replaced is put back then (the
        // optimizer's state, the parameters copied so far), so the error leaves no half.
        if let Err(e) = self.write_into(optimizer) {
            // Best effort: the values put back were just read from these very places.
            let _ = previous.write_into(optimizer);
            return Err(e);
        }
        if let (Some(m), Some(into)) = (self.metrics, metrics) {
            previous.metrics = Some(std::mem::replace(into, m));
        }
        Ok(previous)
    }

    /// Writes the optimizer's state and learning rate, then the parameters.
    fn write_into(&self, optimizer: &mut dyn Optimizer) -> Result<()> {
        optimizer.load_state_dict(&self.optim)?;
        if let Some(lr) = self.lr {
            optimizer.set_learning_rate(lr);
        }
        for (p, new) in &self.params {
            p.copy_from(new)?;
        }
        Ok(())
    }
}

/// Trains a [`Dlrm`]: the tables through their fused optimizer, the dense half through a
/// dense [`Optimizer`].
pub struct DlrmTrainer {
    /// What built it (stored in checkpoints), when a [`DlrmConfig`] did.
    config: Option<DlrmConfig>,
    model: Dlrm,
    optimizer: Box<dyn Optimizer + Send>,
    tasks: Vec<String>,
    metrics: RecMetrics,
    step: u64,
    examples: u64,
}

/// The error of a non-finite loss at `step`: training diverged; `applied` says whether the
/// step's update was applied (on a GPU) or not taken (on the host).
pub(crate) fn diverged(op: &'static str, step: u64, loss: f64, applied: bool) -> Error {
    let then = if applied {
        "its update was applied (restore a checkpoint)"
    } else {
        "the step was not taken: the model is as before it"
    };
    Error::invalid(
        op,
        format!(
            "the loss of step {step} is {loss}: training diverged (lower the learning rates); \
             {then}"
        ),
    )
}

/// On the host, `loss` read before the backward, whose fused update would write a non-finite
/// gradient into the tables: an error naming `step` when it is not finite, the step not taken.
/// On a GPU nothing: that read would wait for the device mid-step, so the caller reads the
/// loss once the step is queued.
pub(crate) fn refuse_diverged_on_host(
    op: &'static str,
    device: Device,
    loss: &Tensor,
    step: u64,
) -> Result<()> {
    if device == Device::Cpu {
        let value = loss.item()?;
        if !value.is_finite() {
            return Err(diverged(op, step, value, false));
        }
    }
    Ok(())
}

impl DlrmTrainer {
    /// A trainer for `model` whose dense parameters are updated by `optimizer` (built over
    /// `model.dense`'s parameters) and whose logits are `tasks` in order; training metrics
    /// keep windows of `window` samples. Tunes the process's `malloc` once (see
    /// [`keep_freed_host_memory`](crate::tensor::keep_freed_host_memory)).
    pub fn new(
        model: Dlrm,
        optimizer: Box<dyn Optimizer + Send>,
        tasks: &[String],
        window: usize,
    ) -> Result<Self> {
        check_tasks(tasks)?;
        let metrics = task_metrics(tasks, window)?;
        crate::tensor::keep_freed_host_memory();
        Ok(DlrmTrainer {
            config: None,
            model,
            optimizer,
            tasks: tasks.to_vec(),
            metrics,
            step: 0,
            examples: 0,
        })
    }

    /// The model.
    pub fn model(&self) -> &Dlrm {
        &self.model
    }

    /// The dense optimizer.
    pub fn optimizer_mut(&mut self) -> &mut (dyn Optimizer + Send) {
        self.optimizer.as_mut()
    }

    /// The tasks, in label-column order.
    pub fn tasks(&self) -> &[String] {
        &self.tasks
    }

    /// Steps taken so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Training examples seen so far.
    pub fn examples_seen(&self) -> u64 {
        self.examples
    }

    /// One step: forward, BCE loss (mean over samples and tasks: each task's mean loss,
    /// averaged), backward (which updates the looked-up table rows
    /// through the fused optimizer), dense optimizer step, metrics update. A non-finite loss
    /// is an error naming the step. On the host the step is then not taken (the loss is read
    /// before the backward); on a GPU its update has been applied, so the parameters may hold
    /// non-finite values (restore a checkpoint).
    ///
    /// The loss and predictions are read back only once the whole step is queued: on a GPU
    /// the host waits for the device once per step, not between forward and backward.
    pub fn train_step(&mut self, batch: &Batch) -> Result<StepOutput> {
        self.train_step_then(batch, || Ok(()))
    }

    /// [`train_step`](Self::train_step), calling `after_backward` once the backward is queued,
    /// before the dense optimizer's step. On a GPU that is where to prefetch the next batch's
    /// cached rows (`EmbeddingBagCollection::prefetch`): their admission runs on the device's
    /// prefetch stream beside this batch's backward. An error from it ends the step (the
    /// backward done, the optimizer's step not taken).
    pub fn train_step_then(
        &mut self,
        batch: &Batch,
        after_backward: impl FnOnce() -> Result<()> + Send,
    ) -> Result<StepOutput> {
        if self.model.device() == Device::Cpu {
            crate::tensor::on_worker(|| self.step_inner(batch, after_backward))
        } else {
            self.step_inner(batch, after_backward)
        }
    }

    fn step_inner(
        &mut self,
        batch: &Batch,
        after_backward: impl FnOnce() -> Result<()>,
    ) -> Result<StepOutput> {
        let b = batch.batch_size();
        if b == 0 {
            // Its mean loss is 0/0, reported as divergence after the optimizer had stepped.
            return Err(Error::invalid(
                "DlrmTrainer::train_step",
                "an empty batch (no example) has nothing to train on",
            ));
        }
        self.optimizer.zero_grad();
        let logits = self.model.forward(&batch.dense, &batch.sparse)?;
        check_logits(&self.tasks, batch, &logits)?;
        let labels = batch.labels.to_device(self.model.device())?;
        let loss = logits.bce_with_logits(&labels, None, Reduction::Mean)?;
        let probs = no_grad(|| logits.detach().sigmoid())?;
        // Named as the step it would have been; a step not taken is not counted.
        refuse_diverged_on_host(OP, self.model.device(), &loss, self.step + 1)?;
        loss.backward()?;
        after_backward()?;
        self.optimizer.step()?;
        let loss_value = loss.item()?;
        if !loss_value.is_finite() {
            self.step += 1;
            return Err(diverged(OP, self.step, loss_value, true));
        }
        update_task_metrics(&mut self.metrics, &probs.to_vec::<f32>()?, batch)?;
        self.step += 1;
        self.examples += b as u64;
        Ok(StepOutput {
            loss: loss_value,
            batch_size: b,
        })
    }

    /// The training metrics so far: lifetime values under their short names (`auc`, `ne`,
    /// …) and window values as `window_auc`, `window_ne`, … (other tasks' suffixed
    /// `/<task>`).
    pub fn train_metrics(&self) -> BTreeMap<String, f64> {
        short_names(&self.tasks, self.metrics.compute())
    }

    /// Probabilities for a batch, `[B × T]` row-major (one per task; for one task, the click
    /// probability of each sample), through the trained tables or, when given, a quantized
    /// copy of them. Row-invariant on CPU ([`row_invariant`](crate::tensor::row_invariant)): a
    /// sample's probabilities are bit-identical whatever else the batch holds.
    pub fn predict(
        &self,
        batch: &Batch,
        tables: Option<&QuantizedEmbeddingBagCollection>,
    ) -> Result<Vec<f32>> {
        crate::tensor::row_invariant(|| {
            no_grad(|| {
                let logits = match tables {
                    None => self.model.forward(&batch.dense, &batch.sparse)?,
                    Some(q) => {
                        let pooled = q.forward(&batch.sparse)?;
                        self.model.forward_pooled(&batch.dense, pooled.values())?
                    }
                };
                check_logits(&self.tasks, batch, &logits)?;
                logits.sigmoid()?.to_vec::<f32>()
            })
        })
    }

    /// Metrics over every batch of `batches` (no training), through the trained tables or a
    /// quantized copy of them.
    pub fn evaluate<I>(
        &self,
        batches: I,
        tables: Option<&QuantizedEmbeddingBagCollection>,
    ) -> Result<EvalReport>
    where
        I: IntoIterator<Item = Result<Batch>>,
    {
        let mut metrics = task_metrics(&self.tasks, 1)?;
        let mut examples = 0;
        for batch in batches {
            let batch = batch?;
            let probs = self.predict(&batch, tables)?;
            update_task_metrics(&mut metrics, &probs, &batch)?;
            examples += batch.batch_size() as u64;
        }
        let metrics = lifetime_metrics(&self.tasks, metrics.compute());
        Ok(EvalReport { metrics, examples })
    }

    /// Writes everything needed to continue training exactly where it stands to `path`
    /// (atomically), with `user` metadata stored alongside (returned by
    /// [`load_checkpoint`](Self::load_checkpoint)).
    pub fn save_checkpoint(
        &self,
        path: impl AsRef<Path>,
        user: &BTreeMap<String, String>,
    ) -> Result<()> {
        let mut w = trainer_writer(FORMAT, self.step, self.examples, self.config.as_ref(), user)?;
        // Tables cached in files go beside the file as their row files.
        w.parts_beside(path.as_ref());
        write_dense_state(
            &mut w,
            &self.model.dense,
            self.optimizer.as_ref(),
            Some(&self.metrics),
        )?;
        self.model.sparse_arch.checkpoint_into(&mut w, "tables.")?;
        w.write(path)
    }

    /// Restores a checkpoint written by [`save_checkpoint`](Self::save_checkpoint) for the
    /// same model configuration and optimizers, and returns its user metadata. Everything is
    /// read and checked before anything changes: a truncated, corrupt or mismatched file
    /// leaves the trainer as it was. A trainer built from a [`DlrmConfig`] refuses a
    /// checkpoint of another one (any field but the device and the seed, whose initial values
    /// the load replaces: a resume with other learning rates is another run).
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
        let f = TrainerFile::open(path, FORMAT, "a trainer checkpoint")?;
        let (step, examples) = (f.count("step")?, f.count("examples")?);
        let named = |e| f.named(e);
        // A trainer built from a configuration continues only a checkpoint of the same one
        // (widths, optimizers, learning rates), not silently another run. The device and the
        // seed (the initial values, which the load replaces) may differ.
        if let Some(mine) = &self.config {
            let saved: DlrmConfig = f.config("a DlrmConfig")?;
            let mine = DlrmConfig {
                device: saved.device,
                seed: saved.seed,
                ..mine.clone()
            };
            f.same_config(&saved, &mine)?;
        }
        // Stage everything.
        let dense =
            DenseState::read(&f.r, &self.model.dense, Some(&self.metrics)).map_err(named)?;
        let tables = self
            .model
            .sparse_arch
            .stage_from(&f.r, "tables.")
            .map_err(named)?;
        let user = f.user();
        // The optimizer checks its whole state before changing anything; after it, nothing
        // left can fail on a value already checked, but the tables' files can (I/O): the
        // dense half is then put back.
        let previous =
            (dense.apply(self.optimizer.as_mut(), Some(&mut self.metrics))).map_err(named)?;
        if let Err(e) = tables.apply(&self.model.sparse_arch.tbes()) {
            (previous.apply(self.optimizer.as_mut(), Some(&mut self.metrics))).map_err(named)?;
            return Err(named(e));
        }
        self.step = step;
        self.examples = examples;
        Ok(user)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{Forward, Linear};

    /// A dense state whose write fails part way (here a parameter a copy cannot go into, a
    /// view; on a device, a failed copy) puts back what it had replaced: the parameters
    /// written before the failure, the optimizer's state and learning rate.
    #[test]
    fn a_dense_load_failing_part_way_leaves_no_half() {
        let a = Tensor::from_slice(&[1.0f32, 2.0], &[2])
            .unwrap()
            .with_requires_grad(true);
        let b = (Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap())
            .t()
            .unwrap();
        let mut optimizer = Adagrad::new(vec![a.clone()], 0.1, 0.0).unwrap();
        let state = DenseState {
            params: vec![
                (a.clone(), Tensor::from_slice(&[9.0f32, 9.0], &[2]).unwrap()),
                (
                    b.clone(),
                    Tensor::zeros(&[2, 2], DType::F32, crate::Device::Cpu),
                ),
            ],
            optim: optimizer.state_dict().unwrap(),
            lr: Some(0.5),
            metrics: None,
        };
        assert!(state.apply(&mut optimizer, None).is_err());
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
        assert_eq!(optimizer.learning_rate(), 0.1);
    }

    /// The dense half of a load applied, then undone with what it returned (as a trainer does
    /// when its tables fail to load): the parameters and the optimizer's state are back, bit
    /// for bit.
    #[test]
    fn a_dense_load_undone_puts_back_the_parameters_and_the_optimizer_state() {
        let dir = std::env::temp_dir().join(format!("embers-dense-undo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dense.safetensors");
        let mut rng = crate::tensor::rng::seeded(3);
        let layer = Linear::new(3, 2, &mut rng).unwrap();
        let mut optimizer = Adagrad::new(layer.parameters(), 0.1, 0.0).unwrap();
        let x = Tensor::from_vec(vec![0.5f32, -1.0, 2.0], &[1, 3]).unwrap();
        let step = |optimizer: &mut Adagrad| {
            optimizer.zero_grad();
            layer
                .forward(&x)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            optimizer.step().unwrap();
        };
        let bits = |optimizer: &Adagrad| {
            let params = (layer.parameters().into_iter()).map(|p| p.to_vec::<f32>().unwrap());
            let state = (optimizer.state_dict().unwrap().into_iter()).map(|(_, t)| {
                t.to_dtype(crate::DType::F64)
                    .unwrap()
                    .to_vec::<f64>()
                    .unwrap()
            });
            (params.collect::<Vec<_>>(), state.collect::<Vec<_>>())
        };
        step(&mut optimizer);
        let mut w = CheckpointWriter::new();
        write_dense_state(&mut w, &layer, &optimizer, None).unwrap();
        w.write(&path).unwrap();
        let saved = bits(&optimizer);
        // A schedule changed the learning rate after the save: the load brings back the
        // saved one (it resumed at the configured rate), the undo the changed one.
        let saved_lr = optimizer.learning_rate();
        optimizer.set_learning_rate(saved_lr / 3.0);
        step(&mut optimizer);
        let now = bits(&optimizer);
        assert_ne!(now, saved, "the second step changed nothing");
        let r = CheckpointReader::open(&path).unwrap();
        let previous = (DenseState::read(&r, &layer, None).unwrap())
            .apply(&mut optimizer, None)
            .unwrap();
        assert_eq!(bits(&optimizer), saved);
        assert_eq!(optimizer.learning_rate().to_bits(), saved_lr.to_bits());
        previous.apply(&mut optimizer, None).unwrap();
        assert_eq!(bits(&optimizer), now);
        assert_eq!(
            optimizer.learning_rate().to_bits(),
            (saved_lr / 3.0).to_bits()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A trainer load whose cached tables fail to commit (their row file's rename, an I/O
    /// error) leaves the whole trainer as it was: dense parameters, their optimizer state and
    /// the step count put back after the dense half was applied, tables untouched. Without
    /// the fault the same load goes through.
    #[test]
    fn a_trainer_load_whose_tables_fail_leaves_the_trainer_as_it_was() {
        use crate::embedding::tbe::cache::store::FAIL_REPLACE;
        use crate::embedding::{CachePolicy, Placement};
        let dir = std::env::temp_dir().join(format!("embers-load-undo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = DlrmConfig {
            num_dense: 3,
            sparse_features: vec![("a".into(), 60), ("b".into(), 40)],
            embedding_dim: 4,
            dense_arch: vec![8],
            over_arch: vec![8],
            tasks: vec!["click".into()],
            dcn: None,
            dense_optimizer: DenseOptimizer::Adagrad { lr: 0.05 },
            sparse_optimizer: FusedOptimizer::RowWiseAdagrad {
                lr: 0.05,
                eps: 1e-8,
            },
            seed: 3,
            metrics_window: 100,
            device: Device::Cpu,
        };
        let placement = Placement::for_kernel(
            "fused_uvm_caching",
            Some(0.2),
            dir.join("rows"),
            CachePolicy::Lru,
        )
        .unwrap();
        let mut t = cfg.build_with(&placement).unwrap();
        assert!(t.model().sparse_arch.tbes()[0].is_cached());
        let b = 8usize;
        let dense: Vec<f32> = (0..b * 3).map(|i| (i % 7) as f32 * 0.3 - 1.0).collect();
        let ids: Vec<i64> = (0..2 * b as i64).map(|i| (i * 13) % 40).collect();
        let batch = Batch::new(
            Tensor::from_vec(dense, &[b, 3]).unwrap(),
            KeyedJaggedTensor::from_lengths(
                vec!["a".into(), "b".into()],
                Tensor::from_vec(ids, &[2 * b]).unwrap(),
                Tensor::from_vec(vec![1i64; 2 * b], &[2 * b]).unwrap(),
                None,
                None,
            )
            .unwrap(),
            Tensor::from_vec((0..b).map(|i| (i % 2) as f32).collect(), &[b, 1]).unwrap(),
        )
        .unwrap();
        let state = |t: &DlrmTrainer| {
            let dense = (t.model().dense.named_parameters().into_iter())
                .map(|(_, p)| p.to_vec::<f32>().unwrap())
                .collect::<Vec<_>>();
            let optimizer = (t.optimizer.state_dict().unwrap().into_iter())
                .map(|(_, s)| s.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap())
                .collect::<Vec<_>>();
            let arch = &t.model().sparse_arch;
            let tables = (arch.configs().iter())
                .map(|c| arch.table_weights(&c.name).unwrap())
                .collect::<Vec<_>>();
            (dense, optimizer, tables, t.step())
        };
        t.train_step(&batch).unwrap();
        let path = dir.join("ckpt.safetensors");
        t.save_checkpoint(&path, &BTreeMap::new()).unwrap();
        let saved = state(&t);
        t.train_step(&batch).unwrap();
        let now = state(&t);
        assert!(now.0 != saved.0 && now.2 != saved.2 && now.3 != saved.3);
        FAIL_REPLACE.with(|f| f.set(true));
        let err = t.load_checkpoint(&path).unwrap_err().to_string();
        FAIL_REPLACE.with(|f| f.set(false));
        assert!(err.contains("a failure made by a test"), "{err}");
        assert!(state(&t) == now, "a failed load changed the trainer");
        t.load_checkpoint(&path).unwrap();
        assert!(state(&t) == saved);
        drop(t);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
