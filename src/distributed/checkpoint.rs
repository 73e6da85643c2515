//! Sharded checkpoints: each rank writes the rectangles of the tables it holds (weights and
//! optimizer state), and any layout reads them back — the same plan, another plan or world
//! size (resharding), or one unsharded [`EmbeddingBagCollection`] (train on 4 processes, serve
//! from 1). An unsharded collection's own checkpoint ([`EmbeddingBagCollection::save`]) loads
//! into a sharded one too.
//!
//! A checkpoint is a directory:
//! * `rank-<r>-of-<W>.<id>.safetensors` per rank: tensors `<table>@<row>,<col>.weight`
//!   (`[rows, cols]`) and `<table>@<row>,<col>.<state>` (`[rows]` for per-row state, else
//!   `[rows, cols]`); a data-parallel table only in rank 0's file;
//! * `manifest.safetensors`: the files of the checkpoint `id`, the rectangles each holds, the
//!   optimizer and its step. A load opens only the files holding rectangles it needs.
//!
//! Every file is written atomically (temporary file, fsync, rename). The manifest is written
//! last, by rank 0, once every rank's file is on disk, and names files no older checkpoint
//! used: a crash at any moment leaves the previous checkpoint whole (files of an unfinished one
//! are removed by the next save).
//!
//! Per-row optimizer state (row-wise Adagrad, the partial row-wise optimizers) is kept per
//! column block: a block's value sums `mean(g²)` over its own columns. Merging blocks into a
//! wider one is exact (the width-weighted mean); splitting a wider block is not (each part gets
//! the wider block's value) and the load reports which tables it approximated.

use std::path::{Path, PathBuf};

use super::comm::Comm;
use crate::checkpoint::{CheckpointReader, CheckpointWriter};
use crate::embedding::{
    EmbeddingBagCollection, EmbeddingCollection, StateShape, TableBatchedEmbedding,
};
use crate::error::{Error, Result};

const FORMAT: &str = "embers.sharded_ebc.v1";
const MANIFEST: &str = "manifest.safetensors";
const OP: &str = "sharded checkpoint";

/// What a load did besides copying values exactly.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Tables whose per-row optimizer state was split from wider column blocks than the ones
    /// loaded (approximate; see the module docs).
    pub approximated_row_state: Vec<String>,
}

/// A rectangle of a table: first row and column, rows and columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rect {
    pub row_offset: usize,
    pub col_offset: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Rect {
    /// Whether the two rectangles share a cell.
    fn meets(&self, other: &Rect) -> bool {
        self.row_offset < other.row_offset + other.rows
            && other.row_offset < self.row_offset + self.rows
            && self.col_offset < other.col_offset + other.cols
            && other.col_offset < self.col_offset + self.cols
    }
}

/// One rectangle held by one TBE table, to be saved or loaded.
pub(crate) struct Held<'a> {
    pub table: &'a str,
    pub rect: Rect,
    pub tbe: &'a TableBatchedEmbedding,
    /// The table's index inside `tbe`.
    pub index: usize,
}

/// Adds `held`'s weights and optimizer state to `w`.
fn add_held(w: &mut CheckpointWriter, held: &Held<'_>) -> Result<()> {
    let Rect {
        row_offset,
        col_offset,
        rows,
        cols,
    } = held.rect;
    let base = format!("{}@{row_offset},{col_offset}", held.table);
    w.add(
        format!("{base}.weight"),
        &[rows, cols],
        &held.tbe.table_weights(held.index)?,
    )?;
    for (i, (name, shape)) in held.tbe.optimizer_state_names().iter().enumerate() {
        let dims = match shape {
            StateShape::PerRow => vec![rows],
            StateShape::PerElement => vec![rows, cols],
        };
        w.add(
            format!("{base}.{name}"),
            &dims,
            &held.tbe.optimizer_state(i, held.index)?,
        )?;
    }
    Ok(())
}

