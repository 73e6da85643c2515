//! A trained DLRM as a [`BatchModel`]: one row per sample, one probability per task out.

use std::sync::Mutex;

use std::path::{Path, PathBuf};

use super::BatchModel;
use crate::checkpoint::clock_nanos;
use crate::checkpoint::in_use;
use crate::embedding::tbe::cache::store::hold_lock;
use crate::embedding::{CacheStats, Placement, QuantizedEmbeddingBagCollection, WeightType};
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
    /// Declared last: the row files in it are removed once the tables above are dropped.
    scratch: Option<ScratchDir>,
}

/// A directory of row files of one servable's own, removed with it; its `.lock` file, locked
/// while the servable lives, tells other processes it is in use.
struct ScratchDir {
    dir: PathBuf,
    lock: Option<std::fs::File>,
}

impl ScratchDir {
    /// A new directory `embers-serve-<process>-<n>-<clock>` under `parent` (a name no other
    /// process makes, even one of the same pid in another PID namespace sharing `parent`),
    /// after removing those that servers no longer running left there. It is made under a
    /// name the removal ignores (`….new`), locked, then renamed: never seen unlocked.
    fn create(parent: &Path) -> Result<Self> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let io = |what: &str, path: &Path, e: std::io::Error| {
            let why = match path.exists() && !path.is_dir() {
                true => "a file is in the way (not a directory)".to_string(),
                false => e.to_string(),
            };
            Error::invalid("DlrmServable", format!("{}: {what}: {why}", path.display()))
        };
        std::fs::create_dir_all(parent)
            .map_err(|e| io("creating the row files' directory", parent, e))?;
        remove_dead_scratch(parent);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = parent.join(format!(
            "embers-serve-{}-{n}-{:x}",
            std::process::id(),
            clock_nanos()
        ));
        let new = dir.with_extension("new");
        std::fs::create_dir(&new).map_err(|e| io("creating", &new, e))?;
        let locked = hold_lock(&new.join(".lock")).and_then(|lock| {
            std::fs::rename(&new, &dir).map_err(|e| io("naming", &dir, e))?;
            Ok(lock)
        });
        match locked {
            Ok(lock) => Ok(ScratchDir {
                dir,
                lock: Some(lock),
            }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&new);
                Err(e)
            }
        }
    }
}

