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

/// About how many bytes of rows are read at a time into the staged row file of a TBE of
/// cached tables (from a checkpoint whose tables are not in row files).
pub(crate) const STAGE_CHUNK_BYTES: usize = 16 << 20;

/// Adds the tables and optimizer state of several TBEs to `w`, every name prefixed by
/// `prefix` (table names must be unique across the TBEs).
pub(crate) fn add_tbes<'a>(
    w: &mut CheckpointWriter<'a>,
    prefix: &str,
    tbes: &[&'a TableBatchedEmbedding],
) -> Result<()> {
    w.set_metadata(format!("{prefix}format"), FORMAT);
    for (g, &tbe) in tbes.iter().enumerate() {
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
                // The directory name a load accepts (see `cached_group_dir`): inside the
                // parts directory, never a hidden or parent path.
                if name.contains(['/', '\\']) || name.starts_with('.') {
                    return Err(Error::invalid(
                        "checkpoint",
                        format!(
                            "the name prefix `{prefix}` would put tables cached in files in \
                             `{name}`, not a directory name of the parts directory: give a \
                             prefix without `/`, `\\` or a leading `.`"
                        ),
                    ));
                }
                tbe.save_cached_checkpoint(parts.join(&name))?;
                w.set_metadata(format!("{prefix}group{g}.rows"), name);
                continue;
            }
        }
        // Read a chunk of rows at a time as the file is written: no second copy of the tables.
        let states = tbe.optimizer_state_names();
        for (t, spec) in tbe.config().tables.iter().enumerate() {
            w.add_rows(
                format!("{prefix}{}.weight", spec.name),
                &[spec.rows, spec.dim],
                move |rows| tbe.table_weight_rows(t, rows),
            )?;
            for (i, (name, shape)) in states.iter().enumerate() {
                w.add_rows(
                    format!("{prefix}{}.{name}", spec.name),
                    &state_shape(*shape, spec.rows, spec.dim),
                    move |rows| tbe.optimizer_state_rows(i, t, rows),
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
        Self::apply_all(vec![(self, tbes)])
    }

    /// [`apply`](Self::apply) of several collections' staged tables, each with its TBEs: the
    /// cached groups of all of them commit first, all or none (the only part that can fail:
    /// on their files), then the tables in memory are written.
    pub(crate) fn apply_all(parts: Vec<(StagedTables, &[&TableBatchedEmbedding])>) -> Result<()> {
        let mut loads = Vec::new();
        let mut rest = Vec::with_capacity(parts.len());
        for (staged, tbes) in parts {
            let StagedTables {
                weights,
                states,
                cached,
                steps,
            } = staged;
            loads.extend(cached.into_iter().map(|(g, rows)| (tbes[g], rows)));
            rest.push((weights, states, steps, tbes));
        }
        commit_cached_checkpoints(loads)?;
        for (weights, states, steps, tbes) in rest {
            for (g, t, w) in weights {
                tbes[g].set_table_weights(t, &w)?;
            }
            for (g, i, t, s) in states {
                tbes[g].set_optimizer_state(i, t, &s)?;
            }
            for (g, step) in steps.into_iter().enumerate() {
                tbes[g].set_step(step);
            }
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
    let format = r.metadata(&format!("{prefix}format"));
    if format != Some(FORMAT) {
        return Err(Error::invalid(
            "checkpoint",
            match format {
                None => format!(
                    "{path}: no embedding tables under `{prefix}` (no `{prefix}format`; a \
                     trainer's checkpoint keeps them under `tables.`)"
                ),
                Some(other) => format!(
                    "{path}: `{prefix}format` is `{other}`, embers writes `{FORMAT}` for tables"
                ),
            },
        ));
    }
    for (g, tbe) in tbes.iter().enumerate() {
        let required = |key: String| {
            r.metadata(&key).ok_or_else(|| {
                Error::invalid(
                    "checkpoint",
                    format!(
                        "{path}: `{key}` is missing (the file holds fewer table groups, or \
                         other tables)"
                    ),
                )
            })
        };
        let saved_opt = required(format!("{prefix}group{g}.optimizer"))?;
        if saved_opt != tbe.config().optimizer.name() {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "{path}: saved with optimizer `{saved_opt}`, this operator uses `{}`",
                    tbe.config().optimizer.name()
                ),
            ));
        }
        let step = required(format!("{prefix}group{g}.step"))?;
        staged
            .steps
            .push(crate::checkpoint::parse_count(step).ok_or_else(|| {
                Error::invalid(
                    "checkpoint",
                    format!("{path}: group {g} step `{step}` is not a count below 2^63"),
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
        if tbe.is_cached() {
            let staged_rows = stage_into_cached(r, prefix, tbe, STAGE_CHUNK_BYTES)?;
            staged.cached.push((g, staged_rows));
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

/// Stages the tables and optimizer state that [`add_tbes`] wrote as tensors (under `prefix`)
/// into a new row file for `tbe`'s cached tables, read and written about `chunk_bytes` of rows
/// at a time: tables bigger than memory load without being held whole. Every tensor's dtype
/// and shape is checked before any row is written.
fn stage_into_cached(
    r: &CheckpointReader,
    prefix: &str,
    tbe: &TableBatchedEmbedding,
    chunk_bytes: usize,
) -> Result<StagedRows> {
    let states = tbe.optimizer_state_names();
    let specs = &tbe.config().tables;
    // (name, shape, elements per row) of table `t`'s weights, then of each state buffer.
    let tensors = |t: usize| {
        let spec = &specs[t];
        let weight = (
            format!("{prefix}{}.weight", spec.name),
            vec![spec.rows, spec.dim],
            spec.dim,
        );
        let states = states.iter().map(move |(state, shape)| {
            let shape = state_shape(*shape, spec.rows, spec.dim);
            let per_row = shape[1..].iter().product();
            (format!("{prefix}{}.{state}", spec.name), shape, per_row)
        });
        std::iter::once(weight).chain(states)
    };
    for t in 0..specs.len() {
        for (name, shape, _) in tensors(t) {
            r.read_range::<f32>(&name, &shape, 0..0)?;
        }
    }
    let row_bytes = |t: usize| 4 * tensors(t).map(|(_, _, n)| n).sum::<usize>();
    tbe.stage_cached_rows(
        |t| chunk_bytes / row_bytes(t).max(1),
        |t, rows| {
            let mut values = tensors(t).map(|(name, shape, n)| {
                r.read_range::<f32>(&name, &shape, rows.start * n..rows.end * n)
            });
            let weights = values.next().expect("the weights come first")?;
            Ok((weights, values.collect::<Result<_>>()?))
        },
    )
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
            let row_bytes = ty.row_bytes(spec.dim);
            // Copied a chunk of rows at a time as the file is written.
            let bytes = self.table_bytes(t)?;
            let name = format!("{}.weight", spec.name);
            let what = name.clone();
            w.add_rows(name, &[spec.rows, row_bytes], move |rows| {
                let part = bytes.get(rows.start * row_bytes..rows.end * row_bytes);
                Ok(part
                    .ok_or_else(|| {
                        Error::invalid(
                            "checkpoint",
                            format!("`{what}`: rows {rows:?} are past the table's stored bytes"),
                        )
                    })?
                    .to_vec())
            })?;
            w.set_metadata(format!("{}.weight_type", spec.name), ty.fbgemm_name());
        }
        w.write(path)
    }

    /// Loads rows written by [`save`](Self::save) (same names, shapes and weight types). Every
    /// table is checked before any row changes — its rows too: a row whose values, scale or
    /// bias are not finite is refused, naming the table and the row. Tables in a file behind a
    /// cache are read once, a chunk at a time, into a new row file beside the live one, which
    /// replaces it only when every row was read and checked.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let r = CheckpointReader::open(path)?;
        let rows_error =
            |e: Error| Error::invalid("checkpoint", format!("{}: {e}", r.path().display()));
        // Each table's name, weight type and stored shape, checked against the file.
        let mut tables = Vec::new();
        for (t, spec) in self.tables().iter().enumerate() {
            let ty = self.weight_types()[t];
            let saved = r
                .metadata(&format!("{}.weight_type", spec.name))
                .map(WeightType::from_fbgemm_name)
                .transpose()
                .map_err(|e| {
                    Error::invalid(
                        "checkpoint",
                        format!("{}: table `{}`: {e}", r.path().display(), spec.name),
                    )
                })?;
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
            let shape = [spec.rows, ty.row_bytes(spec.dim)];
            // Its dtype and shape (no rows read yet).
            r.read_range::<u8>(&name, &shape, 0..0)?;
            tables.push((spec.name.clone(), name, shape, ty, spec.dim));
        }
        if !self.is_cached() {
            let mut all = Vec::with_capacity(tables.len());
            for (table, name, shape, ty, dim) in &tables {
                let bytes = r.read::<u8>(name, shape)?;
                check_finite_rows(*ty, *dim, &bytes, table, 0).map_err(rows_error)?;
                all.push(bytes);
            }
            for (t, b) in all.iter().enumerate() {
                self.set_table_bytes(t, b)?;
            }
            return Ok(());
        }
        // Tables in a file behind a cache may be far bigger than memory: a chunk of rows at a
        // time into the staged file.
        self.replace_cached_rows(|bytes, layout| {
            for (t, (table, name, shape, ty, dim)) in tables.iter().enumerate() {
                let [rows, rb] = *shape;
                if layout[t].record_bytes != rb || layout[t].rows != rows {
                    return Err(Error::invalid(
                        "checkpoint",
                        format!("table `{table}`: the row file's layout is not its rows'"),
                    ));
                }
                let chunk = (STAGE_CHUNK_BYTES / rb.max(1)).max(1);
                for first in (0..rows).step_by(chunk) {
                    let end = (first + chunk).min(rows);
                    let part = r.read_range::<u8>(name, shape, first * rb..end * rb)?;
                    check_finite_rows(*ty, *dim, &part, table, first).map_err(rows_error)?;
                    let at = layout[t].offset as usize + first * rb;
                    bytes[at..at + part.len()].copy_from_slice(&part);
                }
            }
            Ok(())
        })
    }
}

/// Refuses rows (of `ty`, `dim` wide, the first being row `first` of table `table`) whose
/// values, scale or bias are not finite (a NaN scale made every lookup of the row NaN, and
/// answers served from it).
fn check_finite_rows(
    ty: WeightType,
    dim: usize,
    bytes: &[u8],
    table: &str,
    first: usize,
) -> Result<()> {
    let rb = ty.row_bytes(dim);
    let mut values = vec![0f32; dim];
    for (i, row) in bytes.chunks_exact(rb.max(1)).enumerate() {
        super::quantize::dequantize_row(ty, row, &mut values)?;
        if let Some(v) = values.iter().find(|v| !v.is_finite()) {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "table `{table}` row {} decodes to {v} ({}): a checkpoint's rows are finite",
                    first + i,
                    ty.fbgemm_name()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedding::tbe::TbeConfig;
    use crate::embedding::{CacheConfig, CacheSize, PoolingMode, TableSpec};

    fn bits(tbe: &TableBatchedEmbedding) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for t in 0..tbe.config().tables.len() {
            out.push(tbe.table_weights(t).unwrap());
            for i in 0..tbe.optimizer_state_names().len() {
                out.push(tbe.optimizer_state(i, t).unwrap());
            }
        }
        (out.iter())
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    /// Tables saved as tensors load into an operator whose tables are cached in a file, a few
    /// rows at a time (chunks much smaller than a table and not a whole number of them): every
    /// weight and state value equals the saved one, per-row and per-element state alike, and
    /// so does a plain `load`. A tensor of the wrong shape is refused by name, changes
    /// nothing and leaves no staged file.
    #[test]
    fn tables_saved_as_tensors_load_into_cached_tables_a_few_rows_at_a_time() {
        let dir = std::env::temp_dir().join(format!("embers-into-cached-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let optimizers = crate::embedding::optimizer::optimizers_of_both_state_shapes();
        for (k, optimizer) in optimizers.into_iter().enumerate() {
            let tables = vec![TableSpec::new("a", 257, 5), TableSpec::new("b", 40, 3)];
            let cfg = TbeConfig::new(tables, vec![0, 1], PoolingMode::Sum, optimizer);
            let plain = TableBatchedEmbedding::new(cfg.clone()).unwrap();
            for (t, spec) in cfg.tables.iter().enumerate() {
                let w: Vec<f32> = (0..spec.rows * spec.dim)
                    .map(|i| (i as f32 * 0.37 + t as f32).sin())
                    .collect();
                plain.set_table_weights(t, &w).unwrap();
                for i in 0..plain.optimizer_state_names().len() {
                    let n = plain.optimizer_state(i, t).unwrap().len();
                    let s: Vec<f32> = (0..n).map(|j| (j * 3 + i + 1) as f32 * 0.01).collect();
                    plain.set_optimizer_state(i, t, &s).unwrap();
                }
            }
            plain.set_step(7);
            let path = dir.join(format!("plain-{k}.safetensors"));
            plain.save(&path).unwrap();
            let cached = |name: &str| {
                let cache = CacheConfig::new(dir.join(name), CacheSize::LoadFactor(0.2));
                TableBatchedEmbedding::new_cached(cfg.clone(), cache).unwrap()
            };
            let r = CheckpointReader::open(&path).unwrap();
            let a = cached(&format!("a-{k}.bin"));
            // About three rows of `a` (and of `b`'s narrower records, five) per chunk.
            let record = 4 * (5 + optimizer.state_len(0, 1, 5) + optimizer.state_len(1, 1, 5));
            let staged = stage_into_cached(&r, "", &a, 3 * record + 1).unwrap();
            a.commit_cached_checkpoint(staged).unwrap();
            assert!(
                bits(&a) == bits(&plain),
                "{optimizer:?}: chunked load differs"
            );
            let b = cached(&format!("b-{k}.bin"));
            b.load(&path).unwrap();
            assert!(bits(&b) == bits(&plain), "{optimizer:?}: load differs");
            assert_eq!(b.step(), 7);
            // A checkpoint of other shapes: refused by name, nothing changed or left.
            let other = TbeConfig::new(
                vec![TableSpec::new("a", 257, 5), TableSpec::new("b", 41, 3)],
                vec![0, 1],
                PoolingMode::Sum,
                optimizer,
            );
            let wrong = dir.join(format!("wrong-{k}.safetensors"));
            TableBatchedEmbedding::new(other)
                .unwrap()
                .save(&wrong)
                .unwrap();
            let err = b.load(&wrong).unwrap_err().to_string();
            assert!(err.contains("b.weight"), "{err}");
            assert!(bits(&b) == bits(&plain));
            let left: Vec<_> = (std::fs::read_dir(&dir).unwrap())
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .filter(|n| n.contains("restore"))
                .collect();
            assert!(left.is_empty(), "{left:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