fn rank_file(rank: usize, world: usize, id: u64) -> String {
    format!("rank-{rank}-of-{world}.{id:016x}.safetensors")
}

/// Whether `name` is a rank file of some sharded checkpoint.
fn is_rank_file(name: &str) -> bool {
    name.starts_with("rank-") && name.ends_with(".safetensors")
}

/// Writes a sharded checkpoint of `held` (this rank's rectangles) into `dir`: a collective.
/// `optimizer` and `step` describe every rank's tables alike.
pub(crate) fn save(
    comm: &Comm,
    dir: &Path,
    held: &[Held<'_>],
    optimizer: &str,
    step: u64,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.size());
    // Rank 0 picks the checkpoint's id; every rank uses it.
    let proposal = [std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id())];
    let id = comm.all_gather_v("checkpoint.id", &proposal, Some(&vec![1; world]))?[0][0];
    // Rank 0 lists every file's rectangles in the manifest.
    let mine: Vec<serde_json::Value> = (held.iter())
        .map(|h| {
            let r = h.rect;
            serde_json::json!([h.table, r.row_offset, r.col_offset, r.rows, r.cols])
        })
        .collect();
    let mine = serde_json::Value::Array(mine).to_string();
    let listed = comm.all_gather_v("checkpoint.rects", mine.as_bytes(), None)?;
    let written = (|| {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let mut w = CheckpointWriter::new();
        w.set_metadata("format", FORMAT);
        w.set_metadata("rank", rank.to_string());
        w.set_metadata("world_size", world.to_string());
        for h in held {
            add_held(&mut w, h)?;
        }
        w.write(dir.join(rank_file(rank, world, id)))
    })();
    all_ok(comm, "checkpoint.written", written)?;
    let committed = if rank == 0 {
        (|| {
            let mut w = CheckpointWriter::new();
            w.set_metadata("format", FORMAT);
            w.set_metadata("id", format!("{id:016x}"));
            w.set_metadata("world_size", world.to_string());
            w.set_metadata("optimizer", optimizer);
            w.set_metadata("step", step.to_string());
            let files: Vec<String> = (0..world).map(|r| rank_file(r, world, id)).collect();
            w.set_metadata("files", files.join(","));
            for (r, list) in listed.iter().enumerate() {
                w.set_metadata(format!("rects.{r}"), String::from_utf8_lossy(list));
            }
            w.write(dir.join(MANIFEST))?;
            // The previous checkpoints' files (and any unfinished one's) are garbage now.
            if let Ok(entries) = std::fs::read_dir(dir) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    if is_rank_file(&name) && !files.contains(&name) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
            Ok(())
        })()
    } else {
        Ok(())
    };
    all_ok(comm, "checkpoint.committed", committed)
}

/// Every rank's verdict on a step of a collective save or load: this rank's error, an error
/// naming the ranks that failed, or this rank's value when every rank succeeded.
pub(crate) fn all_ok<T>(comm: &Comm, op: &'static str, mine: Result<T>) -> Result<T> {
    let flag = [u8::from(mine.is_err())];
    let all = comm.all_gather_v(op, &flag, Some(&vec![1; comm.size()]))?;
    let value = mine?;
    let failed: Vec<String> = (0..all.len())
        .filter(|&r| all[r][0] != 0)
        .map(|r| r.to_string())
        .collect();
    match failed.len() {
        0 => Ok(value),
        n => Err(Error::Distributed(format!(
            "rank {}: {op} failed on rank{} {} (see their error); nothing changed",
            comm.rank(),
            if n == 1 { "" } else { "s" },
            failed.join(", ")
        ))),
    }
}

/// A rectangle as the manifest lists it: table, first row, first column, rows, columns.
type ListedRect = (String, usize, usize, usize, usize);

/// A rectangle's values read from a checkpoint: weights, then each optimizer state buffer.
type RectValues = (Vec<f32>, Vec<Vec<f32>>);

