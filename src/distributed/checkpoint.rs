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
//! * a rank's shards whose tables are cached in files (the plan's `fused_uvm_caching` and
//!   `fused_uvm` kernels) are not in its file: each of its TBEs of them is saved as its own
//!   cached checkpoint (the row file copied, never read into memory, and a manifest;
//!   [`TableBatchedEmbedding::save_cached_checkpoint`]) into `group<k>/` of the rank file's
//!   parts directory (`rank-<r>-of-<W>.<id>.safetensors.parts-<nonce>/`), and the manifest
//!   lists each such rectangle with its group and place. A TBE of cached tables loading the
//!   same rectangles (the same plan) takes the saved row file whole — checked, copied beside
//!   its own, renamed over it; any other load (another plan, tables in memory, one unsharded
//!   collection) reads from the row file only the rows each rectangle needs, after checking
//!   its checksum. A TBE of cached tables that does not take a saved file whole gets a new
//!   row file written a few rows at a time (staged beside its own, renamed over it when
//!   every rank has read its part), so no cached table is ever held whole in memory. (Rank
//!   files, which hold the tables that were in memory, are still read whole, and only the
//!   rows needed decoded.)
//!
//! Every file is written atomically (temporary file, fsync, rename). The manifest is written
//! last, by rank 0, once every rank's file is on disk, and names files no older checkpoint
//! used: a crash at any moment leaves the previous checkpoint whole (files and parts directories
//! of an unfinished one are removed by the next save).
//!
//! Per-row optimizer state (row-wise Adagrad, the partial row-wise optimizers) is kept per
//! column block: a block's value sums `mean(g²)` over its own columns. Merging blocks into a
//! wider one is exact (the width-weighted mean); splitting a wider block is not (each part gets
//! the wider block's value) and the load reports which tables it approximated.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::comm::Comm;
use crate::checkpoint::{parse_count, CheckpointReader, CheckpointWriter, PARTS_LOCK};
use crate::embedding::checkpoint::{cached_group_dir, STAGE_CHUNK_BYTES};
use crate::embedding::tbe::cache::api::{commit_cached_checkpoints, SavedRows, StagedRows};
use crate::embedding::{
    EmbeddingBagCollection, EmbeddingCollection, StateShape, TableBatchedEmbedding,
};
use crate::error::{Error, Result};

const FORMAT: &str = "embers.sharded_ebc.v2";
/// The format before cached groups (its rectangles list no group): still loaded.
const FORMAT_V1: &str = "embers.sharded_ebc.v1";
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
fn add_held<'a>(w: &mut CheckpointWriter<'a>, held: &Held<'a>) -> Result<()> {
    let Rect {
        row_offset,
        col_offset,
        rows,
        cols,
    } = held.rect;
    let base = format!("{}@{row_offset},{col_offset}", held.table);
    // Read a chunk of rows at a time as the file is written.
    let (tbe, t) = (held.tbe, held.index);
    w.add_rows(format!("{base}.weight"), &[rows, cols], move |r| {
        tbe.table_weight_rows(t, r)
    })?;
    for (i, (name, shape)) in tbe.optimizer_state_names().iter().enumerate() {
        let dims = match shape {
            StateShape::PerRow => vec![rows],
            StateShape::PerElement => vec![rows, cols],
        };
        w.add_rows(format!("{base}.{name}"), &dims, move |r| {
            tbe.optimizer_state_rows(i, t, r)
        })?;
    }
    Ok(())
}

/// A TBE of cached tables saved whole into a rank file's parts directory.
struct CachedGroup<'a> {
    tbe: &'a TableBatchedEmbedding,
}

/// The TBEs among `held` whose tables are cached in files and all held (each once), in order
/// of first appearance: each is saved as its own cached checkpoint.
fn cached_groups<'a>(held: &[Held<'a>]) -> Vec<CachedGroup<'a>> {
    let mut out: Vec<CachedGroup<'a>> = Vec::new();
    for h in held {
        if out.iter().any(|g| std::ptr::eq(g.tbe, h.tbe)) || !h.tbe.is_cached() {
            continue;
        }
        let mut indices: Vec<usize> = (held.iter())
            .filter(|o| std::ptr::eq(o.tbe, h.tbe))
            .map(|o| o.index)
            .collect();
        indices.sort_unstable();
        if indices.iter().copied().eq(0..h.tbe.config().tables.len()) {
            out.push(CachedGroup { tbe: h.tbe });
        }
    }
    out
}

/// The name of a rank file's `k`-th cached group in its parts directory.
fn group_name(k: usize) -> String {
    format!("group{k}")
}

fn rank_file(rank: usize, world: usize, id: u64) -> String {
    format!("rank-{rank}-of-{world}.{id:016x}.safetensors")
}

/// Whether `name` is a rank file of some sharded checkpoint.
fn is_rank_file(name: &str) -> bool {
    name.starts_with("rank-") && name.ends_with(".safetensors")
}

/// The lock of a sharded checkpoint directory, held by the rank 0 of a save from its first
/// file to its manifest (and its removal of the files it replaced). Two saves into one
/// directory at once would each remove the other's files as garbage: the second is refused.
/// An exclusive `flock` on `<dir>/.lock`, released when this is dropped or the process ends
/// (a crashed save holds nothing); take it to keep saves out while you copy a checkpoint.
#[derive(Debug)]
pub struct CheckpointDirLock {
    _file: std::fs::File,
}

