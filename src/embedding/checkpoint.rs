//! Tables and optimizer state in safetensors checkpoints (written atomically by
//! [`crate::checkpoint`]).
//!
//! Training TBEs (one, or all of a collection's, in one file, optionally under a name prefix):
//! `<table>.weight` (F32 `[rows, dim]`), `<table>.momentum1` / `<table>.momentum2` (F32,
//! `[rows]` for row-wise state or `[rows, dim]`), metadata `format`, and per TBE
//! `group<i>.optimizer` and `group<i>.step`. Inference TBE: `<table>.weight` (U8
//! `[rows, row_bytes]`, FBGEMM's row bytes), metadata `<table>.weight_type`.
//!
//! Loading reads and checks everything (names, dtypes, shapes, optimizer, weight types) before
//! writing anything, so a bad file leaves the operator as it was.

use std::path::Path;

use super::config::WeightType;
use super::inference::QuantizedTableBatchedEmbedding;
use super::tbe::cache::api::{commit_cached_checkpoints, read_cached_checkpoint, StagedRows};
use super::tbe::TableBatchedEmbedding;
use super::StateShape;
use crate::checkpoint::{CheckpointReader, CheckpointWriter};
use crate::{Error, Result};

const FORMAT: &str = "embers.tbe.v1";

/// Adds the tables and optimizer state of several TBEs to `w`, every name prefixed by
/// `prefix` (table names must be unique across the TBEs).
pub(crate) fn add_tbes(
    w: &mut CheckpointWriter,
    prefix: &str,
    tbes: &[&TableBatchedEmbedding],
) -> Result<()> {
    w.set_metadata(format!("{prefix}format"), FORMAT);
    for (g, tbe) in tbes.iter().enumerate() {
        w.set_metadata(
            format!("{prefix}group{g}.optimizer"),
            tbe.config().optimizer.name(),
        );
        w.set_metadata(format!("{prefix}group{g}.step"), tbe.step().to_string());
        if tbe.is_cached() {
            if let Some(parts) = w.parts_dir()? {
                // Tables cached in a file: their own checkpoint (the row file copied whole,
                // and a manifest) in the parts directory, never all in memory.
                let name = format!("{prefix}group{g}");
                tbe.save_cached_checkpoint(parts.join(&name))?;
                w.set_metadata(format!("{prefix}group{g}.rows"), name);
                continue;
            }
        }
        let states = tbe.optimizer_state_names();
        for (t, spec) in tbe.config().tables.iter().enumerate() {
            w.add(
                format!("{prefix}{}.weight", spec.name),
                &[spec.rows, spec.dim],
                &tbe.table_weights(t)?,
            )?;
            for (i, (name, shape)) in states.iter().enumerate() {
                w.add(
                    format!("{prefix}{}.{name}", spec.name),
                    &state_shape(*shape, spec.rows, spec.dim),
                    &tbe.optimizer_state(i, t)?,
                )?;
            }
        }
    }
    Ok(())
}

fn state_shape(shape: StateShape, rows: usize, dim: usize) -> Vec<usize> {
    match shape {
        StateShape::PerRow => vec![rows],
        StateShape::PerElement => vec![rows, dim],
    }
}

/// Tables and state read from a checkpoint and checked, not yet written to the TBEs.
pub(crate) struct StagedTables {
    weights: Vec<(usize, usize, Vec<f32>)>,
    states: Vec<(usize, usize, usize, Vec<f32>)>,
    /// Groups whose tables are cached in files: their checkpoints' rows, staged.
    cached: Vec<(usize, StagedRows)>,
    steps: Vec<u64>,
}

impl StagedTables {
    /// Writes the staged values into the TBEs they were read for.
    pub(crate) fn apply(self, tbes: &[&TableBatchedEmbedding]) -> Result<()> {
        // All cached groups or none.
        commit_cached_checkpoints(
            (self.cached.into_iter())
                .map(|(g, rows)| (tbes[g], rows))
                .collect(),
        )?;
        for (g, t, w) in self.weights {
            tbes[g].set_table_weights(t, &w)?;
        }
        for (g, i, t, s) in self.states {
            tbes[g].set_optimizer_state(i, t, &s)?;
        }
        for (g, step) in self.steps.into_iter().enumerate() {
            tbes[g].set_step(step);
        }
        Ok(())
    }
}