/// A saved rectangle: which file, which table, where.
struct SavedRect {
    file: usize,
    /// Tensor name prefix (`<table>@<row>,<col>`, or `<table>` in an unsharded file).
    base: String,
    table: String,
    rect: Rect,
}

/// The contents of a checkpoint, sharded or not.
pub(crate) struct Saved {
    path: PathBuf,
    /// The rank files (or the one unsharded file).
    paths: Vec<PathBuf>,
    /// Each file once opened.
    readers: Vec<Option<CheckpointReader>>,
    rects: Vec<SavedRect>,
    optimizer: String,
    step: u64,
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::invalid(OP, format!("{}: {msg}", path.display()))
}

impl Saved {
    /// Opens a sharded checkpoint directory, or an unsharded collection's checkpoint file.
    pub fn open(path: &Path) -> Result<Saved> {
        if path.is_dir() {
            Saved::open_sharded(path)
        } else {
            Saved::open_unsharded(path)
        }
    }

    fn open_sharded(dir: &Path) -> Result<Saved> {
        let manifest_path = dir.join(MANIFEST);
        if !manifest_path.exists() {
            return Err(bad(
                dir,
                "no manifest: not a sharded checkpoint, or one whose save did not finish",
            ));
        }
        let manifest = CheckpointReader::open(&manifest_path)?;
        if manifest.metadata("format") != Some(FORMAT) {
            return Err(bad(&manifest_path, format!("not a {FORMAT} manifest")));
        }
        let files = manifest.required_metadata("files")?;
        let optimizer = manifest.required_metadata("optimizer")?.to_string();
        let step = (manifest.required_metadata("step")?.parse())
            .map_err(|_| bad(&manifest_path, "the step is not a count"))?;
        let mut paths = Vec::new();
        let mut rects = Vec::new();
        for (file, name) in files.split(',').enumerate() {
            paths.push(dir.join(name));
            let listed = manifest.required_metadata(&format!("rects.{file}"))?;
            let parsed: Option<Vec<ListedRect>> = serde_json::from_str(listed).ok();
            let Some(listed) = parsed else {
                return Err(bad(
                    &manifest_path,
                    format!("the rectangles of file {name} do not parse"),
                ));
            };
            for (table, row_offset, col_offset, rows, cols) in listed {
                rects.push(SavedRect {
                    file,
                    base: format!("{table}@{row_offset},{col_offset}"),
                    table,
                    rect: Rect {
                        row_offset,
                        col_offset,
                        rows,
                        cols,
                    },
                });
            }
        }
        let readers = paths.iter().map(|_| None).collect();
        Ok(Saved {
            path: dir.to_path_buf(),
            paths,
            readers,
            rects,
            optimizer,
            step,
        })
    }