/// Locks the sharded checkpoint directory `dir` (created if missing) against saves, or an
/// error naming it when a save (or another holder) has it.
pub fn lock_checkpoint_dir(dir: &Path) -> Result<CheckpointDirLock> {
    let io = |path: &Path, source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let path = dir.join(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io(&path, e))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            return Err(Error::Distributed(format!(
                "the checkpoint directory {} is locked ({}): another save into it is under way",
                dir.display(),
                path.display()
            )));
        }
        return Err(io(&path, e));
    }
    Ok(CheckpointDirLock { _file: file })
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
    // Rank 0 locks the directory for the whole save and picks the checkpoint's id; every rank
    // uses it. An id of 0 says the lock was refused: every rank stops (no extra collective).
    let lock = (rank == 0).then(|| lock_checkpoint_dir(dir));
    let proposal = match &lock {
        Some(Err(_)) => [0],
        _ => [crate::checkpoint::unique_id()],
    };
    let id = comm.all_gather_v("checkpoint.id", &proposal, Some(&vec![1; world]))?[0][0];
    let _lock = match lock {
        Some(Err(e)) => return Err(e),
        _ if id == 0 => {
            return Err(Error::Distributed(format!(
                "rank 0 could not lock the checkpoint directory {} (another save into it is \
                 under way?): nothing was written",
                dir.display()
            )))
        }
        lock => lock,
    };
    // TBEs whose tables are cached in files are saved as their own checkpoints (row file and
    // manifest) in the rank file's parts directory, never read whole into memory.
    let groups = cached_groups(held);
    let group_of = |h: &Held<'_>| {
        (groups.iter().enumerate()).find_map(|(k, g)| std::ptr::eq(g.tbe, h.tbe).then_some(k))
    };
    // Rank 0 lists every file's rectangles in the manifest (with the group holding a cached
    // one, and the table's place in it).
    let mine: Vec<serde_json::Value> = (held.iter())
        .map(|h| {
            let r = h.rect;
            match group_of(h) {
                Some(k) => serde_json::json!([
                    h.table,
                    r.row_offset,
                    r.col_offset,
                    r.rows,
                    r.cols,
                    group_name(k),
                    h.index
                ]),
                None => serde_json::json!([h.table, r.row_offset, r.col_offset, r.rows, r.cols]),
            }
        })
        .collect();
    let mine = serde_json::Value::Array(mine).to_string();
    let listed = comm.all_gather_v("checkpoint.rects", mine.as_bytes(), None)?;
    let written = (|| {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let path = dir.join(rank_file(rank, world, id));
        let mut w = CheckpointWriter::new();
        w.parts_beside(&path);
        w.set_metadata("format", FORMAT);
        w.set_metadata("rank", rank.to_string());
        w.set_metadata("world_size", world.to_string());
        for h in held.iter().filter(|h| group_of(h).is_none()) {
            add_held(&mut w, h)?;
        }
        for (k, g) in groups.iter().enumerate() {
            let parts = w
                .parts_dir()?
                .ok_or_else(|| bad(&path, "no parts directory"))?;
            g.tbe.save_cached_checkpoint(parts.join(group_name(k)))?;
        }
        w.write(&path)
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
            // The previous checkpoints' files and their parts directories (and any unfinished
            // one's) are garbage now.
            let current: std::collections::HashSet<&str> =
                files.iter().map(String::as_str).collect();
            if let Ok(entries) = std::fs::read_dir(dir) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    if is_rank_file(&name) && !current.contains(name.as_str()) {
                        let _ = std::fs::remove_file(e.path());
                    }
                    // (A rank file's reader keeps it open; a parts directory's holds its lock.)
                    if let Some((file, _)) = name.split_once(".parts-") {
                        let dir = e.file_type().is_ok_and(|t| t.is_dir());
                        if dir
                            && is_rank_file(file)
                            && !current.contains(file)
                            && !crate::checkpoint::in_use(&e.path().join(PARTS_LOCK))
                        {
                            let _ = std::fs::remove_dir_all(e.path());
                        }
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

/// Every rank's verdict on a step of a collective save or load (or any step every rank takes,
/// such as checking a resume's flags): this rank's error, an error naming the ranks that
/// failed, or this rank's value when every rank succeeded. Collective: every rank calls it
/// with the same `op`.
pub fn all_ok<T>(comm: &Comm, op: &'static str, mine: Result<T>) -> Result<T> {
    all_ok_then(comm, op, mine, "nothing changed")
}

/// [`all_ok`], whose error says `then` about the state the failure left.
pub(crate) fn all_ok_then<T>(
    comm: &Comm,
    op: &'static str,
    mine: Result<T>,
    then: &str,
) -> Result<T> {
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
            "rank {}: {op} failed on rank{} {} (see their error); {then}",
            comm.rank(),
            if n == 1 { "" } else { "s" },
            failed.join(", ")
        ))),
    }
}

/// A rectangle as the manifest lists it: its table, where it is, and for a table saved in a
/// cached group, the group's name and the table's place in it.
type Listed = (String, Rect, Option<(String, usize)>);

/// Parses a manifest's rectangle: table, first row, first column, rows, columns, and
/// optionally the cached group's name and the table's place in it.
fn parse_listed(v: &serde_json::Value) -> Option<Listed> {
    let a = v.as_array()?;
    let n = |i: usize| -> Option<usize> { a.get(i)?.as_u64()?.try_into().ok() };
    let rect = Rect {
        row_offset: n(1)?,
        col_offset: n(2)?,
        rows: n(3)?,
        cols: n(4)?,
    };
    // Rectangles whose end does not fit in a `usize` are malformed.
    rect.row_offset.checked_add(rect.rows)?;
    rect.col_offset.checked_add(rect.cols)?;
    let group = match a.len() {
        5 => None,
        7 => Some((a[5].as_str()?.to_string(), n(6)?)),
        _ => return None,
    };
    Some((a[0].as_str()?.to_string(), rect, group))
}

/// A rectangle's values read from a checkpoint: weights, then each optimizer state buffer.
type RectValues = (Vec<f32>, Vec<Vec<f32>>);

/// Where a saved rectangle's values are.
enum Source {
    /// Tensors of its file, named with this prefix (`<table>@<row>,<col>`, or `<table>` in an
    /// unsharded file).
    Tensors(String),
    /// Table `index` of cached group `group` (an index into [`Saved::groups`]).
    Rows { group: usize, index: usize },
}