impl Drop for ScratchDir {
    /// The row files first, the lock last: a directory that lost its row files to a kill
    /// midway is still seen, unlocked, and removed later.
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                if entry.file_name() != ".lock" {
                    let path = entry.path();
                    let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir_all(&path));
                }
            }
        }
        // Closed before it is removed (a file open cannot be removed everywhere).
        drop(self.lock.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes the `embers-serve-<process>-<n>-<clock>` directories under `parent` that servers no
/// longer running left: their `.lock` is held by no one (a live server holds its own, from
/// any process or PID namespace sharing the directory; a lock that cannot be tested reads as
/// held). A directory without a `.lock`, or still named `….new` (a server killed while
/// making it), is left. Unix only: elsewhere locks are not seen, and nothing is removed.
fn remove_dead_scratch(parent: &Path) {
    if !cfg!(unix) {
        return;
    }
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("embers-serve-")) else {
            continue;
        };
        let parts: Vec<&str> = rest.split('-').collect();
        let [pid, n, clock] = parts[..] else {
            continue;
        };
        let number = |s: &str, radix| !s.is_empty() && u64::from_str_radix(s, radix).is_ok();
        if !(number(pid, 10) && number(n, 10) && number(clock, 16)) {
            continue;
        }
        let lock = entry.path().join(".lock");
        if lock.is_file() && !in_use(&lock) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl DlrmServable {
    /// Loads a trainer checkpoint (its model configuration comes from the file, see
    /// [`DlrmConfig::from_checkpoint`]) and, with `quantize`, serves a copy of its tables in
    /// that format. The loaded model must score a probe row (every dense value 0, id 0 of every
    /// feature) to finite probabilities, so a checkpoint that reads but holds NaNs is refused.
    pub fn from_checkpoint(path: impl AsRef<Path>, quantize: Option<WeightType>) -> Result<Self> {
        Self::from_checkpoint_placed(path, quantize, &Placement::Memory)
    }

    /// [`from_checkpoint`](Self::from_checkpoint) with the tables served from where
    /// `placement` puts them: in memory, or — [`Placement::Cached`] — in row files behind a
    /// DRAM cache of the placement's size and policy, for tables bigger than memory (FBGEMM's
    /// `MANAGED_CACHING` for inference; [`Placement::Managed`]: the smallest cache). The row
    /// files go in a directory of this servable's own under the placement's directory
    /// (`embers-serve-<process>-<n>-<clock>`, removed when it is dropped; those that dead
    /// servers left are removed first), or in host memory when that is empty. A checkpoint
    /// whose tables were saved in memory is read into the row files a few megabytes of rows at
    /// a time; one saved from cached tables is copied file to file: neither is ever whole in
    /// memory. With `quantize` the
    /// quantized rows are the cached ones and the FP32 rows stay in a file behind the smallest
    /// cache (the disk holds both); without, the FP32 rows are. Predictions equal those of the
    /// tables in memory, bit for bit. [`cache_stats`](Self::cache_stats) counts the caches'
    /// hits and misses.
    pub fn from_checkpoint_placed(
        path: impl AsRef<Path>,
        quantize: Option<WeightType>,
        placement: &Placement,
    ) -> Result<Self> {
        let path = path.as_ref();
        if let Placement::Cached { size, .. } = placement {
            // Refused before anything is read or written.
            size.check()?;
        }
        let config = DlrmConfig::from_checkpoint(path)?;
        // The row files go in a directory of this servable's own (not for host memory).
        let mut placement = placement.clone();
        let scratch = match &mut placement {
            Placement::Cached { dir, .. } | Placement::Managed { dir, .. }
                if !dir.as_os_str().is_empty() =>
            {
                let s = ScratchDir::create(dir)?;
                dir.clone_from(&s.dir);
                Some(s)
            }
            _ => None,
        };
        // Quantized, the FP32 rows are only read once, to quantize them: the smallest cache.
        let trained = match (&placement, quantize) {
            (Placement::Cached { dir, policy, .. }, Some(_)) => Placement::Managed {
                dir: dir.clone(),
                policy: *policy,
            },
            _ => placement.clone(),
        };
        let mut trainer = config.build_with(&trained)?;
        trainer.load_checkpoint(path)?;
        let tables = quantize
            .map(|w| trainer.model().sparse_arch.quantize_placed(w, &placement))
            .transpose()?;
        let mut servable = DlrmServable::new(trainer, tables);
        servable.weights = quantize;
        servable.scratch = scratch;
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
            scratch: None,
        }
    }

    /// Zeroes the counters [`cache_stats`](Self::cache_stats) gives.
    pub fn reset_cache_stats(&self) {
        if let Some(q) = &self.tables {
            return q.reset_cache_stats();
        }
        let trainer = self.trainer.lock().unwrap_or_else(|p| p.into_inner());
        for t in trainer.model().sparse_arch.tbes() {
            t.reset_cache_stats();
        }
    }

    /// The cache counters of every table served from a cache
    /// ([`from_checkpoint_placed`](Self::from_checkpoint_placed)); empty when none is.
    pub fn cache_stats(&self) -> Vec<CacheStats> {
        if let Some(q) = &self.tables {
            return q.cache_stats();
        }
        let trainer = self.trainer.lock().unwrap_or_else(|p| p.into_inner());
        (trainer.model().sparse_arch.tbes().iter())
            .filter_map(|t| t.cache_stats())
            .flatten()
            .collect()
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