    /// Opens the files holding rectangles of `held` (once each) and checks that they hold
    /// what the manifest lists.
    fn open_files_for(&mut self, held: &[Held<'_>]) -> Result<()> {
        for s in &self.rects {
            if self.readers[s.file].is_some()
                || !held
                    .iter()
                    .any(|h| h.table == s.table && h.rect.meets(&s.rect))
            {
                continue;
            }
            let path = &self.paths[s.file];
            let reader = CheckpointReader::open(path)?;
            for listed in self.rects.iter().filter(|x| x.file == s.file) {
                let tensor = format!("{}.weight", listed.base);
                let want = [listed.rect.rows, listed.rect.cols];
                if reader.shape(&tensor).as_deref() != Some(&want[..]) {
                    return Err(bad(
                        path,
                        format!("no `{tensor}` of shape {want:?}, which the manifest lists"),
                    ));
                }
            }
            self.readers[s.file] = Some(reader);
        }
        Ok(())
    }

    /// An [`EmbeddingBagCollection::save`] file: `<table>.weight` and its state, whole.
    fn open_unsharded(path: &Path) -> Result<Saved> {
        let reader = CheckpointReader::open(path)?;
        let optimizer = reader
            .metadata("group0.optimizer")
            .ok_or_else(|| {
                bad(
                    path,
                    "neither a sharded checkpoint directory nor a collection checkpoint",
                )
            })?
            .to_string();
        let mut step = 0;
        for g in 0.. {
            if reader.metadata(&format!("group{g}.optimizer")).is_none() {
                break;
            }
            let s: u64 = (reader
                .metadata(&format!("group{g}.step"))
                .unwrap_or("0")
                .parse())
            .map_err(|_| bad(path, format!("group {g}'s step is not a count")))?;
            step = step.max(s);
        }
        let mut rects = Vec::new();
        for tensor in reader.names() {
            let Some(table) = tensor.strip_suffix(".weight") else {
                continue;
            };
            let Some([rows, cols]) = reader
                .shape(&tensor)
                .and_then(|s| <[usize; 2]>::try_from(s).ok())
            else {
                return Err(bad(path, format!("`{tensor}` is not 2-D")));
            };
            rects.push(SavedRect {
                file: 0,
                base: table.to_string(),
                table: table.to_string(),
                rect: Rect {
                    row_offset: 0,
                    col_offset: 0,
                    rows,
                    cols,
                },
            });
        }
        Ok(Saved {
            path: path.to_path_buf(),
            paths: vec![path.to_path_buf()],
            readers: vec![Some(reader)],
            rects,
            optimizer,
            step,
        })
    }

    /// Reads `held`'s rectangle: weights, then each state buffer of its TBE; and whether a
    /// per-row state had to be split from a wider block.
    fn read(&self, held: &Held<'_>) -> Result<(Vec<f32>, Vec<Vec<f32>>, bool)> {
        let want = held.rect;
        let (r0, c0) = (want.row_offset, want.col_offset);
        let states = held.tbe.optimizer_state_names();
        let mut weights = vec![0.0f32; want.rows * want.cols];
        let mut state_values: Vec<Vec<f32>> = (states.iter())
            .map(|(_, shape)| match shape {
                StateShape::PerRow => vec![0.0f32; want.rows],
                StateShape::PerElement => vec![0.0f32; want.rows * want.cols],
            })
            .collect();
        let mut covered = vec![0usize; want.rows];
        let mut approximate = false;
        for s in self.rects.iter().filter(|s| s.table == held.table) {
            let have = s.rect;
            let rows = r0.max(have.row_offset)..(r0 + want.rows).min(have.row_offset + have.rows);
            let cols = c0.max(have.col_offset)..(c0 + want.cols).min(have.col_offset + have.cols);
            if rows.is_empty() || cols.is_empty() {
                continue;
            }
            let Some(reader) = &self.readers[s.file] else {
                return Err(bad(&self.paths[s.file], "read before it was opened"));
            };
            let saved =
                reader.read::<f32>(&format!("{}.weight", s.base), &[have.rows, have.cols])?;
            for r in rows.clone() {
                let src = (r - have.row_offset) * have.cols + (cols.start - have.col_offset);
                let dst = (r - r0) * want.cols + (cols.start - c0);
                weights[dst..dst + cols.len()].copy_from_slice(&saved[src..src + cols.len()]);
                covered[r - r0] += cols.len();
            }
            for (i, (name, shape)) in states.iter().enumerate() {
                let tensor = format!("{}.{name}", s.base);
                match shape {
                    StateShape::PerElement => {
                        let saved = reader.read::<f32>(&tensor, &[have.rows, have.cols])?;
                        for r in rows.clone() {
                            let src =
                                (r - have.row_offset) * have.cols + (cols.start - have.col_offset);
                            let dst = (r - r0) * want.cols + (cols.start - c0);
                            state_values[i][dst..dst + cols.len()]
                                .copy_from_slice(&saved[src..src + cols.len()]);
                        }
                    }
                    StateShape::PerRow => {
                        let saved = reader.read::<f32>(&tensor, &[have.rows])?;
                        // The width-weighted mean of the saved blocks over the wanted columns.
                        let share = cols.len() as f32 / want.cols as f32;
                        if have.cols > cols.len() {
                            approximate = true;
                        }
                        for r in rows.clone() {
                            state_values[i][r - r0] += share * saved[r - have.row_offset];
                        }
                    }
                }
            }
        }
        if let Some(r) = covered.iter().position(|&c| c != want.cols) {
            return Err(bad(
                &self.path,
                format!(
                    "table `{}` row {}: {} of columns {}..{} are saved (expected each once; \
                     is this a checkpoint of the same tables?)",
                    held.table,
                    r0 + r,
                    covered[r],
                    c0,
                    c0 + want.cols
                ),
            ));
        }
        Ok((weights, state_values, approximate))
    }

    /// Reads every rectangle of `held` and checks the optimizer, changing nothing: the values
    /// to apply with [`Staged::apply`].
    pub fn stage<'a>(&mut self, held: &'a [Held<'a>], optimizer: &str) -> Result<Staged<'a>> {
        if self.optimizer != optimizer {
            return Err(bad(
                &self.path,
                format!(
                    "saved with optimizer `{}`, these tables use `{optimizer}`",
                    self.optimizer
                ),
            ));
        }
        self.open_files_for(held)?;
        let mut values = Vec::with_capacity(held.len());
        let mut report = LoadReport::default();
        for h in held {
            let (weights, states, approximate) = self.read(h)?;
            if approximate && !report.approximated_row_state.iter().any(|t| t == h.table) {
                report.approximated_row_state.push(h.table.to_string());
            }
            values.push((h, (weights, states)));
        }
        Ok(Staged {
            values,
            step: self.step,
            report,
        })
    }
}

/// Checked values, ready to be written into the TBEs.
pub(crate) struct Staged<'a> {
    values: Vec<(&'a Held<'a>, RectValues)>,
    step: u64,
    report: LoadReport,
}

impl Staged<'_> {
    /// Writes the values and the step count.
    pub fn apply(self) -> Result<LoadReport> {
        for (h, (weights, states)) in &self.values {
            h.tbe.set_table_weights(h.index, weights)?;
            for (i, s) in states.iter().enumerate() {
                h.tbe.set_optimizer_state(i, h.index, s)?;
            }
            h.tbe.set_step(self.step);
        }
        Ok(self.report)
    }
}