/// A saved rectangle: which file, which table, where.
struct SavedRect {
    file: usize,
    source: Source,
    table: String,
    rect: Rect,
}

/// A cached group: the checkpoint of a TBE of cached tables in a file's parts directory.
struct SavedGroup {
    file: usize,
    name: String,
    /// Once opened (and when read from, its checksum verified).
    rows: Option<SavedRows>,
    verified: bool,
}

/// The contents of a checkpoint, sharded or not.
pub(crate) struct Saved {
    path: PathBuf,
    /// A sharded checkpoint's files, as its manifest lists them (`None`: one unsharded file).
    manifest_files: Option<String>,
    /// The rank files (or the one unsharded file).
    paths: Vec<PathBuf>,
    /// Each file once opened.
    readers: Vec<Option<CheckpointReader>>,
    rects: Vec<SavedRect>,
    groups: Vec<SavedGroup>,
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

    /// Reads a sharded checkpoint's manifest (its files are opened by
    /// [`stage`](Self::stage)).
    fn open_sharded(dir: &Path) -> Result<Saved> {
        let manifest_path = dir.join(MANIFEST);
        if !manifest_path.exists() {
            return Err(bad(
                dir,
                "no manifest: not a sharded checkpoint, or one whose save did not finish",
            ));
        }
        let manifest = CheckpointReader::open(&manifest_path)?;
        if !matches!(manifest.metadata("format"), Some(FORMAT | FORMAT_V1)) {
            return Err(bad(&manifest_path, format!("not a {FORMAT} manifest")));
        }
        let files = manifest.required_metadata("files")?;
        let optimizer = manifest.required_metadata("optimizer")?.to_string();
        let step = parse_count(manifest.required_metadata("step")?)
            .ok_or_else(|| bad(&manifest_path, "the step is not a count below 2^63"))?;
        let mut paths = Vec::new();
        let mut rects = Vec::new();
        let mut groups: Vec<SavedGroup> = Vec::new();
        // Each cached group's index, by file and name.
        let mut group_of: HashMap<(usize, String), usize> = HashMap::new();
        for (file, name) in files.split(',').enumerate() {
            if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
                return Err(bad(
                    &manifest_path,
                    format!("`{name}` of its files is not a file name in its directory"),
                ));
            }
            paths.push(dir.join(name));
            let listed = manifest.required_metadata(&format!("rects.{file}"))?;
            let parsed: Option<Vec<_>> = serde_json::from_str::<Vec<serde_json::Value>>(listed)
                .ok()
                .and_then(|l| l.iter().map(parse_listed).collect());
            let Some(listed) = parsed else {
                return Err(bad(
                    &manifest_path,
                    format!("the rectangles of file {name} do not parse"),
                ));
            };
            for (table, rect, group) in listed {
                let source = match group {
                    None => {
                        Source::Tensors(format!("{table}@{},{}", rect.row_offset, rect.col_offset))
                    }
                    Some((group, index)) => {
                        if group.contains(['/', '\\']) || group.starts_with('.') {
                            return Err(bad(
                                &manifest_path,
                                format!("`{group}` of file {name} is not a directory name"),
                            ));
                        }
                        let next = groups.len();
                        let group = *group_of.entry((file, group.clone())).or_insert_with(|| {
                            groups.push(SavedGroup {
                                file,
                                name: group,
                                rows: None,
                                verified: false,
                            });
                            next
                        });
                        Source::Rows { group, index }
                    }
                };
                rects.push(SavedRect {
                    file,
                    source,
                    table,
                    rect,
                });
            }
        }
        let readers = paths.iter().map(|_| None).collect();
        Ok(Saved {
            path: dir.to_path_buf(),
            manifest_files: Some(files.to_string()),
            paths,
            readers,
            rects,
            groups,
            optimizer,
            step,
        })
    }

    /// Opens every file and cached group a load of `held` reads, at once, before it reads
    /// any. A save replacing the checkpoint removes the files of the one it replaced: files
    /// opened stay readable, and a parts directory stays while a reader holds its lock. A
    /// save committed between the manifest's read and the opening is seen in the manifest
    /// read again: the newer checkpoint is opened instead.
    fn hold(&mut self, held: &[Held<'_>]) -> Result<()> {
        const TRIES: usize = 8;
        let held: Vec<&Held<'_>> = held.iter().collect();
        for _ in 0..TRIES {
            let Some(files) = self.manifest_files.clone() else {
                // One unsharded file, open.
                return Ok(());
            };
            #[cfg(test)]
            tests::hook(&tests::AFTER_MANIFEST_READ);
            let opened = self.open_files_for(&held, false);
            let now = (CheckpointReader::open(self.path.join(MANIFEST)).ok())
                .and_then(|m| m.metadata("files").map(str::to_string));
            if now.as_deref() == Some(files.as_str()) {
                #[cfg(test)]
                tests::hook(&tests::AFTER_FILES_OPENED);
                return opened;
            }
            *self = Saved::open_sharded(&self.path.clone())?;
        }
        Err(bad(
            &self.path,
            format!("replaced by a newer save {TRIES} times while it was being opened"),
        ))
    }

    /// Opens file `file` (once) and checks that it holds the tensors the manifest lists.
    fn open_file(&mut self, file: usize) -> Result<()> {
        if self.readers[file].is_some() {
            return Ok(());
        }
        let path = &self.paths[file];
        let reader = CheckpointReader::open(path)?;
        for listed in self.rects.iter().filter(|x| x.file == file) {
            let Source::Tensors(base) = &listed.source else {
                continue;
            };
            let tensor = format!("{base}.weight");
            let want = [listed.rect.rows, listed.rect.cols];
            if reader.shape(&tensor).as_deref() != Some(&want[..]) {
                return Err(bad(
                    path,
                    format!("no `{tensor}` of shape {want:?}, which the manifest lists"),
                ));
            }
        }
        self.readers[file] = Some(reader);
        Ok(())
    }

    /// Opens cached group `g` (once), in its file's parts directory, and checks that it holds
    /// the tables the manifest lists in it.
    fn open_group(&mut self, g: usize) -> Result<()> {
        if self.groups[g].rows.is_some() {
            return Ok(());
        }
        let file = self.groups[g].file;
        self.open_file(file)?;
        let path = &self.paths[file];
        let reader = self.readers[file].as_ref().expect("opened above");
        let parts = reader.parts_dir()?.ok_or_else(|| {
            bad(
                path,
                format!(
                    "its tables of cached group `{}` are in a parts directory, and it names none",
                    self.groups[g].name
                ),
            )
        })?;
        let rows = SavedRows::open(&parts.join(&self.groups[g].name))?;
        for s in &self.rects {
            let Source::Rows { group, index } = s.source else {
                continue;
            };
            let (r, c) = (s.rect.rows as u64, s.rect.cols as u64);
            // The group's table is the rectangle's: named as the table (a collection's TBE) or
            // `<table>#<i>` (a sharded collection's).
            let same = |t: &(String, u64, u64)| {
                let named = (t.0.strip_prefix(s.table.as_str()))
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('#'));
                named && (t.1, t.2) == (r, c)
            };
            if group == g && !rows.tables().get(index).is_some_and(same) {
                return Err(bad(
                    rows.dir(),
                    format!(
                        "no table {index} of {r}×{c} named for `{}` (rows {}.. columns {}..), \
                         which the manifest lists",
                        s.table, s.rect.row_offset, s.rect.col_offset
                    ),
                ));
            }
        }
        self.groups[g].rows = Some(rows);
        Ok(())
    }

    /// Opens the files and cached groups holding rectangles of `held` (once each), checks
    /// that they hold what the manifest lists and, with `verify`, the groups' checksums.
    fn open_files_for(&mut self, held: &[&Held<'_>], verify: bool) -> Result<()> {
        for i in 0..self.rects.len() {
            let s = &self.rects[i];
            if !held
                .iter()
                .any(|h| h.table == s.table && h.rect.meets(&s.rect))
            {
                continue;
            }
            match s.source {
                Source::Tensors(_) => self.open_file(s.file)?,
                Source::Rows { group, .. } => {
                    self.open_group(group)?;
                    let g = &mut self.groups[group];
                    if verify && !g.verified {
                        g.rows.as_ref().expect("opened above").verify()?;
                        g.verified = true;
                    }
                }
            }
        }
        Ok(())
    }

    /// For each TBE of cached tables among `held`, all held, a cached group saved for exactly
    /// those tables (the same rectangles, names, widths and optimizer), its row file checked
    /// and copied beside the TBE's own: such TBEs load whole, never read into memory. Returns
    /// them, the other TBEs of cached tables (all held), and the rectangles left to read.
    fn stage_whole_groups<'a>(
        &mut self,
        held: &'a [Held<'a>],
    ) -> Result<(WholeGroups<'a>, Vec<CachedGroup<'a>>, Vec<&'a Held<'a>>)> {
        let mut whole = Vec::new();
        let mut others = Vec::new();
        let mut rest = Vec::new();
        // Each saved group's rectangles (indices into `rects`), with their tables' in it.
        let mut of_group: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.groups.len()];
        for (i, s) in self.rects.iter().enumerate() {
            if let Source::Rows { group, index } = s.source {
                of_group[group].push((index, i));
            }
        }
        for group in cached_groups(held) {
            let tbe = group.tbe;
            let mine = |h: &&Held<'_>| std::ptr::eq(h.tbe, tbe);
            let tables = tbe.config().tables.len();
            // The saved group whose table `i` is exactly this TBE's table `i`, for every `i`.
            let candidate = (0..self.groups.len()).find(|&g| {
                of_group[g].len() == tables
                    && held.iter().filter(mine).all(|h| {
                        (of_group[g].iter()).any(|&(index, i)| {
                            let s = &self.rects[i];
                            index == h.index && s.table == h.table && s.rect == h.rect
                        })
                    })
            });
            if let Some(g) = candidate {
                self.open_group(g)?;
                let rows = self.groups[g].rows.as_ref().expect("opened above");
                if rows.is_for(tbe.config()) {
                    whole.push((tbe, tbe.stage_cached_checkpoint(rows.dir())?));
                    continue;
                }
            }
            others.push(group);
        }
        for h in held {
            if !whole.iter().any(|(t, _)| std::ptr::eq(*t, h.tbe)) {
                rest.push(h);
            }
        }
        Ok((whole, others, rest))
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
            let key = format!("group{g}.step");
            let text =
                (reader.metadata(&key)).ok_or_else(|| bad(path, format!("`{key}` is missing")))?;
            let s = parse_count(text)
                .ok_or_else(|| bad(path, format!("group {g}'s step is not a count below 2^63")))?;
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
                source: Source::Tensors(table.to_string()),
                table: table.to_string(),
                rect: Rect {
                    row_offset: 0,
                    col_offset: 0,
                    rows,
                    cols,
                },
            });
        }
        // Groups of tables cached in files: their own checkpoints in the parts directory.
        let mut groups = Vec::new();
        for g in 0.. {
            if reader.metadata(&format!("group{g}.optimizer")).is_none() {
                break;
            }
            let Some(dir) = cached_group_dir(&reader, "", g)? else {
                continue;
            };
            let rows = SavedRows::open(&dir)?;
            for (index, (table, n, dim)) in rows.tables().iter().enumerate() {
                rects.push(SavedRect {
                    file: 0,
                    source: Source::Rows {
                        group: groups.len(),
                        index,
                    },
                    table: table.clone(),
                    rect: Rect {
                        row_offset: 0,
                        col_offset: 0,
                        rows: *n as usize,
                        cols: *dim as usize,
                    },
                });
            }
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
            groups.push(SavedGroup {
                file: 0,
                name: name.unwrap_or_default(),
                rows: Some(rows),
                verified: false,
            });
        }
        Ok(Saved {
            path: path.to_path_buf(),
            manifest_files: None,
            paths: vec![path.to_path_buf()],
            readers: vec![Some(reader)],
            rects,
            groups,
            optimizer,
            step,
        })
    }

    /// The most bytes one row of `held`'s rectangle takes, in it or in a saved rectangle it
    /// is read from: weights and optimizer state.
    fn row_bytes(&self, held: &Held<'_>) -> usize {
        let states = held.tbe.optimizer_state_names();
        // (Saturating: a saved rectangle of no rows may list any width.)
        let bytes = |cols: usize| {
            let state = (states.iter()).fold(0usize, |n, (_, shape)| {
                n.saturating_add(match shape {
                    StateShape::PerRow => 1,
                    StateShape::PerElement => cols,
                })
            });
            cols.saturating_add(state).saturating_mul(4)
        };
        (self.rects.iter())
            .filter(|s| s.table == held.table && s.rect.meets(&held.rect))
            .map(|s| bytes(s.rect.cols))
            .fold(bytes(held.rect.cols), usize::max)
    }

    /// Reads rows `sub` (counted from its first) of `held`'s rectangle: weights, then each
    /// state buffer of its TBE; and whether a per-row state had to be split from a wider
    /// block. Only the saved rows it needs are read.
    fn read(
        &self,
        held: &Held<'_>,
        sub: std::ops::Range<usize>,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>, bool)> {
        let want = Rect {
            row_offset: held.rect.row_offset + sub.start,
            rows: sub.len(),
            ..held.rect
        };
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
            // The saved rows wanted, counted from the saved rectangle's first.
            let local = rows.start - have.row_offset..rows.end - have.row_offset;
            // The saved rows' values from row `rows.start` on: weights, then each state buffer.
            let (saved, saved_states) = match &s.source {
                Source::Tensors(base) => {
                    let Some(reader) = &self.readers[s.file] else {
                        return Err(bad(&self.paths[s.file], "read before it was opened"));
                    };
                    // Only the rows wanted, from the file's tensors.
                    let dims = [have.rows, have.cols];
                    let elems = local.start * have.cols..local.end * have.cols;
                    let saved =
                        reader.read_range(&format!("{base}.weight"), &dims, elems.clone())?;
                    let saved_states = (states.iter())
                        .map(|(name, shape)| {
                            let tensor = format!("{base}.{name}");
                            match shape {
                                StateShape::PerElement => {
                                    reader.read_range(&tensor, &dims, elems.clone())
                                }
                                StateShape::PerRow => {
                                    reader.read_range(&tensor, &[have.rows], local.clone())
                                }
                            }
                        })
                        .collect::<Result<Vec<_>>>()?;
                    (saved, saved_states)
                }
                Source::Rows { group, index } => {
                    let Some(g) = &self.groups[*group].rows else {
                        return Err(bad(&self.paths[s.file], "read before it was opened"));
                    };
                    // Only the rows wanted, from the group's row file.
                    g.read_rows(&held.tbe.config().optimizer, *index, local)?
                }
            };
            let first = rows.start;
            for r in rows.clone() {
                let src = (r - first) * have.cols + (cols.start - have.col_offset);
                let dst = (r - r0) * want.cols + (cols.start - c0);
                weights[dst..dst + cols.len()].copy_from_slice(&saved[src..src + cols.len()]);
                covered[r - r0] += cols.len();
            }
            for (i, (_, shape)) in states.iter().enumerate() {
                let saved = &saved_states[i];
                match shape {
                    StateShape::PerElement => {
                        for r in rows.clone() {
                            let src = (r - first) * have.cols + (cols.start - have.col_offset);
                            let dst = (r - r0) * want.cols + (cols.start - c0);
                            state_values[i][dst..dst + cols.len()]
                                .copy_from_slice(&saved[src..src + cols.len()]);
                        }
                    }
                    StateShape::PerRow => {
                        // The width-weighted mean of the saved blocks over the wanted columns.
                        let share = cols.len() as f32 / want.cols as f32;
                        if have.cols > cols.len() {
                            approximate = true;
                        }
                        for r in rows.clone() {
                            state_values[i][r - r0] += share * saved[r - first];
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

    /// Checks that each table of `shapes` (name, rows, columns: the whole tables loaded into)
    /// was saved as rectangles that do not overlap and span exactly its shape: a table saved
    /// larger (its rows past the target's were left unread) or smaller is refused, naming both
    /// shapes, and so is a listing whose overlaps would hide a gap.
    fn check_tables(&self, shapes: &[(&str, usize, usize)]) -> Result<()> {
        for &(table, rows, cols) in shapes {
            let mut rects: Vec<Rect> = (self.rects.iter())
                .filter(|s| s.table == table && s.rect.rows > 0 && s.rect.cols > 0)
                .map(|s| s.rect)
                .collect();
            if rects.is_empty() {
                continue;
            }
            let extent = |f: fn(&Rect) -> usize| rects.iter().map(f).max().unwrap_or(0);
            let saved = (
                extent(|r| r.row_offset + r.rows),
                extent(|r| r.col_offset + r.cols),
            );
            if saved != (rows, cols) {
                return Err(bad(
                    &self.path,
                    format!(
                        "table `{table}` was saved as {} × {}, this collection's is {rows} × \
                         {cols} (resize a table by loading into its old shape and copying)",
                        saved.0, saved.1
                    ),
                ));
            }
            // Overlaps: each rectangle against those after it that start within its rows
            // (sorted by first row: a few comparisons each for row- and column-wise shards).
            rects.sort_by_key(|r| (r.row_offset, r.col_offset));
            for (i, a) in rects.iter().enumerate() {
                let end = a.row_offset + a.rows;
                for b in rects[i + 1..].iter().take_while(|b| b.row_offset < end) {
                    if a.meets(b) {
                        return Err(bad(
                            &self.path,
                            format!(
                                "table `{table}`: the saved rectangles at row {}, column {} and \
                                 row {}, column {} overlap",
                                a.row_offset, a.col_offset, b.row_offset, b.col_offset
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads every rectangle of `held` and checks the optimizer and the tables' shapes
    /// (`shapes`: each table's name, rows and columns), changing nothing: the values to apply
    /// with [`Staged::apply`].
    pub fn stage<'a>(
        &mut self,
        held: &'a [Held<'a>],
        optimizer: &str,
        shapes: &[(&str, usize, usize)],
    ) -> Result<Staged<'a>> {
        // The files first: a save committed since the manifest was read is the checkpoint
        // checked and loaded.
        self.hold(held)?;
        if self.optimizer != optimizer {
            return Err(bad(
                &self.path,
                format!(
                    "saved with optimizer `{}`, these tables use `{optimizer}`",
                    self.optimizer
                ),
            ));
        }
        self.check_tables(shapes)?;
        let (mut whole, chunked, rest) = self.stage_whole_groups(held)?;
        self.open_files_for(&rest, true)?;
        let mut values = Vec::with_capacity(rest.len());
        let mut report = LoadReport::default();
        let mut note = |h: &Held<'_>, approximate: bool| {
            if approximate && !report.approximated_row_state.iter().any(|t| t == h.table) {
                report.approximated_row_state.push(h.table.to_string());
            }
        };
        // The other TBEs of cached tables, all held: new row files written a few rows at a
        // time, never read whole into memory.
        for group in &chunked {
            // Its rectangles by table (`cached_groups` holds each table once).
            let mut mine: Vec<&Held<'_>> = (rest.iter().copied())
                .filter(|h| std::ptr::eq(h.tbe, group.tbe))
                .collect();
            mine.sort_by_key(|h| h.index);
            // About STAGE_CHUNK_BYTES of the widest records read or written per chunk.
            let chunk_rows = |t: usize| STAGE_CHUNK_BYTES / self.row_bytes(mine[t]).max(1);
            let staged = group.tbe.stage_cached_rows(chunk_rows, |t, rows| {
                let (weights, states, approximate) = self.read(mine[t], rows)?;
                note(mine[t], approximate);
                Ok((weights, states))
            })?;
            whole.push((group.tbe, staged));
        }
        for h in rest {
            if chunked.iter().any(|g| std::ptr::eq(g.tbe, h.tbe)) {
                continue;
            }
            let (weights, states, approximate) = self.read(h, 0..h.rect.rows)?;
            note(h, approximate);
            values.push((h, (weights, states)));
        }
        let checkpoint =
            (self.manifest_files.clone()).unwrap_or_else(|| self.path.display().to_string());
        Ok(Staged {
            checkpoint,
            whole,
            values,
            step: self.step,
            report,
        })
    }
}

/// TBEs of cached tables loading a saved row file whole, and that file staged.
type WholeGroups<'a> = Vec<(&'a TableBatchedEmbedding, StagedRows)>;

/// Checked values, ready to be written into the TBEs.
pub(crate) struct Staged<'a> {
    /// Which checkpoint was read: a sharded one's files (they name its id), or the file.
    pub(crate) checkpoint: String,
    /// TBEs of cached tables loaded whole: their staged row files.
    whole: WholeGroups<'a>,
    values: Vec<(&'a Held<'a>, RectValues)>,
    step: u64,
    report: LoadReport,
}

impl Staged<'_> {
    /// Writes the values and the step count.
    pub fn apply(self) -> Result<LoadReport> {
        // All the TBEs of cached tables or none.
        let cached: Vec<&TableBatchedEmbedding> = self.whole.iter().map(|(t, _)| *t).collect();
        commit_cached_checkpoints(self.whole)?;
        for tbe in cached {
            tbe.set_step(self.step);
        }
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

/// Every table of `tbes`, whole.
fn whole_tables<'a>(tbes: &[&'a TableBatchedEmbedding]) -> Vec<Held<'a>> {
    let mut held = Vec::new();
    for &tbe in tbes {
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
    held
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
    let held = whole_tables(&tbes);
    let optimizer = tbes.first().map_or("none", |t| t.config().optimizer.name());
    let shapes: Vec<(&str, usize, usize)> = (held.iter())
        .map(|h| (h.table, h.rect.rows, h.rect.cols))
        .collect();
    saved.stage(&held, optimizer, &shapes)?.apply()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedding::{CachePolicy, CacheSize, EmbeddingBagConfig, FusedOptimizer, Placement};

    type Hook = std::thread::LocalKey<std::cell::RefCell<Option<Box<dyn FnOnce()>>>>;

    thread_local! {
        /// Called once after a load on this thread reads a manifest, before it opens the
        /// files: a save committed in between.
        pub(super) static AFTER_MANIFEST_READ: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            std::cell::RefCell::new(None);
        /// Called once after a load on this thread opens its files, before it reads them:
        /// saves committed in between.
        pub(super) static AFTER_FILES_OPENED: std::cell::RefCell<Option<Box<dyn FnOnce()>>> =
            std::cell::RefCell::new(None);
    }

    /// Runs (and removes) the function `hook` holds on this thread, if any.
    pub(super) fn hook(hook: &'static Hook) {
        if let Some(f) = hook.with(|h| h.borrow_mut().take()) {
            f();
        }
    }

    const RW_ADAGRAD: FusedOptimizer = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 };

    fn held_configs() -> Vec<EmbeddingBagConfig> {
        vec![
            EmbeddingBagConfig::new("m", 30, 4, &["fm"]),
            EmbeddingBagConfig::new("c", 50, 2, &["fc"]),
        ]
    }

    /// This rank's part of the tables drawn from `seed`, row-wise over two ranks, `c` cached
    /// in files under `root` in a directory named for `dir` and `seed`.
    fn drawn(
        root: &Path,
        dir: &Path,
        seed: u64,
        comm: crate::distributed::Comm,
    ) -> crate::distributed::ShardedEmbeddingBagCollection {
        use crate::distributed::{
            Placement as Sharding, ShardCaches, ShardedEmbeddingBagCollection, ShardingPlan,
            TableShape,
        };
        let shapes = [TableShape::new("m", 30, 4), TableShape::new("c", 50, 2)];
        let placements = [("m", Sharding::RowWise), ("c", Sharding::RowWise)];
        let plan = (ShardingPlan::construct(&shapes, &placements, 2, 2))
            .and_then(|p| p.with_kernel("c", crate::distributed::ComputeKernel::FusedUvm, None))
            .unwrap();
        let caches = ShardCaches {
            dir: root.join(format!(
                "rows-{seed}-{}-{}",
                dir.file_name().unwrap().to_string_lossy(),
                comm.rank()
            )),
            policy: CachePolicy::Lru,
            ..ShardCaches::default()
        };
        ShardedEmbeddingBagCollection::with_caches(
            held_configs(),
            &plan,
            RW_ADAGRAD,
            crate::embedding::WeightDecay::None,
            &caches,
            comm,
            seed,
        )
        .unwrap()
    }

    /// Saves into `dir` the tables drawn from `seed`, on two ranks (threads).
    fn save_drawn(root: &Path, dir: &Path, seed: u64) {
        std::thread::scope(|s| {
            for comm in crate::distributed::LocalGroup::comms(2).unwrap() {
                s.spawn(move || drawn(root, dir, seed, comm).save(dir).unwrap());
            }
        });
    }

    /// What a checkpoint holds, read into one collection: each table's weights.
    fn loaded(dir: &Path) -> Vec<Vec<f32>> {
        let into = EmbeddingBagCollection::new(
            held_configs(),
            RW_ADAGRAD,
            &mut crate::tensor::rng::seeded(9),
        )
        .unwrap();
        let tbes = into.tbes();
        let held = whole_tables(&tbes);
        let shapes: Vec<(&str, usize, usize)> = (held.iter())
            .map(|h| (h.table, h.rect.rows, h.rect.cols))
            .collect();
        let mut saved = Saved::open(dir).unwrap();
        saved
            .stage(&held, RW_ADAGRAD.name(), &shapes)
            .unwrap()
            .apply()
            .unwrap();
        ["m", "c"].map(|t| into.table_weights(t).unwrap()).to_vec()
    }

    /// Entries of `dir` whose names contain `part`.
    fn count(dir: &Path, part: &str) -> usize {
        (std::fs::read_dir(dir).unwrap().flatten())
            .filter(|e| e.file_name().to_string_lossy().contains(part))
            .count()
    }

    /// Ranks that read different checkpoints (a save committed between their openings: rank 0
    /// opened the first, rank 1 found its files gone and opened the second) load neither:
    /// every rank refuses, and the tables stay as they were.
    #[test]
    fn ranks_that_read_different_checkpoints_load_nothing() {
        let root = std::env::temp_dir().join(format!("embers-mixed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("ckpt");
        save_drawn(&root, &dir, 1);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tx, rx) = (
            parking_lot::Mutex::new(Some(tx)),
            parking_lot::Mutex::new(Some(rx)),
        );
        std::thread::scope(|s| {
            for comm in crate::distributed::LocalGroup::comms(2).unwrap() {
                let (root, dir, tx, rx) = (&root, &dir, &tx, &rx);
                s.spawn(move || {
                    let rank = comm.rank();
                    let tables = drawn(root, &root.join("live"), 7, comm);
                    let before = tables.table_weights("m").unwrap();
                    if rank == 0 {
                        let tx = tx.lock().take().unwrap();
                        let opened = move || tx.send(()).unwrap();
                        AFTER_FILES_OPENED.with(|h| *h.borrow_mut() = Some(Box::new(opened)));
                    } else {
                        let rx = rx.lock().take().unwrap();
                        let (root, dir) = (root.clone(), dir.clone());
                        let save = move || {
                            rx.recv().unwrap();
                            save_drawn(&root, &dir, 2);
                        };
                        AFTER_MANIFEST_READ.with(|h| *h.borrow_mut() = Some(Box::new(save)));
                    }
                    let err = tables.load(dir).unwrap_err().to_string();
                    assert!(
                        err.contains("read another checkpoint"),
                        "rank {rank}: {err}"
                    );
                    assert_eq!(tables.table_weights("m").unwrap(), before, "rank {rank}");
                });
            }
        });
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A load holds the checkpoint it opened: saves replacing it meanwhile remove its rank
    /// files (which it holds open) and leave its parts directories (which it holds locked),
    /// and it reads what was saved; the next save once it is gone removes them. A save
    /// committed between a load's read of the manifest and its opening of the files is the
    /// checkpoint it loads.
    #[test]
    fn a_load_reads_the_checkpoint_it_opened_while_saves_replace_it() {
        let root = std::env::temp_dir().join(format!("embers-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("ckpt");
        save_drawn(&root, &dir, 1);
        let first = loaded(&dir);
        let (r, d) = (root.clone(), dir.clone());
        let saves = move || {
            save_drawn(&r, &d, 2);
            save_drawn(&r, &d, 3);
            // The first checkpoint's rank files are gone, its parts directories kept.
            assert_eq!(count(&d, ".safetensors.parts-"), 4);
            assert_eq!(count(&d, "rank-") - count(&d, ".parts-"), 2);
        };
        AFTER_FILES_OPENED.with(|h| *h.borrow_mut() = Some(Box::new(saves)));
        assert_eq!(loaded(&dir), first);
        assert!(
            AFTER_FILES_OPENED.with(|h| h.borrow().is_none()),
            "no saves in between"
        );
        assert_ne!(loaded(&dir), first, "the seeds draw other tables");
        save_drawn(&root, &dir, 4);
        assert_eq!(count(&dir, ".safetensors.parts-"), 2);

        let fifth = root.join("fifth");
        save_drawn(&root, &fifth, 5);
        let want = loaded(&fifth);
        let (r, d) = (root.clone(), dir.clone());
        let save = move || save_drawn(&r, &d, 5);
        AFTER_MANIFEST_READ.with(|h| *h.borrow_mut() = Some(Box::new(save)));
        assert_eq!(loaded(&dir), want);
        assert!(
            AFTER_MANIFEST_READ.with(|h| h.borrow().is_none()),
            "no save in between"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Listed rectangles that are malformed do not parse: an end past `usize`, a wrong
    /// number of fields, a group without its place.
    #[test]
    fn malformed_listed_rectangles_do_not_parse() {
        let ok = serde_json::json!(["t", 0, 0, 4, 2]);
        assert!(parse_listed(&ok).is_some());
        let grouped = serde_json::json!(["t", 0, 0, 4, 2, "group0", 1]);
        assert!(matches!(parse_listed(&grouped), Some((_, _, Some((_, 1))))));
        for bad in [
            serde_json::json!(["t", u64::MAX, 0, 4, 2]),
            serde_json::json!(["t", 0, u64::MAX, 4, 2]),
            serde_json::json!(["t", 0, 0, 4]),
            serde_json::json!(["t", 0, 0, 4, 2, "group0"]),
            serde_json::json!(["t", 0, 0, 4, 2, 7, 1]),
        ] {
            assert!(parse_listed(&bad).is_none(), "{bad}");
        }
    }

    /// A saved cached group is taken whole only by cached tables exactly like it: not by the
    /// same tables in memory, nor by cached tables of another shape.
    #[test]
    fn only_the_same_cached_tables_take_a_saved_row_file_whole() {
        let dir = std::env::temp_dir().join(format!("embers-whole-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let optimizer = FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 };
        let configs = |b_rows: usize| {
            vec![
                EmbeddingBagConfig::new("a", 53, 4, &["fa"]),
                EmbeddingBagConfig::new("b", b_rows, 2, &["fb"]),
            ]
        };
        let cached = |name: &str| Placement::Cached {
            dir: dir.join(name),
            size: CacheSize::LoadFactor(0.3),
            policy: CachePolicy::Lru,
        };
        let build = |placement: &Placement, b_rows: usize| {
            let mut rng = crate::tensor::rng::seeded(3);
            EmbeddingBagCollection::with_placement(configs(b_rows), optimizer, placement, &mut rng)
                .unwrap()
        };
        let file = dir.join("saved.safetensors");
        build(&cached("saved"), 9).save(&file).unwrap();
        for (placement, b_rows, taken) in [
            (cached("same"), 9, true),
            (Placement::Memory, 9, false),
            (cached("other"), 10, false),
        ] {
            let target = build(&placement, b_rows);
            let tbes = target.tbes();
            let held = whole_tables(&tbes);
            let mut saved = Saved::open(&file).unwrap();
            let (whole, chunked, rest) = saved.stage_whole_groups(&held).unwrap();
            assert_eq!(
                chunked.len(),
                usize::from(!taken && placement != Placement::Memory)
            );
            assert_eq!(
                whole.len(),
                usize::from(taken),
                "{placement:?} b of {b_rows}"
            );
            assert_eq!(rest.len(), if taken { 0 } else { held.len() });
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Any rows of a saved rectangle read alone equal the same rows of the whole rectangle, for
    /// tables saved as tensors and as a cached group's row file, per-row and per-element state.
    #[test]
    fn reading_some_rows_of_a_rectangle_reads_those_rows() {
        let dir = std::env::temp_dir().join(format!("embers-read-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let optimizers = [
            FusedOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
            FusedOptimizer::Adagrad { lr: 0.1, eps: 1e-8 },
        ];
        for (k, optimizer) in optimizers.into_iter().enumerate() {
            for cached in [false, true] {
                let configs = vec![
                    EmbeddingBagConfig::new("a", 53, 4, &["fa"]),
                    EmbeddingBagConfig::new("b", 9, 2, &["fb"]),
                ];
                let placement = match cached {
                    false => Placement::Memory,
                    true => Placement::Cached {
                        dir: dir.join(format!("rows-{k}")),
                        size: CacheSize::LoadFactor(0.3),
                        policy: CachePolicy::Lru,
                    },
                };
                let mut rng = crate::tensor::rng::seeded(3);
                let ebc = EmbeddingBagCollection::with_placement(
                    configs, optimizer, &placement, &mut rng,
                )
                .unwrap();
                let tbes = ebc.tbes();
                for tbe in &tbes {
                    for (t, spec) in tbe.config().tables.iter().enumerate() {
                        for i in 0..tbe.optimizer_state_names().len() {
                            let n = tbe.optimizer_state(i, t).unwrap().len();
                            let v: Vec<f32> = (0..n).map(|x| (x * 7 + spec.rows) as f32).collect();
                            tbe.set_optimizer_state(i, t, &v).unwrap();
                        }
                    }
                }
                let file = dir.join(format!("ebc-{k}-{cached}.safetensors"));
                ebc.save(&file).unwrap();
                let mut saved = Saved::open(&file).unwrap();
                let held = whole_tables(&tbes);
                let refs: Vec<&Held<'_>> = held.iter().collect();
                saved.open_files_for(&refs, true).unwrap();
                let from_rows = saved
                    .rects
                    .iter()
                    .any(|s| matches!(s.source, Source::Rows { .. }));
                assert_eq!(from_rows, cached);
                for h in &held {
                    let (w, states, _) = saved.read(h, 0..h.rect.rows).unwrap();
                    assert_eq!(w, h.tbe.table_weights(h.index).unwrap());
                    let c = h.rect.cols;
                    for sub in [0..1, 3..8, h.rect.rows - 2..h.rect.rows] {
                        let (ws, ss, _) = saved.read(h, sub.clone()).unwrap();
                        assert_eq!(ws, w[sub.start * c..sub.end * c], "{} {sub:?}", h.table);
                        for (s, part) in states.iter().zip(&ss) {
                            let per = s.len() / h.rect.rows;
                            assert_eq!(part[..], s[sub.start * per..sub.end * per]);
                        }
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
