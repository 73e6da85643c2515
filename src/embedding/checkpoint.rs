//! Tables and optimizer state as safetensors files, written atomically: the file is written
//! under a temporary name in the same directory, flushed to disk (fsync), then renamed over
//! the destination (and the directory synced), so a crash leaves either the old checkpoint or
//! the new one, never half of one.
//!
//! Training TBEs (one, or all of a collection's in one file): `<table>.weight` (F32
//! `[rows, dim]`), `<table>.momentum1` / `<table>.momentum2` (F32, `[rows]` for row-wise state
//! or `[rows, dim]`), metadata `format`, and per TBE `group<i>.optimizer` and `group<i>.step`.
//! Inference TBE: `<table>.weight` (U8 `[rows, row_bytes]`, FBGEMM's row bytes), metadata
//! `<table>.weight_type`.
//!
//! Loading reads and checks everything (names, dtypes, shapes, optimizer, weight types) before
//! writing anything, so a bad file leaves the operator as it was.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};

use super::config::WeightType;
use super::inference::QuantizedTableBatchedEmbedding;
use super::tbe::TableBatchedEmbedding;
use crate::{Error, Result};

const FORMAT: &str = "embers.tbe.v1";

struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn io_err(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn st_err(path: &Path, e: safetensors::SafeTensorError) -> Error {
    Error::invalid("checkpoint", format!("{}: {e}", path.display()))
}

/// Serialises `tensors` to `path` atomically.
fn write_atomically(
    path: &Path,
    tensors: Vec<(String, Bytes)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    let bytes =
        safetensors::serialize(tensors.iter().map(|(n, b)| (n.as_str(), b)), Some(metadata))
            .map_err(|e| st_err(path, e))?;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path.file_name().ok_or_else(|| {
        Error::invalid(
            "checkpoint",
            format!("{} is not a file path", path.display()),
        )
    })?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
        f.write_all(&bytes).map_err(|e| io_err(&tmp, e))?;
        f.sync_all().map_err(|e| io_err(&tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, e))?;
        // Persist the rename itself (directory entry); best effort where directories cannot be
        // opened.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io_err(path, e))
}

fn tensor_f32(st: &SafeTensors<'_>, path: &Path, name: &str, expected: usize) -> Result<Vec<f32>> {
    let view = st.tensor(name).map_err(|e| st_err(path, e))?;
    if view.dtype() != Dtype::F32 {
        return Err(Error::invalid(
            "checkpoint",
            format!(
                "{}: `{name}` is {:?}, expected F32",
                path.display(),
                view.dtype()
            ),
        ));
    }
    let data = view.data();
    if data.len() != expected * 4 {
        return Err(Error::invalid(
            "checkpoint",
            format!(
                "{}: `{name}` has shape {:?}, expected {expected} values",
                path.display(),
                view.shape()
            ),
        ));
    }
    Ok(data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Writes the tables and optimizer state of several TBEs into one file (table names must be
/// unique across them).
pub(crate) fn save_many(path: &Path, tbes: &[&TableBatchedEmbedding]) -> Result<()> {
    let mut tensors = Vec::new();
    let mut metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    let mut names = std::collections::HashSet::new();
    for (g, tbe) in tbes.iter().enumerate() {
        let states = tbe.optimizer_state_names();
        for (t, spec) in tbe.config().tables.iter().enumerate() {
            if !names.insert(spec.name.clone()) {
                return Err(Error::invalid(
                    "checkpoint",
                    format!(
                        "table name `{}` is used twice; names must be unique to be saved",
                        spec.name
                    ),
                ));
            }
            tensors.push((
                format!("{}.weight", spec.name),
                Bytes {
                    dtype: Dtype::F32,
                    shape: vec![spec.rows, spec.dim],
                    data: f32_bytes(&tbe.table_weights(t)?),
                },
            ));
            for (i, (name, shape)) in states.iter().enumerate() {
                let shape = match shape {
                    super::StateShape::PerRow => vec![spec.rows],
                    super::StateShape::PerElement => vec![spec.rows, spec.dim],
                };
                tensors.push((
                    format!("{}.{name}", spec.name),
                    Bytes {
                        dtype: Dtype::F32,
                        shape,
                        data: f32_bytes(&tbe.optimizer_state(i, t)?),
                    },
                ));
            }
        }
        metadata.insert(
            format!("group{g}.optimizer"),
            tbe.config().optimizer.name().to_string(),
        );
        metadata.insert(format!("group{g}.step"), tbe.step().to_string());
    }
    write_atomically(path, tensors, metadata)
}

/// Loads what [`save_many`] wrote for the same TBEs. Everything is read and checked before
/// anything is written, so a bad file leaves the operators untouched.
pub(crate) fn load_many(path: &Path, tbes: &[&TableBatchedEmbedding]) -> Result<()> {
    let bytes = read_file(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| st_err(path, e))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| st_err(path, e))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let mut weights = Vec::new();
    let mut states = Vec::new();
    let mut steps = Vec::new();
    for (g, tbe) in tbes.iter().enumerate() {
        let saved_opt = meta
            .get(&format!("group{g}.optimizer"))
            .map(String::as_str)
            .unwrap_or("");
        if saved_opt != tbe.config().optimizer.name() {
            return Err(Error::invalid(
                "checkpoint",
                format!(
                    "{}: saved with optimizer `{saved_opt}`, this operator uses `{}`",
                    path.display(),
                    tbe.config().optimizer.name()
                ),
            ));
        }
        for (t, spec) in tbe.config().tables.iter().enumerate() {
            weights.push((
                g,
                t,
                tensor_f32(
                    &st,
                    path,
                    &format!("{}.weight", spec.name),
                    spec.rows * spec.dim,
                )?,
            ));
            for (i, (name, _)) in tbe.optimizer_state_names().iter().enumerate() {
                let n = tbe.optimizer_state(i, t)?.len();
                states.push((
                    g,
                    i,
                    t,
                    tensor_f32(&st, path, &format!("{}.{name}", spec.name), n)?,
                ));
            }
        }
        steps.push(
            meta.get(&format!("group{g}.step"))
                .and_then(|s| s.parse().ok())
                .unwrap_or(0u64),
        );
    }
    for (g, t, w) in weights {
        tbes[g].set_table_weights(t, &w)?;
    }
    for (g, i, t, s) in states {
        tbes[g].set_optimizer_state(i, t, &s)?;
    }
    for (g, step) in steps.into_iter().enumerate() {
        tbes[g].set_step(step);
    }
    Ok(())
}

impl TableBatchedEmbedding {
    /// Writes every table (`<name>.weight`) and its optimizer state (`<name>.momentum1`, ...)
    /// to `path` as safetensors, atomically. Table names must be unique.
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
        let path = path.as_ref();
        let mut tensors = Vec::new();
        let mut metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
        for (t, spec) in self.tables().iter().enumerate() {
            let ty = self.weight_types()[t];
            tensors.push((
                format!("{}.weight", spec.name),
                Bytes {
                    dtype: Dtype::U8,
                    shape: vec![spec.rows, ty.row_bytes(spec.dim)],
                    data: self.table_bytes(t)?.to_vec(),
                },
            ));
            metadata.insert(
                format!("{}.weight_type", spec.name),
                ty.fbgemm_name().to_string(),
            );
        }
        write_atomically(path, tensors, metadata)
    }

    /// Loads rows written by [`save`](Self::save) (same names, shapes and weight types).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = read_file(path)?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| st_err(path, e))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| st_err(path, e))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        let mut tables = Vec::new();
        for (t, spec) in self.tables().iter().enumerate() {
            let ty = self.weight_types()[t];
            let key = format!("{}.weight_type", spec.name);
            let saved = meta
                .get(&key)
                .map(|s| WeightType::from_fbgemm_name(s))
                .transpose()?;
            if saved != Some(ty) {
                return Err(Error::invalid(
                    "checkpoint",
                    format!(
                        "{}: table `{}` was saved as {:?}, this operator stores {}",
                        path.display(),
                        spec.name,
                        saved.map(|s| s.fbgemm_name()),
                        ty.fbgemm_name()
                    ),
                ));
            }
            let view = st
                .tensor(&format!("{}.weight", spec.name))
                .map_err(|e| st_err(path, e))?;
            if view.dtype() != Dtype::U8 || view.shape() != [spec.rows, ty.row_bytes(spec.dim)] {
                return Err(Error::invalid(
                    "checkpoint",
                    format!(
                        "{}: `{}.weight` is {:?} {:?}, expected U8 [{}, {}]",
                        path.display(),
                        spec.name,
                        view.dtype(),
                        view.shape(),
                        spec.rows,
                        ty.row_bytes(spec.dim)
                    ),
                ));
            }
            tables.push(view.data().to_vec());
        }
        for (t, b) in tables.iter().enumerate() {
            self.set_table_bytes(t, b)?;
        }
        Ok(())
    }
}
