//! A trained TwoTower with an index of its candidates as a [`BatchModel`]: one row per query
//! (its query-tower features and how many candidates it wants), the nearest candidates out.

use std::path::Path;
use std::sync::Mutex;

use super::BatchModel;
use crate::retrieval::{IvfPqIndex, Search};
use crate::sparse::KeyedJaggedTensor;
use crate::train::{TwoTowerConfig, TwoTowerTrainer};
use crate::{Error, Result, Tensor};

/// One query's answer from [`RetrievalServable`]: its candidates and their scores, best first,
/// or why this query has none (its embedding is not finite); the other queries of its batch
/// are answered either way.
pub type RetrievalAnswer = std::result::Result<Vec<(i64, f32)>, String>;

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
        // An index of another model's candidates (an older one, while a trainer writes its
        // checkpoints and then its index) has the right width and answers, wrongly.
        let model = trainer.model_id();
        if let Some(source) = index.source().filter(|&s| s != model) {
            return Err(bad(format!(
                "{}: holds the candidates of model {source}, {} holds model {model}: build \
                 the index from this checkpoint (a trainer writes its index after its last \
                 checkpoint: a reload then pairs them)",
                index_path.display(),
                checkpoint.display()
            )));
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
        let answer = servable
            .run(vec![probe])
            .and_then(|found| match found.into_iter().next() {
                Some(Ok(list)) => match list.iter().find(|(_, score)| !score.is_finite()) {
                    Some((id, score)) => Err(Error::invalid(
                        "retrieval",
                        format!("candidate {id} scores {score}"),
                    )),
                    None => Ok(()),
                },
                Some(Err(m)) => Err(Error::invalid("retrieval", m)),
                None => Err(Error::invalid("retrieval", "no answer")),
            });
        answer.map_err(|e| {
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
    type Output = RetrievalAnswer;

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

    fn run(&self, rows: Vec<RetrievalRow>) -> Result<Vec<RetrievalAnswer>> {
        let trainer = self
            .trainer
            .lock()
            .map_err(|_| Error::invalid("RetrievalServable", "an earlier batch panicked"))?;
        let model = trainer.model();
        let dim = self.index.dim();
        let index = self.index.with_nprobe(self.nprobe);
        // One search per distinct k among the rows (not the batch at its largest k: a k = 1
        // row beside a k = 100000 one would hold 100000 results, and so would every row).
        let mut by_k: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (i, row) in rows.iter().enumerate() {
            by_k.entry(row.k).or_default().push(i);
        }
        let mut out: Vec<RetrievalAnswer> = vec![Ok(Vec::new()); rows.len()];
        for (k, members) in by_k {
            let group: Vec<&RetrievalRow> = members.iter().map(|&i| &rows[i]).collect();
            let b = group.len();
            let (values, lengths) = super::key_major(&group, self.keys.len(), |r| &r.ids);
            let (nv, nl) = (values.len(), lengths.len());
            let queries = KeyedJaggedTensor::from_lengths(
                self.keys.clone(),
                Tensor::from_vec(values, &[nv])?,
                Tensor::from_vec(lengths, &[nl])?,
                None,
                Some(b),
            )?;
            // Row-invariant products: a query gets the same embedding alone or in any group.
            let embedded =
                crate::tensor::row_invariant(|| model.embed_queries_for(&queries, &index))?;
            // A query the tower cannot embed in f32 is that row's failure, not the batch's:
            // the others are searched.
            let mut finite = Vec::with_capacity(b);
            let mut searched = Vec::with_capacity(embedded.len());
            for (q, &i) in members.iter().enumerate() {
                let e = &embedded[q * dim..(q + 1) * dim];
                match e.iter().position(|x| !x.is_finite()) {
                    Some(at) => {
                        out[i] = Err(format!(
                            "the query tower gives {} at element {at} of its embedding",
                            e[at]
                        ))
                    }
                    None => {
                        finite.push(i);
                        searched.extend_from_slice(e);
                    }
                }
            }
            if finite.is_empty() {
                continue;
            }
            let found = index.search_k(&searched, k.min(self.index.len()))?;
            for (q, &i) in finite.iter().enumerate() {
                out[i] = Ok((found.ids_of(q).iter().zip(found.scores_of(q)))
                    .filter(|(&id, _)| id >= 0)
                    .map(|(&id, &s)| (id, s))
                    .collect());
            }
        }
        Ok(out)
    }
}
