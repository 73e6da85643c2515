//! A trained TwoTower with an index of its candidates as a [`BatchModel`]: one row per query
//! (its query-tower features and how many candidates it wants), the nearest candidates out.

use std::path::Path;
use std::sync::Mutex;

use super::BatchModel;
use crate::retrieval::IvfPqIndex;
use crate::sparse::KeyedJaggedTensor;
use crate::train::{TwoTowerConfig, TwoTowerTrainer};
use crate::{Error, Result, Tensor};

/// One query: for every query-tower feature in [`RetrievalServable::keys`] order, its ids, and
/// the number of candidates wanted.
#[derive(Clone, Debug, PartialEq)]
pub struct RetrievalRow {
    /// Ids of each query feature, in [`RetrievalServable::keys`] order.
    pub ids: Vec<Vec<i64>>,
    /// Candidates wanted (1 to [`RetrievalServable::max_k`]).
    pub k: usize,
}

/// The most candidates a server may let one query ask for (`max_k`).
pub const MAX_RETRIEVAL_K: usize = 100_000;

/// A TwoTower's query tower in front of an IVF-PQ index of its candidate embeddings
/// ([`IvfPqIndex::save`]): each row yields up to `k` `(candidate id, score)` pairs, best first
/// (fewer when the probed lists hold fewer). The products run row-invariant, so a query's
/// answer does not depend on the batch it shared.
pub struct RetrievalServable {
    trainer: Mutex<TwoTowerTrainer>,
    index: IvfPqIndex,
    nprobe: usize,
    max_k: usize,
    keys: Vec<String>,
    rows: Vec<usize>,
}

impl RetrievalServable {
    /// Loads a TwoTower trainer checkpoint (its configuration from the file) and an IVF-PQ
    /// index searched at `nprobe` lists; rows may ask for up to `max_k` candidates. The index
    /// must hold vectors of the towers' output width and at least one vector, and `nprobe`
    /// must be a valid probe count for it.
    pub fn from_files(
        checkpoint: impl AsRef<Path>,
        index: impl AsRef<Path>,
        nprobe: usize,
        max_k: usize,
    ) -> Result<Self> {
        let checkpoint = checkpoint.as_ref();
        let config = TwoTowerConfig::from_checkpoint(checkpoint)?;
        let mut trainer = config.build()?;
        trainer.load_checkpoint(checkpoint)?;
        let index_path = index.as_ref();
        let index = IvfPqIndex::load(index_path)?;
        let bad = |msg: String| Error::invalid("retrieval index", msg);
        let width = trainer.model().query.out_features();
        if index.dim() != width {
            return Err(bad(format!(
                "{}: holds vectors of dimension {}, the towers of {} give {width}",
                index_path.display(),
                index.dim(),
                checkpoint.display()
            )));
        }
        if index.is_empty() {
            return Err(bad(format!("{}: holds no vector", index_path.display())));
        }
        if nprobe == 0 || nprobe > index.config().nlist || !(1..=MAX_RETRIEVAL_K).contains(&max_k) {
            return Err(bad(format!(
                "nprobe {nprobe} (1..={}) and max_k {max_k} (1..={MAX_RETRIEVAL_K})",
                index.config().nlist
            )));
        }
        let (keys, rows) = config.query_features.iter().cloned().unzip();
        let servable = RetrievalServable {
            trainer: Mutex::new(trainer),
            index,
            nprobe,
            max_k,
            keys,
            rows,
        };
        // A query tower that cannot answer (non-finite weights) is refused at load, as a
        // DLRM that cannot score is: it loaded, and every query then failed with a 500.
        let probe = RetrievalRow {
            ids: vec![vec![0]; servable.keys.len()],
            k: 1,
        };
        servable.run(vec![probe]).map_err(|e| {
            Error::invalid(
                "retrieval checkpoint",
                format!(
                    "{}: the loaded query tower cannot answer a probe query (id 0 of every \
                     feature): {e}",
                    checkpoint.display()
                ),
            )
        })?;
        Ok(servable)
    }

    /// The query features, in the order of [`RetrievalRow::ids`].
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// Rows of each query feature's table (ids must lie below).
    pub fn table_rows(&self) -> &[usize] {
        &self.rows
    }

    /// The most candidates a row may ask for.
    pub fn max_k(&self) -> usize {
        self.max_k
    }

    /// Candidates in the index.
    pub fn candidates(&self) -> usize {
        self.index.len()
    }

    /// Lists probed per query.
    pub fn nprobe(&self) -> usize {
        self.nprobe
    }
}

impl BatchModel for RetrievalServable {
    type Row = RetrievalRow;
    type Output = Vec<(i64, f32)>;

    fn validate(&self, rows: &[RetrievalRow]) -> std::result::Result<(), String> {
        for (i, row) in rows.iter().enumerate() {
            if row.k == 0 || row.k > self.max_k {
                return Err(format!(
                    "row {i}: k = {} (1..={} on this server)",
                    row.k, self.max_k
                ));
            }
            super::check_ids(i, &row.ids, &self.keys, &self.rows, "the query tower")?;
        }
        Ok(())
    }

    fn run(&self, rows: Vec<RetrievalRow>) -> Result<Vec<Vec<(i64, f32)>>> {
        let b = rows.len();
        let (values, lengths) = super::key_major(&rows, self.keys.len(), |r| &r.ids);
        let (nv, nl) = (values.len(), lengths.len());
        let queries = KeyedJaggedTensor::from_lengths(
            self.keys.clone(),
            Tensor::from_vec(values, &[nv])?,
            Tensor::from_vec(lengths, &[nl])?,
            None,
            Some(b),
        )?;
        // One search for the batch at its largest k (at most the index's size); each row keeps
        // its own first k.
        let k = rows
            .iter()
            .map(|r| r.k)
            .max()
            .unwrap_or(1)
            .min(self.index.len());
        let trainer = self
            .trainer
            .lock()
            .map_err(|_| Error::invalid("RetrievalServable", "an earlier batch panicked"))?;
        // Row-invariant products: a query gets the same embedding alone or in any batch.
        let found = crate::tensor::row_invariant(|| {
            (trainer.model()).retrieve(&queries, &self.index.with_nprobe(self.nprobe), k)
        })?;
        Ok(rows
            .iter()
            .enumerate()
            .map(|(q, row)| {
                (found.ids_of(q).iter().zip(found.scores_of(q)))
                    .filter(|(&id, _)| id >= 0)
                    .take(row.k)
                    .map(|(&id, &s)| (id, s))
                    .collect()
            })
            .collect())
    }
}