/// Reads and checks what [`add_tbes`] wrote for the same TBEs, changing nothing yet.
pub(crate) fn stage_tbes(
    r: &CheckpointReader,
    prefix: &str,
    tbes: &[&TableBatchedEmbedding],
) -> Result<StagedTables> {
    let path = r.path().display();
    let mut staged = StagedTables {
        weights: Vec::new(),
        states: Vec::new(),
        cached: Vec::new(),
        steps: Vec::new(),
    };
    for (g, tbe) in tbes.iter().enumerate() {
        let saved_opt = r
            .metadata(&format!("{prefix}group{g}.optimizer"))
            .unwrap_or("");
        if saved_opt != tbe.config().optimizer.name() {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "{path}: saved with optimizer `{saved_opt}`, this operator uses `{}`",
                    tbe.config().optimizer.name()
                ),
            ));
        }
        let step = r.metadata(&format!("{prefix}group{g}.step")).unwrap_or("0");
        staged.steps.push(step.parse().map_err(|_| {
            Error::invalid(
                "checkpoint",
                format!("{path}: group {g} step `{step}` is not a count"),
            )
        })?);
        if let Some(dir) = cached_group_dir(r, prefix, g)? {
            if tbe.is_cached() {
                staged.cached.push((g, tbe.stage_cached_checkpoint(&dir)?));
            } else {
                // Into tables in memory: the row file read whole.
                let plain = read_cached_checkpoint(&dir, tbe.config())?;
                for (t, w) in plain.weights.into_iter().enumerate() {
                    staged.weights.push((g, t, w));
                }
                for (i, per_table) in plain.states.into_iter().enumerate() {
                    for (t, s) in per_table.into_iter().enumerate() {
                        staged.states.push((g, i, t, s));
                    }
                }
            }
            continue;
        }
        let states = tbe.optimizer_state_names();
        for (t, spec) in tbe.config().tables.iter().enumerate() {
            let name = format!("{prefix}{}.weight", spec.name);
            staged
                .weights
                .push((g, t, r.read(&name, &[spec.rows, spec.dim])?));
            for (i, (state, shape)) in states.iter().enumerate() {
                let name = format!("{prefix}{}.{state}", spec.name);
                let shape = state_shape(*shape, spec.rows, spec.dim);
                staged.states.push((g, i, t, r.read(&name, &shape)?));
            }
        }
    }
    Ok(staged)
}

/// The directory of group `g`'s own checkpoint (its tables cached in files, saved by
/// [`add_tbes`] under `prefix`) in `r`'s parts directory, if the group was saved so.
pub(crate) fn cached_group_dir(
    r: &CheckpointReader,
    prefix: &str,
    g: usize,
) -> Result<Option<std::path::PathBuf>> {
    let Some(name) = r.metadata(&format!("{prefix}group{g}.rows")) else {
        return Ok(None);
    };
    let path = r.path().display();
    let parts = r.parts_dir()?.ok_or_else(|| {
        Error::invalid(
            "checkpoint",
            format!("{path}: group {g}'s rows are in `{name}`, but it has no parts directory"),
        )
    })?;
    if name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(Error::invalid(
            "checkpoint",
            format!("{path}: group {g}'s rows `{name}` is not a directory name"),
        ));
    }
    Ok(Some(parts.join(name)))
}

/// Writes the tables and optimizer state of several TBEs into one file.
pub(crate) fn save_many(path: &Path, tbes: &[&TableBatchedEmbedding]) -> Result<()> {
    let mut w = CheckpointWriter::new();
    w.parts_beside(path);
    add_tbes(&mut w, "", tbes)?;
    w.write(path)
}

/// Loads what [`save_many`] wrote for the same TBEs; a bad file changes nothing.
pub(crate) fn load_many(path: &Path, tbes: &[&TableBatchedEmbedding]) -> Result<()> {
    let r = CheckpointReader::open(path)?;
    stage_tbes(&r, "", tbes)?.apply(tbes)
}

impl TableBatchedEmbedding {
    /// Writes every table (`<name>.weight`) and its optimizer state (`<name>.momentum1`, ...)
    /// to `path` as safetensors, atomically. Table names must be unique. Tables cached in a
    /// file are saved as their row file and manifest
    /// ([`save_cached_checkpoint`](Self::save_cached_checkpoint)) in a directory beside
    /// `path` ([`CheckpointWriter::parts_beside`]), never read whole into memory.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        save_many(path.as_ref(), &[self])
    }

    /// Loads tables and optimizer state written by [`save`](Self::save) into this operator
    /// (same table names and shapes, same optimizer); a bad file changes nothing.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<()> {
        load_many(path.as_ref(), &[self])
    }
}

impl QuantizedTableBatchedEmbedding {
    /// Writes every table's stored rows to `path` (safetensors U8 `[rows, row_bytes]`,
    /// atomically), with each table's weight type in the metadata.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut w = CheckpointWriter::new();
        w.set_metadata("format", FORMAT);
        for (t, spec) in self.tables().iter().enumerate() {
            let ty = self.weight_types()[t];
            w.add(
                format!("{}.weight", spec.name),
                &[spec.rows, ty.row_bytes(spec.dim)],
                self.table_bytes(t)?,
            )?;
            w.set_metadata(format!("{}.weight_type", spec.name), ty.fbgemm_name());
        }
        w.write(path)
    }

    /// Loads rows written by [`save`](Self::save) (same names, shapes and weight types).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let r = CheckpointReader::open(path)?;
        let mut tables = Vec::new();
        for (t, spec) in self.tables().iter().enumerate() {
            let ty = self.weight_types()[t];
            let saved = r
                .metadata(&format!("{}.weight_type", spec.name))
                .map(WeightType::from_fbgemm_name)
                .transpose()?;
            if saved != Some(ty) {
                return Err(Error::invalid(
                    "checkpoint",
                    format!(
                        "{}: table `{}` was saved as {:?}, this operator stores {}",
                        r.path().display(),
                        spec.name,
                        saved.map(|s| s.fbgemm_name()),
                        ty.fbgemm_name()
                    ),
                ));
            }
            let name = format!("{}.weight", spec.name);
            tables.push(r.read::<u8>(&name, &[spec.rows, ty.row_bytes(spec.dim)])?);
        }
        for (t, b) in tables.iter().enumerate() {
            self.set_table_bytes(t, b)?;
        }
        Ok(())
    }
}