/// An unsharded collection a sharded checkpoint loads into: [`EmbeddingBagCollection`] and
/// [`EmbeddingCollection`].
pub trait UnshardedTables {
    /// Its TBEs (each TBE table named as the collection's table).
    fn tables(&self) -> Vec<&TableBatchedEmbedding>;
}

impl UnshardedTables for EmbeddingBagCollection {
    fn tables(&self) -> Vec<&TableBatchedEmbedding> {
        self.tbes()
    }
}

impl UnshardedTables for EmbeddingCollection {
    fn tables(&self) -> Vec<&TableBatchedEmbedding> {
        self.tbes()
    }
}

/// Loads a sharded checkpoint (or another collection's file) into an unsharded
/// [`EmbeddingBagCollection`] or [`EmbeddingCollection`] with the same tables: train sharded,
/// serve from one process. A bad checkpoint changes nothing.
pub fn load_into_unsharded(
    collection: &impl UnshardedTables,
    path: impl AsRef<Path>,
) -> Result<LoadReport> {
    let mut saved = Saved::open(path.as_ref())?;
    let tbes = collection.tables();
    let mut held = Vec::new();
    for tbe in &tbes {
        for (index, spec) in tbe.config().tables.iter().enumerate() {
            held.push(Held {
                table: &spec.name,
                rect: Rect {
                    row_offset: 0,
                    col_offset: 0,
                    rows: spec.rows,
                    cols: spec.dim,
                },
                tbe,
                index,
            });
        }
    }
    let optimizer = tbes.first().map_or("none", |t| t.config().optimizer.name());
    saved.stage(&held, optimizer)?.apply()
}
