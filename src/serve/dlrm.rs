//! A trained DLRM as a [`BatchModel`]: one row per sample, one probability per task out.

use std::sync::Mutex;

use std::path::Path;

use super::BatchModel;
use crate::embedding::{QuantizedEmbeddingBagCollection, WeightType};
use crate::train::{Batch, DlrmConfig, DlrmTrainer};
use crate::{Error, Result};

/// One sample to score: its dense features and, for every sparse feature in
/// [`DlrmServable::keys`] order, its ids.
#[derive(Clone, Debug, PartialEq)]
pub struct DlrmRow {
    /// Dense features (the model's dense width).
    pub dense: Vec<f32>,
    /// Ids of each sparse feature, in [`DlrmServable::keys`] order.
    pub ids: Vec<Vec<i64>>,
}

/// A trained DLRM answering batches of [`DlrmRow`]s through its FP32 tables or a quantized copy
/// of them; each row yields one probability per task.
pub struct DlrmServable {
    trainer: Mutex<DlrmTrainer>,
    tables: Option<QuantizedEmbeddingBagCollection>,
    keys: Vec<String>,
    rows: Vec<usize>,
    num_dense: usize,
    tasks: usize,
    task_names: Vec<String>,
    weights: Option<WeightType>,
}

impl DlrmServable {
    /// Loads a trainer checkpoint (its model configuration comes from the file, see
    /// [`DlrmConfig::from_checkpoint`]) and, with `quantize`, serves a copy of its tables in
    /// that format. The loaded model must score a probe row (every dense value 0, id 0 of every
    /// feature) to finite probabilities, so a checkpoint that reads but holds NaNs is refused.
    pub fn from_checkpoint(path: impl AsRef<Path>, quantize: Option<WeightType>) -> Result<Self> {
        let path = path.as_ref();
        let config = DlrmConfig::from_checkpoint(path)?;
        let mut trainer = config.build()?;
        trainer.load_checkpoint(path)?;
        let tables = quantize
            .map(|w| trainer.model().sparse_arch.quantize(w))
            .transpose()?;
        let mut servable = DlrmServable::new(trainer, tables);
        servable.weights = quantize;
        let probe = DlrmRow {
            dense: vec![0.0; servable.num_dense],
            ids: vec![vec![0]; servable.keys.len()],
        };
        let out = servable.run(vec![probe])?;
        if let Some(bad) = out.iter().flatten().find(|p| !p.is_finite()) {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "{}: the loaded model scores a probe row to {bad} (non-finite weights?)",
                    path.display()
                ),
            ));
        }
        Ok(servable)
    }

    /// Serves `trainer`'s model, through `tables` (a quantized copy of its tables) when given.
    pub fn new(trainer: DlrmTrainer, tables: Option<QuantizedEmbeddingBagCollection>) -> Self {
        let model = trainer.model();
        let mut keys = Vec::new();
        let mut rows = Vec::new();
        for config in model.sparse_arch.configs() {
            for feature in &config.feature_names {
                keys.push(feature.clone());
                rows.push(config.num_embeddings);
            }
        }
        let num_dense = model.dense.dense_arch.in_features();
        let task_names = trainer.tasks().to_vec();
        DlrmServable {
            trainer: Mutex::new(trainer),
            tables,
            keys,
            rows,
            num_dense,
            tasks: task_names.len(),
            task_names,
            weights: None,
        }
    }

    /// The tasks, in the order of each row's outputs.
    pub fn tasks(&self) -> &[String] {
        &self.task_names
    }

    /// Rows of each sparse feature's table, in [`keys`](Self::keys) order (ids must lie below).
    pub fn table_rows(&self) -> &[usize] {
        &self.rows
    }

    /// The quantized format the tables are served in, when [`from_checkpoint`](Self::from_checkpoint)
    /// quantized them.
    pub fn weights(&self) -> Option<WeightType> {
        self.weights
    }

    /// The sparse features, in the order of [`DlrmRow::ids`].
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// Dense features per row.
    pub fn num_dense(&self) -> usize {
        self.num_dense
    }
}

impl BatchModel for DlrmServable {
    type Row = DlrmRow;
    type Output = Vec<f32>;

    fn validate(&self, rows: &[DlrmRow]) -> std::result::Result<(), String> {
        for (i, row) in rows.iter().enumerate() {
            if row.dense.len() != self.num_dense {
                return Err(format!(
                    "row {i}: {} dense values, the model takes {}",
                    row.dense.len(),
                    self.num_dense
                ));
            }
            if let Some(j) = row.dense.iter().position(|x| !x.is_finite()) {
                return Err(format!("row {i}: dense value {j} is {}", row.dense[j]));
            }
            super::check_ids(i, &row.ids, &self.keys, &self.rows, "the model")?;
        }
        Ok(())
    }

    fn run(&self, rows: Vec<DlrmRow>) -> Result<Vec<Vec<f32>>> {
        let b = rows.len();
        let mut dense = Vec::with_capacity(b * self.num_dense);
        for row in &rows {
            dense.extend_from_slice(&row.dense);
        }
        let (ids, lengths) = super::key_major(&rows, self.keys.len(), |r| &r.ids);
        let labels = vec![0.0; b * self.tasks];
        let batch = Batch::from_parts(
            dense,
            self.num_dense,
            self.keys.clone(),
            ids,
            lengths,
            labels,
            self.tasks,
        )?;
        let trainer = self
            .trainer
            .lock()
            .map_err(|_| Error::invalid("DlrmServable", "an earlier batch panicked"))?;
        let probabilities = trainer.predict(&batch, self.tables.as_ref())?;
        Ok(probabilities
            .chunks(self.tasks)
            .map(<[f32]>::to_vec)
            .collect())
    }
}
